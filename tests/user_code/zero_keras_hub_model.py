"""A user's KerasHub GPT-2 from a small config (its logits reuse the token embedding), one
token input, for ZeRO runs; nothing is downloaded."""

import keras
import numpy as np


def gpt2(**options):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=8,
        dropout=0.0,
    )
    tokens = keras.Input((8,), dtype="int32")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    logits = backbone.token_embedding(hidden, reverse=True)
    model = keras.Model(tokens, logits, name="user_gpt2")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data():
    tokens = np.random.default_rng(0).integers(1, 64, size=(160, 9)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]
