"""Layer placement: every unit, its variables, optimizer slots and backward on its device."""

import itertools
import json
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.models.registry import build_model
from tfmulti.placement.placed_model import place, place_reference_model

BATCH = 8
STEPS = 2
REFERENCE_MODELS = {
    "mlp": ((8, 8, 1), 10, {"hidden_units": (16, 16)}),
    "convnet": ((8, 8, 1), 10, {"filters": (4, 8), "hidden_units": 16}),
    "resnet": ((8, 8, 1), 10, {"stage_filters": (4, 8)}),
    "transformer": ((8,), 16, {"d_model": 16, "num_heads": 2, "num_layers": 2}),
}


def _index(device: str) -> int:
    return tf.DeviceSpec.from_string(device).device_index


def _reference_data(name):
    input_shape, outputs, _ = REFERENCE_MODELS[name]
    rng = np.random.default_rng(0)
    size = BATCH * STEPS
    if name == "transformer":
        x = rng.integers(0, outputs, (size, *input_shape)).astype("int32")
        return x, rng.integers(0, outputs, (size, *input_shape))
    return rng.random((size, *input_shape), dtype="float32"), rng.integers(0, outputs, size)


def _reference_model(name, seed=0):
    input_shape, outputs, options = REFERENCE_MODELS[name]
    return build_model(name, input_shape, outputs, seed=seed, **options)


def _skip_model(seed=0):
    """Two inputs, a skip over a nested model, a keras.ops call, concatenation of branches."""

    def dense(units, name, index):
        initializer = keras.initializers.GlorotUniform(seed * 100 + index)
        return keras.layers.Dense(units, kernel_initializer=initializer, name=name)

    features = keras.Input((6,), name="features")
    extra = keras.Input((3,), name="extra")
    stem = keras.layers.Flatten(name="flatten")(dense(8, "stem", 0)(features))
    inner = keras.Sequential([dense(8, "inner_a", 1), dense(8, "inner_b", 2)], name="inner")
    merged = keras.layers.Add(name="skip_add")([inner(stem), stem])
    side = keras.ops.tanh(dense(8, "side", 3)(stem))
    joined = keras.layers.Concatenate(name="join")([merged, side, extra])
    return keras.Model([features, extra], dense(2, "logits", 4)(joined), name="skip_model")


def _skip_data():
    rng = np.random.default_rng(1)
    size = BATCH * STEPS
    inputs = [rng.random((size, 6), dtype="float32"), rng.random((size, 3), dtype="float32")]
    return inputs, rng.random((size, 2), dtype="float32")


SKIP_MAP = {"stem": 0, "inner": 1, "skip_add": "/device:CPU:1", "side": 2, "logits": 3}


def _train(model, x, y, optimizer, loss):
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def _assert_on_assigned_devices(placed):
    for layer in placed.layers:
        if layer.name not in placed.unit_devices:
            continue
        expected = _index(placed.devices[placed.unit_devices[layer.name]])
        assert {_index(v.value.device) for v in layer.variables} <= {expected}, layer.name
    # Keras names a slot after its variable's path: "<path with _ for />_<slot>".
    by_prefix = {v.path.replace("/", "_") + "_": v for v in placed.trainable_variables}
    checked = 0
    for slot in placed.optimizer.variables:
        owners = [key for key in by_prefix if slot.name.startswith(key)]
        if owners:
            owner = by_prefix[max(owners, key=len)]
            assert _index(slot.value.device) == _index(owner.value.device), slot.path
            checked += 1
    slots_per_variable = 2 if isinstance(placed.optimizer, keras.optimizers.Adam) else 0
    assert checked == slots_per_variable * len(placed.trainable_variables)


@pytest.mark.parametrize(
    "name, placement, optimizer",
    [
        ("mlp", {"mlp_hidden_0": 0, "mlp_hidden_.*": 1, ".*": "/cpu:2"}, "sgd"),
        ("convnet", "params", "adam"),
        ("resnet", "time", "adam"),
        ("transformer", "memory", "sgd"),
    ],
)
def test_placed_reference_model_trains_to_the_unplaced_weights(name, placement, optimizer):
    x, y = _reference_data(name)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = _train(_reference_model(name), x, y, optimizer, loss).get_weights()
    model = _reference_model(name)
    if isinstance(placement, dict):
        placed = place(model, placement, devices=[0, 1, 2, 3], print_fn=None)
    else:
        placed = place(model, balance=placement, sample_input=x[:BATCH], print_fn=None)
    assert len(set(placed.unit_devices.values())) > 1
    _train(placed, x, y, optimizer, loss)
    _assert_on_assigned_devices(placed)
    for actual, reference in zip(placed.get_weights(), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-5, atol=1e-6)


