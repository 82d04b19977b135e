"""A model's whole training state in one weights file, as Keras tracks it.

Step checkpoints must resume exactly, so they hold every variable the model trains with:
its weights and its optimizer's state. A model may export something else through its
own `save_weights` (a `from_model` pipeline writes the single-device model's file, without
the pipeline's optimizer); these functions bypass such exports.
"""

from __future__ import annotations

import keras


def save_training_state(model: keras.Model, path: str) -> None:
    """Writes `model`'s weights and optimizer state to `path` (a `.weights.h5` file)."""
    keras.Model.save_weights(model, path)


def load_training_state(model: keras.Model, path: str) -> None:
    """Reads a file of `save_training_state` back into the same kind of model."""
    keras.Model.load_weights(model, path)
