"""Profile every worker of a multi-worker run into the chief's TensorBoard log directory.

Each worker traces the same training steps and puts its trace at
`<log_dir>/plugins/profile/<run>/<worker name>.xplane.pb`, so TensorBoard's
profile plugin lists one host per worker under one run. The TensorFlow profiler
names trace files after the host name, which every worker on one machine
shares, hence the trace is made in a private directory and then moved.
"""

from __future__ import annotations

import shutil
import tempfile

import keras
import tensorflow as tf


def profile_run_dir(log_dir: str, run_name: str) -> str:
    """The directory TensorBoard's profile plugin reads run `run_name` from."""
    return f"{log_dir.rstrip('/')}/plugins/profile/{run_name}"


class WorkerProfiler(keras.callbacks.Callback):
    """Traces training steps [start_step, stop_step] of this worker into the chief's log dir.

    Every worker must use it with the same steps and run name, and `log_dir`
    must be a path all workers can write (shared storage on a real cluster).

    Args:
        log_dir: the chief's TensorBoard log directory.
        worker_index: this worker's rank; names the host entry "worker<rank>".
        start_step: first training step traced, counted from 0 over all epochs.
        stop_step: last training step traced (inclusive).
        run_name: the profile run all workers share; defaults to "steps_<start>_<stop>".

    Example:
        >>> model.fit(data, callbacks=[WorkerProfiler(log_dir, cluster.task_index, 5, 7)])
    """

    def __init__(
        self,
        log_dir: str,
        worker_index: int,
        start_step: int,
        stop_step: int,
        run_name: str | None = None,
    ):
        super().__init__()
        if not 0 <= start_step <= stop_step:
            raise ValueError(
                "Profile steps must satisfy 0 <= start_step <= stop_step. "
                f"Received: start_step={start_step}, stop_step={stop_step}"
            )
        self.log_dir = log_dir
        self.worker_name = f"worker{worker_index}"
        self.start_step = start_step
        self.stop_step = stop_step
        self.run_name = run_name or f"steps_{start_step}_{stop_step}"
        self.trace_path: str | None = None
        self._step = 0
        self._private_dir: str | None = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._step == self.start_step and self._private_dir is None:
            self._private_dir = tempfile.mkdtemp(prefix="tfmulti-profile-")
            tf.profiler.experimental.start(self._private_dir)

    def on_train_batch_end(self, batch, logs=None):
        if self._step == self.stop_step:
            self._finish()
        self._step += 1

    def on_train_end(self, logs=None):
        self._finish()

    def _finish(self) -> None:
        if self._private_dir is None:
            return
        tf.profiler.experimental.stop()
        traces = tf.io.gfile.glob(f"{self._private_dir}/plugins/profile/*/*.xplane.pb")
        if traces:
            run_dir = profile_run_dir(self.log_dir, self.run_name)
            tf.io.gfile.makedirs(run_dir)
            self.trace_path = f"{run_dir}/{self.worker_name}.xplane.pb"
            tf.io.gfile.copy(traces[0], self.trace_path, overwrite=True)
        shutil.rmtree(self._private_dir, ignore_errors=True)
        self._private_dir = None
