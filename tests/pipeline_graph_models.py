"""Seeded whole models for pipelining with `PipelineModel.from_model`, and their data.

Each builder gives the same weights for the same seed, so one copy trains on one device
as the reference and another through the pipeline.
"""

from __future__ import annotations

import keras
import numpy as np

FEATURES = 6
OUTPUTS = 2
WIDTH = 8


def _dense(units, seed, name, activation=None):
    return keras.layers.Dense(
        units,
        activation=activation,
        kernel_initializer=keras.initializers.GlorotUniform(seed),
        bias_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed + 1000),
        name=name,
    )


def built_sequential(seed=0, activation="tanh") -> keras.Model:
    """A Sequential with a known input shape: built, its weights already there."""
    return keras.Sequential(
        [keras.Input((FEATURES,))]
        + [_dense(WIDTH, seed + i, f"hidden_{i}", activation) for i in range(3)]
        + [_dense(OUTPUTS, seed + 9, "head")],
        name="built_sequential",
    )


def skip_model(seed=0) -> keras.Model:
    """Residual streams: the stem's output is added back two and four layers later."""
    features = keras.Input((FEATURES,), name="features")
    stem = _dense(WIDTH, seed, "stem", "tanh")(features)
    a = _dense(WIDTH, seed + 1, "a", "tanh")(stem)
    b = _dense(WIDTH, seed + 2, "b", "tanh")(a)
    first = keras.layers.Add(name="skip_1")([b, stem])
    c = _dense(WIDTH, seed + 3, "c", "tanh")(first)
    d = _dense(WIDTH, seed + 4, "d", "tanh")(c)
    second = keras.layers.Add(name="skip_2")([d, stem, first])
    return keras.Model(features, _dense(OUTPUTS, seed + 5, "head")(second), name="skip_model")


def masked_model(seed=0) -> keras.Model:
    """Two inputs: features and an integer 0/1 mask every layer's output is multiplied by."""
    features = keras.Input((FEATURES,), name="features")
    mask = keras.Input((WIDTH,), dtype="int32", name="mask")
    hidden = features
    for index in range(4):
        hidden = _dense(WIDTH, seed + index, f"masked_{index}", "tanh")(hidden)
        hidden = keras.layers.Multiply(name=f"apply_mask_{index}")(
            [hidden, keras.ops.cast(mask, "float32")]
        )
    return keras.Model(
        {"features": features, "mask": mask},
        _dense(OUTPUTS, seed + 9, "head")(hidden),
        name="masked_model",
    )


def nested_model(seed=0) -> keras.Model:
    """A model holding a block model (itself holding a Sequential) called twice."""
    block_input = keras.Input((WIDTH,))
    inner = keras.Sequential(
        [_dense(WIDTH, seed + 1, "inner_a", "tanh"), _dense(WIDTH, seed + 2, "inner_b")],
        name="inner",
    )
    block_hidden = inner(block_input)
    block = keras.Model(
        block_input,
        keras.layers.Add(name="block_add")([block_hidden, block_input]),
        name="block",
    )
    features = keras.Input((FEATURES,), name="features")
    hidden = _dense(WIDTH, seed, "stem", "tanh")(features)
    hidden = _dense(WIDTH, seed + 3, "middle", "tanh")(block(hidden))
    return keras.Model(features, _dense(OUTPUTS, seed + 9, "head")(hidden), name="nested_model")


def tied_model(seed=0) -> keras.Model:
    """One Dense layer called in the first layer and again as the output: a tied weight."""
    features = keras.Input((FEATURES,), name="features")
    tied = _dense(FEATURES, seed, "tied")
    hidden = keras.ops.tanh(tied(features))
    for index in range(3):
        hidden = _dense(FEATURES, seed + 1 + index, f"hidden_{index}", "tanh")(hidden)
    return keras.Model(features, tied(hidden), name="tied_model")


def implicit_mask_model(seed=0) -> keras.Model:
    """Token ids whose zeros an Embedding(mask_zero=True) masks; the pooling reads the mask."""
    tokens = keras.Input((WIDTH,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(
        4, WIDTH, mask_zero=True, embeddings_initializer=keras.initializers.RandomNormal(seed=seed)
    )(tokens)
    hidden = _dense(WIDTH, seed + 1, "per_token", "tanh")(embedded)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)
    return keras.Model(tokens, _dense(OUTPUTS, seed + 2, "head")(pooled), name="implicit_mask")


def regression_data(model: keras.Model, rows: int, seed: int = 0):
    """(x, y) for `model`'s inputs: floats, and 0/1 int32 for integer inputs."""
    rng = np.random.default_rng(seed)

    def column(tensor):
        shape = (rows, *tensor.shape[1:])
        if "int" in str(tensor.dtype):
            return rng.integers(0, 2, shape).astype("int32")
        return rng.normal(size=shape).astype("float32")

    # A Sequential has one input and no input structure of its own.
    structure = model._inputs_struct if hasattr(model, "_inputs_struct") else model.inputs[0]
    x = keras.tree.map_structure(column, structure)
    y = rng.normal(size=(rows, *model.outputs[0].shape[1:])).astype("float32")
    return x, y


def gpt2_causal_lm(seed=0):
    """A two-layer KerasHub GPT-2 language model from config (its logits reuse the token
    embedding: a tied weight between the first and last stage)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=32,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        dropout=0.0,
        max_sequence_length=8,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_data(rows: int, length: int = 8, seed: int = 0):
    """({"token_ids", "padding_mask"}, next tokens) with padded tails."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (rows, length + 1)).astype("int32")
    lengths = rng.integers(length // 2, length + 1, rows)
    padding_mask = (np.arange(length)[None, :] < lengths[:, None]).astype("int32")
    x = {"token_ids": tokens[:, :-1] * padding_mask, "padding_mask": padding_mask}
    return x, tokens[:, 1:]
