"""Ending a TensorFlow program without the interpreter's teardown.

When a training run ends, Python's own exit spends about 2 s (on 2 cores) collecting
TensorFlow's and Keras' objects and unloading their modules, for nothing the program still
needs: every launched worker and every run pays it. `end_without_teardown` registers an exit
handler that runs after every other one (Python runs them last registered first): it flushes
every open file, TensorBoard writer and HDF5 file still open (a user's callback that never
closed one loses nothing) and the logging handlers, then ends the process with `os._exit`.
Python has joined the program's threads and run its other exit handlers by then.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import sys

_EXIT = {"code": 1}  # an uncaught exception's traceback, printed before the handlers run


def end_without_teardown() -> None:
    """Makes this process end without the interpreter's teardown once TensorFlow is loaded.

    Call it before anything else registers an exit handler that must run (those registered
    earlier would run after it, so never).
    """
    atexit.register(_end_now)


def exit_code_will_be(code: object) -> None:
    """Records the code of the `SystemExit(code)` the program is ending with."""
    _EXIT["code"] = 0 if code is None else code if isinstance(code, int) else 1


def _end_now() -> None:
    if "tensorflow" not in sys.modules:
        return  # nothing heavy to tear down
    logging.shutdown()
    _flush_open_outputs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    os._exit(_EXIT["code"])


def _flush_open_outputs() -> None:
    summary_writer = _class_or_none("tensorflow", "summary", "SummaryWriter")
    hdf5_file = _class_or_none("h5py", "File")
    for item in gc.get_objects():
        try:
            if isinstance(item, io.IOBase):
                if not item.closed and item.writable():
                    item.flush()
            elif summary_writer is not None and isinstance(item, summary_writer):
                item.flush()
            elif hdf5_file is not None and isinstance(item, hdf5_file):
                if item.id.valid and item.mode != "r":
                    item.flush()
        except Exception:  # noqa: BLE001 - a stale handle must not stop the exit
            continue


def _class_or_none(module_name: str, *path: str):
    """A class of an already imported module, without importing it."""
    found = sys.modules.get(module_name)
    for name in path:
        found = getattr(found, name, None)
    return found
