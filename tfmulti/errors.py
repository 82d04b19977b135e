"""Exception types that mean bad input or a failed run, not a bug in tfmulti.

Scripts print these as one line and exit non-zero; anything else is a bug
and keeps its traceback.
"""

import signal

from tfmulti.names import PREEMPTED_EXIT_CODE


class TrainingError(RuntimeError):
    """Training stopped early (for example on a NaN loss); the message says why."""


class Preempted(RuntimeError):
    """The run was told to end (SIGTERM) and saved a step checkpoint to resume from.

    Args:
        epoch: the epoch (0-based) the checkpoint continues in.
        step: steps of that epoch the checkpoint holds.
        checkpoint: the checkpoint's weights file.
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, epoch: int, step: int, checkpoint: str):
        self.epoch, self.step, self.checkpoint = epoch, step, checkpoint
        super().__init__(
            f"preempted (SIGTERM): saved a checkpoint at epoch {epoch + 1}, step {step} "
            f"({checkpoint}); exiting with code {PREEMPTED_EXIT_CODE}, so a restart with "
            "--resume (or the launcher's --max_restarts) continues from it."
        )


class Terminated(RuntimeError):
    """A run with nothing to resume (a benchmark's timed steps) got SIGTERM and stopped.

    Its exit code is the shell's for a process ended by SIGTERM (143).
    """

    exit_code = 128 + signal.SIGTERM

    def __init__(self):
        super().__init__("stopped by SIGTERM before it finished; nothing was saved to resume")


class IncompatibleCheckpoint(ValueError):
    """A checkpoint holds the training state of another model or layout than the one
    built to resume it; the message says so in one line."""


USER_ERRORS = (ValueError, TrainingError, FileNotFoundError, Preempted, Terminated)
