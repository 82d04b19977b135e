"""Planning for a cluster from its hardware file and a model's shape, without measuring.

Pure Python. Every layout data x pipe x tensor of the devices, with tensor groups inside a
node (tensor dividing the devices of a node and the model's heads), pipe dividing the
repeated layers evenly (Megatron-LM's split: the embedding with the first stage, the
output layer with the last), micro-batch sizes 1, 2, 4, ... dividing each replica's batch,
and 1F1B or interleaved 1F1B (chunks dividing the layers of a stage), is scored by
`score_layout` on blocks from `analytic_costs`, the cost model measured plans use. A
data-only layout is scored at each ZeRO stage too.

A layout whose parameter state alone exceeds a device's memory is not simulated. The
others are simulated in the order of a bound no step can beat (each micro-batch through
the slowest stage, plus the optimizer step), until that bound exceeds the best fitting
step by `SIMULATED_MARGIN`: every layout within the margin of the best is scored.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator

from tfmulti.pipeline.balance import Block
from tfmulti.planner.analytic_costs import (
    cluster_hardware,
    embedding_allreduce_seconds,
    optimizer_seconds,
    shape_blocks,
)
from tfmulti.planner.hardware_files import ClusterHardware
from tfmulti.planner.model_shapes import ModelShape
from tfmulti.planner.scoring import Layout, score_layout
from tfmulti.platform.mesh import HybridMesh
from tfmulti.zero.formulas import ZERO_STAGES

# Layouts whose bound is within this share of the best step are all simulated.
SIMULATED_MARGIN = 0.25
CLUSTER_SCHEDULES = ("1f1b", "interleaved_1f1b")
RECOMPUTE_CHOICES = ("full", "none", "search")


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    """A scored layout on a cluster, with what a cluster's plan reports.

    Args:
        layout: the scored layout (`score_layout`).
        microbatch_size: examples per micro-batch.
        recompute: whether the layers' activations are recomputed in the backward.
        fits: its fullest device holds no more than the hardware's memory.
        model_flops: FLOPs of one step as Megatron-LM counts them.
        num_devices: devices of the cluster (the mesh uses all of them).
        embedding_allreduce_time: the word embedding's gradient sum between the first
            and last stage (`analytic_costs.embedding_allreduce_seconds`), part of the
            layout's overhead with the optimizer step.
    """

    layout: Layout
    microbatch_size: int
    recompute: bool
    fits: bool
    model_flops: float
    num_devices: int
    embedding_allreduce_time: float = 0.0

    @property
    def tflops_per_device(self) -> float:
        """Model TFLOP/s per device: the step's FLOPs over its time and the devices."""
        return self.model_flops / self.layout.step_time / self.num_devices / 1e12

    def to_json(self) -> dict:
        layout = self.layout
        return {
            "data": layout.mesh.data,
            "pipe": layout.mesh.pipe,
            "tensor": layout.mesh.tensor,
            "zero": layout.zero,
            "schedule": layout.schedule,
            "chunks": layout.chunks,
            "microbatch_size": self.microbatch_size,
            "microbatches": layout.num_microbatches,
            "recompute": self.recompute,
            "step_time": layout.step_time,
            "tflops_per_device": self.tflops_per_device,
            "memory_per_device": layout.peak_memory,
            "fits": self.fits,
            "pipeline_time": layout.pipeline_time,
            "allreduce_time": layout.allreduce_time,
            "optimizer_time": layout.overhead_time - self.embedding_allreduce_time,
            "embedding_allreduce_time": self.embedding_allreduce_time,
            "bubble_fraction": layout.bubble_fraction,
        }


@dataclasses.dataclass(frozen=True)
class _Candidate:
    mesh: HybridMesh
    microbatch_size: int
    schedule: str | None
    chunks: int
    recompute: bool
    zero: int


