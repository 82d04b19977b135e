"""Start-up fix: `import keras` loads `keras.wrappers`, and with it scikit-learn and SciPy,
only when a program first touches `keras.wrappers`.

Keras 3 imports its scikit-learn wrappers eagerly (`keras/__init__.py`: `from keras import
wrappers`), and they import scikit-learn whenever it is installed. On the 2-core machine
this project is tested on that adds about 0.8 s to the 4-5 s of a training process's imports,
paid by every training process and every launched worker before its first step. The fix
executes that one module only when a program first reads a name of `keras.wrappers`;
then it imports as before. Keras versions from `FIRST_EAGER_KERAS` up to the
compat fixes' `versions.FIRST_UNCHECKED_KERAS` get it; `tests/test_compat.py` tells when upstream
stops importing scikit-learn eagerly.

Importing this module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import sys

from tfmulti.compat.versions import FIRST_UNCHECKED_KERAS, version_tuple

LAZY_MODULE = "keras.wrappers"
# Keras 3.9 added the scikit-learn wrappers.
FIRST_EAGER_KERAS = (3, 9)


def applies_to(version: tuple[int, ...]) -> bool:
    """Whether Keras `version` is one this fix was checked on."""
    return FIRST_EAGER_KERAS <= version < FIRST_UNCHECKED_KERAS


def install_before_keras_loads() -> bool:
    """Makes the coming `import keras` load `keras.wrappers` lazily; returns whether it will.

    A no-op (False) once Keras is imported, or for a Keras version not checked.
    """
    if "keras" in sys.modules or any(isinstance(f, _LazyWrappers) for f in sys.meta_path):
        return False
    try:
        version = version_tuple(importlib.metadata.version("keras"))
    except importlib.metadata.PackageNotFoundError:
        return False
    if not applies_to(version):
        return False
    sys.meta_path.insert(0, _LazyWrappers())
    return True


class _LazyWrappers(importlib.abc.MetaPathFinder):
    """Finds `keras.wrappers` with the other finders and defers executing it; then leaves."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != LAZY_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ExecuteOnFirstRead(spec.loader)
        return spec


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
