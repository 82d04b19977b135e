"""Promises of the tensor-parallel all-reduce: no device of a group is a hot spot, the bytes
are those of a ring, and the sum and its gradients are those of adding on one device."""

import numpy as np
import pytest
import tensorflow as tf

from tfmulti.collectives.placed_steps import reduce_partial_sums
from tfmulti.parallel import RowParallelDense, resolve_shard_devices
from tfmulti.tensor_parallel.shard_devices import device_key
from tfmulti.tensor_parallel.transfer_bytes import received_bytes, reduction_bytes, tensor_bytes

BATCH, LENGTH, IN_FEATURES, UNITS = 2, 6, 16, 8
ROWS = 256


def _placed(values, devices):
    """Each value as an eager tensor on its device (a traced function captures it there)."""
    placed = []
    for device, value in zip(devices, values, strict=True):
        with tf.device(device):
            placed.append(tf.identity(tf.constant(value)))
    return placed


def _sum_and_gradients(partials, devices, upstream):
    """`reduce_partial_sums` and the gradients of sum(total * upstream) w.r.t. the partials."""
    with tf.GradientTape() as tape:
        tape.watch(partials)
        total = reduce_partial_sums(partials, devices)
        loss = tf.reduce_sum(total * upstream)
    return total, tape.gradient(loss, partials)


@pytest.mark.parametrize("num_shards", [2, 4])
def test_no_device_receives_more_than_a_ring_all_reduce_share_in_a_row_parallel_forward(
    num_shards,
):
    devices = resolve_shard_devices(num_shards)
    layer = RowParallelDense(UNITS, devices, input_is_parallel=True)
    slice_shape = (BATCH, LENGTH, IN_FEATURES // num_shards)
    layer.build([slice_shape] * num_shards)
    rng = np.random.default_rng(0)
    slices = _placed([rng.normal(size=slice_shape).astype("float32") for _ in devices], devices)

    @tf.function
    def forward():
        return layer(slices)

    received = received_bytes(forward.get_concrete_function().graph, devices[0])
    output_bytes = tensor_bytes((BATCH, LENGTH, UNITS), "float32")
    share = 2 * (num_shards - 1) * output_bytes // num_shards
    # Reduce-to-one had the home device receive K-1 whole outputs: 3x the tensor at K=4.
    assert max(received.values()) <= share
    assert received == {
        device_key(device): share if index == 0 else share // 2
        for index, device in enumerate(devices)
    }
    analytic = layer.communication_bytes((BATCH, LENGTH, IN_FEATURES))
    assert sum(received.values()) == analytic.forward


@pytest.mark.parametrize("width", [10, 3])  # uneven chunks; fewer items than devices
def test_reduced_sum_and_its_gradients_equal_adding_on_one_device(width):
    devices = resolve_shard_devices(4)
    rng = np.random.default_rng(1)
    # Enough rows that a traced function captures the values rather than inlining them.
    values = [rng.normal(size=(ROWS, width)).astype("float32") for _ in devices]
    upstream = rng.normal(size=(ROWS, width)).astype("float32")
    partials = _placed(values, devices)

    total, gradients = tf.function(_sum_and_gradients)(partials, devices, upstream)
    np.testing.assert_allclose(total.numpy(), np.sum(values, axis=0), rtol=1e-6, atol=1e-6)
    assert device_key(total.device) == device_key(devices[0])
    for gradient in gradients:
        np.testing.assert_array_equal(gradient.numpy(), upstream)

    @tf.function
    def step_without_outputs():
        _, gradients = _sum_and_gradients(partials, devices, upstream)
        for device, gradient in zip(devices, gradients, strict=True):
            with tf.device(device):  # each gradient's consumer, as a shard's backward
                tf.identity(gradient)

    graph = step_without_outputs.get_concrete_function().graph
    measured = sum(received_bytes(graph, devices[0]).values())
    analytic = reduction_bytes((ROWS, width), "float32", len(devices))
    assert measured == analytic.forward + analytic.backward


def test_each_partials_gradient_is_made_on_its_own_device():
    devices = resolve_shard_devices(4)
    partials = _placed([np.ones((ROWS, 8), "float32")] * 4, devices)
    gradient_devices = []

    @tf.function
    def step():
        _, gradients = _sum_and_gradients(partials, devices, 1.0)
        gradient_devices.extend(device_key(gradient.op.device) for gradient in gradients)

    step.get_concrete_function()
    assert gradient_devices == [device_key(device) for device in devices]
