"""Step-level checkpoints a run resumes from exactly: weights, optimizer, metrics, seeds, position.

Each checkpoint is two files in one directory, both written beside their final name
and renamed into place: `step-<global step>.weights.h5` (weights and optimizer
state: `training_state`, whatever the model exports) and `step-<global step>.json` (the position in
the run, the running values of the epoch's metrics and every random seed state the
model holds). `latest.json` names the newest; a checkpoint counts only once its JSON
file exists, and that file is written after the weights, so a kill during a save
leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import h5py
import keras
import numpy as np

from tfmulti.files import atomic_path, write_json_atomically
from tfmulti.run.training_state import load_training_state, save_training_state

LATEST_FILE = "latest.json"
_STATE_PATTERN = re.compile(r"^step-(\d{9})\.json$")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: `step` steps into epoch `epoch` (0-based), `global_step` in all.

    Args:
        epoch: the epoch (0-based) the run continues in; `step` == 0 starts it afresh.
        step: steps of that epoch already trained.
        global_step: steps trained since the run began.
        weights_path: the checkpoint's weights file.
        state: the saved metric values and seed states (see `StepCheckpoint`).
    """

    epoch: int
    step: int
    global_step: int
    weights_path: str
    state: dict

    @property
    def name(self) -> str:
        return os.path.basename(self.weights_path)


def _seed_state_variables(model: keras.Model) -> list:
    # Dropout and other random layers keep their generator state outside the weights file.
    return [v for v in model.non_trainable_variables if v.path.endswith("seed_generator_state")]


def _values(variables) -> dict[str, list]:
    return {v.path: np.asarray(v.numpy()).tolist() for v in variables}


def _assign(variables, values: dict[str, list]) -> None:
    for variable in variables:
        if variable.path in values:
            variable.assign(np.asarray(values[variable.path], dtype=variable.dtype))


