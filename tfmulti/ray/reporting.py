"""Reports a run's epochs to Ray Train, so the driver's `Result.metrics` holds them."""

from __future__ import annotations

import json
import numbers
import os
import tempfile

import keras
import ray.train

# The file of a Ray checkpoint that points at the run's own checkpoints.
POINTER_FILE = "tfmulti_run.json"


def as_numbers(logs: dict | None) -> dict[str, float]:
    """`logs`' numbers as plain floats, as Ray stores a report; anything else left out."""
    return {
        name: float(value)
        for name, value in (logs or {}).items()
        if isinstance(value, numbers.Real)
    }


def report(metrics: dict, model_dir: str, epoch: int) -> None:
    """`ray.train.report(metrics)`, with a checkpoint from the chief (Ray keeps a report's
    metrics in `Result.metrics` only with a checkpoint).

    The checkpoint holds no weights, only `POINTER_FILE`: `{"model_dir", "epoch"}`, where
    tfmulti's own checkpoints are, which serve resume. Every Ray worker must call it.
    """
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="tfmulti-ray-") as directory:
        with open(os.path.join(directory, POINTER_FILE), "w") as handle:
            json.dump({"model_dir": os.path.abspath(model_dir), "epoch": epoch}, handle)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


class ReportToRay(keras.callbacks.Callback):
    """Reports each epoch's logs to Ray Train at the epoch's end (`report`).

    `ray.train.report` waits for every Ray worker's report, so use it only where every
    worker trains (`multi_worker`), never where the chief drives the others' devices.

    Args:
        model_dir: the run's `model_dir`, which the reports point at.

    Example:
        >>> train(config, callbacks=[ReportToRay(config.run.model_dir)])  # in a Ray worker
    """

    def __init__(self, model_dir: str):
        super().__init__()
        self.model_dir = model_dir
        self.last: dict[str, float] = {}

    def on_epoch_end(self, epoch, logs=None):
        self.last = {"epoch": epoch + 1, **as_numbers(logs)}
        report(self.last, self.model_dir, epoch + 1)
