"""The predicted step time and memory of one layout, by simulating its pipeline.

Pure Python. A layout runs the per-replica batch through a pipeline of `pipe` devices (one
device when pipe = 1), each device possibly one of a tensor group, and `data` replicas of
that. Its step time is the simulated pipeline makespan plus the data-parallel all-reduce
of each device's gradients (all devices reduce at once, each over its own link). When
the devices share one processor, the pipeline part is at least the busy time of every
device of the mesh added up (with measured `MachineCosts`: that sum sped up as far as
the step's concurrency allows, `MachineCosts.shared_compute`), tensor all-reduces counted
as waiting rather than busy. With `MachineCosts`, the framework's own cost is added: a step's fixed
cost, each replica's dispatch, and the pipeline executor's cost per action and per loop
round; with a model anchored on `scripts/train.py`, what that script adds to a step.
Peak memory per device is the parameter state of its stages plus its peak live
activation bytes from the simulator.

Over several hosts (`tfmulti.planner.hosts`), one mesh axis crosses them: stage transfers
between hosts and gradient sums over hosts pay the inter-host link, each host's devices
share only that host's processor, and each process dispatches only the replicas it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from tfmulti.pipeline.actions import Schedule
from tfmulti.pipeline.balance import Block, stage_cost
from tfmulti.pipeline.overlapped_pairs import pair_times
from tfmulti.pipeline.round_loop import loop_schedule
from tfmulti.pipeline.schedules import CHUNKED_SCHEDULES, build_schedule
from tfmulti.pipeline.simulate import CostModel, SimulationResult, StageCost, simulate
from tfmulti.planner.costs import Hardware
from tfmulti.planner.hosts import (
    check_cross_host_axis,
    gradient_allreduce_seconds,
    makespan_across_hosts,
    pipe_device_hosts,
    pipe_transfer_seconds,
)
from tfmulti.planner.train_strategy import EXECUTOR_STRATEGIES, train_strategy
from tfmulti.platform.mesh import HybridMesh
from tfmulti.zero.formulas import zero_state_bytes

# The schedule a one-device "pipeline" runs: one forward, one backward.
NO_PIPELINE = "gpipe"
# Beyond this many micro-batches (a cluster's thousands of examples per replica), a
# schedule is simulated at two smaller counts and its step extrapolated along the line
# through them: past the warm-up, each further micro-batch adds the same time, live bytes
# and busy time (`_extrapolated_simulation`).
EXTRAPOLATE_ABOVE_MICROBATCHES = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to train a model on a mesh, and what the simulator predicts for it.

    Args:
        mesh: the device arrangement.
        schedule: pipeline schedule name, or None when mesh.pipe == 1.
        num_microbatches: micro-batches per replica per step (m).
        chunks: model chunks per pipeline device (v).
        boundaries: first block of each stage after the first (pipe x chunks stages).
        step_time: predicted seconds per training step.
        pipeline_time: the simulated makespan of the per-replica batch (with shared
            compute, at least every device's busy time added up).
        allreduce_time: the data-parallel gradient all-reduce.
        bubble_fraction: idle share of the pipeline devices' time.
        peak_memory: bytes on the fullest device.
        overhead_time: the framework's measured per-step cost (0 without `MachineCosts`).
        uncertainty: the ± seconds the prediction carries from its measurements' spread.
        hosts: hosts the mesh is laid over (each a launched worker).
        cross_host_axis: the mesh axis across the hosts, "data" or "pipe"; None on one host.
        launch_options: `scripts/launch.py` flags that put the workers on real hosts
            (`--hosts_file`, `--remote_shell`), given to `plan.py --launch_option`.
        zero: the ZeRO stage of a data-parallel layout (`--zero`), 0 for none.
    """

    mesh: HybridMesh
    schedule: str | None
    num_microbatches: int
    chunks: int
    boundaries: tuple[int, ...]
    step_time: float
    pipeline_time: float
    allreduce_time: float
    bubble_fraction: float
    peak_memory: float
    overhead_time: float = 0.0
    uncertainty: float = 0.0
    hosts: int = 1
    cross_host_axis: str | None = None
    launch_options: tuple[str, ...] = ()
    zero: int = 0

    @property
    def key(self) -> tuple:
        """What identifies the layout apart from its predictions."""
        return (
            self.mesh,
            self.schedule,
            self.num_microbatches,
            self.chunks,
            self.boundaries,
            self.hosts,
            self.cross_host_axis,
            self.zero,
        )


