"""Per-epoch weight checkpoints that a crash can never leave half-written."""

from __future__ import annotations

import json
import math
import os

import keras

from tfmulti.files import atomic_path, write_json_atomically

LATEST_FILE = "latest.json"


class EpochCheckpoint(keras.callbacks.Callback):
    """Saves the weights (optimizer state included) at the end of each epoch.

    Each file is written beside its final name and renamed into place, then
    `latest.json` is rewritten the same way, so the latest checkpoint is always
    complete. Epochs whose loss is NaN or Inf are not saved, so the last good
    checkpoint survives a diverging run.

    Args:
        directory: where `epoch-NNN.weights.h5` files and `latest.json` go.
        keep: how many recent checkpoints to keep (older ones are deleted).
    """

    def __init__(self, directory: str, keep: int = 3):
        super().__init__()
        self.directory = directory
        self.keep = keep

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            return
        name = f"epoch-{epoch + 1:03d}.weights.h5"
        with atomic_path(os.path.join(self.directory, name)) as temporary:
            self.model.save_weights(temporary)
        write_json_atomically(
            os.path.join(self.directory, LATEST_FILE), {"epoch": epoch + 1, "weights": name}
        )
        self._delete_old_checkpoints()

    def _delete_old_checkpoints(self):
        saved = sorted(f for f in os.listdir(self.directory) if f.startswith("epoch-"))
        for old in saved[: -self.keep]:
            os.remove(os.path.join(self.directory, old))


def latest_checkpoint(directory: str) -> str | None:
    """Returns the path of the newest complete checkpoint in `directory`, or None."""
    try:
        with open(os.path.join(directory, LATEST_FILE)) as handle:
            return os.path.join(directory, json.load(handle)["weights"])
    except FileNotFoundError:
        return None
