"""Finds a user's function from a `package.module:function` reference, as `--model` takes it."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

# A dotted module path, a colon, and a function name: "my_project.models:small_cnn".
_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def is_function_reference(text: str) -> bool:
    """Whether `text` has the form `package.module:function`.

    Example:
        >>> is_function_reference("my_models:small_cnn"), is_function_reference("mlp")
        (True, False)
    """
    return bool(_REFERENCE.match(text))


def load_function(reference: str, flag: str) -> Callable:
    """Imports `package.module:function` and returns the function.

    Args:
        reference: the `package.module:function` text.
        flag: the flag it came from, named in errors (e.g. "--model").

    Raises:
        ValueError: the module cannot be imported, or has no such callable; one line.

    Example:
        >>> build = load_function("my_models:small_cnn", "--model")
    """
    if not is_function_reference(reference):
        raise ValueError(f"{flag} must be package.module:function. Received: {flag}={reference!r}")
    module_name, function_name = reference.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - any failure of the user's import is bad input
        raise ValueError(
            f"{flag}={reference}: cannot import module {module_name!r} "
            f"({type(error).__name__}: {_first_line(error)}); check the name and PYTHONPATH."
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(
            f"{flag}={reference}: module {module_name!r} has no function {function_name!r}. "
            f"Received: {function_name}={function!r}"
        )
    return function


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
