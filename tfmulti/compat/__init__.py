"""Every touch of Keras and TensorFlow internals: fixes applied when Keras loads, and named
accessors of private APIs (`keras_internals`, `tf_internals`), each version-guarded.

Importing this package imports neither TensorFlow nor Keras.

Example:
    >>> import tfmulti.compat
    >>> tfmulti.compat.install_when_keras_loads()  # `import tfmulti` does this
    >>> import keras  # fixes are in place from here on
    >>> tfmulti.compat.active_fixes()
    ['symbolic_build_from_one_replica', ...]
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

__all__ = ["active_fixes", "install", "install_when_keras_loads"]


# The modules whose fixes `install` applies, each with its `FIX_SET` (`compat.fixes.FixSet`).
_FIX_MODULES = (
    "keras_multi_worker",
    "keras_sparse_gradients",
    "keras_replica_state",
    "keras_traceback_lines",
    "keras_build_ahead",
)
# Called after every `install` (see `install_when_keras_loads`).
_AFTER_INSTALL: list[Callable[[], None]] = []


def install() -> list[str]:
    """Imports Keras and applies the fixes it needs (idempotent).

    Also hooks `keras.distribution` into the TensorFlow backend
    (`keras_distribution_tf.active_patch_names()` lists those patches).

    Returns:
        The names of the active fixes; empty for a Keras that needs none or a backend
        other than TensorFlow.
    """
    from tfmulti.compat import keras_distribution_tf

    keras_distribution_tf.apply_patches()
    names = []
    for name in _FIX_MODULES:
        names += importlib.import_module(f"tfmulti.compat.{name}").FIX_SET.apply()
    for then in _AFTER_INSTALL:
        then()
    return names


def active_fixes() -> list[str]:
    """Names of the fixes applied so far, without importing Keras."""
    names = []
    for name in _FIX_MODULES:
        module = sys.modules.get(f"tfmulti.compat.{name}")
        names += module.FIX_SET.active_names() if module is not None else []
    return names


def install_when_keras_loads(then: Callable[[], None] | None = None) -> None:
    """Applies the fixes now if Keras is imported, else right after `import keras` finishes.

    Args:
        then: called after the fixes each time `install` runs; `tfmulti` loads the layers
            above compat that hook into the patches (`keras_distribution`) this way.

    Example:
        >>> install_when_keras_loads()
    """
    if then is not None and then not in _AFTER_INSTALL:
        _AFTER_INSTALL.append(then)
    if "keras" in sys.modules:
        install()
    elif not any(isinstance(finder, _KerasImportHook) for finder in sys.meta_path):
        from tfmulti.compat import keras_lazy_modules

        keras_lazy_modules.install_before_keras_loads()
        sys.meta_path.insert(0, _KerasImportHook())


class _KerasImportHook(importlib.abc.MetaPathFinder):
    """Finds `keras` with the other finders and runs `install()` after it executes.

    It stays on `sys.meta_path` until Keras has actually executed: TensorFlow looks
    Keras up with `find_spec` before importing it.
    """

    def __init__(self):
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _InstallAfterLoading(spec.loader, self)
        return spec


class _InstallAfterLoading(importlib.abc.Loader):
    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        install()
