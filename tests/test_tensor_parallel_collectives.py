"""Promises of tensor-parallel reductions with TensorFlow's collective ops
(`tensor_reduction` "collective"): they sum like the ring and numpy, forward and backward;
split blocks, the reference Transformer and pipelines of tensor groups (rolled loops
included, and across two workers) train like one device with them; the traced step holds
one CollectiveReduceV2 per device per reduction and no ring transfers;
`scripts/train.py --tensor_reduce` runs end to end, and a bad value is one line."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.collectives import collective_all_reduce, replicated
from tfmulti.hybrid import build_hybrid_model
from tfmulti.models import build_model, registry
from tfmulti.names import TENSOR_REDUCTION_NAMES
from tfmulti.parallel import (
    TENSOR_REDUCTIONS,
    resolve_shard_devices,
    tensor_reduction,
    tensor_reduction_scope,
    unsplit_weights,
)
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names
from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices
from tfmulti.tensor_parallel.shard_devices import device_key
from tfmulti.tensor_parallel.transfer_bytes import (
    all_reduce_bytes,
    collective_bytes,
    received_bytes,
    sent_bytes,
    tensor_bytes,
)

_COLLECTIVE = "CollectiveReduceV2"


@pytest.fixture(autouse=True)
def _fail_fast_instead_of_hanging():
    # A collective whose peer never comes fails the test within a minute, not ten
    # (scripts/train.py sets it from --collective_timeout).
    collective_all_reduce.set_collective_timeout(60.0)
    yield
    collective_all_reduce.set_collective_timeout(None)


def _collective_ops(graph_def) -> int:
    """CollectiveReduceV2 nodes in a graph and all the functions it calls."""
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(node.op == _COLLECTIVE for node in nodes)


def test_the_reduction_names_are_those_the_command_line_offers():
    assert TENSOR_REDUCTIONS == TENSOR_REDUCTION_NAMES == ("ring", "collective")
    assert tensor_reduction() == "ring"
    with pytest.raises(ValueError, match="Received: 'nccl'"):
        with tensor_reduction_scope("nccl"):
            pass
    assert tensor_reduction() == "ring"


def test_a_collective_all_reduce_counts_each_device_its_ring_share_where_placed_ops_cannot_chunk():
    num_devices = 4
    devices = resolve_shard_devices(num_devices)
    shape = (3, 2)  # a last axis shorter than K: the placed ops sum on every device

    def traced(sum_on_every_device):
        @tf.function
        def step():
            inputs = []
            for index, device in enumerate(devices):
                with tf.device(device):
                    inputs.append(tf.fill(shape, float(index)))
            # Nothing returned: the outputs would be copied to the default device.
            sum_on_every_device(inputs, devices)

        return step.get_concrete_function().graph

    collective = traced(collective_all_reduce.sum_on_every_device)
    placed = traced(replicated.sum_on_every_device)
    whole = tensor_bytes(shape, "float32")
    share = 2 * (num_devices - 1) * whole // num_devices
    keys = [device_key(device) for device in devices]
    assert collective_bytes(collective, devices[0]) == dict.fromkeys(keys, share)
    # Only the runtime moves the data: received and sent are the ring share and nothing
    # else (the ties between the devices' sums are empty slices).
    assert received_bytes(collective, devices[0]) == dict.fromkeys(keys, share)
    assert sent_bytes(collective, devices[0]) == dict.fromkeys(keys, share)
    assert sum(received_bytes(collective, devices[0]).values()) == 2 * (num_devices - 1) * whole
    # The placed ops copy every tensor to every device: K(K-1) x S in all.
    assert collective_bytes(placed, devices[0]) == {}
    assert sum(received_bytes(placed, devices[0]).values()) == all_reduce_bytes(
        shape, "float32", num_devices
    )
    assert (
        all_reduce_bytes(shape, "float32", num_devices) == num_devices * (num_devices - 1) * whole
    )


def test_counting_a_collective_of_unknown_shape_is_refused_with_the_op_named():
    devices = resolve_shard_devices(2)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    def step(first, second):
        return collective_all_reduce.sum_on_every_device([first, second], devices)

    with pytest.raises(ValueError, match="needs its group size and tensor shape"):
        collective_bytes(step.get_concrete_function().graph, devices[0])


@pytest.mark.parametrize("num_devices", [2, 4])
def test_collective_all_reduce_sums_like_the_ring_and_numpy_forward_and_backward(num_devices):
    devices = resolve_shard_devices(num_devices)
    rng = np.random.default_rng(num_devices)
    values = rng.normal(size=(num_devices, 3, 10)).astype("float32")
    # Each output k is weighted by its own tensor, so a wrong backward shows.
    weights = rng.normal(size=(num_devices, 3, 10)).astype("float32")

    def placed(arrays):
        tensors = []
        for device, array in zip(devices, arrays, strict=True):
            with tf.device(device):
                tensors.append(tf.constant(array))
        return tensors

    @tf.function
    def sums_and_gradients():
        inputs = placed(values)
        ring = replicated.sum_on_every_device(inputs, devices)
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            outputs = collective_all_reduce.all_reduce(inputs, devices)
            loss = tf.add_n(
                [tf.reduce_sum(o * w) for o, w in zip(outputs, placed(weights), strict=True)]
            )
        return ring, outputs, tape.gradient(loss, inputs)

    ring, collective, gradients = sums_and_gradients()
    # Called eagerly (a model's first call, debugging) it gives the same sums.
    eager = collective_all_reduce.sum_on_every_device(placed(values), devices)
    for eager_sum in eager:
        np.testing.assert_array_equal(eager_sum.numpy(), collective[0].numpy())
    for ring_sum, collective_sum in zip(ring, collective, strict=True):
        np.testing.assert_allclose(collective_sum.numpy(), values.sum(axis=0), atol=1e-6)
        np.testing.assert_allclose(collective_sum.numpy(), ring_sum.numpy(), atol=1e-6)
    for gradient in gradients:
        np.testing.assert_allclose(gradient.numpy(), weights.sum(axis=0), atol=1e-6)
    # One collective per device forward and one backward, each on its device.
    graph = sums_and_gradients.get_concrete_function().graph
    collectives = [op for op in graph.get_operations() if op.type == _COLLECTIVE]
    placed_on = [device_key(op.device) for op in collectives]
    assert sorted(placed_on) == sorted([device_key(device) for device in devices] * 2)
    # They fail after the timeout set (the fixture's 60 s), not hang.
    assert {op.get_attr("timeout_seconds") for op in collectives} == {60.0}


@pytest.mark.parametrize("num_devices", [2, 4])
def test_megatron_operators_give_the_same_values_and_gradients_with_either_reduction(
    num_devices,
):
    devices = resolve_shard_devices(num_devices)
    rng = np.random.default_rng(0)
    values = rng.normal(size=(num_devices, 2, 8)).astype("float32")
    weights = rng.normal(size=(num_devices, 2, 8)).astype("float32")

    def run():
        @tf.function
        def step():
            inputs = []
            for device, array in zip(devices, values, strict=True):
                with tf.device(device):
                    inputs.append(tf.constant(array))
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                # f then a per-device product then g: a column-then-row pair's reductions.
                shards = replicated.reduce_gradients(inputs, devices)
                partials = [tf.sin(s) * w for s, w in zip(shards, weights, strict=True)]
                sums = replicated.all_reduce(partials, devices)
                loss = tf.reduce_sum(sums[0] * sums[0])
            return sums, tape.gradient(loss, inputs)

        sums, gradients = step()
        return [s.numpy() for s in sums], [g.numpy() for g in gradients]

    with tensor_reduction_scope("ring"):
        ring_sums, ring_gradients = run()
    with tensor_reduction_scope("collective"):
        collective_sums, collective_gradients = run()
    expected = (np.sin(values) * weights).sum(axis=0)
    for ring_sum, collective_sum in zip(ring_sums, collective_sums, strict=True):
        np.testing.assert_allclose(collective_sum, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(collective_sum, ring_sum, rtol=1e-5, atol=1e-6)
    for ring_gradient, collective_gradient in zip(
        ring_gradients, collective_gradients, strict=True
    ):
        np.testing.assert_allclose(collective_gradient, ring_gradient, rtol=1e-5, atol=1e-6)
    # The loss reads replica 0 only. Megatron's g hands each partial its own replica's
    # gradient (zero but for partial 0), and f sums the shards' gradients on every
    # device, so every x_j gets partial 0's: 2 s cos(x_0) w_0, s = sum_k sin(x_k) w_k.
    for gradient in collective_gradients:
        np.testing.assert_allclose(
            gradient, 2 * expected * np.cos(values[0]) * weights[0], rtol=1e-5, atol=1e-6
        )


def _collectives_in_a_step(model, x) -> int:
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.sin(model(x)))
        return tape.gradient(loss, model.trainable_variables)

    return _collective_ops(step.get_concrete_function(tf.constant(x)).graph.as_graph_def())


# A group of 4's collectives, forward and backward: the sums' and Megatron operators' tests.
@pytest.mark.parametrize("tensor_parallel", [2])
def test_transformer_with_collective_reductions_trains_to_the_weights_of_one_device(
    tensor_parallel,
):
    length, vocabulary = 6, 16
    tokens = np.random.default_rng(1).integers(vocabulary, size=(8, length + 1)).astype("int32")
    options = {"num_layers": 2, "num_heads": 4, "d_model": 8, "mlp_dim": 16}
    results, collectives = {}, {}
    for split in (1, tensor_parallel):
        with tensor_reduction_scope("collective"):
            model = build_model(
                "transformer", (length,), vocabulary, seed=5, tensor_parallel=split, **options
            )
            optimizer = keras.optimizers.SGD(learning_rate=0.5)
            place_optimizer_on_variable_devices(optimizer)
            model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            initial = unsplit_weights(model)
            model.fit(
                tokens[:, :-1], tokens[:, 1:], batch_size=4, epochs=2, shuffle=False, verbose=0
            )
            collectives[split] = _collectives_in_a_step(model, tokens[:4, :-1])
        results[split] = initial, unsplit_weights(model)

    # Every reduction of the split model is a collective: the vocabulary embedding's,
    # two per block and pass, and each is one op per device.
    assert collectives[1] == 0
    assert collectives[tensor_parallel] == tensor_parallel * (2 + 4 * options["num_layers"])
    (initial_1, trained_1), (initial_k, trained_k) = results[1], results[tensor_parallel]
    for first, second in zip(initial_1, initial_k, strict=True):
        np.testing.assert_array_equal(second, first)
    moved = [not np.allclose(a, b) for a, b in zip(trained_1, initial_1, strict=True)]
    assert sum(moved) > len(moved) // 2
    for first, second in zip(trained_1, trained_k, strict=True):
        np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-6)


def _pipeline_blocks(devices=None):
    options = {"num_layers": 2, "num_heads": 4, "d_model": 8}
    if devices is not None:
        options.update(tensor_parallel=len(devices), tensor_parallel_devices=list(devices))
    return registry.build_blocks("transformer", (8,), 16, seed=0, **options)


def _loops_and_collectives(hybrid, x, y) -> tuple[int, int]:
    """While loops and CollectiveReduceV2 ops in the step of the hybrid's first replica."""

    @tf.function(autograph=False)
    def losses(x, y):
        return hybrid.replicas[0].run_schedule(x, y, loss_model=hybrid).losses

    graph_def = losses.get_concrete_function(x, y).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return sum(node.op in ("While", "StatelessWhile") for node in nodes), _collective_ops(graph_def)


