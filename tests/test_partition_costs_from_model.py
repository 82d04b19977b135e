"""`PipelineModel.from_model(..., partition="time")` and layer placement by time: calls
that cost the same are timed once, and a cost cache lets the next cut (or placement) of the
same model time nothing."""

import logging

import keras
import numpy as np
import pytest
from pipeline_graph_models import gpt2_causal_lm, masked_model, regression_data, token_data

import tfmulti.pipeline.stages.block_partition as partition
from tfmulti.hybrid import build_hybrid_model_from_model
from tfmulti.parallel import place
from tfmulti.pipeline.runtime import CostCache, PipelineModel
from tfmulti.platform.runtime.devices import first_logical_devices, logical_device_names

WIDTH, REPEATS = 16, 4


@pytest.fixture
def timed(monkeypatch):
    """The operations `time_block` was asked to time, by name, in order."""
    names = []
    original = partition.time_block

    def counting(call, inputs, **kwargs):
        names.append(call.operation.name)
        return original(call, inputs, **kwargs)

    monkeypatch.setattr(partition, "time_block", counting)
    return names


def _repeated_dense_model():
    """A stem, REPEATS identical hidden layers (only their names and seeds differ), a head."""
    inputs = keras.Input((8,), name="features")
    x = keras.layers.Dense(WIDTH, activation="tanh", name="stem")(inputs)
    for index in range(REPEATS):
        initializer = keras.initializers.GlorotUniform(seed=index)
        x = keras.layers.Dense(
            WIDTH, activation="tanh", kernel_initializer=initializer, name=f"hidden_{index}"
        )(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x))


def _cut(model, sample_input, num_stages=2, partition="time", **options):
    return PipelineModel.from_model(
        model,
        first_logical_devices(num_stages, "stages"),
        partition=partition,
        sample_input=sample_input,
        **options,
    )


def _stage_sizes(pipe):
    return [len(stage.call_names) for stage in pipe.stages]


def test_identical_layer_calls_are_timed_once(timed, caplog):
    model = _repeated_dense_model()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

    with caplog.at_level(logging.INFO, logger="absl"):
        _cut(model, x, num_stages=3)

    assert timed == ["stem", "hidden_0", "head"]
    assert f"Block timing: 3 timed, {REPEATS - 1} same as another block." in caplog.text


def test_gpt2_decoder_layers_are_timed_once_and_the_tied_embedding_twice(timed):
    x, _ = token_data(4)

    _cut(gpt2_causal_lm(), x)

    # The token embedding runs forwards (ids -> vectors) and, tied, reversed (vectors ->
    # logits): other arguments and shapes, so it is timed for each.
    assert [name for name in timed if "transformer_layer" in name] == ["transformer_layer_0"]
    assert timed.count("token_embedding") == 2


def test_keras_ops_between_layers_get_signatures_too(timed):
    model = masked_model()
    x, _ = regression_data(model, 4)

    _cut(model, x)

    # Four casts of one mask and four multiplies: one of each; masked_0 takes the
    # features, the three layers after it each other's outputs: two distinct layers.
    # Keras numbers an op's auto name by the ops made before it in the process.
    names = [name if not name.startswith("cast") else "cast" for name in timed]
    assert names == ["masked_0", "cast", "apply_mask_0", "masked_1", "head"]


class _Unconfigurable(keras.layers.Layer):
    """A layer without a config: its `__init__` takes a function, which Keras cannot save."""

    def __init__(self, activation_function, **kwargs):
        super().__init__(**kwargs)
        self.activation_function = activation_function

    def call(self, inputs):
        return self.activation_function(inputs)


def test_calls_without_a_config_are_each_timed(timed):
    inputs = keras.Input((8,))
    x = _Unconfigurable(keras.ops.tanh, name="free_0")(inputs)
    x = _Unconfigurable(keras.ops.tanh, name="free_1")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(x))

    _cut(model, np.zeros((4, 8), "float32"))

    assert timed == ["free_0", "free_1", "head"]


def test_a_second_cut_with_the_same_cache_times_nothing_and_cuts_at_the_same_calls(
    tmp_path, timed, caplog
):
    path = tmp_path / "partition_costs.json"
    x, _ = token_data(4)
    first = _cut(gpt2_causal_lm(), x, num_stages=3, cost_cache=str(path))
    timed_first = len(timed)
    assert path.exists() and timed_first > 0

    with caplog.at_level(logging.INFO, logger="absl"):
        second = _cut(gpt2_causal_lm(), x, num_stages=3, cost_cache=CostCache(str(path)))

    assert len(timed) == timed_first  # nothing timed again
    assert "Block timing: used the cached costs" in caplog.text
    assert _stage_sizes(second) == _stage_sizes(first)

    _cut(gpt2_causal_lm(), x, cost_cache=CostCache(str(path), remeasure=True))

    assert len(timed) == 2 * timed_first


def test_memory_partition_times_nothing(timed):
    model = _repeated_dense_model()

    _cut(model, np.zeros((4, 8), "float32"), partition="memory")

    assert timed == []


def test_a_cost_cache_of_another_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match="Received: cost_cache=3"):
        _cut(_repeated_dense_model(), np.zeros((4, 8), "float32"), cost_cache=3)


def test_a_hybrids_replicas_time_the_model_once_and_reuse_the_cache(tmp_path, timed):
    path = str(tmp_path / "partition_costs.json")
    x = np.zeros((4, 8), "float32")

    def build():
        return build_hybrid_model_from_model(
            _repeated_dense_model(),
            "data=2,pipe=2",
            2,
            partition="time",
            sample_input=x,
            devices=logical_device_names("CPU")[:4],
            cost_cache=path,
        )

    first = build()
    # Replica 0 times stem, one hidden layer and head; the copy is cut at the same calls.
    assert timed == ["stem", "hidden_0", "head"]

    second = build()

    assert len(timed) == 3
    assert _stage_sizes(second.replicas[0]) == _stage_sizes(first.replicas[0])


def test_layer_placement_times_identical_layers_once_and_then_reads_the_cache(timed, tmp_path):
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    cache_file = str(tmp_path / "partition_costs.json")

    def placed():
        return place(
            _repeated_dense_model(),
            devices=[0, 1],
            balance="time",
            sample_input=x,
            print_fn=None,
            cost_cache=cache_file,
        )

    first = placed()
    assert timed == ["stem", "hidden_0", "head"]
    timed.clear()
    second = placed()
    assert timed == []
    devices = [[layer.device for layer in p.placement_summary.layers] for p in (first, second)]
    assert devices[0] == devices[1]
