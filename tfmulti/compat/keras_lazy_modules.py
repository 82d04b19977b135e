"""Start-up fix: `import keras` executes `keras.wrappers` (scikit-learn, SciPy) and Keras'
visualization modules (matplotlib's pyplot) only when a program first reads their names.

Keras 3 imports its scikit-learn wrappers eagerly (`keras/__init__.py`: `from keras import
wrappers`), and they import scikit-learn whenever it is installed; it imports its image
visualization helpers eagerly too (`keras.visualization`, `keras.src.visualization`), and
those import `matplotlib.pyplot` whenever matplotlib is installed. On the 2-core machine
this project is tested on that adds about 0.8 s and 0.6 s to the 4-5 s of a training
process's imports, paid by every training process and every launched worker before its
first step. The fix executes each of those modules only when a program first reads one of
its names; then it imports as before. Keras versions from `FIRST_EAGER_KERAS` up to the
compat fixes' `versions.FIRST_UNCHECKED_KERAS` get it; `tests/test_compat.py` tells when
upstream stops importing scikit-learn or matplotlib eagerly.

Importing this module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import sys

from tfmulti.compat.versions import FIRST_UNCHECKED_KERAS, version_tuple

# The public visualization module imports the internal one's submodules, so both wait.
LAZY_MODULES = frozenset({"keras.wrappers", "keras.visualization", "keras.src.visualization"})
# Keras 3.9 added the scikit-learn wrappers.
FIRST_EAGER_KERAS = (3, 9)


def applies_to(version: tuple[int, ...]) -> bool:
    """Whether Keras `version` is one this fix was checked on."""
    return FIRST_EAGER_KERAS <= version < FIRST_UNCHECKED_KERAS


def install_before_keras_loads() -> bool:
    """Makes the coming `import keras` load `LAZY_MODULES` lazily; returns whether it will.

    A no-op (False) once Keras is imported, or for a Keras version not checked.
    """
    if "keras" in sys.modules or any(isinstance(f, _LazyModules) for f in sys.meta_path):
        return False
    try:
        version = version_tuple(importlib.metadata.version("keras"))
    except importlib.metadata.PackageNotFoundError:
        return False
    if not applies_to(version):
        return False
    sys.meta_path.insert(0, _LazyModules())
    return True


class _LazyModules(importlib.abc.MetaPathFinder):
    """Finds each of `LAZY_MODULES` with the other finders and defers executing it; leaves
    once it has found them all."""

    def __init__(self):
        self._waiting = set(LAZY_MODULES)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._waiting:
            return None
        self._waiting.discard(fullname)
        if not self._waiting:
            sys.meta_path.remove(self)
        # The other finders, without this one (it may still be on sys.meta_path).
        spec = _find_without(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ExecuteOnFirstRead(spec.loader)
        return spec


def _find_without(finder, fullname, path, target):
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _ExecuteOnFirstRead(importlib.abc.Loader):
    """Leaves the module holding only its import attributes (`__file__`, `__path__`, ...)
    until a program reads any other name of it (PEP 562 `__getattr__`), then executes it.

    Not `importlib.util.LazyLoader`: that executes on any attribute read, and TensorFlow's
    autograph reads every loaded module's `__file__` the first time it converts a function.
    """

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        def execute_then_get(name: str):
            del module.__dict__["__getattr__"]
            self._loader.exec_module(module)
            return getattr(module, name)

        module.__getattr__ = execute_then_get
