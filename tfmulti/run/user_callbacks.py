"""The user's Keras callbacks, from a `package.module:function` reference (`--callbacks`)."""

from __future__ import annotations

import keras

from tfmulti.user_code import load_function


def load_callbacks(reference: str | None) -> list[keras.callbacks.Callback]:
    """Calls the user's `package.module:function` and returns the callbacks it gives.

    The function takes no arguments and returns a list (or tuple) of
    `keras.callbacks.Callback`, or one; they train next to tfmulti's own under every
    strategy.

    Args:
        reference: the `--callbacks` value; None gives no callbacks.

    Raises:
        ValueError: the module or function cannot be found, or the function returns
            anything but callbacks; one line.

    Example:
        >>> # my_project/train_hooks.py
        >>> def callbacks():
        ...     return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)]
        >>> load_callbacks("my_project.train_hooks:callbacks")
        [<EarlyStopping ...>]
    """
    if reference is None:
        return []
    function = load_function(reference, "--callbacks")
    callbacks = function()
    if isinstance(callbacks, keras.callbacks.Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, list | tuple):
        raise ValueError(
            f"--callbacks={reference} must return a list of keras.callbacks.Callback. "
            f"Received: {type(callbacks).__name__}"
        )
    others = [
        type(item).__name__ for item in callbacks if not isinstance(item, keras.callbacks.Callback)
    ]
    if others:
        raise ValueError(
            f"--callbacks={reference} must return keras.callbacks.Callback objects only. "
            f"Received: {', '.join(others)} in its list"
        )
    return list(callbacks)