def score_layout(
    blocks: Sequence[Block],
    mesh: HybridMesh,
    schedule: str | None,
    num_microbatches: int,
    chunks: int,
    boundaries: Sequence[int],
    hardware: Hardware,
    num_variables: int = 0,
    relative_spread: float = 0.0,
    *,
    run_overhead: float = 0.0,
    hosts: int = 1,
    cross_host_axis: str | None = None,
    zero: int = 0,
) -> Layout:
    """Simulates one layout.

    Args:
        blocks: per-block costs of one micro-batch on one device of a tensor group
            (see `tfmulti.planner.costs.blocks_at`).
        mesh: the device arrangement.
        schedule: a name in `SCHEDULE_NAMES`, or None when mesh.pipe == 1.
        num_microbatches: micro-batches per replica per step.
        chunks: model chunks per pipeline device (> 1 only for "interleaved_1f1b").
        boundaries: pipe x chunks - 1 strictly increasing split points.
        hardware: bandwidth and bytes per parameter, and the machine's measured costs.
        num_variables: the model's trainable variables (each replica updates each).
        relative_spread: the block timings' relative spread, for the uncertainty.
        run_overhead: what a `scripts/train.py` step adds once beyond the framework and
            the blocks (`ModelCosts.run_overhead`), added to the overhead.
        hosts: hosts the mesh is laid over, an equal share of its devices on each.
        cross_host_axis: with hosts > 1, the axis across them: one of
            `tfmulti.planner.hosts.cross_host_axes(mesh, hosts)`.
        zero: the ZeRO stage of a data-only mesh (`tfmulti.zero`): state held per device by
            ZeRO's formulas; stage 3 sends its weights once more per step and runs each
            forward again in the backward, where it gathers them anew.

    Returns:
        The scored `Layout`.

    Example:
        >>> blocks = [Block(1, 2, params=10), Block(1, 2, params=10)]
        >>> score_layout(blocks, HybridMesh(pipe=2), "1f1b", 4, 1, (1,), Hardware()).pipeline_time
        15.0
    """
    check_cross_host_axis(mesh, hosts, cross_host_axis)
    if zero and (mesh.pipe > 1 or mesh.tensor > 1 or mesh.data < 2):
        raise ValueError(
            f"ZeRO shards the state of data parallelism: it needs a data-only mesh of 2 or "
            f"more devices. Received: mesh={mesh}, zero={zero}"
        )
    num_stages = mesh.pipe * chunks
    if len(boundaries) != num_stages - 1:
        raise ValueError(
            f"A layout with pipe={mesh.pipe} and chunks={chunks} needs {num_stages - 1} split "
            f"points. Received: boundaries={tuple(boundaries)}"
        )
    extrapolated = _extrapolates(mesh.pipe, num_microbatches, hardware, cross_host_axis)
    plan = build_schedule(
        schedule or NO_PIPELINE,
        mesh.pipe,
        extrapolated[0] if extrapolated else num_microbatches,
        chunks if chunks > 1 else None,
    )
    edges = (0, *boundaries, len(blocks))
    stage_blocks = [blocks[start:end] for start, end in zip(edges[:-1], edges[1:], strict=True)]
    if any(not stage for stage in stage_blocks):
        raise ValueError(
            f"Split points must increase strictly within 1..{len(blocks) - 1}. "
            f"Received: boundaries={tuple(boundaries)}"
        )
    stage_costs = tuple(
        stage_cost(stage, hands_gradients_back=index > 0)
        for index, stage in enumerate(stage_blocks)
    )
    sent_bytes = max((stage[-1].output_bytes for stage in stage_blocks[:-1]), default=0.0)
    transfer_seconds = pipe_transfer_seconds(sent_bytes, mesh, hardware)
    if hardware.blocking_transfers and mesh.pipe > 1:
        stage_costs = _held_through_exchanges(
            stage_costs, transfer_seconds + tensor_gather_seconds(sent_bytes, mesh, hardware)
        )
    pair_fraction = hardware.machine.pair_fraction if hardware.machine else 1.0
    cost_model = CostModel(
        stage_costs,
        transfer_seconds,
        # An overlapped pair (DualPipeV) takes the measured share of its two halves' time.
        pair_times=pair_times(
            plan,
            lambda forward, backward: (
                pair_fraction
                * (stage_costs[forward.stage].forward + stage_costs[backward.stage].backward)
            ),
        ),
    )
    if extrapolated:
        result = _extrapolated_simulation(plan, cost_model, num_microbatches, extrapolated)
    else:
        result = simulate(plan, cost_model)
    pipeline_time, bubble_fraction = result.makespan, result.bubble_fraction
    if cross_host_axis == "pipe":
        pipeline_time = makespan_across_hosts(
            plan,
            cost_model,
            pipe_device_hosts(mesh.pipe, hosts, cross_host_axis),
            hardware.inter_host_latency + sent_bytes / hardware.inter_host_bandwidth,
        )
        bubble_fraction = 1.0 - sum(result.busy_time) / (pipeline_time * mesh.pipe)

    device_params = [0.0] * mesh.pipe
    for stage, device in zip(stage_blocks, plan.stage_devices, strict=True):
        device_params[device] += sum(block.params for block in stage)
    allreduce_time = gradient_allreduce_seconds(
        max(device_params) * hardware.gradient_bytes_per_param,
        mesh,
        hosts,
        cross_host_axis,
        hardware,
    )
    device_memory = [0.0] * mesh.pipe
    for stage, device in zip(stage_blocks, plan.stage_devices, strict=True):
        device_memory[device] += sum(block.param_bytes for block in stage)
    if zero:
        device_memory = [zero_held_bytes(blocks, mesh.data, zero, hardware)]
        if zero == 3:
            # A third pass of weights (2 -> 3), and each forward again in the backward.
            allreduce_time *= 1.5
            pipeline_time += num_microbatches * stage_costs[0].forward
    device_transient = [0.0] * mesh.pipe
    for stage, device in zip(stage_blocks, plan.stage_devices, strict=True):
        device_transient[device] = max(
            device_transient[device], *(block.transient_bytes for block in stage)
        )
    peak_memory = max(
        held + live + transient
        for held, live, transient in zip(
            device_memory, result.peak_activation_bytes, device_transient, strict=True
        )
    )
    # Each host's devices share that host's processor only. A tensor group's all-reduces
    # wait rather than compute: they take no share of the processor, but each device
    # waits through its own.
    device_waits = [0.0] * mesh.pipe
    for stage, device in zip(stage_blocks, plan.stage_devices, strict=True):
        device_waits[device] += num_microbatches * sum(b.communication_time for b in stage)
    summed_busy = (sum(result.busy_time) - sum(device_waits)) * mesh.data * mesh.tensor / hosts
    # With the data axis across, each worker's process runs its own replicas; with the pipe
    # axis across, the chief drives every replica.
    dispatched_replicas = mesh.data // hosts if cross_host_axis == "data" else mesh.data
    machine = hardware.machine
    overhead_time = run_overhead
    if machine is not None:
        pipeline_time = max(
            pipeline_time, machine.shared_compute(pipeline_time, summed_busy) + max(device_waits)
        )
        executor = runs_pipeline_executor(mesh, hosts)
        overhead_time += machine.step_seconds(num_variables) + machine.replica_seconds(
            dispatched_replicas, num_variables // mesh.pipe, executor=executor
        )
        if executor:
            actions, rounds = executed_actions(plan, rolled=cross_host_axis != "pipe")
            overhead_time += machine.pipeline_fixed + dispatched_replicas * (
                machine.per_action * actions + machine.per_round * rounds
            )
    elif hardware.shared_compute:
        pipeline_time = max(pipeline_time, summed_busy + max(device_waits))
    step_time = pipeline_time + allreduce_time + overhead_time
    spread = math.hypot(machine.relative_spread if machine else 0.0, relative_spread)
    return Layout(
        mesh=mesh,
        schedule=schedule if mesh.pipe > 1 else None,
        num_microbatches=num_microbatches,
        chunks=chunks,
        boundaries=tuple(boundaries),
        step_time=step_time,
        pipeline_time=pipeline_time,
        allreduce_time=allreduce_time,
        bubble_fraction=bubble_fraction,
        peak_memory=peak_memory,
        overhead_time=overhead_time,
        uncertainty=step_time * spread,
        hosts=hosts,
        cross_host_axis=cross_host_axis,
        zero=zero,
    )


