"""Exception types that mean bad input or a failed run, not a bug in tfmulti.

Scripts print these as one line and exit non-zero; anything else is a bug
and keeps its traceback.
"""


class TrainingError(RuntimeError):
    """Training stopped early (for example on a NaN loss); the message says why."""


USER_ERRORS = (ValueError, TrainingError, FileNotFoundError)
