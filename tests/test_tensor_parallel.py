"""Promises of the tensor-parallel layers: they compute what the unsplit layers compute, keep
weights, slots and work on their devices, and move the bytes their analytic count says."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.models import build_model
from tfmulti.models.transformer import CausalSelfAttention, FeedForward
from tfmulti.parallel import (
    ColumnParallelDense,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelDense,
    VocabParallelEmbedding,
    measure_communication,
    resolve_shard_devices,
    unsplit_weights,
)
from tfmulti.platform.runtime.devices import logical_device_names
from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices
from tfmulti.tensor_parallel.shard_devices import device_key

BATCH, LENGTH, WIDTH, VOCAB = 2, 6, 8, 16


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(VOCAB, size=(BATCH, LENGTH)).astype("int32")


def _activations(seed=0, width=WIDTH):
    return np.random.default_rng(seed).normal(size=(BATCH, LENGTH, width)).astype("float32")


def _pair(kind, devices):
    """Returns (unsplit layer, split layer, input) for a split layer kind."""
    if kind == "column":
        return keras.layers.Dense(12, activation="gelu"), ColumnParallelDense, _activations()
    if kind == "column_not_gathered":
        return keras.layers.Dense(12), ColumnParallelDense, _activations()
    if kind == "row":
        return keras.layers.Dense(5, activation="relu"), RowParallelDense, _activations()
    if kind == "mlp":
        return FeedForward(WIDTH, 16, seed=1), ParallelMLP(WIDTH, 16, devices), _activations()
    if kind == "attention":
        attention = ParallelSelfAttention(WIDTH, 4, devices)
        return CausalSelfAttention(WIDTH, 4, seed=2), attention, _activations()
    embedding = VocabParallelEmbedding(VOCAB, WIDTH, devices)
    return keras.layers.Embedding(VOCAB, WIDTH), embedding, _tokens()


def _split_copy(kind, devices):
    """Builds both layers of `kind`, the split one holding the unsplit one's weights."""
    unsplit, split, inputs = _pair(kind, devices)
    unsplit(inputs)
    if isinstance(split, type):
        options = {"gather_output": False} if kind == "column_not_gathered" else {}
        split = split.from_dense(unsplit, devices, **options)
    else:
        split.build(inputs.shape)
        split.set_unsplit_weights(unsplit.get_weights())
    return unsplit, split, inputs


def _outputs_and_gradients(layer, inputs, output_weights):
    """Output, and gradients of sum(output * output_weights) w.r.t. the input and weights,
    from a traced step (the path Keras training takes)."""

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            if inputs.dtype.is_floating:
                tape.watch(inputs)
            outputs = layer(inputs)
            if isinstance(outputs, list):
                outputs = tf.concat(outputs, axis=-1)
            loss = tf.reduce_sum(outputs * output_weights)
        sources = ([inputs] if inputs.dtype.is_floating else []) + layer.trainable_variables
        return outputs, [tf.convert_to_tensor(g) for g in tape.gradient(loss, sources)]

    outputs, gradients = step(tf.constant(inputs))
    return outputs.numpy(), [gradient.numpy() for gradient in gradients]


def _in_unsplit_layout(split, weight_gradients):
    """Maps gradients of the split layer's variables to the unsplit layer's weight layout."""
    saved = split.get_weights()
    for variable, gradient in zip(split.trainable_variables, weight_gradients, strict=True):
        variable.assign(gradient)
    mapped = unsplit_weights(split)
    split.set_weights(saved)
    return mapped


# Each kind once, on 2 or 4 shards in turn; the communication test below takes each kind
# on the other count.
SPLIT_KINDS = [
    ("column", 2),
    ("column_not_gathered", 4),
    ("row", 2),
    ("mlp", 4),
    ("attention", 2),
    ("embedding", 4),
]
OTHER_SHARD_COUNT = [(kind, 6 - num_shards) for kind, num_shards in SPLIT_KINDS]


