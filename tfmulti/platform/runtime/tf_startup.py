"""Start TensorFlow without its start-up notices on the user's console.

On a machine without GPUs, TensorFlow 2.21 prints, while it is imported and when it first
looks for devices, lines such as `Could not find cuda drivers`, `failed call to cuInit:
... UNKNOWN ERROR (303)` (as an error) and absl's `WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR`. Several come from C++ code that
writes to file descriptor 2 whatever `TF_CPP_MIN_LOG_LEVEL` says, so `start_tensorflow`
sends that descriptor to a file while TensorFlow starts and then passes on every line
that is not one of those notices: a real error still shows.

It also asks for TensorFlow's BFC CPU allocator (`cpu_allocator`), which steps under a
strategy need, before TensorFlow starts its devices.

A log level from the user (`--tf_log_level`, or `TF_CPP_MIN_LOG_LEVEL` set before the
script starts) turns the filter off and lets TensorFlow print by its own rules.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

from tfmulti.platform.runtime.cpu_allocator import prefer_bfc_cpu_allocator

TF_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# Set beside TF_LOG_LEVEL_ENV when tfmulti chose the level, so a process started from
# this one (the planner's --validate runs) is not taken for a user's choice.
_QUIET_MARK_ENV = "TFMULTI_QUIET_TF_STARTUP"
DEFAULT_LOG_LEVEL = 2  # TensorFlow's warnings and info off, errors on
STARTUP_NOISE = re.compile(
    r"All log messages before absl::InitializeLog\(\) is called"
    r"|Could not find cuda drivers"
    r"|failed call to cuInit"
    r"|Unable to register cu(?:DNN|FFT|BLAS) factory"
    r"|computation placer already registered"
    r"|oneDNN custom operations are on"
    r"|This TensorFlow binary is optimized to use available CPU instructions"
    r"|To enable the following instructions: .* rebuild TensorFlow"
)


def user_log_level(log_level: int | None = None) -> int | None:
    """The TensorFlow log level the user asked for: `log_level` (a flag) if given, else
    `TF_CPP_MIN_LOG_LEVEL` if the user set it, else None."""
    if log_level is not None:
        return log_level
    text = os.environ.get(TF_LOG_LEVEL_ENV)
    if text is None or os.environ.get(_QUIET_MARK_ENV):
        return None
    return int(text) if text.strip().isdigit() else None


@contextlib.contextmanager
def stderr_without(noise: re.Pattern):
    """Holds back what is written to file descriptor 2, then writes it minus `noise` lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not noise.search(line)))
            sys.stderr.flush()


def start_tensorflow(log_level: int | None = None) -> None:
    """Imports TensorFlow and lists its devices, keeping its start-up notices off stderr,
    with the BFC CPU allocator unless the user chose one (`prefer_bfc_cpu_allocator`).

    Call it before anything imports TensorFlow; later calls do nothing new.

    Args:
        log_level: TensorFlow's C++ log level (0 all, 1 no info, 2 no warnings, 3 no
            errors), e.g. from `--tf_log_level`. None keeps the user's
            `TF_CPP_MIN_LOG_LEVEL` if set, else filters the start-up notices.
    """
    if "tensorflow" in sys.modules:
        return
    prefer_bfc_cpu_allocator()
    chosen = user_log_level(log_level)
    if chosen is not None:
        os.environ[TF_LOG_LEVEL_ENV] = str(chosen)
        os.environ.pop(_QUIET_MARK_ENV, None)
        import tensorflow  # noqa: F401

        return
    os.environ[TF_LOG_LEVEL_ENV] = str(DEFAULT_LOG_LEVEL)
    os.environ[_QUIET_MARK_ENV] = "1"
    with stderr_without(STARTUP_NOISE):
        import tensorflow as tf

        tf.config.list_physical_devices()
