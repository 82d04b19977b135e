"""Where TensorFlow's profiler may run: not on non-chief workers of a multi-worker cluster.

TensorFlow 2.20-2.21's host tracer (TSL `TraceMeRecorder::Consume`) keeps raw
pointers to the end events of activities that began on another thread while it
fills a vector that may reallocate, then writes through them: a heap corruption
(`free(): invalid pointer`, `munmap_chunk(): invalid pointer`) inside
`tf.profiler.experimental.stop()`. Collective ops start such an activity
(`CollectiveExecutor::CompleteParams`) on one thread and end it on another when
the group leader answers over gRPC, which happens on every worker but the chief,
every step. Measured: a non-chief worker that starts and stops the profiler
around 4-step windows aborted in 4 of 7 two-worker runs (6 windows each); the
chief, 0 crashes in 480 windows. Newer TSL reserves the vector first.

Only the chief therefore records a trace in multi-worker runs on the affected
versions. `tests/workers/profiler_probe.py` reproduces the crash (`--profiling_rank=1`)
and shows the chief unharmed (`--profiling_rank=0`); run the first on a new
TensorFlow release before setting FIRST_CHECKED_FIXED_TENSORFLOW.
"""

from __future__ import annotations

from tfmulti.compat.versions import version_tuple

FIRST_BROKEN_TENSORFLOW = (2, 20)
# Newest TensorFlow checked is 2.21; setup.py allows no newer one. On a newer one the
# guard stays on until the probe (see above) shows the crash gone there.
FIRST_CHECKED_FIXED_TENSORFLOW: tuple[int, ...] | None = None


def tensorflow_version() -> tuple[int, ...]:
    """The installed TensorFlow version as integers, e.g. (2, 21, 0)."""
    import tensorflow as tf

    return version_tuple(tf.__version__)


def host_profiler_is_safe(is_multi_worker: bool, is_chief: bool) -> bool:
    """Whether this process may start and stop TensorFlow's profiler without risking a crash.

    Args:
        is_multi_worker: the process runs collectives with other worker processes.
        is_chief: it is the chief (worker 0), which leads the collective groups.
    """
    if not is_multi_worker or is_chief:
        return True
    version = tensorflow_version()
    if version < FIRST_BROKEN_TENSORFLOW:
        return True
    return FIRST_CHECKED_FIXED_TENSORFLOW is not None and version >= FIRST_CHECKED_FIXED_TENSORFLOW


def skipped_notice(rank: int) -> str:
    """The line a worker that records no profile logs instead."""
    import tensorflow as tf

    return (
        f"tfmulti: worker {rank} records no profile: TensorFlow {tf.__version__}'s profiler "
        "corrupts the heap of non-chief multi-worker processes (see "
        "tfmulti/compat/tf_profiler.py); the chief's trace is in the run's profile directory."
    )
