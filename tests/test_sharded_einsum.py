"""Einsums with a weight split over devices: which collective each split needs, and
Megatron's column->row pairing computed without gathering and re-splitting in between."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmulti  # noqa: F401
from tfmulti.keras_distribution.sharded_einsum import (
    BOTH,
    CONTRACTED,
    OUTPUT,
    EinsumSplit,
    analyse_split,
    explicit_equation,
)


@pytest.mark.parametrize(
    "equation, axis, expected",
    [
        ("...i,io->...o", 1, EinsumSplit(OUTPUT, None, -1)),  # Dense, column split
        ("...i,io->...o", 0, EinsumSplit(CONTRACTED, -1, None)),  # Dense, row split
        ("bqm,muh->bquh", 1, EinsumSplit(OUTPUT, None, 2)),  # attention heads
        ("bquh,uhm->bqm", 0, EinsumSplit(CONTRACTED, 2, None)),  # attention output
        ("abc,cd->abd", 0, EinsumSplit(CONTRACTED, 2, None)),
        ("btd,dt->bt", 1, EinsumSplit(BOTH, 1, 1)),
    ],
)
def test_split_letter_decides_the_collective(equation, axis, expected):
    assert analyse_split(equation, axis) == expected


def test_explicit_equation_computes_the_same_einsum():
    rng = np.random.default_rng(0)
    inputs, weight = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5))
    equation = explicit_equation("...i,io->...o", 3)
    assert "..." not in equation
    np.testing.assert_allclose(
        np.einsum(equation, inputs, weight), np.einsum("...i,io->...o", inputs, weight)
    )


def column_then_row(activation):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation=activation, name="column")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="row")(hidden))


def split_ops_in_forward(model, inputs):
    forward = tf.function(lambda batch: model(batch))
    graph = forward.get_concrete_function(inputs).graph
    return sum(op.type in ("Split", "SplitV") for op in graph.get_operations())


@pytest.mark.parametrize("activation, splits", [("relu", 0), ("softmax", 1)])
def test_row_split_layer_reads_column_slices_where_they_are(activation, splits):
    inputs = tf.constant(np.random.default_rng(1).normal(size=(4, 8)), tf.float32)
    expected = column_then_row(activation)(inputs)
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["column/kernel"] = (None, "model")
    layout_map["column/bias"] = ("model",)
    layout_map["row/kernel"] = ("model", None)
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = column_then_row(activation)
    # An elementwise activation runs on each slice, so the row layer takes the slices;
    # softmax needs the whole row, so its output is gathered and split again.
    assert split_ops_in_forward(model, inputs) == splits
    np.testing.assert_allclose(model(inputs), expected, atol=1e-6)
