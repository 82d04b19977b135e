"""Pipelined, hybrid and placed models answer Keras' everyday calls as the model they wrap:
weights, count_params, set_weights, summary, weight files and ModelCheckpoint files are the
plain model's, before and after training, whether made from built stages or a whole model."""

import keras
import numpy as np
import pytest
from pipeline_graph_models import built_sequential, regression_data, skip_model
from pipeline_runtime_models import FEATURES, dense_stages, regression_batches

from tfmulti.hybrid import HybridPipelineModel, build_hybrid_model_from_model
from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.placement.placed_model import place
from tfmulti.platform.runtime.devices import first_logical_devices, logical_device_names

BATCH = 8


def _stage_model(seed=0):
    """The plain model a user of a stage list has: the stages in a Sequential."""
    return keras.Sequential([keras.Input((FEATURES,)), *dense_stages(2, seed)], name="stages")


def _built_stages(seed=0):
    stages = dense_stages(2, seed)
    keras.Sequential([keras.Input((FEATURES,)), *stages])
    return stages


def _pipeline_of_built_stages(seed):
    return PipelineModel(_built_stages(seed), first_logical_devices(2, "stages"), 2)


def _pipeline_of_model(seed):
    return PipelineModel.from_model(skip_model(seed), first_logical_devices(2, "stages"), 2)


def _hybrid_of_model(seed):
    return build_hybrid_model_from_model(
        skip_model(seed),
        "data=2,pipe=2",
        devices=logical_device_names("CPU")[:4],
        num_microbatches=2,
    )


def _hybrid_of_stages(seed):
    devices = logical_device_names("CPU")[:4]
    hybrid = HybridPipelineModel(
        lambda: dense_stages(2, seed), [devices[:2], devices[2:]], num_microbatches=2
    )
    hybrid(regression_batches(1, 2)[0][0])
    return hybrid


def _placed_model(seed):
    return place(skip_model(seed), balance="params", devices=[0, 1], print_fn=None)


def _placed_sequential(seed):
    return place(built_sequential(seed), balance="params", devices=[0, 1], print_fn=None)


# name: (wrapped model of seed, plain model of seed)
CASES = {
    "pipeline_built_stages": (_pipeline_of_built_stages, _stage_model),
    "pipeline_from_model": (_pipeline_of_model, skip_model),
    "hybrid_stage_list": (_hybrid_of_stages, _stage_model),
    "hybrid_from_model": (_hybrid_of_model, skip_model),
    "placed_functional": (_placed_model, skip_model),
    "placed_sequential": (_placed_sequential, built_sequential),
}


@pytest.fixture(params=list(CASES))
def case(request):
    return CASES[request.param]


def _data(plain):
    return regression_data(plain, 2 * BATCH)


def _train(model, x, y, callbacks=()):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=list(callbacks), verbose=0)


def _assert_same_weights(model, plain):
    assert model.count_params() == plain.count_params()
    assert [w.shape for w in model.weights] == [w.shape for w in plain.weights]
    for mine, theirs in zip(model.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def _assert_predicts_like(model, plain, x):
    np.testing.assert_allclose(
        model.predict(x, batch_size=BATCH, verbose=0),
        plain.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-6,
    )


def test_weights_checkpoints_weight_files_and_set_weights_are_the_plain_models(case, tmp_path):
    """One training of the wrapped model (2 epochs, with ModelCheckpoint files), then each
    call in turn: weights and count_params, ModelCheckpoint files in plain Keras, weight
    files both ways, set_weights into every copy."""
    make_wrapped, make_plain = case
    wrapped, plain = make_wrapped(0), make_plain(0)
    x, y = _data(plain)
    _assert_same_weights(wrapped, plain)
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "model-{epoch}.keras")),
        keras.callbacks.ModelCheckpoint(
            str(tmp_path / "model-{epoch}.weights.h5"), save_weights_only=True
        ),
    ]
    _train(wrapped, x, y, callbacks)
    _train(plain, x, y)
    # Weights and count_params after training.
    assert len(wrapped.trainable_weights) == len(plain.trainable_weights)
    for mine, theirs in zip(wrapped.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert wrapped.count_params() == plain.count_params()

    # ModelCheckpoint files load in plain Keras.
    loaded = keras.saving.load_model(tmp_path / "model-2.keras")
    assert not hasattr(loaded, "stages") and not hasattr(loaded, "replicas")
    _assert_predicts_like(wrapped, loaded, x)
    from_checkpoint = make_plain(5)
    from_checkpoint.load_weights(tmp_path / "model-2.weights.h5")
    _assert_predicts_like(wrapped, from_checkpoint, x)

    # Weight files interchange with the plain model both ways.
    wrapped.save_weights(tmp_path / "wrapped.weights.h5")
    from_wrapped = make_plain(5)
    from_wrapped.load_weights(tmp_path / "wrapped.weights.h5")
    _assert_predicts_like(wrapped, from_wrapped, x)
    other = make_plain(9)
    other.save_weights(tmp_path / "plain.weights.h5")
    wrapped.load_weights(tmp_path / "plain.weights.h5")
    _assert_same_weights(wrapped, other)
    _assert_predicts_like(wrapped, other, x)

    # set_weights takes the plain model's list into every copy.
    wrapped.set_weights(from_wrapped.get_weights())
    _assert_same_weights(wrapped, from_wrapped)
    for replica in getattr(wrapped, "replicas", []):
        _assert_same_weights(replica, from_wrapped)
    _assert_predicts_like(wrapped, from_wrapped, x)


def test_summary_shows_each_layers_stage_and_device(case):
    make_wrapped, make_plain = case
    wrapped, plain = make_wrapped(0), make_plain(0)
    lines = []
    wrapped.summary(print_fn=lambda text, **_: lines.extend(str(text).splitlines()))
    text = "\n".join(lines)
    assert f"Total params: {plain.count_params():,}" in text
    placement = text[text.index("Placement of") :].splitlines()
    for layer_name in {weight.path.split("/")[-2] for weight in wrapped.weights}:
        row = next(line.split() for line in placement if line.split()[:1] == [layer_name])
        assert any(cell.startswith("/device:CPU:") for cell in row), row
        if hasattr(wrapped, "stages") or hasattr(wrapped, "replicas"):
            assert row[1].isdigit(), row
