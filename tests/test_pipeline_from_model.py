"""PipelineModel.from_model: any functional or Sequential model, cut into stages, trains to
the weights one-device training gives (every schedule), with skips, masks, nested models
and tied weights crossing the cuts."""

import keras
import numpy as np
import pytest
from pipeline_graph_models import (
    built_sequential,
    gpt2_causal_lm,
    implicit_mask_model,
    masked_model,
    nested_model,
    regression_data,
    skip_model,
    tied_model,
    token_data,
)
from pipeline_runtime_models import device_index

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.runtime.devices import first_logical_devices

STEPS = 2
BATCH = 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1)]
MODELS = {
    "built_sequential": built_sequential,
    "skip": skip_model,
    "masked": masked_model,
    "nested": nested_model,
    "tied": tied_model,
}


def _optimizer(name):
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.02)


def _train_both(
    make_model, data, schedule, chunks, optimizer, loss="mse", num_microbatches=2, **options
):
    """Trains one copy on one device and one through the pipeline; returns both and the
    pipeline's initial weights."""
    reference, model = make_model(), make_model()
    initial = [w.copy() for w in model.get_weights()]
    pipe = PipelineModel.from_model(
        model,
        first_logical_devices(2, "stages"),
        num_microbatches,
        schedule,
        chunks=chunks,
        **options,
    )
    reference.compile(optimizer=_optimizer(optimizer), loss=loss, jit_compile=False)
    pipe.compile(optimizer=_optimizer(optimizer), loss=loss)
    x, y = data
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        batch_x = keras.tree.map_structure(lambda t, rows=rows: t[rows], x)
        reference_loss = reference.train_on_batch(batch_x, y[rows])
        pipe_loss = pipe.train_on_batch(batch_x, y[rows])
    # A KerasHub task compiles with an accuracy metric too; compare the losses.
    np.testing.assert_allclose(np.ravel(pipe_loss)[0], np.ravel(reference_loss)[0], rtol=1e-5)
    return reference, pipe, initial


def _assert_same_weights(reference, trained, initial, tolerance=1e-5):
    weights = trained.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(initial, weights, strict=True)) > 1e-3
    for expected, actual in zip(reference.get_weights(), weights, strict=True):
        np.testing.assert_allclose(actual, expected, atol=tolerance)


# Each model once and each schedule once (a rotation, not the product): the cut is the
# model's, the schedule the executor's, and neither depends on the other.
@pytest.mark.parametrize(
    "model_name, schedule, chunks",
    [(name, *schedule) for name, schedule in zip(sorted(MODELS), SCHEDULES, strict=True)],
)
def test_transparency_from_model_matches_one_device_training(model_name, schedule, chunks):
    make_model = MODELS[model_name]
    optimizer = "adam" if (len(model_name) + chunks) % 2 else "sgd"
    data = regression_data(make_model(), STEPS * BATCH)
    reference, pipe, initial = _train_both(
        make_model, data, schedule, chunks, optimizer, partition="uniform"
    )
    # to_model() is the model passed in, its weights in its own order.
    _assert_same_weights(reference, pipe.to_model(), initial)


def test_skip_connection_is_carried_through_the_stage_it_skips():
    model = skip_model()
    pipe = PipelineModel.from_model(
        model, first_logical_devices(4, "stages"), partition=["a", "b", "c"]
    )
    x, _ = regression_data(model, BATCH)
    crossing = []
    inputs = x
    for stage in pipe.stages[:-1]:
        inputs = stage(inputs)
        crossing.append(len(inputs))
    # Stage 1 ("a") hands on its output and the stem's; stage 2 ("b") the sum and the stem.
    assert crossing == [1, 2, 2]
    np.testing.assert_allclose(pipe.stages[-1](inputs), model(x), atol=1e-6)


def test_integer_mask_crosses_every_stage():
    model = masked_model()
    pipe = PipelineModel.from_model(model, first_logical_devices(4, "stages"), partition="uniform")
    x, _ = regression_data(model, BATCH)
    inputs = x
    for stage in pipe.stages[:-1]:
        inputs = stage(inputs)
        assert "int32" in [str(t.dtype.name) for t in inputs]