def tensor_gather_seconds(sent_bytes: float, mesh: HybridMesh, hardware: Hardware) -> float:
    """The all-gather inside a tensor group of the 1/t shares of a received tensor, each
    `sent_bytes`, as a ring: t - 1 messages of the node's latency and bytes.

    Example:
        >>> tensor_gather_seconds(1e6, HybridMesh(pipe=2, tensor=4), Hardware(bandwidth=1e9))
        0.003
    """
    steps = mesh.tensor - 1
    return steps * (hardware.intra_node_latency + sent_bytes / hardware.bandwidth)


def _held_through_exchanges(stage_costs, seconds: float) -> tuple[StageCost, ...]:
    """Each stage's forward and backward holding its device `seconds` longer: the
    exchange with its neighbours that a blocking send and receive wait through."""
    return tuple(
        StageCost(
            forward=cost.forward + seconds,
            backward=cost.backward + seconds,
            activation_bytes=cost.activation_bytes,
        )
        for cost in stage_costs
    )


def zero_held_bytes(
    blocks: Sequence[Block], num_devices: int, stage: int, hardware: Hardware
) -> float:
    """Bytes of weights, gradients and optimizer state a device holds under ZeRO `stage`:
    weights and gradients of `hardware.gradient_bytes_per_param` each (float32 unless
    mixed precision), the rest of `hardware.bytes_per_param` optimizer state."""
    params = sum(block.params for block in blocks)
    working_bytes = hardware.gradient_bytes_per_param
    optimizer_bytes = max(hardware.bytes_per_param - 2 * working_bytes, 0.0)
    return zero_state_bytes(
        stage, params, num_devices, working_bytes, working_bytes, optimizer_bytes
    ).total


