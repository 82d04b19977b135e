"""Preemption: on SIGTERM the whole group saves a step checkpoint at one agreed step and exits.

TensorFlow's `PreemptionCheckpointHandler` does the agreeing: the worker that receives
SIGTERM names the next step through the coordination service, every worker trains up
to it, and each then calls our `save_fn` and `exit_fn` at the same step. Here `save_fn`
writes tfmulti's own step checkpoint (weights, optimizer, metrics, seeds, position), so
a restarted run resumes at that exact step like any other, and `exit_fn` raises
`Preempted`, which the scripts turn into `PREEMPTED_EXIT_CODE`: the code the launcher
(and Borg-style cluster managers, as TensorFlow's own default) read as "restart me".
On one process (one device, mirrored, pipeline, placed, hybrid on one host) the same
handler works locally, with no agreement to make. When the chief drives other workers'
devices (`connected_cluster`), a SIGTERM to one of those workers reaches the chief as a
notice, and the chief saves and exits as on its own.

Off the main thread (Ray Train runs a training function on another) Python installs no
signal handler: there the handler polls `request_preemption`'s flag instead, once a
second, and the same agreement, save and exit follow. An engine that learns of a
preemption (or a user's own watcher thread) calls `request_preemption()`.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading

import keras
import tensorflow as tf
from absl import logging

from tfmulti.compat import tf_internals
from tfmulti.errors import Preempted, Terminated
from tfmulti.platform.launching.sigterm import on_main_thread
from tfmulti.platform.runtime.connected_cluster import serving_worker_got_sigterm
from tfmulti.run.step_checkpoint import StepCheckpoint

_preemption_requested = threading.Event()


def request_preemption() -> None:
    """Asks a run trained off the main thread to save a step checkpoint and stop, as
    SIGTERM does on the main thread; `fit` then raises `Preempted`. Safe from any thread;
    the request holds until a run acts on it."""
    _preemption_requested.set()


class SaveOnPreemption(keras.callbacks.Callback):
    """Saves a step checkpoint and ends training when this run or a peer gets SIGTERM
    (off the main thread: when `request_preemption` is called).

    Put it after `step_checkpoint` among the callbacks (it saves at the position that
    one has counted) and after the callbacks that record an epoch (a preemption on an
    epoch's last step lets the epoch finish, validation and records included, and ends
    the run at the epoch-end checkpoint).

    Args:
        step_checkpoint: the run's step checkpoints (a private directory on non-chief
            workers, as for its own saves); None for steps that are only timed (the
            planner's benchmarks), which SIGTERM ends with `Terminated`, saving nothing.
        cluster_resolver: the multi-worker strategy's resolver; None on one process.

    Raises:
        Preempted: from `fit`, once the checkpoint is saved.
        Terminated: from `fit`, without a step checkpoint.
    """

    def __init__(self, step_checkpoint: StepCheckpoint | None, cluster_resolver=None):
        super().__init__()
        self.step_checkpoint = step_checkpoint
        self.cluster_resolver = cluster_resolver
        self._handler = None
        self._on_main_thread = True
        self._previous_sigterm = None
        self._scratch = None
        self._saved: tuple[int, int, str] | None = None
        self._ends_with_epoch = False
        self._worker_got_sigterm = False

    def on_train_begin(self, logs=None):
        self._on_main_thread = on_main_thread()
        if self._on_main_thread:
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
        # The handler restores and keeps its own step counter in a checkpoint directory;
        # ours never writes there (save_fn replaces its save), so a scratch one serves.
        self._scratch = tempfile.mkdtemp(prefix="tfmulti-preemption-")
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), self._scratch, max_to_keep=1)
        config = tf.distribute.experimental.TerminationConfig(
            # None: the handler installs its SIGTERM handler, which only the main thread may.
            termination_watcher_fn=None if self._on_main_thread else _preemption_requested.is_set,
            exit_fn=self._exit,
            save_fn=self._save,
            grace_period=0,
        )
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            self.cluster_resolver, manager, termination_config=config
        )

    def on_train_batch_end(self, batch, logs=None):
        rank = None if self._worker_got_sigterm else serving_worker_got_sigterm()
        if rank is not None:
            self._worker_got_sigterm = True
            logging.warning("Worker %d got SIGTERM: saving a step checkpoint to stop at.", rank)
            # The handler catches this process's SIGTERM (or polls the flag off the main
            # thread): the same save at the same step.
            if self._on_main_thread:
                signal.raise_signal(signal.SIGTERM)
            else:
                request_preemption()
        self._handler.save_checkpoint_if_preempted()

    def on_epoch_end(self, epoch, logs=None):
        if self._ends_with_epoch:
            # The epoch-end checkpoint (saved before this callback runs) is the one.
            self._raise(epoch + 1, 0, self.step_checkpoint.last_saved)

    def on_train_end(self, logs=None):
        # Each worker's handler has a thread waiting on the chief's coordination service for
        # a peer's preemption; one still waiting when the chief's process ends fails with a
        # traceback. Every worker ends its own here, before the final evaluation, whose
        # collectives the chief cannot finish without them: so none waits past the chief.
        # (A failed `fit` leaves it: peers may be gone, and the process ends soon.)
        if self._handler is not None:
            tf_internals.stop_peer_preemption_watcher(self._handler)
        self.release()

    def _save(self) -> None:
        if self.step_checkpoint is None:
            return
        epoch, step = self.step_checkpoint.position
        if step >= self.step_checkpoint.steps_per_epoch:
            self._ends_with_epoch = True
            return
        self._saved = (epoch, step, self.step_checkpoint.save(epoch, step))

    def _exit(self) -> None:
        _preemption_requested.clear()  # acted on
        if self.step_checkpoint is None:
            self.release()
            raise Terminated()
        if self._ends_with_epoch:
            return
        epoch, step, path = self._saved
        self._raise(epoch, step, path)

    def _raise(self, epoch: int, step: int, checkpoint: str) -> None:
        self.release()
        raise Preempted(epoch, step, checkpoint)

    def release(self) -> None:
        """Gives SIGTERM back to its previous handler, so a late one ends the process, and
        removes the handler's scratch directory. Called when training ends or is preempted,
        and by the trainer after a `fit` that raised anything else; calling again does
        nothing."""
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        # Off the main thread, TensorFlow's thread that polls the request ends once it has
        # seen it, and must not drop the handler's last reference: the handler's __del__
        # would join that very thread. This callback keeps it until it goes itself.
        if self._on_main_thread:
            self._handler = None
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