@pytest.mark.parametrize("kind, num_shards", SPLIT_KINDS)
def test_split_layer_gives_the_unsplit_layers_outputs_and_gradients(kind, num_shards):
    devices = resolve_shard_devices(num_shards)
    unsplit, split, inputs = _split_copy(kind, devices)
    output_weights = np.random.default_rng(7).normal(size=unsplit(inputs).shape)
    output_weights = output_weights.astype("float32")

    expected, expected_gradients = _outputs_and_gradients(unsplit, inputs, output_weights)
    actual, actual_gradients = _outputs_and_gradients(split, inputs, output_weights)

    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    eager = split(inputs)
    eager = np.concatenate(eager, axis=-1) if isinstance(eager, list) else eager
    np.testing.assert_allclose(eager, expected, rtol=1e-5, atol=1e-6)
    num_input_gradients = 1 if inputs.dtype == np.float32 else 0
    np.testing.assert_allclose(
        actual_gradients[:num_input_gradients], expected_gradients[:num_input_gradients], atol=1e-5
    )
    mapped = _in_unsplit_layout(split, actual_gradients[num_input_gradients:])
    assert len(mapped) == len(expected_gradients) - num_input_gradients
    for actual_gradient, expected_gradient in zip(
        mapped, expected_gradients[num_input_gradients:], strict=True
    ):
        np.testing.assert_allclose(actual_gradient, expected_gradient, rtol=1e-5, atol=1e-6)


def _device_indices(variables):
    return [device_key(variable.value.device)[1] for variable in variables]


def test_shards_and_their_optimizer_slots_live_on_their_devices():
    devices = resolve_shard_devices(4)
    inputs = keras.Input((LENGTH,), dtype="int32")
    hidden = VocabParallelEmbedding(VOCAB, WIDTH, devices, name="embedding")(inputs)
    hidden = ParallelSelfAttention(WIDTH, 4, devices, name="attention")(hidden)
    outputs = ParallelMLP(WIDTH, 16, devices, name="mlp")(hidden)
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.Adam()
    place_optimizer_on_variable_devices(optimizer)
    model.compile(optimizer, "mse")
    model.fit(_tokens(), _activations(), epochs=1, verbose=0)

    num_shards = 0
    for variable in model.trainable_variables:
        name = variable.path.split("/")[-1]
        expected_device = int(name.rsplit("_", 1)[1]) if "_shard_" in name else 0
        num_shards += "_shard_" in name
        # Keras names a slot after its variable's path: "adam/<path with _>_momentum".
        slot_names = {
            f"{variable.path.replace('/', '_')}_{kind}" for kind in ("momentum", "velocity")
        }
        slots = [slot for slot in optimizer.variables if slot.path.split("/")[-1] in slot_names]
        assert len(slots) == 2, variable.path
        assert _device_indices([variable, *slots]) == [expected_device] * 3, variable.path
    # Embedding table; query, key, value kernels and biases; output kernel; MLP's three.
    assert num_shards == 4 * (1 + 6 + 1 + 3)


def test_shard_backward_runs_on_the_shard_device_without_a_device_scope():
    devices = resolve_shard_devices(2)
    mlp = ParallelMLP(WIDTH, 16, devices)
    mlp.build((BATCH, LENGTH, WIDTH))

    @tf.function
    def step(inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mlp(inputs))
        return tape.gradient(loss, mlp.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((BATCH, LENGTH, WIDTH))).graph
    matmul_devices = [
        device_key(op.device) if op.device else None
        for op in graph.get_operations()
        if op.type in ("MatMul", "BatchMatMulV2")
    ]
    # Per device and layer: forward, input gradient and kernel gradient.
    assert sorted(matmul_devices, key=str) == [("CPU", 0)] * 6 + [("CPU", 1)] * 6


