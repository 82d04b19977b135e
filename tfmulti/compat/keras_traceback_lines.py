"""Keras' traceback filtering fails on a traceback entry that has no line number.

Keras wraps `fit`, `evaluate` and more in `filter_traceback`, which rebuilds an error's
traceback without Keras' own frames: `types.TracebackType(..., line_no)` for each entry.
Since Python 3.11 an entry's `tb_lineno` is None when the error was raised at an
instruction that has no line: a signal handler's exception (SIGTERM's `Terminated`, or
Ctrl-C's `KeyboardInterrupt`) can land on one. Keras then raises
`TypeError: 'NoneType' object cannot be interpreted as an integer` in place of the error,
and a script that reports a SIGTERM in one line printed a traceback instead (seen once in
CI: `tests/test_planner_sigterm.py`, SIGTERM during TensorFlow's platform probe in `fit`).

The fix gives such entries their frame's current line (else the function's first) before
Keras' filtering reads them. `tests/test_compat_traceback_lines.py` tells when upstream
handles them itself.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from keras.src.utils import traceback_utils

from tfmulti.compat.fixes import Fix, FixSet


def with_every_line_numbered(traceback: types.TracebackType | None):
    """`traceback` with each entry that has no line number given its frame's line (or its
    function's first line); `traceback` itself when every entry has one.

    Example:
        >>> numbered = with_every_line_numbered(error.__traceback__)
    """
    entries = []
    entry = traceback
    while entry is not None:
        entries.append(entry)
        entry = entry.tb_next
    if all(entry.tb_lineno is not None for entry in entries):
        return traceback
    rebuilt = None
    for entry in reversed(entries):
        frame = entry.tb_frame
        line = entry.tb_lineno
        if line is None:
            line = frame.f_lineno if frame.f_lineno is not None else frame.f_code.co_firstlineno
        rebuilt = types.TracebackType(rebuilt, frame, entry.tb_lasti, line)
    return rebuilt


def _numbering_every_line(original: Callable) -> Callable:
    @functools.wraps(original)
    def process(traceback):
        return original(with_every_line_numbered(traceback))

    return process


FIXES = (
    Fix(
        name="traceback_entries_without_a_line",
        owner=traceback_utils,
        attribute="_process_traceback_frames",
        make_replacement=_numbering_every_line,
    ),
)

FIX_SET = FixSet(FIXES)


def original_process_traceback_frames() -> Callable:
    """Keras' own filtering of a traceback, to check whether upstream still needs the fix."""
    return FIX_SET.original(FIXES[0].name)
