"""The layout holds: layers import only downward, no import circles, Keras and TensorFlow
internals only under `tfmulti/compat/`, and the documented public API imports."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_ROOT = REPOSITORY / "tfmulti"
REFERENCE_MODELS = REPOSITORY / "models"

# Each group of modules may import from its own group and from lower layers only.
LAYERS = [
    [
        "tfmulti.names",
        "tfmulti.errors",
        "tfmulti.files",
        "tfmulti.step_ranges",
        "tfmulti.user_code",
        "tfmulti.text_table",
    ],
    ["tfmulti.compat", "tfmulti.pipeline", "tfmulti.platform", "tfmulti.config"],
    [
        "tfmulti.costing",
        "tfmulti.collectives",
        "tfmulti.data",
        "tfmulti.wrapped_model",
        "tfmulti.build_ahead",
    ],
    ["tfmulti.tensor_parallel", "tfmulti.zero"],
    ["tfmulti.keras_distribution", "tfmulti.pipeline.stages"],
    ["tfmulti.placement", "tfmulti.pipeline.runtime"],
    ["tfmulti.hybrid"],
    ["tfmulti.parallel"],
    ["tfmulti.models"],
    ["tfmulti.planner"],
    ["tfmulti.strategies"],
    ["tfmulti.run"],
    ["tfmulti.flags", "tfmulti.ray"],
    ["tfmulti.cli", "tfmulti"],
]
LAYER_OF = {group: index for index, groups in enumerate(LAYERS) for group in groups}
PRIVATE_MODULES = ("keras.src", "tensorflow.python")


def _module_files() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name; `models/` installs as `tfmulti.models`."""
    files = {}
    for folder, package in ((PACKAGE_ROOT, "tfmulti"), (REFERENCE_MODELS, "tfmulti.models")):
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            files[".".join((package, *parts))] = path
    return files


MODULES = _module_files()


def _group(module: str) -> str:
    """The longest LAYERS group that `module` belongs to."""
    candidates = [g for g in LAYER_OF if module == g or module.startswith(g + ".")]
    return max(candidates, key=len)


def _imports(module: str) -> set[str]:
    """The tfmulti modules `module` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfmulti"):
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tfmulti")}
    return found


def test_every_module_belongs_to_a_layer():
    assert all(_group(module) for module in MODULES)


def test_modules_import_only_their_own_layer_or_lower():
    upward = [
        f"{module} -> {target}"
        for module in MODULES
        for target in _imports(module)
        if LAYER_OF[_group(target)] > LAYER_OF[_group(module)]
    ]
    assert upward == []


def test_no_import_circles_between_modules():
    graph = {module: _imports(module) & set(MODULES) for module in MODULES}
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if target.startswith(module + ".") or module.startswith(target + "."):
                continue  # a package and its own submodules
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def _own_names() -> set[str]:
    """Every name tfmulti itself defines or assigns (so `obj._x` of our own objects passes)."""
    names = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def test_private_keras_and_tensorflow_internals_are_used_only_in_compat():
    own = _own_names()
    uses = []
    for module, path in MODULES.items():
        if module.startswith("tfmulti.compat"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
                uses.append(f"{module}: from {node.module}")
            elif isinstance(node, ast.Import):
                uses += [
                    f"{module}: import {a.name}"
                    for a in node.names
                    if a.name.startswith(PRIVATE_MODULES)
                ]
            elif isinstance(node, ast.keyword) and (node.arg or "").startswith("_"):
                uses.append(f"{module}: keyword {node.arg}=")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in own
            ):
                uses.append(f"{module}: .{node.attr}")
    assert uses == []


def test_no_class_overrides_a_private_keras_method_outside_compat():
    import keras

    overrides = []
    for module in MODULES:
        if module.startswith("tfmulti.compat") or module.startswith("tfmulti.cli"):
            continue
        loaded = importlib.import_module(module)
        for _, cls in inspect.getmembers(loaded, inspect.isclass):
            if cls.__module__ != module or not issubclass(
                cls, (keras.layers.Layer, keras.optimizers.Optimizer)
            ):
                continue
            for name in vars(cls):
                if name.startswith("_") and not name.startswith("__"):
                    if any(
                        name in vars(base)
                        for base in cls.__mro__[1:]
                        if base.__module__.startswith("keras")
                    ):
                        overrides.append(f"{module}.{cls.__name__}.{name}")
    assert overrides == []


def _documented_imports() -> list[str]:
    """Every `from tfmulti... import ...` line shown in the documentation and docstrings."""
    texts = [REPOSITORY / name for name in ("README.md", "BUILD.md")]
    texts += sorted((REPOSITORY / "docs").rglob("*.md"))
    texts += list(MODULES.values())
    lines = set()
    for path in texts:
        for raw in path.read_text().splitlines():
            line = raw.strip().removeprefix(">>> ").strip()
            if line.startswith("from tfmulti") and " import " in line and not line.endswith("("):
                lines.add(line)
    return sorted(lines)


@pytest.mark.parametrize("statement", _documented_imports())
def test_documented_import_works(statement):
    exec(statement, {})


@pytest.mark.parametrize("package", ["tfmulti", "tfmulti.parallel", "tfmulti.pipeline"])
def test_public_api_names_import(package):
    loaded = importlib.import_module(package)
    names = getattr(loaded, "__all__", None) or list(loaded._LAZY_EXPORTS)
    missing = [name for name in names if not hasattr(loaded, name)]
    assert missing == []
