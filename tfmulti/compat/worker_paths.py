"""Where non-chief workers write: a private scratch directory, as in Keras 2.

Under MultiWorkerMirroredStrategy every worker must run each save (reading
ON_READ variables runs a collective), but only the chief's files should land
in the user's paths. Non-chief workers therefore keep saving, into scratch.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import keras

_REDIRECTED_MARK = "_tfmulti_redirected_to"
_scratch_dir: str | None = None


def scratch_dir() -> str:
    """This process's scratch directory, made on first use and removed at exit."""
    global _scratch_dir
    if _scratch_dir is None:
        _scratch_dir = tempfile.mkdtemp(prefix=f"tfmulti-worker-{os.getpid()}-")
        atexit.register(shutil.rmtree, _scratch_dir, ignore_errors=True)
    return _scratch_dir


def redirect_to_scratch(callbacks: list, scratch: str) -> None:
    """Points the output paths of Keras's writing callbacks into `scratch`, in place.

    ModelCheckpoint and CSVLogger keep their file names; TensorBoard logs go to
    `scratch/tensorboard`; BackupAndRestore backs up into scratch but first
    copies the chief's latest backup there, so a restarted worker resumes from
    the same state as the chief. Callbacks already redirected are left alone.

    Args:
        callbacks: Keras callbacks, as held by a `CallbackList`.
        scratch: a directory only this worker writes.
    """
    for callback in callbacks:
        if getattr(callback, _REDIRECTED_MARK, None) is not None:
            continue
        if isinstance(callback, keras.callbacks.ModelCheckpoint):
            name = os.path.basename(callback.filepath)
            callback.filepath = os.path.join(scratch, f"model_checkpoint_{id(callback)}", name)
        elif isinstance(callback, keras.callbacks.CSVLogger):
            name = os.path.basename(callback.filename)
            callback.filename = os.path.join(scratch, f"csv_logger_{id(callback)}", name)
            os.makedirs(os.path.dirname(callback.filename), exist_ok=True)
        elif isinstance(callback, keras.callbacks.TensorBoard):
            callback.log_dir = os.path.join(scratch, f"tensorboard_{id(callback)}")
        elif isinstance(callback, keras.callbacks.BackupAndRestore):
            _redirect_backup(callback, os.path.join(scratch, f"backup_{id(callback)}"))
        else:
            continue
        setattr(callback, _REDIRECTED_MARK, scratch)


def _redirect_backup(callback: keras.callbacks.BackupAndRestore, backup_dir: str) -> None:
    chief_backup_dir = callback.backup_dir
    if os.path.isdir(chief_backup_dir):
        shutil.copytree(chief_backup_dir, backup_dir, dirs_exist_ok=True)
    callback.backup_dir = backup_dir
    callback._weights_path = os.path.join(backup_dir, os.path.basename(callback._weights_path))
    callback._training_metadata_path = os.path.join(
        backup_dir, os.path.basename(callback._training_metadata_path)
    )
    callback._prev_weights_path = f"{callback._weights_path}.bkp"
    callback._prev_training_metadata_path = f"{callback._training_metadata_path}.bkp"
