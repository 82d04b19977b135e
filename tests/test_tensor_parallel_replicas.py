"""Promises of the replicated residual stream in tensor-parallel Transformer blocks: every
device of a group ends each reduction with the whole sum, no device sends or receives more
than its ring all-reduce share plus the one copy in and out of a stack, the bytes are the
analytic and the planner's figures, and the numbers are those of one device."""

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.collectives.replica_handoff import replicas_of
from tfmulti.data import load_source
from tfmulti.models import registry
from tfmulti.models.transformer import TransformerBlock
from tfmulti.parallel import resolve_shard_devices, tensor_reduction_scope, unsplit_weights
from tfmulti.planner import Hardware, blocks_at, score_layout, tensor_group_bytes
from tfmulti.planner.measure import measure_model_costs
from tfmulti.platform.mesh import HybridMesh
from tfmulti.tensor_parallel.shard_devices import device_key
from tfmulti.tensor_parallel.transfer_bytes import (
    collective_bytes,
    received_bytes,
    sent_bytes,
    step_graph,
    tensor_bytes,
)

BATCH, LENGTH, WIDTH, HEADS, MLP_WIDTH = 4, 8, 64, 4, 256
SHAPE = (BATCH, LENGTH, WIDTH)


def _blocks(num_blocks, devices):
    blocks = [
        TransformerBlock(WIDTH, HEADS, MLP_WIDTH, seed=index, tensor_parallel_devices=devices)
        for index in range(num_blocks)
    ]
    for block in blocks:
        block.build(SHAPE)
    return blocks


def _per_device(graph, devices):
    """(received, sent) bytes of each device in `devices` order."""
    received, sent = received_bytes(graph, devices[0]), sent_bytes(graph, devices[0])
    keys = [device_key(device) for device in devices]
    assert set(received) | set(sent) <= set(keys)
    return [received.get(key, 0) for key in keys], [sent.get(key, 0) for key in keys]


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_no_device_sends_or_receives_more_than_its_all_reduce_share_plus_one_copy_in_and_out(
    num_blocks,
):
    num_devices = 4
    devices = resolve_shard_devices(num_devices)
    blocks = _blocks(num_blocks, devices)
    received, sent = _per_device(step_graph(blocks, tf.TensorSpec(SHAPE), devices[0]), devices)

    activations = tensor_bytes(SHAPE, "float32")
    # Each block all-reduces its activations twice per pass, forward and backward; a ring
    # all-reduce has every device send and receive 2(K-1)/K of the tensor.
    share = 2 * (num_devices - 1) * activations // num_devices
    reductions = 4 * num_blocks * share
    # Where the stack starts its input goes along the chain 0 -> 1 -> 2 -> 3 (forward),
    # where it ends its output gradient (backward): one whole tensor in and out of each
    # device at most. The norms' and output biases' values go from device 0 to the others.
    weights = num_blocks * blocks[0].replicated_weight_bytes()
    # Reduce-to-one with a fan-out from device 0 had it send 3 whole activations per
    # fan-out, 6 per block forward alone: 12 per block step against 6 + 2 here.
    assert max(sent + received) <= reductions + 2 * activations + 3 * weights
    assert received == [reductions] + [reductions + 2 * activations + weights] * 3
    assert sent == [
        reductions + 2 * activations + 3 * weights,
        reductions + 2 * activations,
        reductions + 2 * activations,
        reductions,
    ]
    analytic = [
        block.communication_bytes(SHAPE, enters=index == 0, exits=index == num_blocks - 1)
        for index, block in enumerate(blocks)
    ]
    assert sum(received) == sum(each.forward + each.backward for each in analytic)