def test_keras_implicit_mask_travels_with_its_tensor_across_cuts():
    model = implicit_mask_model()
    pipe = PipelineModel.from_model(
        model, first_logical_devices(2, "stages"), 2, "gpipe", partition=["pool"]
    )
    x, y = regression_data(model, 2 * BATCH)
    # Zeros are masked out of the average: without the mask the outputs would differ.
    unmasked = keras.Model(
        model.inputs,
        model.get_layer("head")(keras.ops.mean(model.get_layer("per_token").output, axis=1)),
    )
    assert np.abs(unmasked.predict(x, verbose=0) - model.predict(x, verbose=0)).max() > 1e-3
    np.testing.assert_allclose(pipe.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    reference = implicit_mask_model()
    for trained in (reference, pipe):
        trained.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
        trained.train_on_batch(x, y)
    _assert_same_weights(reference, model, implicit_mask_model().get_weights())


def test_nested_models_are_opened_so_cuts_fall_inside_them():
    pipe = PipelineModel.from_model(
        nested_model(), first_logical_devices(2, "stages"), partition=["inner_b"]
    )
    assert pipe.stages[0].call_names == ["stem", "block/inner/inner_a"]
    assert pipe.stages[1].call_names[0] == "block/inner/inner_b"


def test_tied_weight_lives_on_first_stage_and_is_trained_once():
    model = tied_model()
    devices = first_logical_devices(2, "stages")
    pipe = PipelineModel.from_model(model, devices, partition="uniform")
    tied_kernel = model.get_layer("tied").kernel
    assert any(v is tied_kernel for v in pipe.stages[0].trainable_variables)
    assert any(v is tied_kernel for v in pipe.stages[-1].trainable_variables)
    assert sum(v is tied_kernel for v in pipe.trainable_variables) == 1
    assert device_index(tied_kernel) == device_index(pipe.stages[0].trainable_variables[0])


def test_built_layers_and_optimizer_state_move_to_their_stage_devices():
    model = built_sequential()
    devices = first_logical_devices(4, "stages")
    pipe = PipelineModel.from_model(model, devices, 2, "1f1b", partition="params")
    pipe.compile(optimizer="adam", loss="mse")
    x, y = regression_data(model, BATCH)
    pipe.train_on_batch(x, y)
    for stage, device in zip(pipe.stages, devices, strict=True):
        expected = device_index(stage.trainable_variables[0])
        assert expected[1] == int(device.rsplit(":", 1)[1])
        for variable in stage.trainable_variables:
            assert device_index(variable) == expected
            index = pipe.optimizer._get_variable_index(variable)
            assert device_index(pipe.optimizer._momentums[index]) == expected
            assert device_index(pipe.optimizer._velocities[index]) == expected


def test_unbuilt_sequential_is_built_on_the_sample_input():
    def make():
        return keras.Sequential(
            [keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)], name="unbuilt"
        )

    keras.utils.set_random_seed(3)
    reference = make()
    keras.utils.set_random_seed(3)
    model = make()
    x, y = regression_data(built_sequential(), BATCH)
    reference(x)
    pipe = PipelineModel.from_model(model, first_logical_devices(2, "stages"), sample_input=x)
    for trained in (reference, pipe):
        trained.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        trained.train_on_batch(x, y)
    for expected, actual in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-6)