# Adam, whose slots must follow their variables; SGD is trained placed on reference models.
@pytest.mark.parametrize("optimizer", ["adam"])
def test_branched_two_input_model_trains_to_the_unplaced_weights(optimizer):
    x, y = _skip_data()
    expected_outputs = _skip_model().predict(x, verbose=0)
    expected = _train(_skip_model(), x, y, optimizer, "mse").get_weights()
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    np.testing.assert_allclose(placed.predict(x, verbose=0), expected_outputs, rtol=1e-6)
    _train(placed, x, y, optimizer, "mse")
    _assert_on_assigned_devices(placed)
    for actual, reference in zip(placed.get_weights(), expected, strict=True):
        np.testing.assert_allclose(actual, reference, rtol=1e-5, atol=1e-6)


def test_a_first_fit_with_metrics_traces_the_step_once():
    # Keras builds metrics and optimizer slots of a model without a strategy in the first
    # step's trace, which made tf.function trace the step twice.
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    placed.compile(optimizer="adam", loss="mse", metrics=["mae"])
    traces = []
    train_step = placed.train_step

    def counted(data):
        traces.append(data)
        return train_step(data)

    placed.train_step = counted
    x, y = _skip_data()
    placed.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert len(traces) == 1


def test_weightless_units_left_out_of_the_map_run_with_their_producer():
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    device_of = placed.placement_summary.device_of
    # keras.ops calls get process-unique names such as "tanh_6".
    (tanh,) = [x.name for x in placed.placement_summary.layers if x.kind == "Tanh"]
    assert device_of("flatten") == device_of("stem")
    assert device_of(tanh) == device_of("side")
    assert device_of("join") == device_of("skip_add")


def _crossings(graph):
    """Distinct (tensor, destination device) pairs whose producer sits on another device."""
    pairs = set()
    for op in graph.get_operations():
        for tensor in op.inputs:
            source = tensor.op.device
            if op.device and source and _index(source) != _index(op.device):
                pairs.add((tensor.name, _index(op.device)))
    return pairs


def test_tensors_cross_devices_only_at_graph_edges():
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    summary = placed.placement_summary
    specs = [tf.TensorSpec((BATCH, 6)), tf.TensorSpec((BATCH, 3))]
    graph = tf.function(lambda a, b: placed([a, b])).get_concrete_function(*specs).graph
    predicted = {
        (producer, _index(summary.device_of(consumer)))
        for producer, consumer in summary.cross_device_edges
    }
    assert len(predicted) >= 3
    assert len(_crossings(graph)) == len(predicted)

    together = place(_skip_model(), {".*": 1}, print_fn=None)
    graph = tf.function(lambda a, b: together([a, b])).get_concrete_function(*specs).graph
    assert not together.placement_summary.cross_device_edges
    assert not _crossings(graph)


def test_backward_ops_run_on_their_layers_devices():
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    placed.compile(optimizer="sgd", loss="mse")
    specs = ((tf.TensorSpec((BATCH, 6)), tf.TensorSpec((BATCH, 3))), tf.TensorSpec((BATCH, 2)))
    step = tf.function(lambda x, y: placed.train_step((x, y)))
    graph = step.get_concrete_function(*specs).graph
    gradient_matmuls = [
        op for op in graph.get_operations() if op.type == "MatMul" and "gradient_tape" in op.name
    ]
    assert gradient_matmuls
    for layer in ("stem", "inner", "side", "logits"):
        ops = [op for op in gradient_matmuls if re.search(rf"/{layer}(_\d+)?/", op.name)]
        assert ops, layer
        expected = _index(placed.placement_summary.device_of(layer))
        assert {_index(op.device) if op.device else None for op in ops} == {expected}, layer


def test_fit_with_callbacks_and_weight_files(tmp_path):
    x, y = _skip_data()
    placed = place(_skip_model(), SKIP_MAP, print_fn=None)
    placed.compile(optimizer="adam", loss="mse", metrics=["mae"])
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"), save_weights_only=True),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1),
        keras.callbacks.TensorBoard(str(tmp_path / "logs")),
    ]
    history = placed.fit(x, y, batch_size=BATCH, epochs=2, callbacks=callbacks, verbose=0)
    assert len(history.history["loss"]) == 2
    assert (tmp_path / "best.weights.h5").exists() and any((tmp_path / "logs").iterdir())
    assert np.isfinite(placed.evaluate(x, y, verbose=0)[0])

    placed.save_weights(str(tmp_path / "placed.weights.h5"))
    reloaded = place(_skip_model(seed=7), SKIP_MAP, print_fn=None)
    reloaded.load_weights(str(tmp_path / "placed.weights.h5"))
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), placed.predict(x, verbose=0))
    unplaced = _skip_model(seed=7)
    unplaced.load_weights(str(tmp_path / "placed.weights.h5"))
    np.testing.assert_allclose(unplaced.predict(x, verbose=0), placed.predict(x, verbose=0))


