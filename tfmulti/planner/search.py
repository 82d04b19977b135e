"""Searching layouts: meshes, schedules, micro-batch counts and stage splits.

Pure Python. For every mesh data x pipe x tensor of the devices, every schedule (and
chunk count for interleaved 1F1B), and every micro-batch count that divides the
per-replica batch, the stage split comes from the balancer (`balance(..., "time")`), and
from every contiguous split as well when there are few enough of them; each split is
scored by simulation (`score_layout`) and the fastest that fits in memory is kept.
Over several hosts, each mesh is scored once for every axis that can cross the hosts
(`tfmulti.planner.hosts.cross_host_axes`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator, Sequence

from tfmulti.pipeline.balance import Block, balance
from tfmulti.pipeline.schedules import (
    CHUNKED_SCHEDULES,
    SCHEDULE_CHUNKS,
    SCHEDULE_NAMES,
    build_schedule,
)
from tfmulti.planner.costs import Hardware, ModelCosts, blocks_at
from tfmulti.planner.hosts import cross_host_axes, hosts_used
from tfmulti.planner.overlap_anchor import anchored_overlap
from tfmulti.planner.scoring import Layout, score_layout
from tfmulti.platform.mesh import HybridMesh
from tfmulti.zero.formulas import ZERO_STAGES

# Up to this many contiguous splits per pipeline shape, all are simulated (exact optimum);
# beyond it, only the balancer's.
EXHAUSTIVE_SPLIT_LIMIT = 256


def meshes(
    num_devices: int, tensor_sizes: Sequence[int] = (1,), allow_fewer_devices: bool = False
) -> list[HybridMesh]:
    """Every runnable data x pipe x tensor arrangement of `num_devices` (or of fewer, if allowed).

    A tensor group alone runs as `--strategy=model_parallel --tensor_parallel=K`; mixed
    with data or pipe, as `--strategy=hybrid --mesh=data=D,pipe=P,tensor=K`.

    Example:
        >>> [str(mesh) for mesh in meshes(2)]
        ['data=1,pipe=2,tensor=1', 'data=2,pipe=1,tensor=1']
    """
    if num_devices < 1:
        raise ValueError(f"Need at least one device. Received: num_devices={num_devices}")
    counts = range(1, num_devices + 1) if allow_fewer_devices else (num_devices,)
    found = []
    for count in counts:
        if num_devices % count:
            continue
        for tensor in sorted(size for size in set(tensor_sizes) if count % size == 0):
            for data in _divisors(count // tensor):
                pipe = count // tensor // data
                found.append(HybridMesh(data=data, pipe=pipe, tensor=tensor))
    return sorted(found, key=lambda mesh: (mesh.num_devices, mesh.tensor, mesh.data))


def search_layouts(
    costs: ModelCosts,
    num_devices: int,
    global_batch: int,
    hardware: Hardware,
    *,
    allow_fewer_devices: bool = False,
    max_microbatches: int = 32,
    max_chunks: int = 4,
    hosts: int = 1,
) -> list[Layout]:
    """The best-split layout of every (mesh, axis across hosts, schedule, micro-batches,
    chunks) that fits.

    Args:
        costs: the model's block costs.
        num_devices: devices to lay out, over all hosts.
        global_batch: examples per step over all replicas.
        hardware: bandwidth, parameter-state bytes and memory per device; the model's
            own serial fractions (`costs.serial_fraction(s)`), when measured, replace its
            machine's; with `costs.data_parallel_step`, the layouts without a pipe axis
            are scored on that curve anchored on it (`overlap_anchor`).
        allow_fewer_devices: also consider meshes of a divisor of `num_devices`.
        max_microbatches: largest micro-batch count tried.
        max_chunks: largest chunk count tried for interleaved 1F1B.
        hosts: hosts the devices are on, num_devices / hosts each. A mesh of fewer
            devices runs on whole hosts, or on part of one.

    Returns:
        Layouts sorted fastest first (then by peak memory, then fewer devices).
    """
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1. Received: global_batch={global_batch}")
    if hosts < 1 or num_devices % hosts:
        raise ValueError(
            "The devices must split evenly over the hosts. "
            f"Received: num_devices={num_devices}, hosts={hosts}"
        )
    hardware = model_hardware(costs, hardware)
    pipeless_hardware, _ = anchored_overlap(costs, hardware)
    blocks_for = functools.lru_cache(maxsize=None)(
        lambda microbatch_size, tensor: tuple(blocks_at(costs, microbatch_size, tensor, hardware))
    )
    layouts = []
    for mesh in meshes(num_devices, costs.tensor_parallel_sizes, allow_fewer_devices):
        if global_batch % mesh.data:
            continue
        per_replica = global_batch // mesh.data
        # A hybrid run with tensor groups runs one stage per device group (no chunks).
        chunk_limit = 1 if mesh.tensor > 1 else max_chunks
        mesh_hosts = hosts_used(mesh.num_devices, hosts, num_devices // hosts)
        if mesh_hosts is None:
            continue
        for cross_host_axis, (schedule, num_microbatches, chunks) in itertools.product(
            cross_host_axes(mesh, mesh_hosts),
            _pipeline_shapes(
                mesh.pipe, per_replica, len(costs.blocks), max_microbatches, chunk_limit
            ),
        ):
            blocks = blocks_for(per_replica / num_microbatches, mesh.tensor)
            best = _best_split(
                blocks,
                mesh,
                (schedule, num_microbatches, chunks),
                (mesh_hosts, cross_host_axis),
                hardware if mesh.pipe > 1 else pipeless_hardware,
                costs,
            )
            if best is not None:
                layouts.append(best)
            if mesh.data > 1 and mesh.pipe == 1 and mesh.tensor == 1:
                # Data parallelism with its state sharded: the same step, less memory.
                for zero in ZERO_STAGES[1:]:
                    sharded = _best_split(
                        blocks,
                        mesh,
                        (schedule, num_microbatches, chunks),
                        (mesh_hosts, cross_host_axis),
                        pipeless_hardware,
                        costs,
                        zero,
                    )
                    if sharded is not None:
                        layouts.append(sharded)
    return sorted(layouts, key=_rank)


def model_hardware(costs: ModelCosts, hardware: Hardware) -> Hardware:
    """`hardware` with the model's own serial fractions, when measured, in place of its
    machine's."""
    if hardware.machine is None or costs.serial_fraction is None:
        return hardware
    machine = dataclasses.replace(
        hardware.machine,
        serial_fraction=costs.serial_fraction,
        serial_fractions=costs.serial_fractions,
    )
    return dataclasses.replace(hardware, machine=machine)


