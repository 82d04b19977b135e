"""Hybrid data x pipeline parallelism of a whole user model: the replicas pipeline copies of
the model cut at the same calls, train to one-device weights, and save as the plain model."""

import keras
import numpy as np
import pytest
from pipeline_graph_models import (
    gpt2_causal_lm,
    regression_data,
    skip_model,
    tied_model,
    token_data,
)

from tfmulti.hybrid import build_hybrid_model_from_model, copy_model
from tfmulti.platform.runtime.devices import logical_device_names

STEPS = 2
BATCH = 8


def _train_both(make_model, data, mesh, optimizer, loss="mse", **options):
    """One copy trained on one device, one through the hybrid model, on the same batches;
    returns both and the hybrid's initial weights."""
    reference, model = make_model(), make_model()
    initial = [w.copy() for w in model.get_weights()]
    hybrid = build_hybrid_model_from_model(
        model, mesh, devices=logical_device_names("CPU")[:4], **options
    )
    for trained in (reference, hybrid):
        trained.compile(optimizer=optimizer(), loss=loss, jit_compile=False)
    x, y = data
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        batch_x = keras.tree.map_structure(lambda t, rows=rows: t[rows], x)
        reference_loss = reference.train_on_batch(batch_x, y[rows])
        hybrid_loss = hybrid.train_on_batch(batch_x, y[rows])
    np.testing.assert_allclose(np.ravel(hybrid_loss)[0], np.ravel(reference_loss)[0], rtol=1e-5)
    return reference, hybrid, initial


def _assert_same_weights(reference, trained, initial):
    weights = trained.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(initial, weights, strict=True)) > 1e-3
    for expected, actual in zip(reference.get_weights(), weights, strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-5)


@pytest.mark.parametrize(
    "make_model, mesh, schedule, optimizer",
    [
        (skip_model, "data=2,pipe=2", "1f1b", lambda: keras.optimizers.SGD(0.1)),
        (tied_model, "data=2,pipe=2", "zb_h1", lambda: keras.optimizers.Adam(0.02)),
    ],
    ids=["skip_sgd", "tied_adam"],
)
def test_hybrid_of_a_whole_model_trains_like_one_device(make_model, mesh, schedule, optimizer):
    data = regression_data(make_model(), STEPS * BATCH)
    reference, hybrid, initial = _train_both(
        make_model, data, mesh, optimizer, num_microbatches=2, schedule=schedule
    )
    first, second = hybrid.replicas
    # The copy is cut at the same calls, and every copy holds the same weights.
    assert [s.call_names for s in first.stages] == [s.call_names for s in second.stages]
    for a, b in zip(first.to_model().weights, second.to_model().weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    _assert_same_weights(reference, hybrid.to_model(), initial)


def test_hybrid_of_a_keras_hub_task_trains_like_one_device_and_saves_as_the_task(tmp_path):
    data = token_data(STEPS * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, hybrid, initial = _train_both(
        gpt2_causal_lm,
        data,
        "data=2,pipe=2",
        lambda: keras.optimizers.Adam(0.01),
        loss=loss,
        num_microbatches=2,
        partition="uniform",
    )
    model = hybrid.to_model()
    _assert_same_weights(reference, model, initial)
    path = str(tmp_path / "gpt2.keras")
    hybrid.save(path)
    loaded = keras.saving.load_model(path, compile=False)
    assert type(loaded) is type(model)
    x = keras.tree.map_structure(lambda t: t[:4], data[0])
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-5)


def test_copy_model_keeps_the_architecture_and_layer_names_not_the_weights():
    model = skip_model(seed=0)
    copied = copy_model(model)
    assert copied is not model
    assert [layer.name for layer in copied.layers] == [layer.name for layer in model.layers]
    assert [w.shape for w in copied.weights] == [w.shape for w in model.weights]
    assert all(a is not b for a, b in zip(copied.weights, model.weights, strict=True))


def test_copy_model_keeps_a_layer_shared_by_a_nested_model_and_its_outer_model_one_layer():
    # A backbone's embedding reused outside it (a tied output projection, as KerasHub's
    # GPT-2 reuses `token_embedding`): the copy must hold it once, tied as in the model.
    tokens = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(10, 3, name="token_embedding")
    backbone = keras.Model(tokens, keras.layers.Dense(3, name="mix")(embedding(tokens)))
    outer_tokens = keras.Input((4,), dtype="int32")
    hidden = backbone(outer_tokens)
    model = keras.Model(outer_tokens, keras.layers.Add()([hidden, embedding(outer_tokens)]))
    copied = copy_model(model)
    assert len(copied.weights) == len(model.weights) == 3
    (inner,) = [layer for layer in copied.layers if isinstance(layer, keras.Model)]
    (outer,) = [layer for layer in copied.layers if layer.name == "token_embedding"]
    assert outer is inner.get_layer("token_embedding") and outer is not embedding
