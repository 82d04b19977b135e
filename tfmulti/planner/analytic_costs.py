"""Block costs from first principles: a model's shape on a cluster's hardware file.

Pure Python. What `tfmulti.planner.costs.blocks_at` measures on this machine, computed
instead for a `ModelShape` (`model_shapes`) on `ClusterHardware` (`hardware_files`), so
the same `score_layout` simulates both:

- a matmul takes its FLOPs at `LARGE_MATMUL_EFFICIENCY` of the device's peak, or, when it
  moves more bytes than that time allows (attention's products over a head's 64-160
  columns), its bytes at the memory bandwidth: the roofline, on each matmul's own shape;
- element-wise kernels take their bytes at the memory bandwidth;
- the backward takes twice the forward (a gradient for the input and one for the weights,
  each as large as the forward's product; element-wise, read the gradient and the saved
  input, write one);
- a tensor group of t devices (inside a node) all-reduces each layer's input-sized output
  `tensor_allreduces` times a forward and `backward_tensor_allreduces` a backward, as a
  ring: 2(t-1) messages of the link's latency, 2(t-1)/t x bytes at its bandwidth;
- full activation recomputation runs each covered layer's forward, all-reduces included,
  again in its backward: it keeps only the layer's input, and needs the layer's whole
  activations only while it runs (`Block.transient_bytes`);
- a stage sends its last layer's output, 1/t of it from each device of a tensor group
  (Megatron-LM's scatter/gather across nodes), and the send holds both devices
  (`Hardware.blocking_transfers`);
- a pipelined GPT's last stage holds a copy of the word embedding, whose gradient it sums
  with the first stage's each step (`embedding_allreduce_seconds`);
- parameter state is 16 bytes a parameter (mixed-precision Adam: 16-bit weight and
  gradient, 32-bit master weight, momentum and variance), gradients summed in 16 bits;
- the optimizer step reads and writes each parameter's state once (`optimizer_seconds`).

`LARGE_MATMUL_EFFICIENCY` is the one constant fitted to published data: see its comment.
"""

from __future__ import annotations

import dataclasses

from tfmulti.pipeline.balance import Block
from tfmulti.planner.costs import Hardware
from tfmulti.planner.hardware_files import ClusterHardware
from tfmulti.planner.model_shapes import ELEMENT_BYTES, LayerSpec, Matmul, ModelShape
from tfmulti.platform.mesh import HybridMesh

# The fraction of peak FLOP/s a large 16-bit matmul reaches inside a training step.
# Fitted: the one constant fitted to published data, on row 145.6B of Megatron-LM's
# Table 1 (Narayanan et al., SC'21; 8-way tensor, 8-way pipeline, 1,536 A100 GPUs,
# 148 TFLOP/s per GPU), the middle of the table's sizes: the value at which that row's
# prediction is 148 (`tests/test_planner_cluster.py` holds it there, so a change to the
# model refits it). Every other figure is the hardware file's or a count of FLOPs and bytes.
LARGE_MATMUL_EFFICIENCY = 0.626
# Mixed-precision Adam: 16-bit weight and gradient, 32-bit master weight, momentum and
# variance (Rajbhandari et al., "ZeRO", SC'20, section 3.1).
MIXED_PRECISION_ADAM_BYTES = 16.0
# Bytes a mixed-precision Adam step reads and writes per parameter: the 16-bit gradient
# read, master weight, momentum and variance read and written, the 16-bit weight written.
OPTIMIZER_STEP_BYTES = 2 + 2 * 12 + 2
BACKWARD_OVER_FORWARD = 2.0


def cluster_hardware(hardware: ClusterHardware) -> Hardware:
    """The `Hardware` `score_layout` scores a cluster's layouts on."""
    return Hardware(
        bandwidth=hardware.intra_node_bandwidth,
        bytes_per_param=MIXED_PRECISION_ADAM_BYTES,
        memory_per_device=hardware.memory_bytes,
        inter_host_bandwidth=hardware.inter_node_bandwidth,
        inter_host_latency=hardware.inter_node_latency,
        devices_per_node=hardware.devices_per_node,
        intra_node_latency=hardware.intra_node_latency,
        gradient_bytes_per_param=ELEMENT_BYTES,
        blocking_transfers=True,
    )


def matmul_seconds(
    matmul: Matmul, microbatch_size: int, tensor: int, hardware: ClusterHardware
) -> float:
    """The roofline time of one forward `matmul` of a micro-batch on one device of a
    tensor group: FLOPs at the large-matmul fraction of peak, or bytes at the memory
    bandwidth, whichever is longer.

    Example:
        >>> from tfmulti.planner.hardware_files import load_hardware
        >>> a100 = load_hardware("a100_80gb")
        >>> f"{matmul_seconds(Matmul(2048, 4096, 4096), 1, 1, a100) * 1e6:.0f} us"
        '355 us'
    """
    rows = microbatch_size * matmul.batch * matmul.m
    left, right, out = rows * matmul.k, matmul.k * matmul.n, rows * matmul.n
    if not matmul.weight:
        right *= microbatch_size * matmul.batch
    split_left = matmul.split in ("k", "batch")
    split_right = matmul.split != "none"
    split_out = matmul.split in ("n", "batch")
    moved = ELEMENT_BYTES * (
        left / (tensor if split_left else 1)
        + right / (tensor if split_right else 1)
        + out / (tensor if split_out else 1)
    )
    flops = microbatch_size * matmul.flops / (tensor if split_right else 1)
    efficiency = hardware.matmul_efficiency or LARGE_MATMUL_EFFICIENCY
    return max(flops / (efficiency * hardware.peak_flops), moved / hardware.memory_bandwidth)


