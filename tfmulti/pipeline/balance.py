"""Splitting an ordered list of model blocks into contiguous pipeline stages.

Pure Python. Policies:

- "uniform": equal block counts (earlier stages take the remainder).
- "params": the smallest possible largest stage parameter count (exact).
- "time": the smallest simulated step time of the chosen schedule. The bottleneck
  (largest per-stage F+B time, which sets the steady-state rate) is minimised exactly by
  binary search over segment sums with a dynamic-programming feasibility test; the step time is then
  minimised by simulating the partitions that reach the best few bottlenecks and
  hill-climbing their boundaries. `Partition.step_time_lower_bound` (m x the smallest
  bottleneck, which no split can beat) certifies how close the answer is.
- "manual": the given boundaries.

A memory cap, when given, bounds every stage's parameter bytes plus its peak live
activation bytes (peak live micro-batches of the schedule at that stage x the stage's
activation bytes); "params" and "time" search only splits that fit, the others raise.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tfmulti.pipeline.schedules import build_schedule
from tfmulti.pipeline.simulate import CostModel, StageCost, simulate

PARTITION_POLICIES = ("uniform", "params", "time", "manual")
_CANDIDATE_BOTTLENECKS = 8
_PHASE_SCAN_LIMIT = 16


@dataclasses.dataclass(frozen=True)
class Block:
    """Costs of one model block (for example a layer) for one micro-batch.

    Args:
        forward_time: time of the forward pass.
        backward_time: time of the full backward pass.
        params: parameter count.
        flops: forward FLOPs (reported, not used by the policies).
        activation_bytes: bytes kept alive from forward to backward.
        param_bytes: bytes of parameters and optimizer state; defaults to 4 x params.
        name: for reports.
        communication_time: the part of forward_time + backward_time spent waiting on
            collectives (a tensor group's all-reduces), not computing.
        input_grad_time: time of the input-gradient part of a split backward (I), as
            measured; None when not measured.
        weight_grad_time: time of its weight-gradient part (W); None when not measured.
        output_bytes: bytes it hands the next stage per micro-batch when a stage ends with
            it; None: its `activation_bytes`.
        transient_bytes: bytes it needs only while it runs (with activation
            recomputation, its whole activations during its backward).
    """

    forward_time: float = 1.0
    backward_time: float = 2.0
    params: int = 0
    flops: float = 0.0
    activation_bytes: float = 0.0
    param_bytes: float | None = None
    name: str = ""
    communication_time: float = 0.0
    input_grad_time: float | None = None
    weight_grad_time: float | None = None
    output_bytes: float | None = None
    transient_bytes: float = 0.0

    def __post_init__(self):
        if self.param_bytes is None:
            object.__setattr__(self, "param_bytes", 4.0 * self.params)
        if self.output_bytes is None:
            object.__setattr__(self, "output_bytes", self.activation_bytes)


def stage_cost(blocks: Sequence[Block], hands_gradients_back: bool = True) -> StageCost:
    """One stage's costs for one micro-batch: its blocks' times summed.

    With the blocks' split backward measured (`Block.input_grad_time`), I and W are
    theirs; the first stage hands no gradient back, so its I computes nothing and its W is
    the whole backward, as the executor cuts it. Otherwise the simulator's default split
    (halves of B) stands.

    Example:
        >>> stage_cost([Block(1, 2, input_grad_time=1.5, weight_grad_time=0.7)]).input_grad
        1.5
    """
    forward = sum(block.forward_time for block in blocks)
    backward = sum(block.backward_time for block in blocks)
    activation_bytes = sum(block.activation_bytes for block in blocks)
    measured = all(
        block.input_grad_time is not None and block.weight_grad_time is not None for block in blocks
    )
    if not measured:
        return StageCost(forward, backward, activation_bytes=activation_bytes)
    if not hands_gradients_back:
        return StageCost(forward, backward, backward, activation_bytes, input_grad=0.0)
    return StageCost(
        forward,
        backward,
        weight_grad=sum(block.weight_grad_time for block in blocks),
        activation_bytes=activation_bytes,
        input_grad=sum(block.input_grad_time for block in blocks),
    )


@dataclasses.dataclass(frozen=True)
class Partition:
    """A split of blocks into contiguous stages, with its predicted cost.

    Args:
        boundaries: index of the first block of stages 1..p-1; stage s holds blocks
            [boundaries[s-1], boundaries[s]) with 0 and len(blocks) at the ends.
        num_blocks: total number of blocks.
        stage_times: per stage, F+B time for one micro-batch.
        stage_memory: per stage, parameter bytes + peak live activation bytes.
        step_time: simulated time of one step.
        step_time_lower_bound: no split of these blocks can have a shorter step.
        policy: the policy that produced the split.
    """

    boundaries: tuple[int, ...]
    num_blocks: int
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    step_time: float
    step_time_lower_bound: float
    policy: str

    @property
    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        """Per stage, the (start, end) block indices, end exclusive."""
        edges = (0, *self.boundaries, self.num_blocks)
        return tuple(zip(edges[:-1], edges[1:], strict=True))


def parse_partition_spec(spec: str) -> tuple[str, tuple[int, ...] | None]:
    """Reads "uniform", "params", "time" or "manual:3,6,9" into (policy, boundaries).

    Example:
        >>> parse_partition_spec("manual:3,6,9")
        ('manual', (3, 6, 9))
    """
    policy, _, rest = spec.partition(":")
    if policy == "manual":
        try:
            boundaries = tuple(int(token) for token in rest.split(","))
        except ValueError:
            raise ValueError(
                "A manual partition lists the first block index of every stage after the "
                f"first, e.g. 'manual:3,6,9'. Received: {spec!r}"
            ) from None
        return policy, boundaries
    if policy not in PARTITION_POLICIES or rest:
        raise ValueError(
            "Partition must be 'uniform', 'params', 'time' or 'manual:<split points>' such as "
            f"'manual:3,6,9'. Received: {spec!r}"
        )
    return policy, None


def balance(
    blocks: Sequence[Block],
    num_stages: int,
    num_microbatches: int,
    policy: str = "time",
    *,
    schedule: str = "1f1b",
    memory_cap: float | None = None,
    boundaries: Sequence[int] | None = None,
    transfer_time: float = 0.0,
) -> Partition:
    """Splits `blocks` into `num_stages` contiguous stages with `policy`.

    Args:
        blocks: the model's blocks in order.
        num_stages: pipeline depth p (one stage per device).
        num_microbatches: micro-batches per step m.
        policy: one of `PARTITION_POLICIES` (see the module docstring).
        schedule: a one-stage-per-device schedule name: "gpipe", "1f1b", "zb_h1", "zb_h2".
        memory_cap: largest allowed stage memory in bytes, or None.
        boundaries: the split points, for policy "manual".
        transfer_time: time to send activations between devices.

    Returns:
        The `Partition`.

    Example:
        >>> blocks = [Block(1, 2), Block(1, 2), Block(2, 4), Block(2, 4)]
        >>> balance(blocks, 2, 4).boundaries
        (3,)
    """
    if num_stages < 1 or len(blocks) < num_stages:
        raise ValueError(
            "Need 1 <= num_stages <= number of blocks. "
            f"Received: num_stages={num_stages}, {len(blocks)} blocks"
        )
    if policy not in PARTITION_POLICIES:
        raise ValueError(f"policy must be one of {PARTITION_POLICIES}. Received: {policy!r}")
    planner = _Planner(blocks, num_stages, num_microbatches, schedule, memory_cap, transfer_time)
    if policy == "manual":
        chosen = planner.check_manual(boundaries)
    elif policy == "uniform":
        chosen = planner.uniform()
    elif policy == "params":
        chosen = planner.min_bottleneck(planner.params_prefix)
    else:
        chosen = planner.fastest()
    if policy in ("manual", "uniform") and not planner.fits(chosen):
        raise ValueError(
            f"The {policy} split {chosen} needs {max(planner.memory(chosen)):.6g} bytes on "
            f"one stage, over memory_cap={memory_cap}; use policy 'params' or 'time'."
        )
    return planner.partition(chosen, policy)


class _Planner:
    """Prefix sums and cost evaluation shared by the policies."""

    def __init__(self, blocks, num_stages, num_microbatches, schedule, memory_cap, transfer):
        self.num_blocks = len(blocks)
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.memory_cap = memory_cap
        self.transfer_time = transfer
        plan = build_schedule(schedule, num_stages, num_microbatches)
        self.schedule = plan
        # Peak live micro-batches per stage depend only on each device's order.
        self.peak_live = simulate(plan).peak_activations
        self.forward_prefix = _prefix([b.forward_time for b in blocks])
        self.backward_prefix = _prefix([b.backward_time for b in blocks])
        self.time_prefix = _prefix([b.forward_time + b.backward_time for b in blocks])
        self.params_prefix = _prefix([b.params for b in blocks])
        self.param_bytes_prefix = _prefix([b.param_bytes for b in blocks])
        self.activation_prefix = _prefix([b.activation_bytes for b in blocks])
        self.blocks = list(blocks)
        self._step_times: dict[tuple[int, ...], float] = {}
        self._sums: dict[int, list[float]] = {}

    def segment(self, prefix, start, end):
        return prefix[end] - prefix[start]

    def segment_memory(self, stage, start, end):
        return self.segment(self.param_bytes_prefix, start, end) + self.peak_live[
            stage
        ] * self.segment(self.activation_prefix, start, end)

    def edges(self, boundaries):
        return (0, *boundaries, self.num_blocks)

    def memory(self, boundaries):
        edges = self.edges(boundaries)
        return [self.segment_memory(s, edges[s], edges[s + 1]) for s in range(self.num_stages)]

    def fits(self, boundaries):
        return self.memory_cap is None or max(self.memory(boundaries)) <= self.memory_cap

    def check_manual(self, boundaries):
        if boundaries is None or len(boundaries) != self.num_stages - 1:
            raise ValueError(
                f"A manual split into {self.num_stages} stages needs {self.num_stages - 1} "
                f"split points. Received: {boundaries}"
            )
        edges = self.edges(tuple(boundaries))
        if any(a >= b for a, b in zip(edges[:-1], edges[1:], strict=True)):
            raise ValueError(
                "Split points must increase strictly within 1.."
                f"{self.num_blocks - 1} so every stage has a block. Received: {boundaries}"
            )
        return tuple(boundaries)

    def uniform(self):
        size, extra = divmod(self.num_blocks, self.num_stages)
        sizes = [size + (1 if s < extra else 0) for s in range(self.num_stages)]
        return tuple(itertools.accumulate(sizes[:-1]))

    def split_within(self, limits, pack_early=True):
        """A split whose stages all respect `limits` and the memory cap, or None.

        `limits` pairs prefix sums with the largest sum a stage may have. Each constraint
        only tightens as a segment grows, so for a stage and an end block the valid starts
        form a range; a dynamic programme over (stage, end) then decides feasibility in
        O(stages x blocks). `pack_early` picks the split whose early stages are longest.
        """
        num_blocks = self.num_blocks
        fits = self._fits_checker(limits)
        reachable = [True] + [False] * num_blocks
        # Per stage: the earliest valid start for each end block, and which block indices
        # the earlier stages can end at.
        stage_tables = []
        for stage in range(self.num_stages):
            reached_count = _prefix(int(r) for r in reachable)
            earliest = [0] * (num_blocks + 1)
            next_reachable = [False] * (num_blocks + 1)
            start = 0
            for end in range(1, num_blocks + 1):
                while start < end and not fits(stage, start, end):
                    start += 1
                earliest[end] = start
                next_reachable[end] = reached_count[end] > reached_count[start]
            stage_tables.append((earliest, reachable))
            reachable = next_reachable
        if not reachable[num_blocks]:
            return None
        cuts = []
        end = num_blocks
        for stage in reversed(range(1, self.num_stages)):
            earliest, reachable_before = stage_tables[stage]
            starts = [i for i in range(earliest[end], end) if reachable_before[i]]
            end = max(starts) if pack_early else min(starts)
            cuts.append(end)
        return tuple(reversed(cuts))

    def _fits_checker(self, limits):
        """A fast test of whether blocks [start, end) fit on `stage` within `limits`."""
        cap = self.memory_cap
        param_bytes, activations, peak_live = (
            self.param_bytes_prefix,
            self.activation_prefix,
            self.peak_live,
        )

        def fits(stage, start, end):
            for prefix, limit in limits:
                if prefix[end] - prefix[start] > limit:
                    return False
            if cap is None:
                return True
            memory = param_bytes[end] - param_bytes[start]
            return memory + peak_live[stage] * (activations[end] - activations[start]) <= cap

        return fits

    def smallest_limit(self, prefix, other_limits=(), high=None):
        """Sorted segment sums of `prefix`, and the index of the smallest achievable largest.

        `high`, when given, is an index already known to be achievable.
        """
        candidates = self._segment_sums(prefix)
        if high is None:
            high = len(candidates) - 1
            if self.split_within([*other_limits, (prefix, candidates[high])]) is None:
                return candidates, None
        low = 0
        while low < high:
            middle = (low + high) // 2
            if self.split_within([*other_limits, (prefix, candidates[middle])]) is None:
                low = middle + 1
            else:
                high = middle
        return candidates, low

    def _segment_sums(self, prefix):
        key = id(prefix)
        if key not in self._sums:
            self._sums[key] = sorted(
                {
                    self.segment(prefix, i, j)
                    for i in range(self.num_blocks)
                    for j in range(i + 1, self.num_blocks + 1)
                }
            )
        return self._sums[key]

    def min_bottleneck(self, prefix):
        candidates, index = self.smallest_limit(prefix)
        if index is None:
            raise ValueError(self._memory_cap_message())
        return self.split_within([(prefix, candidates[index])])

    def fastest(self):
        seeds = self._bottleneck_seeds() | self._phase_seeds()
        ranked = sorted(seeds, key=self.step_time)
        return min((self.hill_climb(seed) for seed in ranked[:8]), key=self.step_time)

    def _bottleneck_seeds(self):
        """Splits reaching the smallest few largest stage F+B times (1F1B's steady rate)."""
        candidates, index = self.smallest_limit(self.time_prefix)
        if index is None:
            raise ValueError(self._memory_cap_message())
        seeds = set()
        for limit in candidates[index : index + _CANDIDATE_BOTTLENECKS]:
            for pack_early in (True, False):
                split = self.split_within([(self.time_prefix, limit)], pack_early)
                if split is not None:
                    seeds.add(split)
        return seeds

    def _phase_seeds(self):
        """Splits with the smallest largest-F plus largest-B (GPipe's two phases' rates).

        Scans the forward limit upwards; once it alone plus the smallest possible backward
        limit cannot beat the best sum, no larger forward limit can.
        """
        forward_sums, forward_index = self.smallest_limit(self.forward_prefix)
        backward_sums, backward_floor = self.smallest_limit(self.backward_prefix)
        best_total, seeds, backward_index = None, {}, None
        for forward_limit in forward_sums[forward_index:][:_PHASE_SCAN_LIMIT]:
            if best_total is not None and forward_limit + backward_sums[backward_floor] >= (
                best_total
            ):
                break
            constraint = ((self.forward_prefix, forward_limit),)
            # A looser forward limit never needs a larger backward limit.
            _, backward_index = self.smallest_limit(
                self.backward_prefix, constraint, high=backward_index
            )
            index = backward_index
            total = forward_limit + backward_sums[index]
            if best_total is None or total < best_total:
                best_total = total
                limits = [*constraint, (self.backward_prefix, backward_sums[index])]
                seeds = {self.split_within(limits, pack_early) for pack_early in (True, False)}
        return {seed for seed in seeds if seed is not None}

    def hill_climb(self, boundaries):
        improved = True
        while improved:
            improved = False
            for index, delta in itertools.product(range(len(boundaries)), (-1, 1)):
                moved = list(boundaries)
                moved[index] += delta
                moved = tuple(moved)
                edges = self.edges(moved)
                if any(a >= b for a, b in zip(edges[:-1], edges[1:], strict=True)):
                    continue
                if self.fits(moved) and self.step_time(moved) < self.step_time(boundaries):
                    boundaries, improved = moved, True
        return boundaries

    def step_time(self, boundaries):
        if boundaries not in self._step_times:
            edges = self.edges(boundaries)
            stages = tuple(
                stage_cost(self.blocks[edges[s] : edges[s + 1]], hands_gradients_back=s > 0)
                for s in range(self.num_stages)
            )
            result = simulate(self.schedule, CostModel(stages, self.transfer_time))
            self._step_times[boundaries] = result.makespan
        return self._step_times[boundaries]

    def partition(self, boundaries, policy):
        edges = self.edges(boundaries)
        stage_times = tuple(
            self.segment(self.time_prefix, edges[s], edges[s + 1]) for s in range(self.num_stages)
        )
        candidates, index = self.smallest_limit(self.time_prefix)
        lower_bound = self.num_microbatches * candidates[index] if index is not None else 0.0
        return Partition(
            boundaries=tuple(boundaries),
            num_blocks=self.num_blocks,
            stage_times=stage_times,
            stage_memory=tuple(self.memory(boundaries)),
            step_time=self.step_time(tuple(boundaries)),
            step_time_lower_bound=lower_bound,
            policy=policy,
        )

    def _memory_cap_message(self):
        single_blocks = [
            self.segment_memory(stage, block, block + 1)
            for stage in range(self.num_stages)
            for block in range(self.num_blocks)
        ]
        return (
            f"No split into {self.num_stages} stages fits memory_cap={self.memory_cap} "
            f"(one block alone needs up to {max(single_blocks):.6g} bytes on some stage); "
            "raise the cap or use more stages."
        )


def _prefix(values):
    return [0, *itertools.accumulate(values)]
