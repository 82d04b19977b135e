"""Release numbers as comparable tuples, for the version guards of the compat fixes."""

from __future__ import annotations

import re

# The first Keras release no test of tests/test_compat*.py has run on (the newest checked
# is 3.15.1): every version-guarded fix and accessor stays off from here on until those
# tests pass there and this bound is raised.
FIRST_UNCHECKED_KERAS = (3, 16)


def version_tuple(text: str) -> tuple[int, ...]:
    """`text`'s leading release number as integers; suffixes like ".dev0" or "-rc1" dropped.

    Example:
        >>> version_tuple("3.15.1.dev0")
        (3, 15, 1)
    """
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"Cannot read a release number. Received: {text!r}")
    return tuple(int(number) for number in match.groups() if number is not None)
