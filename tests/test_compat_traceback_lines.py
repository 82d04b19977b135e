"""An error whose traceback has an entry without a line number passes through Keras'
traceback filtering as itself (Keras 3 raised a TypeError in its place)."""

import sys
import types

import keras
import pytest
from keras.src.utils import traceback_utils

from tfmulti.compat import keras_traceback_lines
from tfmulti.errors import Terminated


def _function_with_an_unnumbered_instruction():
    try:
        return sys._getframe()
    except Exception:
        return None


def _entry_without_a_line() -> types.TracebackType:
    """A traceback entry whose instruction has no line, as a signal handler's error can get."""
    frame = _function_with_an_unnumbered_instruction()
    unnumbered = [start for start, _, line in frame.f_code.co_lines() if line is None]
    assert unnumbered, "this Python numbers every instruction; find another way to build one"
    entry = types.TracebackType(None, frame, unnumbered[0], -1)
    assert entry.tb_lineno is None
    return entry


def _raises_terminated_without_a_line():
    raise Terminated().with_traceback(_entry_without_a_line())


def test_upstream_keras_still_fails_on_an_entry_without_a_line():
    # Fails once Keras handles such entries itself: then remove keras_traceback_lines.
    original = keras_traceback_lines.original_process_traceback_frames()
    with pytest.raises(TypeError, match="NoneType"):
        original(_entry_without_a_line())


def test_with_the_fix_a_keras_filtered_call_raises_the_error_itself():
    assert "traceback_entries_without_a_line" in keras_traceback_lines.FIX_SET.apply()
    assert keras.config.is_traceback_filtering_enabled()
    filtered = traceback_utils.filter_traceback(_raises_terminated_without_a_line)
    with pytest.raises(Terminated) as raised:
        filtered()
    lines = [entry.tb_lineno for entry in _entries(raised.value.__traceback__)]
    assert None not in lines


def test_numbering_keeps_every_entry_and_numbered_ones_as_they_are():
    entry = _entry_without_a_line()
    numbered_outer = types.TracebackType(entry, sys._getframe(), 0, 7)
    rebuilt = keras_traceback_lines.with_every_line_numbered(numbered_outer)
    entries = _entries(rebuilt)
    assert [e.tb_frame for e in entries] == [numbered_outer.tb_frame, entry.tb_frame]
    code = entry.tb_frame.f_code
    assert entries[0].tb_lineno == 7
    assert code.co_firstlineno <= entries[1].tb_lineno <= code.co_firstlineno + 4
    complete = types.TracebackType(None, sys._getframe(), 0, 3)
    assert keras_traceback_lines.with_every_line_numbered(complete) is complete


def _entries(traceback):
    entries = []
    while traceback is not None:
        entries.append(traceback)
        traceback = traceback.tb_next
    return entries
