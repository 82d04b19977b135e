"""Version-guarded replacements of Keras functions: one `Fix` each, applied by a module's
`FixSet` (which `tfmulti.compat.install` applies), keeping the functions they replaced.

Example:
    >>> FIX_SET = FixSet((Fix("my_fix", SomeKerasClass, "method", make_replacement),))
    >>> FIX_SET.apply()  # on the TensorFlow backend, for a Keras that needs it
    ['my_fix']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras

from tfmulti.compat.versions import FIRST_UNCHECKED_KERAS, version_tuple

# On Keras from versions.FIRST_UNCHECKED_KERAS on, the fixes stay off (or are removed,
# when tests/test_compat.py reports that upstream fixed them).
FIRST_BROKEN_KERAS = (3, 0)


def keras_version() -> tuple[int, ...]:
    """The installed Keras version as integers, e.g. (3, 15, 1); suffixes like ".dev0" dropped."""
    return version_tuple(keras.version())


@dataclasses.dataclass(frozen=True)
class Fix:
    """One replaced Keras function.

    Args:
        name: short name used by `active_fixes()`.
        owner: the module or class that holds the function.
        attribute: the function's name on `owner`.
        make_replacement: builds the replacement from the original function.
        first_broken: first Keras version known to need the fix.
        first_unchecked: first Keras version not checked; the fix is off from there on.
    """

    name: str
    owner: object
    attribute: str
    make_replacement: Callable[[Callable], Callable]
    first_broken: tuple[int, ...] = FIRST_BROKEN_KERAS
    first_unchecked: tuple[int, ...] = FIRST_UNCHECKED_KERAS

    def applies_to(self, version: tuple[int, ...]) -> bool:
        """Whether Keras `version` needs this fix and still has the function it replaces."""
        in_range = self.first_broken <= version < self.first_unchecked
        return in_range and hasattr(self.owner, self.attribute)


def apply_each(fixes: tuple[Fix, ...], originals: dict[str, Callable]) -> None:
    """Applies each of `fixes` the installed Keras takes, once, keeping originals by name."""
    version = keras_version()
    for fix in fixes:
        if fix.name in originals or not fix.applies_to(version):
            continue
        original = getattr(fix.owner, fix.attribute)
        originals[fix.name] = original
        setattr(fix.owner, fix.attribute, fix.make_replacement(original))


class FixSet:
    """One module's fixes: applied on the TensorFlow backend, each once, to the Keras
    versions that need it, remembering the functions they replaced."""

    def __init__(self, fixes: tuple[Fix, ...]):
        self.fixes = fixes
        self._originals: dict[str, Callable] = {}

    def apply(self) -> list[str]:
        """Applies the fixes the installed Keras needs (idempotent); returns their names."""
        if keras.backend.backend() != "tensorflow":
            return []
        apply_each(self.fixes, self._originals)
        return self.active_names()

    def active_names(self) -> list[str]:
        """Names of the fixes currently applied."""
        return [fix.name for fix in self.fixes if fix.name in self._originals]

    def original(self, name: str) -> Callable:
        """The unpatched Keras function behind fix `name` (to check whether upstream still
        needs it)."""
        for fix in self.fixes:
            if fix.name == name:
                return self._originals.get(name, getattr(fix.owner, fix.attribute))
        known = ", ".join(fix.name for fix in self.fixes)
        raise KeyError(f"No fix named {name!r}. Known fixes: {known}")
