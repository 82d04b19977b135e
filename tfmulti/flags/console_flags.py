"""Flags of what a script prints: TensorFlow's own log lines, and which workers talk."""

from __future__ import annotations

from absl import flags

from tfmulti.flags.help import flag_group


@flag_group("console")
def define_console_flags() -> None:
    """Flags of every script that starts TensorFlow."""
    flags.DEFINE_integer(
        "tf_log_level",
        None,
        "TensorFlow's C++ log level: 0 all, 1 no info, 2 no warnings, 3 no errors (as "
        "TF_CPP_MIN_LOG_LEVEL, which also works). Unset: TensorFlow's start-up notices "
        "(no CUDA driver, cuInit, CPU instructions) are kept off the console, errors shown.",
        lower_bound=0,
        upper_bound=3,
    )


@flag_group("console")
def define_worker_console_flags() -> None:
    """Flags of scripts that run as one of several workers."""
    flags.DEFINE_boolean(
        "verbose_workers",
        False,
        "Every worker prints Keras's progress lines and the final paths; by default only the "
        "chief does (the others print warnings and errors).",
    )
