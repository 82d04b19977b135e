"""A model's measured block costs, how they scale with batch and tensor splits, and their file.

Pure Python. Times are affine in the micro-batch size (a fixed part, kernel launches and
per-op overhead, plus a part per example), fitted from measurements at two batch sizes.
Activation bytes are per example.

Tensor parallelism is modelled analytically (Megatron-style): a block split over K devices
runs its per-example compute in 1/K of the time but keeps its fixed part, holds 1/K of
its parameters, and in each of forward and backward all-reduces its output activations
`tensor_allreduces` times within the tensor group (a ring: 2(K-1)/K x bytes / bandwidth).

The cost file is JSON:

    {"format": "tfmulti.planner.costs/1", "model": "transformer",
     "model_options": {"num_layers": 2}, "dataset": "tokens", "tensor_parallel_sizes": [1, 2],
     "measured_batch_sizes": [8, 64],
     "blocks": [{"name": "embedding", "params": 6144,
                 "forward_seconds": {"fixed": 2e-4, "per_example": 1e-6},
                 "backward_seconds": {"fixed": 4e-4, "per_example": 2e-6},
                 "activation_bytes_per_example": 8192, "tensor_allreduces": 0,
                 "tensor_replicated_bytes": 0, "input_grad_share": 0.0,
                 "weight_grad_share": 1.0}, ...]}

The two shares (optional) are what a split backward's I and W take of B.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from tfmulti.pipeline.balance import Block
from tfmulti.planner.machine import MachineCosts

COST_FILE_FORMAT = "tfmulti.planner.costs/1"
GRADIENT_BYTES_PER_PARAM = 4.0


@dataclasses.dataclass(frozen=True)
class AffineTime:
    """Seconds for a batch of b examples: fixed + per_example x b."""

    fixed: float
    per_example: float

    def __post_init__(self):
        if self.fixed < 0 or self.per_example < 0:
            raise ValueError(f"Times must be >= 0. Received: {self}")

    @classmethod
    def fit(cls, batch_sizes: Sequence[int], seconds: Sequence[float]) -> AffineTime:
        """The line through the first and last of (batch size, seconds), clipped at zero.

        Example:
            >>> AffineTime.fit([8, 64], [0.002, 0.009])
            AffineTime(fixed=0.001, per_example=0.000125)
        """
        if len(batch_sizes) != len(seconds) or not batch_sizes:
            raise ValueError(
                "Need one time per batch size. "
                f"Received: batch_sizes={list(batch_sizes)}, seconds={list(seconds)}"
            )
        if len(batch_sizes) == 1 or batch_sizes[-1] == batch_sizes[0]:
            return cls(0.0, seconds[-1] / batch_sizes[-1])
        slope = (seconds[-1] - seconds[0]) / (batch_sizes[-1] - batch_sizes[0])
        slope = max(slope, 0.0)
        return cls(round(max(seconds[0] - slope * batch_sizes[0], 0.0), 12), round(slope, 12))

    def at(self, batch_size: float, tensor_parallel: int = 1) -> float:
        """Seconds for `batch_size` examples, the per-example part split `tensor_parallel` ways."""
        return self.fixed + self.per_example * batch_size / tensor_parallel


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What one model block costs, as a function of batch size.

    Args:
        name: the block's name.
        params: parameter count.
        forward_seconds: forward time.
        backward_seconds: backward time (input and weight gradients).
        activation_bytes_per_example: bytes kept from forward to backward, per example.
        tensor_allreduces: all-reduces of the block's output per pass when split over a
            tensor group (2 for a Transformer block: after attention and after the MLP);
            0 if the block cannot be split.
        tensor_replicated_bytes: bytes of the weights every device of a tensor group
            reads (a Transformer block's norms and the biases after its reductions), sent
            from the group's first device each pass.
        variables: trainable variables (what a data-parallel replica updates one by one).
        input_grad_share: the input-gradient part (I) of a split backward as a share of
            the whole backward, as measured (`split_backward.split_backward_shares`);
            None when not measured (the simulator then splits B in halves).
        weight_grad_share: the weight-gradient part (W), likewise; I + W may exceed 1.
    """

    name: str
    params: int
    forward_seconds: AffineTime
    backward_seconds: AffineTime
    activation_bytes_per_example: float
    tensor_allreduces: int = 0
    tensor_replicated_bytes: float = 0.0
    variables: int = 0
    input_grad_share: float | None = None
    weight_grad_share: float | None = None


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """`scripts/train.py --strategy=mirrored`'s step of the model: the data-parallel run
    the model's overlap curve is anchored on (`tfmulti.planner.overlap_anchor`).

    Args:
        devices: replicas (logical devices) it ran on.
        batch: global batch it ran at.
        seconds: its step, counted as the validation counts a layout's.
    """

    devices: int
    batch: int
    seconds: float

    def __post_init__(self):
        if self.devices < 2 or self.batch < self.devices or self.seconds <= 0:
            raise ValueError(
                "A data-parallel step runs on 2 or more devices, at least one example "
                f"each, in a positive time. Received: {self}"
            )


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """Costs of every block of a model, and what they were measured on.

    Args:
        model: the reference model's name (`scripts/train.py --model`).
        model_options: its options (`--model_option`).
        dataset: the dataset measured on (`--dataset`).
        data_path: its file(s), for "npz" and "tfrecord" (`--data_path`).
        blocks: one `BlockCost` per block, in order.
        tensor_parallel_sizes: tensor-group sizes the model can be built with (1: none).
        measured_batch_sizes: batch sizes the times were fitted from.
        timing_spread: the block timings' relative spread between rounds (interquartile
            range over median), the uncertainty they carry.
        serial_fraction: the share of the devices' summed work on this model that runs
            one after the other, measured with the model itself
            (`machine_benchmarks.model_serial_fraction`); it replaces the machine's
            figure, or None to keep that.
        serial_fractions: the same with k = 1..n devices at work at once
            (`machine_benchmarks.model_serial_fractions`), replacing the machine's; empty
            to keep those.
        anchor_steps: `scripts/train.py`'s one-device step at each measured batch size,
            the steps the model was anchored on (`measure.anchored_to_steps`); empty when
            the blocks were scaled to a step timed in the measuring process, or not at all.
        run_overhead: seconds a `scripts/train.py` step adds once, beyond the framework's
            step cost and the blocks (its input pipeline and loop), paid by every layout.
        data_parallel_step: train.py's data-parallel step, which the overlap curve of
            the layouts without a pipe axis is anchored on; None: not timed.
    """

    model: str
    model_options: dict
    dataset: str
    data_path: str | None
    blocks: tuple[BlockCost, ...]
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    measured_batch_sizes: tuple[int, ...] = ()
    timing_spread: float = 0.0
    serial_fraction: float | None = None
    serial_fractions: tuple[float, ...] = ()
    anchor_steps: tuple[float, ...] = ()
    run_overhead: float = 0.0
    data_parallel_step: DataParallelStep | None = None

    def to_json(self) -> dict:
        """The cost file's JSON object."""
        return {"format": COST_FILE_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> ModelCosts:
        """Reads the cost file's JSON object; errors name the missing or bad field."""
        if data.get("format") != COST_FILE_FORMAT:
            raise ValueError(
                f"A cost file starts with format {COST_FILE_FORMAT!r}. "
                f"Received: format={data.get('format')!r}"
            )
        try:
            blocks = tuple(
                BlockCost(
                    name=block["name"],
                    params=int(block["params"]),
                    forward_seconds=AffineTime(**block["forward_seconds"]),
                    backward_seconds=AffineTime(**block["backward_seconds"]),
                    activation_bytes_per_example=float(block["activation_bytes_per_example"]),
                    tensor_allreduces=int(block.get("tensor_allreduces", 0)),
                    tensor_replicated_bytes=float(block.get("tensor_replicated_bytes", 0.0)),
                    variables=int(block.get("variables", 0)),
                    input_grad_share=_optional_float(block.get("input_grad_share")),
                    weight_grad_share=_optional_float(block.get("weight_grad_share")),
                )
                for block in data["blocks"]
            )
            return cls(
                model=data["model"],
                model_options=dict(data.get("model_options", {})),
                dataset=data["dataset"],
                data_path=data.get("data_path"),
                blocks=blocks,
                tensor_parallel_sizes=tuple(data.get("tensor_parallel_sizes", (1,))),
                measured_batch_sizes=tuple(data.get("measured_batch_sizes", ())),
                timing_spread=float(data.get("timing_spread", 0.0)),
                serial_fraction=data.get("serial_fraction"),
                serial_fractions=tuple(data.get("serial_fractions", ())),
                anchor_steps=tuple(map(float, data.get("anchor_steps", ()))),
                run_overhead=float(data.get("run_overhead", 0.0)),
                data_parallel_step=(
                    DataParallelStep(**data["data_parallel_step"])
                    if data.get("data_parallel_step")
                    else None
                ),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"Cost file field missing or malformed: {error}. See tfmulti.planner.costs "
                "for the format."
            ) from None


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def save_costs(costs: ModelCosts, path: str) -> None:
    """Writes `costs` as a JSON cost file."""
    with open(path, "w") as file:
        json.dump(costs.to_json(), file, indent=1)


def load_costs(path: str) -> ModelCosts:
    """Reads a JSON cost file written by `save_costs` (or by hand)."""
    with open(path) as file:
        return ModelCosts.from_json(json.load(file))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Assumptions about the devices.

    Args:
        bandwidth: bytes per second between any two devices of one host (all-reduce,
            stage transfers).
        bytes_per_param: parameter-state bytes per parameter on its device: weight,
            gradient and optimizer slots (16 for float32 Adam: weight, gradient, m, v).
        memory_per_device: bytes a device may hold, or None for no limit.
        shared_compute: the devices share one processor (logical devices of one CPU or
            GPU), so their work does not overlap: a step takes at least the busy time of
            all devices together.
        machine: the framework's measured per-step costs and the devices' measured
            overlap and all-reduce (`MachineCosts`); when given, its all-reduce replaces
            `bandwidth` and its serial fraction replaces `shared_compute`.
        inter_host_bandwidth: bytes per second of the link between two hosts (default
            10 Gbit/s Ethernet); transfers and all-reduces that cross hosts use it.
        inter_host_latency: seconds each message between hosts waits beyond its bytes
            (default 100 us: TensorFlow's gRPC runtime over a LAN).
        devices_per_node: on a cluster described by a hardware file
            (`tfmulti.planner.hardware_files`), the devices of one node, laid out in
            Megatron-LM's rank order: tensor fastest, then data, then pipe. A pipeline send
            or a data-parallel all-reduce whose group spans nodes pays the inter-host link
            (`inter_host_bandwidth` per device, `inter_host_latency` per message), one
            inside a node `bandwidth` and `intra_node_latency`. None: the hosts of
            `score_layout`'s `hosts` and `cross_host_axis` instead.
        intra_node_latency: with `devices_per_node`, seconds each message inside a node
            waits beyond its bytes.
        gradient_bytes_per_param: bytes of a parameter's gradient as data parallelism sums
            it, and of its working weight (4: float32; 2: mixed precision).
        blocking_transfers: a pipeline send holds both its devices for its time, besides
            delaying its consumer: Megatron-LM's sends wait for their receives and then
            synchronize the device (`p2p_communication._communicate`), so each forward and
            backward of a pipeline stage pays one exchange with its neighbours; with a
            tensor group, each device sends 1/t of the tensor and the receivers all-gather
            it (the scatter/gather of Narayanan et al., section 4.1). False: a send
            overlaps the devices' work and only delays its consumer (tfmulti's executor).
    """

    bandwidth: float = 10e9
    bytes_per_param: float = 16.0
    memory_per_device: float | None = None
    shared_compute: bool = False
    machine: MachineCosts | None = None
    inter_host_bandwidth: float = 1.25e9
    inter_host_latency: float = 1e-4
    devices_per_node: int | None = None
    intra_node_latency: float = 0.0
    gradient_bytes_per_param: float = GRADIENT_BYTES_PER_PARAM
    blocking_transfers: bool = False

    def __post_init__(self):
        if self.bandwidth <= 0 or self.inter_host_bandwidth <= 0:
            raise ValueError(
                "Bandwidths must be > 0 bytes/s. Received: "
                f"bandwidth={self.bandwidth}, inter_host_bandwidth={self.inter_host_bandwidth}"
            )
        if self.inter_host_latency < 0:
            raise ValueError(
                f"inter_host_latency must be >= 0 s. Received: {self.inter_host_latency}"
            )


def ring_allreduce_seconds(num_bytes: float, group_size: int, bandwidth: float) -> float:
    """Time of a ring all-reduce of `num_bytes` over `group_size` devices: 2(n-1)/n x bytes / bw."""
    if group_size <= 1:
        return 0.0
    return 2 * (group_size - 1) / group_size * num_bytes / bandwidth


def allreduce_seconds(
    num_bytes: float, group_size: int, hardware: Hardware, in_graph: bool = False
) -> float:
    """An all-reduce on `hardware`: measured latency and bandwidth if known (with
    `in_graph`, a tensor group's inside a step), else the ring."""
    if hardware.machine is not None and in_graph:
        return hardware.machine.tensor_allreduce_seconds(num_bytes, group_size)
    if hardware.machine is not None:
        return hardware.machine.allreduce_seconds(num_bytes, group_size)
    return ring_allreduce_seconds(num_bytes, group_size, hardware.bandwidth)


def blocks_at(
    costs: ModelCosts, microbatch_size: float, tensor_parallel: int, hardware: Hardware
) -> list[Block]:
    """Each block's costs for one micro-batch on one device of a tensor group, as `Block`s.

    Blocks that cannot be split run whole on every device of the group.
    """
    blocks = []
    for block in costs.blocks:
        activation_bytes = block.activation_bytes_per_example * microbatch_size
        split = tensor_parallel if block.tensor_allreduces else 1
        communication = block.tensor_allreduces * allreduce_seconds(
            activation_bytes, split, hardware, in_graph=True
        )
        backward_compute = block.backward_seconds.at(microbatch_size, split)
        split_backward = {}
        if block.input_grad_share is not None and block.weight_grad_share is not None:
            # The output gradient's all-reduce belongs to I, which hands gradients on.
            split_backward = {
                "input_grad_time": block.input_grad_share * backward_compute + communication,
                "weight_grad_time": block.weight_grad_share * backward_compute,
            }
        blocks.append(
            Block(
                forward_time=block.forward_seconds.at(microbatch_size, split) + communication,
                backward_time=backward_compute + communication,
                params=block.params // split,
                activation_bytes=activation_bytes,
                param_bytes=block.params / split * hardware.bytes_per_param,
                name=block.name,
                communication_time=2 * communication,
                **split_backward,
            )
        )
    return blocks
