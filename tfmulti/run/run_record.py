"""`metrics.json`: the machine-readable record of a training run.

Keys:
    run: the run's settings (strategy, replicas, batch sizes, model, dataset, ...).
    status: "running", "completed" or "failed".
    failure: why the run failed, or null.
    epochs: one record per completed epoch, each exactly once even across
        resumes: {"epoch", "loss", metric names, "val_loss", "val_<metric>",
        "learning_rate", "examples_per_sec", "step_time_ms", "epoch_seconds"}.
    final: the last evaluation on the validation data ({"loss", metrics}).
    resumes: one record per resume: {"epoch" (1-based), "step" (steps of that epoch
        already trained), "checkpoint", "time" (seconds since the epoch, UTC)}.
    membership: one record per start on a new set of workers: {"workers", "slots",
        "left", "joined", "epoch", "step", "global_step", "time"} (see `note_membership`).
    starts: one record per start of the training process (the first run and each resume):
        {"seconds_to_first_step" (from the process's start to the end of its first
        training step, or null where the system does not say when the process started),
        "time"}.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time

import keras
from absl import logging

from tfmulti.files import write_json_atomically
from tfmulti.platform.launching.membership import MEMBERSHIP_VARIABLE
from tfmulti.platform.launching.process_age import process_age_seconds

METRICS_FILE = "metrics.json"


def _plain(value):
    number = float(value)
    return number if math.isfinite(number) else str(number)


class RunRecord:
    """Holds and atomically rewrites `metrics.json` in `directory`.

    Args:
        directory: where `metrics.json` is written (None: keep in memory only,
            as non-chief workers do).
        run: the run's settings, stored under "run".
        resume_from_epoch: when resuming, epochs up to this one are kept from an
            existing file; later ones are dropped, since they will be trained again.
            None for a fresh run.
    """

    def __init__(self, directory: str | None, run: dict, resume_from_epoch: int | None = None):
        self.path = os.path.join(directory, METRICS_FILE) if directory else None
        epochs, resumes, preemptions, membership, starts = [], [], [], [], []
        self._previous = None
        if resume_from_epoch is not None and self.path and os.path.exists(self.path):
            with open(self.path) as handle:
                previous = json.load(handle)
            self._previous = copy.deepcopy(previous)
            epochs = [e for e in previous["epochs"] if e["epoch"] <= resume_from_epoch]
            resumes = previous.get("resumes", [])
            preemptions = previous.get("preemptions", [])
            membership = previous.get("membership", [])
            starts = previous.get("starts", [])
        self.record = {
            "run": run,
            "status": "running",
            "failure": None,
            "epochs": epochs,
            "resumes": resumes,
            "preemptions": preemptions,
            "membership": membership,
            "starts": starts,
        }
        self.record["final"] = {}
        self.write()

    def add_resume(self, epoch: int, step: int, checkpoint: str, when: float) -> None:
        """Notes that the run resumed `step` steps into `epoch` (1-based) from `checkpoint`."""
        self.record["resumes"].append(
            {"epoch": epoch, "step": step, "checkpoint": checkpoint, "time": when}
        )
        self.write()

    def add_preemption(self, epoch: int, step: int, checkpoint: str, when: float) -> None:
        """Notes that the run was preempted and saved `step` steps into `epoch` (1-based)."""
        self.record["preemptions"].append(
            {"epoch": epoch, "step": step, "checkpoint": checkpoint, "time": when}
        )
        self.record["status"] = "preempted"
        self.write()

    def add_membership(self, entry: dict) -> None:
        """Notes the workers a start runs on, when they differ from the last start's."""
        last = self.record["membership"][-1] if self.record["membership"] else {}
        if (last.get("workers"), last.get("slots")) != (entry["workers"], entry["slots"]):
            self.record["membership"].append(entry)
            self.write()

    def add_start(self, seconds_to_first_step: float | None) -> None:
        """Notes how long this process took to finish its first training step."""
        self.record["starts"].append(
            {"seconds_to_first_step": seconds_to_first_step, "time": time.time()}
        )
        self.write()

    def add_epoch(self, epoch: int, logs: dict) -> None:
        self.record["epochs"].append(
            {"epoch": epoch, **{name: _plain(value) for name, value in logs.items()}}
        )
        self.write()

    def set_memory(self, memory: dict) -> None:
        """Records the bytes each device holds (`tfmulti.run.device_memory.memory_section`)."""
        self.record["memory"] = memory
        self.write()

    def finish(self, final: dict, failure: str | None = None) -> None:
        self.record["final"] = {name: _plain(value) for name, value in final.items()}
        self.record["status"] = "failed" if failure else "completed"
        self.record["failure"] = failure
        self.write()

    def put_back_previous(self) -> None:
        """Rewrites the file a resumed run found, as it was (the resume failed before
        training anything, e.g. its checkpoint did not fit the model built)."""
        if self._previous is not None:
            self.record = self._previous
            self.write()

    def write(self) -> None:
        if self.path:
            write_json_atomically(self.path, self.record)


class RecordFirstStep(keras.callbacks.Callback):
    """Adds a `RunRecord` start once this process's first training step has finished: how
    long after the process started (`process_age_seconds`), a user's time to first step."""

    # Keras runs async-safe batch hooks once the step's logs are values, so the step is done.
    async_safe = True

    def __init__(self, record: RunRecord):
        super().__init__()
        self.record = record
        self.recorded = False

    def on_train_batch_end(self, batch, logs=None):
        if not self.recorded:
            self.recorded = True
            self.record.add_start(process_age_seconds())


class RecordEpochs(keras.callbacks.Callback):
    """Appends every finished epoch's logs to a `RunRecord`."""

    def __init__(self, record: RunRecord):
        super().__init__()
        self.record = record

    def on_epoch_end(self, epoch, logs=None):
        self.record.add_epoch(epoch + 1, logs or {})


def note_membership(
    record: RunRecord,
    num_workers: int,
    epoch: int,
    step: int,
    global_step: int,
    log_dir: str,
    is_chief: bool = True,
) -> None:
    """Records the workers this start runs on; the chief says a change of them in one
    log line and draws the count as TensorBoard's `workers` scalar (in `log_dir`).

    The launcher says which slots run, and who left or joined, in `TFMULTI_MEMBERSHIP`;
    without it (a run not started by the launcher) only the count is known.
    """
    import tensorflow as tf

    launched = json.loads(os.environ.get(MEMBERSHIP_VARIABLE) or "{}")
    entry = {
        "workers": num_workers,
        "slots": launched.get("slots"),
        "left": launched.get("left", []),
        "joined": launched.get("joined", []),
        "epoch": epoch,
        "step": step,
        "global_step": global_step,
        "time": time.time(),
    }
    record.add_membership(entry)
    if not is_chief:
        return
    if entry["left"] or entry["joined"]:
        changes = [f"{', '.join(entry[key])} {key}" for key in ("left", "joined") if entry[key]]
        logging.info(
            "Membership changed: %s; now %d workers; resuming at epoch %d, step %d "
            "(global step %d)",
            "; ".join(changes),
            num_workers,
            epoch,
            step,
            global_step,
        )
    writer = tf.summary.create_file_writer(log_dir)
    with writer.as_default():
        tf.summary.scalar("workers", num_workers, step=global_step)
    writer.close()
