"""Every user-facing message in tfmulti and its scripts fills in the values it names.

A plain string such as `"Received: tensor={mesh.tensor}"` (the `f` forgotten) reaches the
user as written. This test reads every message site (a `raise`, an exception built, a
print, a log call, a stderr write, a flag validator's `message=`) and refuses a plain
string literal there that holds a `{name}` placeholder and is never `.format`ted.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

from script_runner import REPO_ROOT

SCANNED_DIRECTORIES = ("tfmulti", "scripts")
# `{name}`, `{obj.attr}`, `{x[0]}`, `{x!r}`, `{x:.3f}`; not `{{`, `}}` or JSON like `{"a": 1}`.
PLACEHOLDER = re.compile(r"(?<!\{)\{[A-Za-z_][\w.]*(\[[^\]]*\])?(![rsa])?(:[^{}]*)?\}(?!\})")
MESSAGE_CALLS = {"print", "write", "exit", "error", "warning", "info", "fatal", "warn", "debug"}


def _callee_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_message_site(node: ast.AST) -> bool:
    if isinstance(node, ast.Raise):
        return True
    if not isinstance(node, ast.Call):
        return False
    name = _callee_name(node)
    return (
        name in MESSAGE_CALLS
        or name.endswith(("Error", "Exception", "Warning"))
        or any(keyword.arg == "message" for keyword in node.keywords)
    )


def _message_spans(tree: ast.AST) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [
        ((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset))
        for node in ast.walk(tree)
        if _is_message_site(node)
    ]


def _is_formatted_later(tokens: list[tokenize.TokenInfo], index: int) -> bool:
    """True if the string concatenation holding tokens[index] is followed by `.format`."""
    skipped = {tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT}
    while index < len(tokens) and tokens[index].type in skipped:
        if tokens[index].type == tokenize.NEWLINE:
            return False
        index += 1
    following = [token.string for token in tokens[index : index + 2]]
    return following == [".", "format"]


def unfilled_placeholders(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each plain string literal in a message site of `source` that
    holds a `{name}` placeholder nothing fills in."""
    spans = _message_spans(ast.parse(source))
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found = []
    for index, token in enumerate(tokens):
        if token.type != tokenize.STRING:
            continue
        prefix = re.match(r"[A-Za-z]*", token.string).group().lower()
        if "f" in prefix or not PLACEHOLDER.search(token.string):
            continue
        inside_message = any(start <= token.start < end for start, end in spans)
        if inside_message and not _is_formatted_later(tokens, index + 1):
            found.append((token.start[0], token.string))
    return found


def _python_files():
    for directory in SCANNED_DIRECTORIES:
        for root, _, names in os.walk(os.path.join(REPO_ROOT, directory)):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def test_scan_finds_a_forgotten_f_prefix():
    source = (
        "def check(mesh):\n"
        "    raise ValueError(\n"
        '        f"Mesh {mesh} is wrong. "\n'
        '        "Received: tensor={mesh.tensor}; use tensor=1."\n'
        "    )\n"
    )
    assert unfilled_placeholders(source) == [(4, '"Received: tensor={mesh.tensor}; use tensor=1."')]


def test_scan_accepts_f_strings_format_escaped_braces_and_non_messages():
    source = (
        "def check(x):\n"
        '    TEMPLATE = "{x} is kept for later"\n'
        '    print(f"x={x!r}", "{{literal}}", \'{"json": 1}\')\n'
        '    raise ValueError("Received: x={x}; " "use y={y}".format(x=x, y=1))\n'
    )
    assert unfilled_placeholders(source) == []


def test_no_user_facing_message_has_an_unfilled_placeholder():
    problems = []
    for path in _python_files():
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        relative = os.path.relpath(path, REPO_ROOT)
        problems += [f"{relative}:{line}: {text}" for line, text in unfilled_placeholders(source)]
    assert not problems, "messages with unfilled placeholders:\n" + "\n".join(problems)