def _smallest_largest_load(costs, num_devices):
    """Brute force over every contiguous split: the smallest possible largest device load."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), num_devices - 1):
        edges = (0, *cuts, len(costs))
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("policy", ["params", "memory", "time"])
def test_balance_places_contiguous_runs_with_the_smallest_largest_load(policy):
    name = "transformer"
    input_shape, outputs, options = REFERENCE_MODELS[name]
    model = build_model(name, input_shape, outputs, **{**options, "num_layers": 4})
    x, _ = _reference_data(name)
    placed = place(model, balance=policy, devices=[1, 2, 3], sample_input=x[:BATCH], print_fn=None)
    summary = placed.placement_summary
    indices = [placed.unit_devices[layer.name] for layer in summary.layers]
    assert indices == sorted(indices) and set(indices) == {0, 1, 2}
    field = {"params": "params", "memory": "memory", "time": "time"}[policy]
    costs = [getattr(layer, field) for layer in summary.layers]
    largest = max(getattr(load, field) for load in summary.device_loads())
    if policy == "time":
        # "time" optimises a simulated step, which follows but need not equal the largest load.
        assert largest <= 1.5 * _smallest_largest_load(costs, 3)
    else:
        assert largest == pytest.approx(_smallest_largest_load(costs, 3), abs=len(costs))


def test_summary_lists_every_layer_and_each_devices_load():
    printed = []
    model = _reference_model("resnet")
    x, _ = _reference_data("resnet")
    placed = place(
        model, balance="params", devices=[0, 1], sample_input=x[:BATCH], print_fn=printed.append
    )
    summary = placed.placement_summary
    assert printed == [str(summary)]
    for layer in model.layers[1:]:
        assert layer.name in printed[0]
    assert "/device:CPU:0" in printed[0] and "/device:CPU:1" in printed[0]
    loads = summary.device_loads()
    assert sum(load.params for load in loads) == sum(
        v.numpy().size for v in model.trainable_variables
    )
    assert sum(load.num_layers for load in loads) == len(model.layers) - 1


def test_place_reference_model_reads_a_placement_file(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps({"embedding": 0, "transformer_block_.*": 1, ".*": 2}))
    placed, summary = place_reference_model(
        _reference_model("transformer"), None, str(path), print_fn=None
    )
    assert [_index(layer.device) for layer in summary.layers] == [0, 1, 1, 2]
    assert placed.placement_summary is summary

    x, _ = _reference_data("transformer")
    _, auto = place_reference_model(_reference_model("transformer"), [0, 1], "auto", x[:BATCH])
    assert auto.policy == "balance=time"


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"device_map": {"no_such_layer": 0}}, "no_such_layer"),
        ({"device_map": {"transformer_block_9.*": 0, ".*": 1}}, "transformer_block_9"),
        ({"device_map": {"(": 0}}, "("),
        ({"device_map": {".*": "/device:CPU:99"}}, "CPU:99"),
        ({"device_map": {".*": 9}, "devices": [0, 1]}, "9"),
        ({"device_map": {".*": "/device:CPU:5"}, "devices": [0, 1]}, "CPU:5"),
        ({"device_map": {"embedding": 0}}, "transformer_block_0"),
        ({"device_map": {".*": 0}, "balance": "params"}, "balance='params'"),
        ({"balance": "flops"}, "flops"),
    ],
)
def test_bad_device_map_is_a_one_line_error_naming_the_value(arguments, named):
    with pytest.raises(ValueError) as error:
        place(_reference_model("transformer"), print_fn=None, **arguments)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_bad_placement_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text("[1, 2]")
    for placement in (str(path), "fastest"):
        with pytest.raises(ValueError, match=re.escape(placement)):
            place_reference_model(_reference_model("mlp"), None, placement, print_fn=None)


def test_sequential_model_is_placed_as_its_graph_with_the_same_outputs():
    def sequential():
        initializer = keras.initializers.GlorotUniform(3)
        return keras.Sequential(
            [keras.Input((6,))]
            + [keras.layers.Dense(4, kernel_initializer=initializer) for _ in range(3)]
        )

    x, _ = _skip_data()
    expected = sequential().predict(x[0], verbose=0)
    placed = place(sequential(), balance="params", devices=[2, 3], print_fn=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        np.testing.assert_allclose(placed.predict(x[0], verbose=0), expected, rtol=1e-6)
    assert sorted(set(placed.unit_devices.values())) == [0, 1]
