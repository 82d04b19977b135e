"""A sharded model's weights are the model's weights: `weights`, `get_weights()`,
`set_weights()` and `count_params()` give the unsharded model's order, shapes and values,
for `keras.distribution` models, `shard(...)` models and tensor-parallel models; training
still updates the shards, which `shards_of` and `model.variables` reach."""

import keras
import keras_hub
import numpy as np
import pytest

import tfmulti  # noqa: F401
from tfmulti.models import registry
from tfmulti.parallel import shard, shards_of, unsplit_model, variable_bytes_per_device

MESH_DEVICES = [f"cpu:{index}" for index in range(4)]
LLAMA = dict(
    vocabulary_size=128,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
)


def _mesh(columns=4):
    return keras.distribution.DeviceMesh((1, columns), ("batch", "model"), MESH_DEVICES[:columns])


def _llama():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(**LLAMA)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    normed = keras.layers.BatchNormalization(name="norm")(hidden)
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(normed))


def _mlp_layout_map():
    layout_map = keras.distribution.LayoutMap(_mesh())
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["hidden/bias"] = ("model",)
    layout_map["out/kernel"] = ("model", None)
    return layout_map


def _mlp_data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")


def _train(model, x, y, loss="mse"):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def assert_same_weights(model, reference, atol=0.0):
    assert [tuple(w.shape) for w in model.weights] == [tuple(w.shape) for w in reference.weights]
    assert [w.trainable for w in model.weights] == [w.trainable for w in reference.weights]
    assert len(model.trainable_weights) == len(reference.trainable_weights)
    assert len(model.non_trainable_weights) == len(reference.non_trainable_weights)
    assert model.count_params() == reference.count_params()
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.fixture(scope="module")
def llama_pair():
    plain = _llama()
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(_mesh())
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        sharded = _llama()
    return plain, sharded


def test_keras_distribution_llama_lists_the_unsharded_weights(llama_pair):
    plain, sharded = llama_pair
    assert len(sharded.weights) == len(plain.weights) == 21
    assert [w.path for w in sharded.weights] == [w.path for w in plain.weights]
    assert sharded.get_weights()[0].shape == (128, 32)
    assert_same_weights(sharded, plain)


def test_keras_distribution_llama_takes_the_unsharded_models_weights(llama_pair):
    plain, sharded = llama_pair
    rng = np.random.default_rng(0)
    new_weights = [rng.normal(size=w.shape).astype("float32") for w in plain.get_weights()]
    plain.set_weights(new_weights)
    sharded.set_weights(plain.get_weights())
    assert_same_weights(sharded, plain)
    tokens = {"token_ids": rng.integers(0, 128, (2, 8)), "padding_mask": np.ones((2, 8), "int32")}
    np.testing.assert_allclose(
        sharded.predict(tokens, verbose=0), plain.predict(tokens, verbose=0), atol=1e-4
    )


def test_shards_stay_reachable_through_shards_of_and_variables(llama_pair):
    _, sharded = llama_pair
    embedding = sharded.weights[0]
    shards = shards_of(embedding)
    assert [tuple(shard.shape) for shard in shards] == [(32, 32)] * 4
    joined = np.concatenate([shard.numpy() for shard in shards], embedding.axis)
    assert np.array_equal(joined, embedding.numpy())
    assert len(sharded.variables) > len(sharded.weights)
    assert {id(s) for s in shards} <= {id(v) for v in sharded.trainable_variables}
    assert len(variable_bytes_per_device(sharded)) == 4
    whole = sharded.weights[-1]
    assert shards_of(whole) == [whole]


def test_keras_distribution_mlp_trains_from_set_weights_to_the_unsharded_weights():
    x, y = _mlp_data()
    plain = _mlp()
    with keras.distribution.ModelParallel(layout_map=_mlp_layout_map()).scope():
        sharded = _mlp()
    assert len(sharded.variables) > len(plain.variables)
    rng = np.random.default_rng(2)
    plain.set_weights([rng.normal(size=w.shape).astype("float32") for w in plain.get_weights()])
    sharded.set_weights(plain.get_weights())
    assert_same_weights(sharded, plain)
    _train(plain, x, y)
    _train(sharded, x, y)
    assert_same_weights(sharded, plain, atol=1e-5)


def test_shard_model_lists_and_trains_the_unsharded_weights():
    x, y = _mlp_data()
    plain, sharded = _mlp(), _mlp()
    shard(sharded, _mlp_layout_map())
    assert len(sharded.variables) > len(plain.variables)
    assert_same_weights(sharded, plain)
    rng = np.random.default_rng(3)
    plain.set_weights([rng.normal(size=w.shape).astype("float32") for w in plain.get_weights()])
    sharded.set_weights(plain.get_weights())
    _train(plain, x, y)
    _train(sharded, x, y)
    assert_same_weights(sharded, plain, atol=1e-5)


def test_tensor_parallel_transformer_lists_and_trains_the_unsplit_weights():
    options = dict(num_layers=1, d_model=16, num_heads=2)
    parallel = registry.build_model("transformer", (16,), 32, seed=0, tensor_parallel=2, **options)
    plain = unsplit_model(parallel)
    assert len(parallel.variables) > len(parallel.weights)
    assert_same_weights(parallel, plain)
    reference = registry.build_model("transformer", (16,), 32, seed=0, **options)
    assert_same_weights(parallel, reference)

    rng = np.random.default_rng(4)
    reference.set_weights(
        [rng.normal(0, 0.1, w.shape).astype("float32") for w in reference.weights]
    )
    parallel.set_weights(reference.get_weights())
    tokens = rng.integers(0, 32, (16, 16))
    labels = rng.integers(0, 32, (16, 16))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    _train(reference, tokens, labels, loss)
    _train(parallel, tokens, labels, loss)
    assert_same_weights(parallel, reference, atol=1e-4)


def test_save_weights_and_keras_file_of_a_sharded_model_stay_unsharded(tmp_path):
    with keras.distribution.ModelParallel(layout_map=_mlp_layout_map()).scope():
        sharded = _mlp()
    rng = np.random.default_rng(5)
    sharded.set_weights([rng.normal(size=w.shape).astype("float32") for w in sharded.weights])

    sharded.save_weights(tmp_path / "sharded.weights.h5")
    plain = _mlp()
    plain.load_weights(tmp_path / "sharded.weights.h5")
    assert_same_weights(plain, sharded)

    sharded.save(tmp_path / "sharded.keras")
    loaded = keras.saving.load_model(tmp_path / "sharded.keras")
    assert len(loaded.variables) == len(plain.variables)
    assert_same_weights(loaded, sharded)