def runs_pipeline_executor(mesh: HybridMesh, hosts: int = 1) -> bool:
    """Whether `scripts/train.py` runs a layout through the pipeline executor: a pipeline,
    or a hybrid mesh, whose replicas are one-stage pipelines when pipe = 1 (tensor-only
    meshes over several hosts run as hybrid too).

    Example:
        >>> runs_pipeline_executor(HybridMesh(data=2, tensor=2))
        True
    """
    return train_strategy(mesh, hosts) in EXECUTOR_STRATEGIES


@functools.lru_cache(maxsize=256)
def executed_actions(plan: Schedule, rolled: bool = True) -> tuple[int, int]:
    """(actions, loop rounds) the executor runs for `plan`: a rolled loop runs its body
    every round, actions outside the schedule's micro-batches skipped at a cost; unrolled
    (stages on several hosts), each action once.

    Kept per schedule: rolling one takes up to a second, and a search scores every
    split of a model under the same schedule.

    Example:
        >>> executed_actions(build_schedule("1f1b", 2, 4))
        (24, 6)
    """
    loop = loop_schedule(plan) if rolled else None
    if loop is None:
        return sum(map(len, plan.device_actions)), 0
    body = len(loop.body) * loop.rounds
    return len(loop.prologue) + body + len(loop.epilogue), loop.rounds


def _extrapolates(
    pipe: int, num_microbatches: int, hardware: Hardware, cross_host_axis: str | None
) -> tuple[int, int] | None:
    """The two micro-batch counts to simulate and extrapolate from, or None to simulate
    `num_microbatches` itself (few of them, measured machine costs that count each
    action, or stages across hosts, whose simulation runs the actions once more)."""
    unit = pipe * math.ceil(8 / pipe)
    counts = (2 * unit, 3 * unit)
    if num_microbatches <= max(EXTRAPOLATE_ABOVE_MICROBATCHES, counts[1]):
        return None
    if hardware.machine is not None or cross_host_axis == "pipe":
        return None
    return counts


def _extrapolated_simulation(
    plan: Schedule, costs: CostModel, num_microbatches: int, counts: tuple[int, int]
) -> SimulationResult:
    """`simulate` of `plan`'s schedule at `num_microbatches`, from its simulations at
    `counts` (multiples of its depth, which every schedule accepts): makespan, busy time
    and live bytes each on the line through the two."""
    pipe, chunks = plan.num_devices, plan.chunks
    if plan.name in CHUNKED_SCHEDULES and num_microbatches % pipe:
        build_schedule(plan.name, pipe, num_microbatches, chunks)  # raises its own error
    low, high = (
        simulate(build_schedule(plan.name, pipe, count, chunks if chunks > 1 else None), costs)
        for count in counts
    )
    scale = (num_microbatches - counts[0]) / (counts[1] - counts[0])

    def along(first, second):
        return tuple(a + (b - a) * scale for a, b in zip(first, second, strict=True))

    return SimulationResult(
        schedule=plan,
        records=(),
        makespan=along((low.makespan,), (high.makespan,))[0],
        busy_time=along(low.busy_time, high.busy_time),
        peak_activations=tuple(
            round(n) for n in along(low.peak_activations, high.peak_activations)
        ),
        peak_activation_bytes=along(low.peak_activation_bytes, high.peak_activation_bytes),
    )
