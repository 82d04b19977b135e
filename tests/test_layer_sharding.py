"""Any axis of a Dense, EinsumDense, Embedding or ReversibleEmbedding weight sharded as a
layout map says: training reaches the unsharded model's weights."""

import keras
import keras_hub
import numpy as np
import pytest

import tfmulti  # noqa: F401
from tfmulti.keras_distribution.layer_sharding import sharded_views
from tfmulti.parallel import unsplit_weights

VOCABULARY, WIDTH, STEPS = 16, 8, 6


def token_model(embedding):
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = embedding(inputs)
    projected = keras.layers.EinsumDense(
        "abc,cde->abde", (STEPS, 2, 4), bias_axes="de", activation="tanh", name="heads"
    )(hidden)
    flat = keras.layers.Reshape((STEPS, WIDTH))(projected)
    if isinstance(embedding, keras_hub.layers.ReversibleEmbedding):
        return keras.Model(inputs, embedding(flat, reverse=True))
    return keras.Model(inputs, keras.layers.Dense(VOCABULARY, name="logits")(flat))


def plain_embedding():
    return token_model(keras.layers.Embedding(VOCABULARY, WIDTH, name="embed"))


def reversible(tie_weights):
    def build():
        layer = keras_hub.layers.ReversibleEmbedding(
            VOCABULARY, WIDTH, tie_weights=tie_weights, name="embed"
        )
        return token_model(layer)

    return build


LAYOUTS = {
    "embedding-rows": (plain_embedding, {"embed/embeddings": ("model", None)}),
    "embedding-columns": (plain_embedding, {"embed/embeddings": (None, "model")}),
    "einsum-contracted": (plain_embedding, {"heads/kernel": ("model", None, None)}),
    "einsum-output-with-bias": (
        plain_embedding,
        {"heads/kernel": (None, "model", None), "heads/bias": ("model", None)},
    ),
    "einsum-last-axis": (plain_embedding, {"heads/kernel": (None, None, "model")}),
    "dense-rows": (plain_embedding, {"logits/kernel": ("model", None)}),
    "tied-reverse-rows": (reversible(True), {"embed/embeddings": ("model", None)}),
    "tied-reverse-columns": (reversible(True), {"embed/embeddings": (None, "model")}),
    "untied-reverse-vocabulary": (
        reversible(False),
        {"embed/embeddings": ("model", None), "embed/reverse_embeddings": (None, "model")},
    ),
    "untied-reverse-hidden": (reversible(False), {"embed/reverse_embeddings": ("model", None)}),
}


def fit(model, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCABULARY, (8, STEPS)).astype("int32")
    targets = rng.integers(0, VOCABULARY, (8, STEPS)).astype("int32")
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(tokens, targets, batch_size=4, shuffle=False, verbose=0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_axis_trains_to_unsharded_weights(name):
    build, layouts = LAYOUTS[name]
    keras.utils.set_random_seed(0)
    reference = build()
    fit(reference)
    devices = keras.distribution.list_devices("cpu")[:2]
    layout_map = keras.distribution.LayoutMap(
        keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    )
    for path, axes in layouts.items():
        layout_map[path] = axes
    keras.utils.set_random_seed(0)
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = build()
    assert sorted(view.path for view in sharded_views(model)) == sorted(layouts)
    fit(model)
    for want, got in zip(reference.get_weights(), unsplit_weights(model), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
