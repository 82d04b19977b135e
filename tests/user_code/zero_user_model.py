"""A user's own model and data for ZeRO runs: an embedding (sparse gradients), a
BatchNorm-free MLP whose widths do not divide by the devices, and a compiled AdamW."""

import keras
import numpy as np


def model(**options):
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(37, 5, name="tokens")(inputs)
    hidden = keras.layers.Flatten()(hidden)
    hidden = keras.layers.Dense(13, activation="tanh", name="odd_width")(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    built = keras.Model(inputs, outputs, name="zero_user_model")
    built.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return built


def data():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 37, size=(202, 6)).astype("int32")
    y = (x.sum(axis=1) % 3).astype("int32")
    return (x[:170], y[:170]), (x[170:], y[170:])
