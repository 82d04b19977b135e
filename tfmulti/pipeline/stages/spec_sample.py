"""A sample batch made from a model's input specs, for cutting or placing it by measured cost."""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging

# Rows of a sample made from specs: enough that a call's time is not only its launch cost.
SAMPLE_ROWS = 8


def sample_from_input_specs(model: keras.Model, needed_by: str, rows: int = SAMPLE_ROWS):
    """One batch shaped and typed as `model`'s inputs, when their shapes are known.

    Float inputs get seeded normal values; integer inputs (token ids, masks) ones, a valid
    index for any Embedding of two or more rows and a kept position for any padding mask;
    bool inputs True. An input with a fixed batch size keeps it; others get `rows` rows.

    Args:
        model: a functional model (its `input` gives the specs and their structure).
        needed_by: what needs the sample, for the error, e.g. "partition='time'".
        rows: rows of the batch where the batch axis is unknown.

    Raises:
        ValueError: in one line, naming the input, when an axis after the batch axis is
            unknown or the dtype has no sample value (strings).

    Example:
        >>> sample = sample_from_input_specs(model, "partition='time'")
    """

    def sample(spec):
        shape = tuple(spec.shape)
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if any(axis is None for axis in shape[1:]) or dtype == "string":
            raise ValueError(
                f"{needed_by} measures the model on a sample batch, and input {spec.name!r} "
                f"of {model.name!r} ({dtype}, shape {shape}) does not say what one looks "
                "like. Received: sample_input=None; pass one micro-batch of model input."
            )
        shape = (rows if shape[0] is None else shape[0], *shape[1:])
        if keras.backend.is_float_dtype(dtype):
            return tf.random.stateless_normal(shape, seed=[0, 0], dtype=dtype)
        return tf.ones(shape, dtype)

    batch = keras.tree.map_structure(sample, model.input)
    logging.info(
        "%s: measuring %r on a sample of %d rows made from its input specs; pass a sample "
        "input to measure on real data.",
        needed_by,
        model.name,
        rows,
    )
    return batch
