"""`--help` of tfmulti's scripts: the script's usage, then its own flags by group.

absl's `--help` lists only the flags defined in the `__main__` module, which for a thin
script (`scripts/train.py` calls `tfmulti.cli.train`) is none, and `--helpfull` buries
tfmulti's flags among absl's and TensorFlow's. Here each `define_*_flags` function
records its flags under a group title (`flag_group`), and `install_help_flags` replaces
`--help`/`--helpshort` with a text listing those groups, plus the flags the script's own
module defines, in absl's format (defaults included). `--helpfull` is left as absl has it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from absl import flags

FLAGS = flags.FLAGS
# Group title -> names of the flags its define function added, in definition order.
_GROUPS: dict[str, list[str]] = {}
HELP_FOOTER = "Try --helpfull to also list absl's and TensorFlow's flags."


def flag_group(title: str) -> Callable:
    """Decorates a `define_*_flags` function so its flags are listed under `title` in `--help`.

    Example:
        >>> @flag_group("loop")
        ... def define_loop_flags():
        ...     flags.DEFINE_integer("epochs", 5, "Epochs to train.")
    """

    def decorate(define: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(define)
        def define_and_record() -> None:
            before = set(FLAGS)
            define()
            added = [name for name in FLAGS if name not in before and len(name) > 1]
            _GROUPS.setdefault(title, []).extend(added)

        return define_and_record

    return decorate


def _render_group(title: str, names: list[str]) -> str:
    # absl renders a module's "key flags" under its name; a group title serves as one.
    for name in names:
        FLAGS.register_key_flag_for_module(title, FLAGS[name])
    return FLAGS.module_help(title)


def script_help(usage: str, module: str, title: str) -> str:
    """The `--help` text: `usage`, every recorded flag group, then the flags `module`
    defines outside any group, under `title`."""
    grouped = {name for names in _GROUPS.values() for name in names}
    own = [flag.name for flag in FLAGS.get_flags_for_module(module) if flag.name not in grouped]
    sections = [_render_group(group, names) for group, names in _GROUPS.items() if names]
    if own:
        sections.append(_render_group(title, own))
    listing = "\n".join(sections)
    return f"{usage.rstrip()}\n\nflags:\n{listing}\n\n{HELP_FOOTER}\n"


class _ScriptHelpFlag(flags.BooleanFlag):
    """`--help` (or `--helpshort`): prints `text()` and exits with code 0."""

    def __init__(self, name: str, short_name: str | None, text: Callable[[], str]):
        super().__init__(
            name,
            False,
            "show this script's flags, by group",
            short_name=short_name,
            allow_override=True,
        )
        self._text = text

    def parse(self, argument) -> None:
        super().parse(argument)
        if self.value:
            sys.stdout.write(self._text())
            sys.exit(0)


def install_help_flags(usage: str | None, module: str = "__main__", title: str = "options"):
    """Makes `--help` and `--helpshort` print `script_help(usage, module, title)`.

    Call it after absl defines its own help flags (`app.run` does, before it calls the
    flags parser), i.e. from the flags parser.

    Args:
        usage: the script's docstring (examples first); None uses `__main__`'s.
        module: the module whose own flags are listed after the groups.
        title: the heading of those flags.
    """
    usage = usage if usage is not None else (sys.modules["__main__"].__doc__ or "")
    text = functools.partial(script_help, usage, module, title)
    # Listed where absl's own help flags were, so --helpfull reads as before.
    flags.DEFINE_flag(_ScriptHelpFlag("help", "?", text), module_name="absl.app")
    flags.DEFINE_flag(_ScriptHelpFlag("helpshort", None, text), module_name="absl.app")