class StepCheckpoint(keras.callbacks.Callback):
    """Saves a resumable checkpoint every `every_steps` steps and at the end of each epoch.

    Under a multi-worker strategy every worker must run each save (reading mirrored
    state runs collectives); give non-chief workers a private `directory`.

    Args:
        directory: where checkpoints and `latest.json` go.
        steps_per_epoch: steps in one epoch, to turn a step count into a position.
        every_steps: save every this many steps (0: at epoch ends only).
        keep: complete checkpoints kept (at least 2, so a corrupt newest has a fallback).
        start: the point this run resumed from (None for a fresh run).
    """

    def __init__(
        self,
        directory: str,
        steps_per_epoch: int,
        every_steps: int = 0,
        keep: int = 2,
        start: ResumePoint | None = None,
    ):
        super().__init__()
        self.directory = directory
        self.steps_per_epoch = steps_per_epoch
        self.every_steps = every_steps
        self.keep = max(2, keep)
        self.start = start
        self._epoch = start.epoch if start else 0
        self.position = (start.epoch, start.step) if start else (0, 0)
        self.last_saved: str | None = None
        # Without step saves the batch hooks do nothing, so Keras need not wait on each step.
        self.async_safe = not every_steps

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        resumed_steps = self.start.step if self.start and self._epoch == self.start.epoch else 0
        step = resumed_steps + batch + 1
        # (epoch, steps of it trained): where a save now would let a resumed run continue.
        self.position = (self._epoch, step)
        if not self.every_steps:
            return
        global_step = self._epoch * self.steps_per_epoch + step
        if global_step % self.every_steps == 0 and step < self.steps_per_epoch:
            self.save(self._epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        # Saved after the epoch's validation and records, so a resume starts the next epoch.
        self.save(epoch + 1, 0)

    def save(self, epoch: int, step: int) -> str:
        """Writes a checkpoint `step` steps into `epoch` (0-based); returns the weights path."""
        global_step = epoch * self.steps_per_epoch + step
        stem = f"step-{global_step:09d}"
        weights_path = os.path.join(self.directory, f"{stem}.weights.h5")
        with atomic_path(weights_path) as temporary:
            save_training_state(self.model, temporary)
        state = {
            "epoch": epoch,
            "step": step,
            "global_step": global_step,
            "weights": os.path.basename(weights_path),
            "metrics": _values(self.model.metrics_variables) if step else {},
            "seeds": _values(_seed_state_variables(self.model)),
        }
        write_json_atomically(os.path.join(self.directory, f"{stem}.json"), state)
        write_json_atomically(os.path.join(self.directory, LATEST_FILE), {"state": f"{stem}.json"})
        self._delete_old()
        self.last_saved = weights_path
        return weights_path

    def _delete_old(self) -> None:
        states = sorted(name for name in os.listdir(self.directory) if _STATE_PATTERN.match(name))
        for old in states[: -self.keep]:
            stem = old[: -len(".json")]
            for path in (f"{stem}.json", f"{stem}.weights.h5"):
                full = os.path.join(self.directory, path)
                if os.path.exists(full):
                    os.remove(full)


def _readable(point: ResumePoint) -> bool:
    """Whether every array of the weights file can be read back (a truncated file cannot)."""
    arrays = []
    try:
        with h5py.File(point.weights_path, "r") as handle:
            handle.visititems(
                lambda name, item: (
                    arrays.append(item[()]) if isinstance(item, h5py.Dataset) else None
                )
            )
    except (OSError, ValueError, KeyError, RuntimeError):
        return False
    return bool(arrays)


def _load_point(directory: str, state_name: str) -> ResumePoint | None:
    try:
        with open(os.path.join(directory, state_name)) as handle:
            state = json.load(handle)
        point = ResumePoint(
            int(state["epoch"]),
            int(state["step"]),
            int(state["global_step"]),
            os.path.join(directory, state["weights"]),
            state,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return point if _readable(point) else None


def find_resume_point(directory: str, report=print) -> ResumePoint | None:
    """The newest complete checkpoint in `directory`, or None if it holds none.

    A newest checkpoint that cannot be read (a kill during its save, a damaged file)
    is skipped for the one before it, and `report` is called with one line saying so.
    """
    if not os.path.isdir(directory):
        return None
    names = sorted(
        (name for name in os.listdir(directory) if _STATE_PATTERN.match(name)), reverse=True
    )
    for index, name in enumerate(names):
        point = _load_point(directory, name)
        if point is None:
            continue
        if index:
            skipped = ", ".join(names[:index])
            report(
                f"tfmulti: checkpoint {skipped} in {directory} is incomplete or damaged; "
                f"resuming from the previous complete one, {name}."
            )
        return point
    return None


def restore(model: keras.Model, point: ResumePoint) -> None:
    """Loads the weights, optimizer state and seed states of `point` into `model`.

    Keras skips the state of an optimizer that is not built yet; `fit` builds it before
    `on_train_begin` for most models, but not for one with its own `build` (a pipeline).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        order = getattr(model, "optimizer_variable_order", None)
        optimizer.build(order() if order else model.trainable_variables)
    load_training_state(model, point.weights_path)
    _assign(_seed_state_variables(model), point.state.get("seeds", {}))


class ResumeRun(keras.callbacks.Callback):
    """Continues a run from a step checkpoint inside `fit(initial_epoch=point.epoch)`.

    At the start of training it restores the checkpoint. Keras starts every epoch with
    zeroed metrics and `steps_per_epoch` steps; for the epoch the checkpoint was taken
    in, this restores the metrics' running values and ends the epoch after the steps
    the checkpoint lacks, so its record equals an uninterrupted run's. Put it first
    among the callbacks, so others that stop training at an epoch's end still can.

    Args:
        point: the checkpoint to continue from.
        steps_per_epoch: steps in a full epoch.
    """

    def __init__(self, point: ResumePoint, steps_per_epoch: int):
        super().__init__()
        self.point = point
        self.remaining = steps_per_epoch - point.step
        self._active = False
        self._cut = False
        self._steps = 0

    def on_train_begin(self, logs=None):
        restore(self.model, self.point)

    def on_epoch_begin(self, epoch, logs=None):
        self._active = epoch == self.point.epoch and self.point.step > 0
        self._steps = 0
        if self._active:
            _assign(self.model.metrics_variables, self.point.state.get("metrics", {}))

    def on_train_batch_end(self, batch, logs=None):
        if not self._active:
            return
        self._steps += 1
        if self._steps >= self.remaining and not self.model.stop_training:
            self.model.stop_training = True
            self._cut = True

    def on_epoch_end(self, epoch, logs=None):
        if self._cut:
            # The cut ends this epoch only; fit goes on with the next one.
            self.model.stop_training = False
            self._cut = False
        self._active = False
