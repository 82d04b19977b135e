"""Bytes that tensor-parallel layers move between devices: analytic counts and graph measurements.

The measured count reads a traced graph: every tensor an op reads from another device is
one transfer of `num_elements * dtype.size` bytes, counted once per (tensor, destination
device), as TensorFlow's graph partitioner sends it once. Constants are not counted
(each device gets its own) nor are resource handles (reading a variable runs on the
variable's device); a captured tensor starts on its value's device. A collective
all-reduce (`CollectiveReduceV2`) moves its data in the runtime, not along graph edges:
each of its ops counts its device's ring share, 2(K-1)/K of the tensor sent and as much
received, the traffic of the ring (CPUs) and of NCCL's ring (GPUs) alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfmulti.collectives import ring
from tfmulti.platform.runtime.devices import device_key


@dataclasses.dataclass(frozen=True)
class CommunicationBytes:
    """Bytes crossing devices in one forward and one backward pass of a layer."""

    forward: int
    backward: int

    def __add__(self, other: CommunicationBytes) -> CommunicationBytes:
        return CommunicationBytes(self.forward + other.forward, self.backward + other.backward)


def tensor_bytes(shape: Sequence[int], dtype) -> int:
    """Returns the bytes of a tensor of fully known `shape` and `dtype`."""
    return int(np.prod(shape, dtype=np.int64)) * tf.as_dtype(dtype).size


def cross_device_bytes(graph: tf.Graph, unplaced_device: str) -> int:
    """Returns the bytes of the tensors that ops in `graph` read from another device,
    collective all-reduces' ring traffic included.

    Args:
        graph: a traced graph, e.g. `concrete_function.graph`; crossing tensors need
            static shapes.
        unplaced_device: where TensorFlow puts ops with no device of their own (the
            default device, or the device scope the graph was traced under).
    """
    return sum(received_bytes(graph, unplaced_device).values())


def received_bytes(graph: tf.Graph, unplaced_device: str) -> dict[tuple[str, int], int]:
    """Returns the bytes each device receives from other devices in `graph`, by `device_key`,
    collective all-reduces' ring traffic included.

    Args are those of `cross_device_bytes`; devices that receive nothing are left out.

    Example:
        >>> received_bytes(step.get_concrete_function(spec).graph, "/CPU:0")
        {('CPU', 0): 1536, ('CPU', 1): 768}
    """
    received = collective_bytes(graph, unplaced_device)
    for _, destination, num_bytes in transfers(graph, unplaced_device):
        received[destination] = received.get(destination, 0) + num_bytes
    return received


def sent_bytes(
    graph: tf.Graph, unplaced_device: str, skip_scalars: bool = False
) -> dict[tuple[str, int], int]:
    """Returns the bytes each device sends to other devices in `graph`, by `device_key`,
    collective all-reduces' ring traffic included.

    Args are those of `cross_device_bytes`, and `skip_scalars`: leave out scalars (a
    step's losses, counters and learning rate); devices that send nothing are left out.
    """
    sent = collective_bytes(graph, unplaced_device)
    for source, _, num_bytes in transfers(graph, unplaced_device, skip_scalars):
        sent[source] = sent.get(source, 0) + num_bytes
    return sent


def collective_bytes(graph: tf.Graph, unplaced_device: str) -> dict[tuple[str, int], int]:
    """Returns the bytes each device sends (and as many it receives) in the collective
    all-reduces of `graph`, by `device_key`; devices with none are left out.

    Each `CollectiveReduceV2` op is one device's part of a K-device all-reduce of a
    tensor of S bytes; the ring moves 2(K-1)/K x S out of and into that device (rounded
    down where S does not divide by K). Its data moves in the runtime, so `transfers`,
    which follows graph edges, does not see it. Args are those of `cross_device_bytes`.
    """
    moved = {}
    for op in graph.get_operations():
        if op.type != "CollectiveReduceV2":
            continue
        tensor, group_size = op.inputs[0], tf.get_static_value(op.inputs[1])
        if group_size is None or not tensor.shape.is_fully_defined():
            raise ValueError(
                "Counting a collective's bytes needs its group size and tensor shape when "
                f"traced. Received: {op.name} of shape {tensor.shape}, group size {group_size}"
            )
        share = 2 * (int(group_size) - 1) * tensor_bytes(tensor.shape, tensor.dtype)
        device = device_key(op.device or unplaced_device)
        moved[device] = moved.get(device, 0) + share // int(group_size)
    return moved


def transfers(
    graph: tf.Graph, unplaced_device: str, skip_scalars: bool = False
) -> list[tuple[tuple, tuple, int]]:
    """Returns (source, destination, bytes) of each tensor an op in `graph` reads from
    another device, once per tensor and destination; devices by `device_key`. Collectives'
    own traffic is not a graph edge: `collective_bytes` counts it.

    Args are those of `sent_bytes`.
    """
    captured_devices = {
        id(internal): external.device
        for external, internal in getattr(graph, "captures", ())
        if getattr(external, "device", "")
    }

    def device_of(op) -> tuple[str, int]:
        if op.type == "Placeholder" and id(op.outputs[0]) in captured_devices:
            # A captured tensor is fed from where its value is, whatever device the
            # placeholder was traced with.
            return device_key(captured_devices[id(op.outputs[0])])
        if op.device:
            return device_key(op.device)
        for tensor in op.inputs:
            # An unplaced variable read runs where the variable is.
            if tensor.dtype == tf.resource and id(tensor) in captured_devices:
                return device_key(captured_devices[id(tensor)])
        return device_key(unplaced_device)

    seen = set()
    found = []
    for op in graph.get_operations():
        destination = device_of(op)
        for tensor in op.inputs:
            producer = tensor.op
            if tensor.dtype in (tf.resource, tf.variant) or producer.type == "Const":
                continue
            source = device_of(producer)
            if source == destination or (tensor.name, destination) in seen:
                continue
            if skip_scalars and tensor.shape.rank == 0:
                continue
            if not tensor.shape.is_fully_defined():
                raise ValueError(
                    "Counting bytes needs static shapes; trace with a fully known input "
                    f"shape. Received: tensor {tensor.name} of shape {tensor.shape}"
                )
            seen.add((tensor.name, destination))
            found.append((source, destination, tensor_bytes(tensor.shape, tensor.dtype)))
    return found


def all_reduce_bytes(shape: Sequence[int], dtype, num_devices: int) -> int:
    """Bytes a ring all-reduce of K tensors of `shape` moves to leave the sum on every device.

    The reduce-scatter moves each of the K chunks K-1 steps and the all-gather copies
    each to the K-1 other devices: 2(K-1) x S, each device sending and receiving
    2(K-1)/K x S when the last axis divides by K. A last axis shorter than K is summed
    on every device from all K tensors: K(K-1) x S
    (`tfmulti.collectives.replicated.sum_on_every_device`).
    """
    whole = tensor_bytes(shape, dtype)
    if ring.can_chunk(tf.TensorShape(shape), num_devices):
        return 2 * (num_devices - 1) * whole
    return num_devices * (num_devices - 1) * whole


def reduction_bytes(shape: Sequence[int], dtype, num_devices: int) -> CommunicationBytes:
    """Bytes `collectives.reduce_partial_sums` moves to sum K tensors of `shape` on the home device.

    Forward, the ring reduce-scatter moves each of the K chunks K-1 steps, (K-1) x S, and
    the gather home the K-1 chunks not on it; backward mirrors it (scatter from home,
    all-gather). A last axis shorter than K is summed on the home device: (K-1) x S each way.
    """
    whole = tensor_bytes(shape, dtype)
    moved = (num_devices - 1) * whole
    if num_devices > 1 and ring.can_chunk(tf.TensorShape(shape), num_devices):
        home_chunk = ring.chunk_sizes(shape[-1], num_devices)[0]
        moved += whole - tensor_bytes((*shape[:-1], home_chunk), dtype)
    return CommunicationBytes(moved, moved)


def fan_out_bytes(shape: Sequence[int], dtype, num_devices: int) -> CommunicationBytes:
    """Bytes `collectives.fan_out` moves: the tensor to K-1 devices; backward, the K
    gradients reduced home (`reduction_bytes`). Integer tensors have no backward."""
    forward = (num_devices - 1) * tensor_bytes(shape, dtype)
    if not tf.as_dtype(dtype).is_floating:
        return CommunicationBytes(forward, 0)
    return CommunicationBytes(forward, reduction_bytes(shape, dtype, num_devices).forward)


def measure_communication(layer, input_spec) -> CommunicationBytes:
    """Traces `layer` forward, and forward with backward, and counts the bytes crossing devices.

    The input and the gradients of outputs on the home device (`layer.devices[0]`) start
    there, as they do in a model whose other layers run on the home device; a gradient of
    an output left on a shard's device starts on that device, as its consumer's would.
    The backward count is that of forward-and-backward minus that of forward.

    Args:
        layer: a built tensor-parallel layer (has `devices`).
        input_spec: a `tf.TensorSpec` of the input with a fully known shape.

    Example:
        >>> measure_communication(mlp, tf.TensorSpec((8, 16, 64)))
        CommunicationBytes(forward=32768, backward=32768)
    """
    home = layer.devices[0]

    @tf.function
    def forward(inputs):
        with tf.device(home):
            layer(inputs)

    @tf.function
    def forward_and_backward(inputs):
        with tf.device(home):
            sources = list(layer.trainable_variables)
            with tf.GradientTape() as tape:
                if inputs.dtype.is_floating:
                    tape.watch(inputs)
                    sources.insert(0, inputs)
                outputs = tf.nest.flatten(layer(inputs))
            # Each output's gradient is made where the output is, and is no constant
            # (constants are not counted), as a consumer's gradient would be.
            upstream = []
            for output in outputs:
                with tf.device(output.op.device or home):
                    upstream.append(tf.identity(output))
            tape.gradient(outputs, sources, output_gradients=upstream)

    forward_bytes = cross_device_bytes(forward.get_concrete_function(input_spec).graph, home)
    total_bytes = cross_device_bytes(
        forward_and_backward.get_concrete_function(input_spec).graph, home
    )
    return CommunicationBytes(forward_bytes, total_bytes - forward_bytes)


def step_graph(layers: Sequence, input_spec: tf.TensorSpec, home: str) -> tf.Graph:
    """Traces `layers` applied in turn, forward and backward, and returns the graph.

    The input and the gradient of the last output are on `home`, as they are for a
    stack of layers between layers on one device; each weight's gradient is left where
    it is made (an optimizer on the weight's device reads it there).

    Example:
        >>> graph = step_graph(blocks, tf.TensorSpec((8, 32, 64)), "/CPU:0")
        >>> sent_bytes(graph, "/CPU:0")
    """

    @tf.function
    def step(inputs):
        with tf.device(home):
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                outputs = inputs
                for layer in layers:
                    outputs = layer(outputs)
            upstream = tf.identity(outputs)
            sources = [inputs] + [v for layer in layers for v in layer.trainable_variables]
            tape.gradient(outputs, sources, output_gradients=upstream)

    return step.get_concrete_function(input_spec).graph