def test_transformer_with_tensor_parallel_2_trains_to_the_weights_of_tensor_parallel_1():
    tokens = np.random.default_rng(1).integers(VOCAB, size=(8, LENGTH + 1)).astype("int32")
    options = {"num_layers": 1, "num_heads": 2, "d_model": WIDTH, "mlp_dim": 16}
    results = {}
    for tensor_parallel in (1, 2):
        model = build_model(
            "transformer", (LENGTH,), VOCAB, seed=5, tensor_parallel=tensor_parallel, **options
        )
        optimizer = keras.optimizers.SGD(learning_rate=0.5)
        place_optimizer_on_variable_devices(optimizer)
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = unsplit_weights(model)
        model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=4, epochs=1, shuffle=False, verbose=0)
        results[tensor_parallel] = initial, unsplit_weights(model)

    (initial_1, trained_1), (initial_2, trained_2) = results[1], results[2]
    assert len(trained_2) == len(trained_1)
    for first, second in zip(initial_1, initial_2, strict=True):
        np.testing.assert_array_equal(second, first)
    moved = [
        not np.allclose(after, before) for after, before in zip(trained_1, initial_1, strict=True)
    ]
    assert sum(moved) > len(moved) // 2
    for first, second in zip(trained_1, trained_2, strict=True):
        np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, num_shards", OTHER_SHARD_COUNT)
def test_measured_communication_bytes_equal_the_analytic_count(kind, num_shards):
    _, split, inputs = _split_copy(kind, resolve_shard_devices(num_shards))
    measured = measure_communication(split, tf.TensorSpec(inputs.shape, inputs.dtype))
    assert measured == split.communication_bytes(inputs.shape)
    assert measured.forward > 0 and measured.backward > 0


def test_parallel_mlp_moves_a_broadcast_and_an_all_reduce_forward_and_two_all_reduces_back():
    for num_shards in (2, 4):
        mlp = ParallelMLP(64, 256, resolve_shard_devices(num_shards))
        activation_bytes = BATCH * LENGTH * 64 * 4
        # A ring all-reduce delivered home: a reduce-scatter ((K-1) x bytes) and the K-1
        # chunks not on home gathered there; backward, the same bytes the other way.
        all_reduce = (num_shards - 1) * activation_bytes * (num_shards + 1) // num_shards
        broadcast = (num_shards - 1) * activation_bytes
        cost = mlp.communication_bytes((BATCH, LENGTH, 64))
        assert (cost.forward, cost.backward) == (broadcast + all_reduce, 2 * all_reduce)


@pytest.mark.parametrize(
    "make_layer, message",
    [
        (lambda devices: ColumnParallelDense(6, devices), "units=6"),
        (lambda devices: RowParallelDense(4, devices).build((None, 6)), "input features=6"),
        (lambda devices: ParallelMLP(8, 6, devices), "mlp_dim=6"),
        (lambda devices: ParallelSelfAttention(8, 2, devices), "num_heads=2"),
        (lambda devices: VocabParallelEmbedding(10, 4, devices), "vocabulary size\\)=10"),
    ],
)
def test_sizes_that_do_not_split_evenly_are_one_clear_error(make_layer, message):
    with pytest.raises(ValueError, match=f"divisible by the number of devices \\(4\\).*{message}"):
        make_layer(resolve_shard_devices(4))


def test_more_shards_than_devices_is_a_clear_error():
    too_many = len(logical_device_names()) + 1
    with pytest.raises(ValueError, match=f"needs {too_many} devices but only"):
        build_model("transformer", (LENGTH,), VOCAB, tensor_parallel=too_many, num_heads=2)


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown devices \\['/device:CPU:99'\\]"):
        ColumnParallelDense(4, ["/device:CPU:0", "/device:CPU:99"])


@pytest.mark.parametrize("kind", ["column", "row", "mlp", "attention", "embedding"])
def test_split_layer_rebuilt_from_its_config_has_the_same_config(kind):
    _, split, _ = _split_copy(kind, resolve_shard_devices(2))
    rebuilt = type(split).from_config(split.get_config())
    assert rebuilt.get_config() == split.get_config()