def cluster_meshes(
    shape: ModelShape, hardware: ClusterHardware, num_devices: int
) -> list[HybridMesh]:
    """Every data x pipe x tensor of `num_devices` the pruned search lays out: tensor
    inside a node and dividing the heads, pipe dividing the repeated layers."""
    heads = shape.gpt["heads"] if shape.gpt else None
    found = []
    for tensor in _divisors(hardware.devices_per_node):
        if num_devices % tensor or (heads and heads % tensor):
            continue
        for pipe in _divisors(shape.repeated_layers):
            if (num_devices // tensor) % pipe == 0:
                found.append(
                    HybridMesh(data=num_devices // tensor // pipe, pipe=pipe, tensor=tensor)
                )
    return found


def check_layout(
    shape: ModelShape,
    hardware: ClusterHardware,
    num_devices: int,
    global_batch: int,
    mesh: HybridMesh,
) -> None:
    """Raises a one-line ValueError naming what keeps `mesh` from running `shape`."""
    if mesh.num_devices != num_devices:
        raise ValueError(
            f"--layout must use all --devices={num_devices}: data x pipe x tensor = "
            f"{mesh.num_devices}. Received: --layout={mesh}"
        )
    if mesh.tensor > hardware.devices_per_node or hardware.devices_per_node % mesh.tensor:
        raise ValueError(
            f"--layout tensor must divide the {hardware.devices_per_node} devices of a node "
            f"(tensor groups stay inside one). Received: tensor={mesh.tensor}"
        )
    if shape.gpt and shape.gpt["heads"] % mesh.tensor:
        raise ValueError(
            f"--layout tensor must divide the model's heads={shape.gpt['heads']}. "
            f"Received: tensor={mesh.tensor}"
        )
    if shape.repeated_layers % mesh.pipe:
        raise ValueError(
            f"--layout pipe must divide the model's {shape.repeated_layers} layers. "
            f"Received: pipe={mesh.pipe}"
        )
    if global_batch % mesh.data:
        raise ValueError(
            f"--layout data must divide --global_batch={global_batch}. Received: data={mesh.data}"
        )


def search_cluster_layouts(
    shape: ModelShape,
    hardware: ClusterHardware,
    num_devices: int,
    global_batch: int,
    *,
    layout: HybridMesh | None = None,
    recompute: str = "full",
    max_chunks: int = 4,
    max_microbatch_size: int = 8,
) -> list[ClusterLayout]:
    """The scored layouts of `shape` on `num_devices` devices of `hardware`: those that
    fit fastest first, then those that do not.

    Args:
        shape: the model.
        hardware: the cluster.
        num_devices: devices to lay out (all of them).
        global_batch: examples per step over all replicas.
        layout: score only this mesh (every micro-batch size, schedule and chunk count).
        recompute: "full" (Megatron-LM's full activation recomputation), "none", or
            "search" (both).
        max_chunks: largest chunk count of interleaved 1F1B.
        max_microbatch_size: largest micro-batch size tried (powers of two); a shape's own
            micro-batch size, when it has one, is the only one.

    Returns:
        `ClusterLayout`s; empty when no mesh can run the model on these devices.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}. Received: {recompute!r}")
    if global_batch < 1 or num_devices < 1:
        raise ValueError(
            "Need at least one device and one example. "
            f"Received: num_devices={num_devices}, global_batch={global_batch}"
        )
    if layout is not None:
        check_layout(shape, hardware, num_devices, global_batch, layout)
    scoring_hardware = cluster_hardware(hardware)
    blocks_for = functools.lru_cache(maxsize=None)(
        lambda b, tensor, recomputes, pipelined: shape_blocks(
            shape, b, tensor, hardware, recomputes, pipelined
        )
    )
    meshes = [layout] if layout else cluster_meshes(shape, hardware, num_devices)
    candidates = []
    for candidate in _candidates(
        shape, meshes, global_batch, recompute, max_chunks, max_microbatch_size
    ):
        blocks = _blocks(blocks_for, candidate)
        if layout is None and _state_bytes(blocks, candidate) > hardware.memory_bytes:
            continue
        candidates.append((_step_bound(blocks, candidate, global_batch, hardware), candidate))
    candidates.sort(key=lambda pair: pair[0])
    scored, best_fitting = [], None
    for bound, candidate in candidates:
        if (
            layout is None
            and best_fitting is not None
            and bound > best_fitting * (1 + SIMULATED_MARGIN)
        ):
            break
        blocks = _blocks(blocks_for, candidate)
        planned = _score(
            shape, blocks, candidate, global_batch, num_devices, hardware, scoring_hardware
        )
        scored.append(planned)
        if planned.fits:
            best_fitting = min(best_fitting or planned.layout.step_time, planned.layout.step_time)
    return sorted(
        scored,
        key=lambda planned: (
            not planned.fits,
            planned.layout.step_time,
            planned.layout.peak_memory,
        ),
    )


def _blocks(blocks_for, candidate: _Candidate) -> tuple[Block, ...]:
    return blocks_for(
        candidate.microbatch_size,
        candidate.mesh.tensor,
        candidate.recompute,
        candidate.mesh.pipe > 1,
    )


def _candidates(
    shape, meshes, global_batch, recompute, max_chunks, max_microbatch_size
) -> Iterator[_Candidate]:
    recomputes = {"full": (True,), "none": (False,), "search": (True, False)}[recompute]
    sizes = (
        [shape.microbatch_size]
        if shape.microbatch_size
        else [2**k for k in range(max_microbatch_size.bit_length()) if 2**k <= max_microbatch_size]
    )
    for mesh in meshes:
        if global_batch % mesh.data:
            continue
        per_replica = global_batch // mesh.data
        for b, recomputes_now in itertools.product(sizes, recomputes):
            if per_replica % b:
                continue
            for schedule, chunks in _schedules(shape, mesh.pipe, per_replica // b, max_chunks):
                zeros = (
                    ZERO_STAGES if mesh.data > 1 and mesh.pipe == 1 and mesh.tensor == 1 else (0,)
                )
                for zero in zeros:
                    yield _Candidate(mesh, b, schedule, chunks, recomputes_now, zero)


def _schedules(shape: ModelShape, pipe: int, num_microbatches: int, max_chunks: int):
    if pipe == 1:
        yield None, 1
        return
    if num_microbatches < pipe:
        return
    yield "1f1b", 1
    if num_microbatches % pipe:
        return
    for chunks in range(2, max_chunks + 1):
        if shape.repeated_layers % (pipe * chunks) == 0:
            yield "interleaved_1f1b", chunks


def _boundaries(shape: ModelShape, stages: int) -> tuple[int, ...]:
    """Megatron-LM's split: equal layers a stage, the embedding with the first stage and
    the output layer with the last."""
    offset = 1 if shape.gpt else 0
    per_stage = shape.repeated_layers // stages
    return tuple(offset + per_stage * stage for stage in range(1, stages))


def _state_bytes(blocks: tuple[Block, ...], candidate: _Candidate) -> float:
    """Parameter state of an average pipeline device: the fullest holds no less."""
    state = sum(block.param_bytes for block in blocks) / candidate.mesh.pipe
    return state / candidate.mesh.data if candidate.zero else state


def _step_bound(
    blocks, candidate: _Candidate, global_batch: int, hardware: ClusterHardware
) -> float:
    per_replica = global_batch // candidate.mesh.data
    num_microbatches = per_replica // candidate.microbatch_size
    total = sum(block.forward_time + block.backward_time for block in blocks)
    params = sum(block.params for block in blocks) / candidate.mesh.pipe
    return num_microbatches * total / candidate.mesh.pipe + optimizer_seconds(params, hardware)


def _score(
    shape, blocks, candidate, global_batch, num_devices, hardware, scoring_hardware
) -> ClusterLayout:
    mesh = candidate.mesh
    device_params = sum(block.params for block in blocks) / mesh.pipe
    if candidate.zero:
        device_params /= mesh.data
    embedding_allreduce = embedding_allreduce_seconds(shape, mesh, hardware)
    layout = score_layout(
        blocks,
        mesh,
        candidate.schedule,
        global_batch // mesh.data // candidate.microbatch_size,
        candidate.chunks,
        _boundaries(shape, mesh.pipe * candidate.chunks),
        scoring_hardware,
        run_overhead=optimizer_seconds(device_params, hardware) + embedding_allreduce,
        zero=candidate.zero,
    )
    return ClusterLayout(
        layout=layout,
        microbatch_size=candidate.microbatch_size,
        recompute=candidate.recompute,
        fits=layout.peak_memory <= hardware.memory_bytes,
        model_flops=shape.model_flops(global_batch, candidate.recompute),
        num_devices=num_devices,
        embedding_allreduce_time=embedding_allreduce,
    )


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
