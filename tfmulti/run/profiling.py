"""Profiler traces of chosen training steps, readable by TensorBoard's profile plugin."""

from __future__ import annotations

import shutil
import tempfile

import keras
import tensorflow as tf

from tfmulti.compat import tf_internals


def profile_run_dir(log_dir: str, run_name: str) -> str:
    """The directory TensorBoard's profile plugin reads run `run_name` from."""
    return f"{log_dir.rstrip('/')}/plugins/profile/{run_name}"


class ProfileSteps(keras.callbacks.Callback):
    """Records a profiler trace of training steps `first..last` (1-based, over all epochs).

    Every step is wrapped in a `tf.profiler.experimental.Trace` marked as a step
    (`_r=1`), which Keras's own TensorBoard callback omits, so the profile
    plugin's step view is filled. The trace lands in
    `log_dir/plugins/profile/<run>/<host>.xplane.pb`.

    With `host_name` (multi-worker), the trace is recorded privately and copied
    to `log_dir/plugins/profile/<run_name>/<host_name>.xplane.pb`; when every
    worker gives the same `log_dir` and run name and its own host name, the
    profile plugin shows the workers side by side.

    Args:
        log_dir: TensorBoard log directory of the run (shared by all workers).
        steps: (first, last) steps to trace.
        host_name: this process's entry in the run, e.g. "worker1"; None lets
            the profiler name it after the machine.
        run_name: the profile run with `host_name`; defaults to "steps_<first>_<last>".

    Example:
        >>> model.fit(data, callbacks=[ProfileSteps("runs/a/logs/train", (3, 5))])
    """

    def __init__(
        self,
        log_dir: str,
        steps: tuple[int, int],
        host_name: str | None = None,
        run_name: str | None = None,
    ):
        super().__init__()
        self.log_dir = log_dir
        self.first_step, self.last_step = steps
        self.host_name = host_name
        self.run_name = run_name or f"steps_{self.first_step}_{self.last_step}"
        self.trace_path: str | None = None
        self._step = 0
        self._profile_dir: str | None = None
        self._trace = None

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.first_step:
            self._start()
        if self._profile_dir is not None:
            self._trace = tf_internals.step_trace("train", self._step)
            self._trace.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if self._step >= self.last_step:
            self._stop()

    def on_train_end(self, logs=None):
        self._stop()

    def _start(self) -> None:
        private = self.host_name is not None
        self._profile_dir = tempfile.mkdtemp(prefix="tfmulti-profile-") if private else self.log_dir
        tf.profiler.experimental.start(self._profile_dir)

    def _stop(self) -> None:
        if self._profile_dir is None:
            return
        tf.profiler.experimental.stop()
        if self.host_name is not None:
            self._publish_private_trace()
        self._profile_dir = None

    def _publish_private_trace(self) -> None:
        traces = tf.io.gfile.glob(f"{self._profile_dir}/plugins/profile/*/*.xplane.pb")
        if traces:
            run_dir = profile_run_dir(self.log_dir, self.run_name)
            tf.io.gfile.makedirs(run_dir)
            self.trace_path = f"{run_dir}/{self.host_name}.xplane.pb"
            tf.io.gfile.copy(traces[0], self.trace_path, overwrite=True)
        shutil.rmtree(self._profile_dir, ignore_errors=True)
