"""Crash-safe file writes: write to a temporary file, then rename over the target."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yields a temporary path beside `path`; on success renames it over `path`.

    A crash before the rename leaves `path` as it was, never half-written.

    Example:
        >>> with atomic_path("ckpt.weights.h5") as tmp:
        ...     model.save_weights(tmp)
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    base, extension = os.path.splitext(os.path.basename(path))
    if base.endswith(".weights"):
        base, extension = base[: -len(".weights")], ".weights" + extension
    handle, temporary = tempfile.mkstemp(
        prefix=f".{base}.", suffix=f".tmp{extension}", dir=directory
    )
    os.close(handle)
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_json_atomically(path: str, value) -> None:
    """Writes `value` as indented JSON to `path` with an atomic rename."""
    with atomic_path(path) as temporary, open(temporary, "w") as handle:
        json.dump(value, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
