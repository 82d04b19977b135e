"""The ways of spreading a model, and finding the user's model function, without training."""

import keras
import pytest

from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.names import TRAIN_STRATEGY_NAMES
from tfmulti.strategies import (
    TRAINING_STRATEGIES,
    ModelSource,
    TrainingStrategy,
    get_training_strategy,
    model_source,
)
from tfmulti.user_code import is_function_reference, load_function

INFO = DataInfo("digits", "classification", (8, 8, 1), 10, 100, 20, "float32")


def test_every_strategy_name_has_one_way_of_spreading_a_model():
    assert set(TRAINING_STRATEGIES) == set(TRAIN_STRATEGY_NAMES)
    assert all(
        isinstance(training_strategy, TrainingStrategy)
        for training_strategy in TRAINING_STRATEGIES.values()
    )


def test_unknown_strategy_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match="Received: 'parameter_server'"):
        get_training_strategy("parameter_server")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("pkg.models:build", True),
        ("models:build", True),
        ("mlp", False),
        ("pkg.models:", False),
        ("pkg/models.py:build", False),
        ("a:b:c", False),
    ],
)
def test_function_reference_is_dotted_module_colon_name(text, expected):
    assert is_function_reference(text) is expected


def test_load_function_finds_a_module_function():
    assert load_function("keras.layers:Dense", "--model") is keras.layers.Dense


@pytest.mark.parametrize(
    "reference, named",
    [
        ("no_such_module_xyz:build", "no_such_module_xyz"),
        ("keras.layers:NoSuchLayer", "NoSuchLayer"),
    ],
)
def test_load_function_error_is_one_line_naming_what_is_missing(reference, named):
    with pytest.raises(ValueError, match=named) as raised:
        load_function(reference, "--model")
    assert "\n" not in str(raised.value)


def test_reference_model_source_builds_the_registry_model_once():
    source = model_source(TrainConfig.from_flat(model="mlp"), INFO)
    assert source.is_reference
    assert source.model() is source.model()
    assert source.model().output_shape == (None, 10)


def test_user_function_returning_no_model_is_named_in_one_line():
    source = model_source(
        TrainConfig.from_flat(model="keras.layers:Dense", model_options={"units": 3}), INFO
    )
    assert not source.is_reference
    with pytest.raises(ValueError, match="must return a keras.Model. Received: Dense"):
        source.model()


def test_user_function_given_options_it_does_not_take_is_one_line():
    with pytest.raises(ValueError, match="does not take the options"):
        model_source(
            TrainConfig.from_flat(model="keras.layers:Dense", model_options={"size": 3}), INFO
        )


def test_compiled_user_model_keeps_its_loss_and_metrics():
    def compiled():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    source = ModelSource("mine:compiled", compiled)
    source.model()
    assert source.loss_and_metrics() == ("mse", ["mae"])


def test_uncompiled_model_trains_logits_against_integer_labels():
    source = ModelSource("mine:plain", lambda: keras.Sequential([keras.Input((4,))]))
    source.model()
    loss, metrics = source.loss_and_metrics()
    assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
    assert loss.get_config()["from_logits"]
    assert [metric.name for metric in metrics] == ["accuracy"]