# A lone block (it both takes the stack's input and gives its output): the ring's count
# above, which this test's collectives move alike.
@pytest.mark.parametrize("num_blocks", [2])
def test_collective_reductions_are_one_op_per_device_and_move_what_the_ring_of_placed_ops_moves(
    num_blocks,
):
    num_devices = 4
    devices = resolve_shard_devices(num_devices)
    blocks = _blocks(num_blocks, devices)
    with tensor_reduction_scope("collective"):
        graph = step_graph(blocks, tf.TensorSpec(SHAPE), devices[0])
    # Two reductions forward (after attention, after the MLP) and two backward per block,
    # each one CollectiveReduceV2 on every device of the group.
    collective_devices = [
        device_key(op.device) for op in graph.get_operations() if op.type == "CollectiveReduceV2"
    ]
    assert sorted(collective_devices) == sorted([device_key(d) for d in devices] * 4 * num_blocks)
    received, sent = _per_device(graph, devices)
    activations = tensor_bytes(SHAPE, "float32")
    weights = num_blocks * blocks[0].replicated_weight_bytes()
    # The runtime moves each reduction's data: every device's ring share, 2(K-1)/K of
    # the activations, per reduction.
    reductions = 4 * num_blocks * (2 * (num_devices - 1) * activations // num_devices)
    in_collectives = collective_bytes(graph, devices[0])
    assert [in_collectives.get(device_key(d), 0) for d in devices] == [reductions] * num_devices
    # Left on graph edges: the stack's input along the chain 0 -> 1 -> 2 -> 3 forward and
    # its output gradient backward, and the norms' and biases' values from device 0; no
    # device sends a reduction's partial sums to another.
    edges_received = [total - reductions for total in received]
    edges_sent = [total - reductions for total in sent]
    assert edges_received == [0] + [2 * activations + weights] * 3
    assert edges_sent == [2 * activations + 3 * weights, 2 * activations, 2 * activations, 0]
    # Device by device, the collective moves what the placed ring does.
    with tensor_reduction_scope("ring"):
        ring_graph = step_graph(blocks, tf.TensorSpec(SHAPE), devices[0])
    assert _per_device(ring_graph, devices) == (received, sent)


@pytest.mark.parametrize("reduction", ["ring", "collective"])
def test_every_device_ends_each_reduction_with_the_whole_sum_and_step_equals_one_device(
    reduction,
):
    devices = resolve_shard_devices(4)
    split = _blocks(2, devices)
    unsplit = [TransformerBlock(WIDTH, HEADS, MLP_WIDTH, seed=index) for index in range(2)]
    for plain, parallel in zip(unsplit, split, strict=True):
        plain.build(SHAPE)
        plain.set_weights(unsplit_weights(parallel))
    inputs = tf.constant(np.random.default_rng(0).normal(size=SHAPE).astype("float32"))

    @tf.function
    def step(blocks):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            outputs = inputs
            for block in blocks:
                outputs = block(outputs)
            loss = tf.reduce_sum(tf.sin(outputs))
        variables = [v for block in blocks for v in block.trainable_variables]
        return outputs, tape.gradient(loss, [inputs, *variables])

    with tensor_reduction_scope(reduction):
        outputs, gradients = step(split)
    expected_outputs, expected_gradients = step(unsplit)
    np.testing.assert_allclose(outputs.numpy(), expected_outputs.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gradients[0].numpy(), expected_gradients[0].numpy(), atol=1e-5)
    # One SGD step on each side leaves the same weights (in the unsplit layout).
    for blocks, weight_gradients in ((split, gradients[1:]), (unsplit, expected_gradients[1:])):
        variables = [v for block in blocks for v in block.trainable_variables]
        for variable, gradient in zip(variables, weight_gradients, strict=True):
            variable.assign(variable - 0.1 * gradient)
    for plain, parallel in zip(unsplit, split, strict=True):
        for expected, actual in zip(plain.get_weights(), unsplit_weights(parallel), strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)

    # Replicas the first block hands on are bitwise equal on every device.
    @tf.function
    def replicas_after_first_block():
        return replicas_of(split[0](inputs), devices)

    replicas = [replica.numpy() for replica in replicas_after_first_block()]
    for replica in replicas[1:]:
        np.testing.assert_array_equal(replica, replicas[0])


def test_planner_tensor_bytes_equal_the_measured_graph_bytes_of_a_hybrid_layout():
    options = {"num_layers": 2, "d_model": 32, "num_heads": 4}
    costs = measure_model_costs("transformer", "tokens", options, batch_sizes=(2, 4), rounds=1)
    mesh = HybridMesh(data=2, pipe=2, tensor=2)
    global_batch, num_microbatches, boundaries = 8, 2, (2,)
    microbatch = global_batch // mesh.data // num_microbatches
    layout = score_layout(
        blocks_at(costs, microbatch, mesh.tensor, Hardware()),
        mesh,
        "1f1b",
        num_microbatches,
        1,
        boundaries,
        Hardware(),
    )
    info = load_source("tokens").info
    all_devices = resolve_shard_devices(8)
    measured = 0
    edges = (0, *boundaries, len(costs.blocks))
    for stage, (start, end) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        group = all_devices[2 * stage : 2 * stage + 2]
        blocks = registry.build_blocks(
            "transformer",
            info.input_shape,
            info.num_classes,
            tensor_parallel=2,
            tensor_parallel_devices=group,
            **options,
        )
        split = [block for block in blocks[start:end] if isinstance(block, TransformerBlock)]
        shape = (microbatch, *info.input_shape, options["d_model"])
        with tf.device(group[0]):  # the stage's device, where its unsplit weights live
            for block in split:
                block.build(shape)
        graph = step_graph(split, tf.TensorSpec(shape), group[0])
        measured += sum(received_bytes(graph, group[0]).values())
    # Each replica runs each micro-batch through both stages' tensor groups.
    measured *= num_microbatches * mesh.data
    assert tensor_group_bytes(costs, layout, global_batch) == measured