def tensor_allreduce_seconds(num_bytes: float, tensor: int, hardware: ClusterHardware) -> float:
    """A ring all-reduce of `num_bytes` over a tensor group inside one node."""
    if tensor <= 1:
        return 0.0
    steps = 2 * (tensor - 1)
    return steps * hardware.intra_node_latency + (
        steps / tensor * num_bytes / hardware.intra_node_bandwidth
    )


def layer_block(
    layer: LayerSpec,
    next_input_bytes: float,
    microbatch_size: int,
    tensor: int,
    hardware: ClusterHardware,
    recompute: bool,
) -> Block:
    """What `layer` costs one device of a tensor group of `tensor` for one micro-batch."""
    b = microbatch_size
    compute = sum(matmul_seconds(matmul, b, tensor, hardware) for matmul in layer.matmuls)
    compute += (
        b
        * (layer.elementwise_bytes + layer.elementwise_split_bytes / tensor)
        / hardware.memory_bandwidth
    )
    allreduce = tensor_allreduce_seconds(b * layer.input_bytes, tensor, hardware)
    forward_communication = layer.tensor_allreduces * allreduce
    backward_communication = layer.backward_tensor_allreduces * allreduce
    forward = compute + forward_communication
    backward = BACKWARD_OVER_FORWARD * compute + backward_communication
    whole_activations = b * (layer.activation_bytes + layer.activation_split_bytes / tensor)
    recomputes = recompute and layer.recomputed
    if recomputes:
        backward += forward
        backward_communication += forward_communication
    params = layer.replicated_params + layer.params / tensor
    return Block(
        forward_time=forward,
        backward_time=backward,
        params=round(params),
        flops=b * layer.forward_flops / tensor,
        activation_bytes=b * layer.input_bytes if recomputes else whole_activations,
        param_bytes=params * MIXED_PRECISION_ADAM_BYTES,
        name=layer.name,
        communication_time=forward_communication + backward_communication,
        output_bytes=b * next_input_bytes / tensor,
        transient_bytes=whole_activations if recomputes else 0.0,
    )


def shape_blocks(
    shape: ModelShape,
    microbatch_size: int,
    tensor: int,
    hardware: ClusterHardware,
    recompute: bool = True,
    pipelined: bool = False,
) -> tuple[Block, ...]:
    """One `Block` per layer of `shape`, for `score_layout`.

    `pipelined`: the layers are split over pipeline stages, so a GPT's last stage holds
    its own copy of the word embedding its output layer reuses (Megatron-LM keeps one on
    the first and the last stage and sums their gradients, `embedding_allreduce_seconds`).
    """
    next_inputs = [layer.input_bytes for layer in shape.layers[1:]] + [0.0]
    blocks = [
        layer_block(layer, next_input, microbatch_size, tensor, hardware, recompute)
        for layer, next_input in zip(shape.layers, next_inputs, strict=True)
    ]
    if pipelined and shape.gpt:
        copy = shape.gpt["vocab"] * shape.gpt["hidden"] / tensor
        output = blocks[-1]
        blocks[-1] = dataclasses.replace(
            output,
            params=round(output.params + copy),
            param_bytes=output.param_bytes + copy * MIXED_PRECISION_ADAM_BYTES,
        )
    return tuple(blocks)


def embedding_allreduce_seconds(shape: ModelShape, mesh: HybridMesh, hardware: ClusterHardware):
    """The sum of a pipelined GPT's word-embedding gradient between its first and last
    stage, after the data-parallel all-reduce (Megatron-LM's `train_step`: "All-reduce
    word_embeddings' grad across first and last stages"): a ring of two devices, V·h/t
    16-bit gradients, over the link between the two stages' nodes.

    Example:
        >>> from tfmulti.planner.hardware_files import load_hardware
        >>> from tfmulti.planner.model_shapes import gpt_shape
        >>> shape = gpt_shape(8, 8192, 64, 2048, 51200)
        >>> mesh = HybridMesh(data=32, pipe=2, tensor=8)
        >>> f"{embedding_allreduce_seconds(shape, mesh, load_hardware('a100_80gb')) * 1e3:.1f} ms"
        '4.2 ms'
    """
    if not shape.gpt or mesh.pipe == 1:
        return 0.0
    num_bytes = ELEMENT_BYTES * shape.gpt["vocab"] * shape.gpt["hidden"] / mesh.tensor
    if mesh.num_devices > hardware.devices_per_node:
        return 2 * hardware.inter_node_latency + num_bytes / hardware.inter_node_bandwidth
    return 2 * hardware.intra_node_latency + num_bytes / hardware.intra_node_bandwidth


def optimizer_seconds(device_params: float, hardware: ClusterHardware) -> float:
    """The optimizer step of a device's parameters: their state read and written once."""
    return device_params * OPTIMIZER_STEP_BYTES / hardware.memory_bandwidth
