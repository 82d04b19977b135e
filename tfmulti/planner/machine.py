"""What a training step costs on this machine beyond its blocks' compute, measured once.

Pure Python; `tfmulti.planner.machine_benchmarks` (TensorFlow) measures the numbers with
small benchmarks and keeps them in the cost cache beside the block costs. The terms:

- a Keras training step's fixed cost on one device and its cost per trainable variable
  (the optimizer updates each one), and what each data-parallel replica
  of `tf.distribute.MirroredStrategy` adds (per replica, and per replica and variable:
  MirroredStrategy dispatches every replica's updates and reduces every variable);
- the pipeline executor's fixed cost per step, per scheduled action and per loop round,
  and what each copy of a hybrid mesh adds to it (per copy, and per copy and variable:
  the executor sums the copies' gradients and copies one optimizer update to the others,
  far less than MirroredStrategy's update of every replica);
- an all-reduce's latency and bandwidth between the logical devices, as MirroredStrategy
  calls one (a gradient sum) and as a tensor group runs one inside a step (its split
  layers' sums, ops of the step's graph);
- how much logical devices of one processor overlap: `serial_fraction` is the share of
  every device's work added up that runs one after the other (1: none overlaps, as for
  logical CPU devices sharing the cores; 1/n: n devices run fully in parallel), and
  `serial_fractions` the same with k = 1..n devices at work at once (two cores are full
  with two devices at work: more adds no overlap);
- how much two independent pieces of work on one device overlap: `pair_fraction`, the
  time of both at once over the two one after the other, is what an overlapped F&B pair
  of DualPipeV costs against its forward and backward.

Each term carries its measured relative spread, which `step_uncertainty` turns into the
uncertainty printed beside a predicted step time.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class MachineCosts:
    """Measured per-step costs of the framework on one machine (seconds, bytes/s).

    Args:
        step_fixed: one-device Keras training step with (nearly) no compute.
        per_variable: added to a step by each trainable variable (its optimizer update).
        per_replica: added by each MirroredStrategy replica.
        per_replica_variable: added by each replica for each trainable variable.
        pipeline_fixed: added to a step by the pipeline executor beyond `step_fixed`,
            whatever its schedule; negative where the executor's step costs less than a
            strategy's (it runs under TensorFlow's default strategy), down to -step_fixed.
        per_action: each pipeline action (F, B, I or W of a stage on a micro-batch).
        per_round: each round of the executor's rolled loop.
        executor_per_replica: added by each data-parallel copy of a pipeline (a hybrid
            mesh's replica) beyond its actions; None (not measured, an older cost cache):
            MirroredStrategy's `per_replica` stands in.
        executor_per_replica_variable: added by each such copy for each trainable variable.
        allreduce_latency: fixed time of one all-reduce over the logical devices.
        allreduce_bandwidth: bytes per second an all-reduce moves beyond its latency.
        tensor_allreduce_latency: fixed time of one all-reduce of a tensor group inside a
            step's graph; None (an older cost cache): `allreduce_latency` stands in.
        tensor_allreduce_bandwidth: its bytes per second beyond the latency; None:
            `allreduce_bandwidth`.
        serial_fraction: share of the devices' summed busy time that serialises.
        serial_fractions: the serial fraction with k devices at work at once, for
            k = 1..n (first 1.0); empty: `serial_fraction` whatever the concurrency.
        pair_fraction: time of two independent pieces of work started together on one
            device over their time one after the other, within [1/2, 1]: an overlapped
            pair's time over its forward's and backward's.
        relative_spread: the benchmarks' relative spread (interquartile range / median),
            the uncertainty these terms carry.
        num_devices: logical devices the benchmarks ran on.
    """

    step_fixed: float = 0.0
    per_variable: float = 0.0
    per_replica: float = 0.0
    per_replica_variable: float = 0.0
    pipeline_fixed: float = 0.0
    per_action: float = 0.0
    per_round: float = 0.0
    executor_per_replica: float | None = None
    executor_per_replica_variable: float | None = None
    allreduce_latency: float = 0.0
    allreduce_bandwidth: float = 10e9
    tensor_allreduce_latency: float | None = None
    tensor_allreduce_bandwidth: float | None = None
    serial_fraction: float = 0.0
    serial_fractions: tuple[float, ...] = ()
    pair_fraction: float = 1.0
    relative_spread: float = 0.0
    num_devices: int = 1

    def __post_init__(self):
        values = dataclasses.asdict(self)
        values["serial_fractions"] = min(self.serial_fractions, default=0.0)
        # The executor's fixed cost is relative to a strategy's step: their sum is its own.
        values["step_fixed+pipeline_fixed"] = self.step_fixed + values.pop("pipeline_fixed")
        negative = {
            name: value for name, value in values.items() if value is not None and value < 0
        }
        bandwidths = {
            "allreduce_bandwidth": self.allreduce_bandwidth,
            "tensor_allreduce_bandwidth": self.tensor_allreduce_bandwidth,
        }
        zero = {name: value for name, value in bandwidths.items() if value == 0}
        if negative or zero:
            raise ValueError(
                f"Machine costs must be >= 0 and the bandwidths > 0. Received: {negative or zero}"
            )
        if any(not 0 < fraction <= 1 for fraction in self.serial_fractions):
            raise ValueError(
                "Serial fractions lie in (0, 1]. "
                f"Received: serial_fractions={self.serial_fractions}"
            )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "serial_fractions": list(self.serial_fractions)}

    @classmethod
    def from_json(cls, data: dict) -> MachineCosts:
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"Unknown machine cost fields {sorted(unknown)}; known: {names}")
        return cls(**{**data, "serial_fractions": tuple(data.get("serial_fractions", ()))})

    def allreduce_seconds(self, num_bytes: float, group_size: int) -> float:
        """One ring all-reduce of `num_bytes` over `group_size` devices: latency + traffic.

        Example:
            >>> MachineCosts(allreduce_latency=1e-3, allreduce_bandwidth=1e9).allreduce_seconds(
            ...     1e6, 2)
            0.002
        """
        if group_size <= 1:
            return 0.0
        traffic = 2 * (group_size - 1) / group_size * num_bytes / self.allreduce_bandwidth
        return self.allreduce_latency + traffic

    def tensor_allreduce_seconds(self, num_bytes: float, group_size: int) -> float:
        """One all-reduce of `num_bytes` within a tensor group of `group_size`, inside a
        step: the in-graph latency and bandwidth, MirroredStrategy's when not measured.

        Example:
            >>> MachineCosts(allreduce_latency=1.0, tensor_allreduce_latency=1e-4,
            ...              tensor_allreduce_bandwidth=1e9).tensor_allreduce_seconds(1e6, 2)
            0.0011
        """
        if self.tensor_allreduce_latency is None:
            return self.allreduce_seconds(num_bytes, group_size)
        in_graph = dataclasses.replace(
            self,
            allreduce_latency=self.tensor_allreduce_latency,
            allreduce_bandwidth=self.tensor_allreduce_bandwidth or self.allreduce_bandwidth,
        )
        return in_graph.allreduce_seconds(num_bytes, group_size)

    def step_seconds(self, variables: int) -> float:
        """A training step's framework cost on one device for a model of `variables`."""
        return self.step_fixed + self.per_variable * variables

    def replica_seconds(self, replicas: int, variables: int, executor: bool = False) -> float:
        """What `replicas` data-parallel replicas of a model with `variables` add per step:
        MirroredStrategy's replicas, or with `executor` the pipeline executor's copies
        (MirroredStrategy's terms when the executor's were not measured).

        Example:
            >>> MachineCosts(per_replica=1.0, executor_per_replica=0.5).replica_seconds(
            ...     2, 10, executor=True)
            1.0
        """
        if replicas <= 1:
            return 0.0
        if executor and self.executor_per_replica is not None:
            per_variable = self.executor_per_replica_variable or 0.0
            return replicas * (self.executor_per_replica + per_variable * variables)
        return replicas * (self.per_replica + self.per_replica_variable * variables)

    def shared_compute(self, makespan: float, summed_busy: float) -> float:
        """Compute time of a step whose devices share processors: the devices' summed busy
        time sped up by as much as the step's concurrency (summed busy time over the
        makespan) allows, and at least the makespan.

        Example:
            >>> MachineCosts(serial_fraction=0.9).shared_compute(1.0, 4.0)
            3.6
            >>> MachineCosts(serial_fractions=(1.0, 0.5, 0.5, 0.5)).shared_compute(2.0, 2.0)
            2.0
        """
        if not self.serial_fractions or makespan <= 0:
            return max(makespan, self.serial_fraction * summed_busy)
        concurrency = min(max(summed_busy / makespan, 1.0), len(self.serial_fractions))
        return max(makespan, summed_busy / self.speedup(concurrency))

    def speedup(self, concurrency: float) -> float:
        """How many times faster than one after the other the work of `concurrency`
        devices at once runs (1 / serial fraction), linearly between whole device counts.

        Example:
            >>> MachineCosts(serial_fractions=(1.0, 0.5, 0.5)).speedup(1.5)
            1.5
        """
        lower = min(int(concurrency), len(self.serial_fractions))
        upper = min(lower + 1, len(self.serial_fractions))
        share = concurrency - lower
        low, high = (1.0 / self.serial_fractions[k - 1] for k in (lower, upper))
        return low + share * (high - low)


def step_uncertainty(step_time: float, costs: MachineCosts, block_spread: float = 0.0) -> float:
    """The ± seconds a predicted step carries from the measurements' own spread.

    The block timings' and the machine benchmarks' relative spreads add in quadrature.

    Example:
        >>> round(step_uncertainty(0.1, MachineCosts(relative_spread=0.03), 0.04), 6)
        0.005
    """
    return step_time * math.hypot(costs.relative_spread, block_spread)