@pytest.mark.parametrize(
    "mesh_text, schedule, remat",
    [
        # Each schedule and option once: the split backward with remat on one copy; two
        # copies, each with its own collectives, on the plain 1F1B.
        ("data=1,pipe=2,tensor=2", "zb_h1", True),
        ("data=2,pipe=2,tensor=2", "1f1b", False),
    ],
)
def test_pipelined_tensor_groups_with_collectives_in_rolled_loops_train_like_one_device(
    mesh_text, schedule, remat
):
    vocabulary, length, batch, steps = 16, 8, 16, 2
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocabulary, (steps * batch, length + 1)).astype("int32")
    batches = [
        (tokens[i * batch : (i + 1) * batch, :-1], tokens[i * batch : (i + 1) * batch, 1:])
        for i in range(steps)
    ]
    with tensor_reduction_scope("collective"):
        hybrid = build_hybrid_model(
            _pipeline_blocks,
            mesh_text,
            num_microbatches=8,
            schedule=schedule,
            remat=remat,
            devices=logical_device_names("CPU")[: parse_mesh(mesh_text).num_devices],
            make_split_blocks=_pipeline_blocks,
        )
        reference = registry.build_model(
            "transformer", (length,), vocabulary, seed=0, num_layers=2, num_heads=4, d_model=8
        )
        for model in (reference, hybrid):
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss, jit_compile=False)
        for x, y in batches:
            np.testing.assert_allclose(
                hybrid.train_on_batch(x, y), reference.train_on_batch(x, y), rtol=1e-5
            )
        rows = batch // len(hybrid.replicas)
        loops, collectives = _loops_and_collectives(
            hybrid, tf.constant(batches[0][0][:rows]), tf.constant(batches[0][1][:rows])
        )
    # The steady state runs as a loop whose stage functions hold the collectives.
    assert loops >= 1
    assert collectives > 0
    probe = batches[0][0][::-1]
    np.testing.assert_allclose(
        hybrid.predict(probe, verbose=0), reference.predict(probe, verbose=0), atol=1e-5
    )
