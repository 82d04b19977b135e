"""Cutting or placing a model by measured time or memory needs no sample batch when the
model's inputs say what one looks like; inputs with unknown axes keep the one-line error."""

import keras
import numpy as np
import pytest
from pipeline_graph_models import implicit_mask_model, masked_model, regression_data, skip_model

from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.pipeline.stages.spec_sample import sample_from_input_specs
from tfmulti.placement.placed_model import place
from tfmulti.platform.runtime.devices import first_logical_devices


def _cut_predicts_like_the_model(model, x, **options):
    """Cuts `model` over two devices with no sample input; the pipeline predicts as the
    model did before the cut."""
    expected = model.predict(x, verbose=0)
    pipe = PipelineModel.from_model(model, first_logical_devices(2, "stages"), 2, **options)
    assert all(stage.call_names for stage in pipe.stages)
    np.testing.assert_allclose(pipe.predict(x, verbose=0), expected, atol=1e-5)


def test_time_partition_of_an_application_with_a_known_input_shape_needs_no_sample():
    keras.utils.set_random_seed(0)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=10)
    x = np.random.default_rng(0).uniform(0, 255, (4, 32, 32, 3)).astype("float32")
    _cut_predicts_like_the_model(model, x, schedule="zb_h1", partition="time")


@pytest.mark.parametrize("make_model", [masked_model, implicit_mask_model])
@pytest.mark.parametrize("partition", ["time", "memory"])
def test_measured_partitions_of_models_with_integer_inputs_need_no_sample(make_model, partition):
    model = make_model()
    x, _ = regression_data(model, 8)
    _cut_predicts_like_the_model(model, x, partition=partition)


def test_sample_follows_each_inputs_shape_dtype_and_structure():
    model = masked_model()
    sample = sample_from_input_specs(model, "partition='time'", rows=3)
    assert set(sample) == set(model.input)
    for name, spec in model.input.items():
        assert tuple(sample[name].shape) == (3, *spec.shape[1:])
        assert keras.backend.standardize_dtype(sample[name].dtype) == spec.dtype
    # Integer inputs hold valid ids and kept positions.
    assert np.all(sample["mask"].numpy() == 1)


def test_time_balanced_placement_needs_no_sample():
    model = skip_model()
    placed = place(model, balance="time", devices=[0, 1], print_fn=None)
    assert all(layer.time is not None for layer in placed.placement_summary.layers)
    x, _ = regression_data(model, 8)
    np.testing.assert_allclose(placed.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def _variable_length_token_model():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(8, 4)(tokens)
    hidden = keras.layers.Dense(4, activation="tanh")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(tokens, keras.layers.Dense(2)(pooled), name="variable_length")


@pytest.mark.parametrize("partition", ["time", "memory"])
def test_inputs_with_unknown_axes_are_refused_in_one_line_naming_the_input(partition):
    with pytest.raises(ValueError, match="Received: sample_input=None") as error:
        PipelineModel.from_model(
            _variable_length_token_model(), first_logical_devices(2, "stages"), partition=partition
        )
    assert "'tokens'" in str(error.value) and "(None, None)" in str(error.value)
    assert "\n" not in str(error.value)


def test_placement_by_time_of_inputs_with_unknown_axes_is_refused_in_one_line():
    with pytest.raises(ValueError, match="balance='time'.*Received: sample_input=None") as error:
        place(_variable_length_token_model(), balance="time", devices=[0, 1], print_fn=None)
    assert "'tokens'" in str(error.value) and "\n" not in str(error.value)
