"""Profiler traces of chosen training steps, readable by TensorBoard's profile plugin."""

from __future__ import annotations

import keras
import tensorflow as tf


class ProfileSteps(keras.callbacks.Callback):
    """Records a profiler trace of training steps `first..last` (1-based, over all epochs).

    Every step is wrapped in a `tf.profiler.experimental.Trace` marked as a step
    (`_r=1`), which Keras's own TensorBoard callback omits, so the profile
    plugin's step view is filled. The trace lands in
    `log_dir/plugins/profile/<run>/<host>.xplane.pb`.

    Args:
        log_dir: TensorBoard log directory of the run.
        steps: (first, last) steps to trace.
    """

    def __init__(self, log_dir: str, steps: tuple[int, int]):
        super().__init__()
        self.log_dir = log_dir
        self.first_step, self.last_step = steps
        self._step = 0
        self._profiling = False
        self._trace = None

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.first_step:
            tf.profiler.experimental.start(self.log_dir)
            self._profiling = True
        if self._profiling:
            self._trace = tf.profiler.experimental.Trace("train", step_num=self._step, _r=1)
            self._trace.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._trace is not None:
            self._trace.__exit__(None, None, None)
            self._trace = None
        if self._profiling and self._step >= self.last_step:
            self._stop()

    def on_train_end(self, logs=None):
        if self._profiling:
            self._stop()

    def _stop(self):
        tf.profiler.experimental.stop()
        self._profiling = False