def test_unbuilt_sequential_without_sample_input_is_refused_in_one_line():
    model = keras.Sequential([keras.layers.Dense(2)], name="unbuilt")
    with pytest.raises(ValueError, match="Received: sample_input=None") as error:
        PipelineModel.from_model(model, first_logical_devices(2, "stages"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("partition", ["params", "time", "memory"])
def test_partition_policies_cut_every_stage_non_empty(partition):
    model = skip_model()
    x, _ = regression_data(model, BATCH)
    pipe = PipelineModel.from_model(
        model, first_logical_devices(3, "stages"), partition=partition, sample_input=x
    )
    names = [stage.call_names for stage in pipe.stages]
    assert all(names) and sum(len(n) for n in names) == 8
    if partition == "params":
        # Five 72-parameter layers, a 56 and an 18: no stage holds twice another.
        counts = [sum(int(np.prod(v.shape)) for v in s.trainable_variables) for s in pipe.stages]
        assert max(counts) <= 2 * min(counts)
    np.testing.assert_allclose(pipe.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize(
    "partition, message",
    [
        (["nowhere"], "No call named 'nowhere'"),
        (["a", "b"], "1 names for 2 stages"),
        ("balanced", "partition must be one of"),
    ],
)
def test_bad_partition_is_refused_naming_it(partition, message):
    with pytest.raises(ValueError, match=message):
        PipelineModel.from_model(
            skip_model(), first_logical_devices(2, "stages"), partition=partition
        )


def test_a_cut_inside_a_layer_names_the_layer_that_cannot_be_split():
    with pytest.raises(ValueError, match=r"inside 'gpt2_backbone(_\d+)?/transformer_layer_0'"):
        PipelineModel.from_model(
            gpt2_causal_lm(), first_logical_devices(2, "stages"), partition=["self_attention"]
        )


def test_transparency_keras_applications_mobilenet():
    def make():
        keras.utils.set_random_seed(0)
        return keras.applications.MobileNetV3Small(
            input_shape=(32, 32, 3),
            alpha=0.75,
            minimalistic=True,
            weights=None,
            classes=4,
            include_preprocessing=False,
        )

    rng = np.random.default_rng(0)
    # Three batches' worth drawn, two trained on: the data the tolerance below was measured on.
    x = rng.random((3 * BATCH, 32, 32, 3), dtype="float32")
    y = rng.integers(0, 4, 3 * BATCH)
    reference, model = make(), make()
    initial = [w.copy() for w in model.get_weights()]
    # One micro-batch: BatchNorm's statistics are those of the whole batch, as on one device.
    pipe = PipelineModel.from_model(model, first_logical_devices(2, "stages"), 1, "1f1b")
    for trained in (reference, pipe):
        # XLA would fuse the reference's ops differently; the pipeline runs without it.
        trained.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss="sparse_categorical_crossentropy",
            jit_compile=False,
        )
    # Two steps agree to 7e-7. On the third, with losses still equal to 4e-6, one kernel's
    # update parts by ~1e-3 (measured at 32 and 64 pixels): float rounding amplified by
    # this small-batch network, not a missing gradient, which would show from step one.
    for step in range(2):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        np.testing.assert_allclose(
            pipe.train_on_batch(x[rows], y[rows]),
            reference.train_on_batch(x[rows], y[rows]),
            rtol=1e-5,
        )
    _assert_same_weights(reference, model, initial, tolerance=1e-5)


@pytest.mark.parametrize("schedule, chunks", [("interleaved_1f1b", 2)])
def test_transparency_keras_hub_gpt2_with_tied_embedding(schedule, chunks):
    data = token_data(STEPS * BATCH)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference, pipe, initial = _train_both(
        gpt2_causal_lm,
        data,
        schedule,
        chunks,
        "adam",
        loss=loss,
        partition="uniform",
    )
    model = pipe.to_model()
    embedding = model.backbone.token_embedding.embeddings
    assert any(v is embedding for v in pipe.stages[-1].trainable_variables)
    _assert_same_weights(reference, model, initial)


def test_transparency_pipeline_steps_get_the_fusions_of_one_device():
    # oneDNN runs swish as one fused op only after Grappler's second pass has dropped its
    # multiplication by beta=1.0; when pipeline steps had one pass, EfficientNetV2B0 parted
    # from one device by 1.8e-1 in loss. One micro-batch: the same sums, to the last bit.
    def make_model():
        return built_sequential(activation="swish")

    data = regression_data(make_model(), STEPS * BATCH)
    reference, pipe, _ = _train_both(make_model, data, "1f1b", 1, "sgd", num_microbatches=1)
    for expected, actual in zip(
        reference.get_weights(), pipe.to_model().get_weights(), strict=True
    ):
        np.testing.assert_array_equal(actual, expected)
