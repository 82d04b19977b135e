"""Keras callbacks that work under every tfmulti strategy.

- `ThroughputLogger`: examples/sec and step time to the console and TensorBoard.
- `StopOnNonFiniteLoss`: stops training at the first NaN or Inf loss and says where.
"""

from __future__ import annotations

import math
import threading
import time

import keras
import tensorflow as tf
from absl import logging


class ThroughputLogger(keras.callbacks.Callback):
    """Logs examples/sec and step time every `log_steps` steps and per epoch.

    Per-epoch figures are also added to the epoch `logs` (`examples_per_sec`,
    `step_time_ms`, `epoch_seconds`) so later callbacks record them.

    Args:
        global_batch_size: examples in one step over all replicas.
        log_steps: how often to log, in steps; 0 logs per epoch only.
        log_dir: TensorBoard directory for the scalars, or None for console only.

    Example:
        >>> model.fit(ds, callbacks=[ThroughputLogger(256, log_steps=50, log_dir="logs/train")])
    """

    # Keras may run batch hooks on a worker thread, so the step loop need not wait for them.
    async_safe = True

    def __init__(self, global_batch_size: int, log_steps: int = 100, log_dir: str | None = None):
        super().__init__()
        self._lock = threading.Lock()
        self.global_batch_size = global_batch_size
        self.log_steps = log_steps
        self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._global_step = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._window_start = time.perf_counter()
        self._epoch_first_step = self._window_first_step = self._global_step

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1 Keras calls this once per execution, with
        # the index of the last step run, so count steps from the index.
        with self._lock:
            self._global_step = max(self._global_step, self._epoch_first_step + batch + 1)
            steps = self._global_step - self._window_first_step
            if self.log_steps and steps >= self.log_steps:
                now = time.perf_counter()
                self._report("step", self._global_step, steps, now - self._window_start)
                self._window_start, self._window_first_step = now, self._global_step

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._epoch_start
        steps = self._global_step - self._epoch_first_step
        examples_per_sec, step_time_ms = self._report("epoch", epoch + 1, steps, seconds)
        if logs is not None:
            logs.update(
                examples_per_sec=examples_per_sec,
                step_time_ms=step_time_ms,
                epoch_seconds=seconds,
            )

    def on_train_end(self, logs=None):
        if self._writer:
            self._writer.flush()

    def _report(self, unit: str, index: int, steps: int, seconds: float) -> tuple[float, float]:
        steps = max(steps, 1)
        examples_per_sec = steps * self.global_batch_size / max(seconds, 1e-9)
        step_time_ms = 1000.0 * seconds / steps
        logging.info(
            "%s %d: %.1f examples/sec, %.2f ms/step", unit, index, examples_per_sec, step_time_ms
        )
        if self._writer:
            with self._writer.as_default():
                tf.summary.scalar(f"{unit}_examples_per_sec", examples_per_sec, step=index)
                tf.summary.scalar(f"{unit}_step_time_ms", step_time_ms, step=index)
        return examples_per_sec, step_time_ms


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stops training at the first NaN or Inf loss and records where it happened.

    Unlike `keras.callbacks.TerminateOnNaN`, the place is kept in `self.failure`
    (a message, or None) so the caller can report it and exit non-zero.
    """

    async_safe = True

    def __init__(self):
        super().__init__()
        self.failure: str | None = None
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self.failure = f"loss became {float(loss)} at epoch {self._epoch + 1}, step {batch + 1}"
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        # Validation loss can overflow even when every training step was finite.
        loss = (logs or {}).get("val_loss")
        if self.failure is None and loss is not None and not math.isfinite(float(loss)):
            self.failure = f"validation loss became {float(loss)} at epoch {epoch + 1}"
            self.model.stop_training = True
