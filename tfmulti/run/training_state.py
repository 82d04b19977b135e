"""A model's whole training state in one weights file, as Keras tracks it.

Step checkpoints must resume exactly, so they hold every variable the model trains with:
its weights and its optimizer's state. A model may export something else through its
own `save_weights` (a `from_model` pipeline writes the single-device model's file, without
the pipeline's optimizer); these functions bypass such exports.
"""

from __future__ import annotations

import keras

from tfmulti.errors import IncompatibleCheckpoint


def save_training_state(model: keras.Model, path: str) -> None:
    """Writes `model`'s weights and optimizer state to `path` (a `.weights.h5` file)."""
    keras.Model.save_weights(model, path)


def load_training_state(model: keras.Model, path: str) -> None:
    """Reads a file of `save_training_state` back into the same kind of model.

    Raises:
        IncompatibleCheckpoint: in one line, when the file holds another model's or layout's state
            (a run resumed with another strategy, stage count, partition or model size).
    """
    try:
        keras.Model.load_weights(model, path)
    except ValueError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        example = next((line for line in lines if "expected" in line), lines[0] if lines else "")
        raise IncompatibleCheckpoint(
            f"{path} holds the training state of another model or layout ({example}); resume "
            "with the flags of the run that wrote it (its metrics.json 'run' record: "
            "strategy, stages, partition, mesh, model options), or train into a new "
            "--model_dir."
        ) from None