def _rank(layout: Layout) -> tuple:
    # Of equal steps, the lower ZeRO stage: it shards only what it must.
    return (
        layout.step_time,
        layout.zero,
        layout.peak_memory,
        layout.mesh.num_devices,
        str(layout.key),
    )


def _pipeline_shapes(
    pipe: int, per_replica: int, num_blocks: int, max_microbatches: int, max_chunks: int
) -> Iterator[tuple[str | None, int, int]]:
    """(schedule, micro-batches, chunks) that can run `pipe` stages of `num_blocks` blocks."""
    if pipe == 1:
        yield None, 1, 1
        return
    if pipe > num_blocks:
        return
    counts = [m for m in _divisors(per_replica) if m <= max_microbatches]
    for schedule in SCHEDULE_NAMES:
        fewest, most = SCHEDULE_CHUNKS.get(schedule, (1, 1))
        chunk_counts = range(fewest, min(most or max_chunks, max_chunks) + 1)
        for chunks, num_microbatches in itertools.product(chunk_counts, counts):
            if pipe * chunks > num_blocks:
                continue
            try:
                build_schedule(schedule, pipe, num_microbatches, chunks)
            except ValueError:
                continue
            yield schedule, num_microbatches, chunks


def _best_split(
    blocks: Sequence[Block],
    mesh: HybridMesh,
    shape: tuple[str | None, int, int],
    placement: tuple[int, str | None],
    hardware: Hardware,
    costs: ModelCosts,
    zero: int = 0,
) -> Layout | None:
    """The fastest split that fits, for a pipeline `shape` (schedule, micro-batches,
    chunks) on a `placement` (hosts, axis across them), at ZeRO stage `zero`."""
    schedule, num_microbatches, chunks = shape
    hosts, cross_host_axis = placement
    splits = _candidate_splits(blocks, mesh.pipe * chunks, num_microbatches, schedule, hardware)
    num_variables = sum(block.variables for block in costs.blocks)
    scored = (
        score_layout(
            blocks,
            mesh,
            schedule,
            num_microbatches,
            chunks,
            split,
            hardware,
            num_variables,
            costs.timing_spread,
            run_overhead=costs.run_overhead,
            hosts=hosts,
            cross_host_axis=cross_host_axis,
            zero=zero,
        )
        for split in splits
    )
    cap = hardware.memory_per_device
    fitting = [layout for layout in scored if cap is None or layout.peak_memory <= cap]
    return min(fitting, key=_rank, default=None)


def _candidate_splits(
    blocks: Sequence[Block],
    num_stages: int,
    num_microbatches: int,
    schedule: str | None,
    hardware: Hardware,
) -> set[tuple[int, ...]]:
    if num_stages == 1:
        return {()}
    if math.comb(len(blocks) - 1, num_stages - 1) <= EXHAUSTIVE_SPLIT_LIMIT:
        return set(itertools.combinations(range(1, len(blocks)), num_stages - 1))
    # The balancer simulates flat schedules only: a chunked model's p x v stages
    # (interleaved, ZBV) are balanced as a flat 1F1B pipeline of that depth (without the
    # memory cap, whose per-device sums differ), then scored as they run.
    interleaved = schedule in CHUNKED_SCHEDULES
    transfer_time = max(block.activation_bytes for block in blocks) / hardware.bandwidth
    splits = set()
    for policy in ("time", "params"):
        try:
            partition = balance(
                blocks,
                num_stages,
                num_microbatches,
                policy,
                schedule="1f1b" if interleaved else schedule,
                memory_cap=None if interleaved else hardware.memory_per_device,
                transfer_time=transfer_time,
            )
        except ValueError:  # no split fits the memory cap
            continue
        splits.add(partition.boundaries)
    return splits


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]
