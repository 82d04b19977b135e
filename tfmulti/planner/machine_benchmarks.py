"""Small benchmarks of what a training step costs beyond its blocks, run once per machine.

Each benchmark runs the framework itself on work too small to matter, so what it
times is the framework: a Keras training step of a tiny model of two sizes on one device
(fixed cost, per variable) and under MirroredStrategy (per replica, per replica and
variable), the pipeline
executor on tiny stages (fixed cost, per action, per loop round) and a hybrid mesh's
data-parallel copies of it (per copy, per copy and variable), an
all-reduce of two sizes (latency, bandwidth) as MirroredStrategy calls it and as a
tensor group runs it inside a step, the same matrix products on one and
on n logical devices at once (how much of their work serialises), and two chains of them
on one device at once (how much an overlapped pair's halves overlap). Every figure is the
median of repeated steps, so a burst of load from other processes moves it little, and
each benchmark model's fastest of `_BUILDS` builds counts; the interquartile range over
the median is kept as the terms' uncertainty. Within `timed_with_callbacks` the steps run
a training run's callbacks, so what those add to a step is part of the terms.

The numbers go into the cost cache beside the block costs (`CostCache.put_machine`),
keyed by the device count and how they were timed (`machine_key`), so a later plan on the
same machine measures nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable, Iterator

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti.costing.cost_cache import CostCache
from tfmulti.pipeline.schedules import build_schedule
from tfmulti.planner.machine import MachineCosts
from tfmulti.planner.scoring import NO_PIPELINE, executed_actions
from tfmulti.platform.runtime.quiet_logs import warnings_only

_STEPS = 16
_WARMUP_STEPS = 4
# Fresh builds of each benchmark model; the fastest one's step counts.
_BUILDS = 3
# How the benchmarks time steps; a cost cache measured otherwise is measured again.
# 2: each benchmark's fastest of `_BUILDS` builds (1: a single build); 3: the tensor
# group's in-graph all-reduce timed on its own; 4: the executor's fixed cost may be
# below a strategy step's.
_TIMING = 4
# Makes the callbacks a training run adds to each step (`timed_with_callbacks`).
_STEP_CALLBACKS: contextvars.ContextVar[Callable[[], list] | None] = contextvars.ContextVar(
    "step_callbacks", default=None
)
# Dense layers of the small and the large benchmark model: the difference in variables
# gives each replica's cost per variable.
_SMALL_LAYERS, _LARGE_LAYERS = 2, 16
# All-reduces chained in one function to time a tensor group's in-graph all-reduce.
_CHAIN = 8


def machine_costs(
    devices: list[str], cache: CostCache | None = None, remeasure: bool = False
) -> MachineCosts:
    """The machine's `MachineCosts` over `devices`: from `cache`, else measured and cached.

    Args:
        devices: the logical devices a plan lays models out on (two or more for the
            data-parallel, pipeline and overlap terms).
        cache: where the numbers are kept (`CostCache`), or None to measure each time.
        remeasure: measure even if `cache` holds them.

    Example:
        >>> costs = machine_costs(logical_device_names("CPU"), CostCache("costs.json"))
    """
    key = machine_key(len(devices))
    if cache is not None and not remeasure:
        held = cache.get_machine(key)
        if held is not None:
            return MachineCosts.from_json(held)
    costs = measure_machine_costs(devices)
    if cache is not None:
        cache.put_machine(key, costs.to_json())
        cache.save()
    return costs


def machine_key(num_devices: int) -> str:
    """The cost cache's key for the machine's costs over `num_devices`, measured the way
    this version measures them (`_TIMING`) and with or without a training run's callbacks:
    costs measured another way are measured again.

    Example:
        >>> machine_key(4)
        'devices=4,timing=4'
    """
    callbacks = ",callbacks" if _STEP_CALLBACKS.get() is not None else ""
    return f"devices={num_devices},timing={_TIMING}{callbacks}"


def measure_machine_costs(devices: list[str]) -> MachineCosts:
    """Runs every benchmark over `devices` (about a minute on an idle 2-core CPU, a few
    under load)."""
    started = time.perf_counter()
    spreads = []
    one_small, one_large = _keras_step_seconds(devices[:1], spreads)
    step_fixed, per_variable = _fixed_and_per_variable(one_small, one_large)
    latency, bandwidth = _allreduce_costs(devices, spreads)
    tensor_latency, tensor_bandwidth = _tensor_allreduce_costs(devices, spreads)
    per_replica = per_replica_variable = 0.0
    pipeline_fixed = per_action = per_round = 0.0
    executor_per_replica = executor_per_replica_variable = None
    if len(devices) > 1:
        many_small, many_large = _keras_step_seconds(devices, spreads)
        # What the replicas add beyond one device, per replica.
        per_replica, per_replica_variable = _fixed_and_per_variable(
            (many_small - one_small) / len(devices), (many_large - one_large) / len(devices)
        )
        pipeline_fixed, per_action, per_round = _executor_seconds(devices[:2], step_fixed, spreads)
        executor_per_replica, executor_per_replica_variable = _executor_replica_seconds(
            devices, per_action, latency, spreads
        )
    serial_fractions = tuple(float(value) for value in _serial_fractions(devices, spreads))
    costs = MachineCosts(
        step_fixed=float(step_fixed),
        per_variable=float(per_variable),
        per_replica=float(per_replica),
        per_replica_variable=float(per_replica_variable),
        pipeline_fixed=float(pipeline_fixed),
        per_action=float(per_action),
        per_round=float(per_round),
        executor_per_replica=executor_per_replica,
        executor_per_replica_variable=executor_per_replica_variable,
        allreduce_latency=float(latency),
        allreduce_bandwidth=float(bandwidth),
        tensor_allreduce_latency=tensor_latency,
        tensor_allreduce_bandwidth=tensor_bandwidth,
        serial_fraction=serial_fractions[-1],
        serial_fractions=serial_fractions,
        pair_fraction=float(_serial_fractions(devices[:1] * 2, spreads)[-1]),
        relative_spread=float(statistics.median(spreads)) if spreads else 0.0,
        num_devices=len(devices),
    )
    logging.info("Measured the machine's costs in %.0fs: %s", time.perf_counter() - started, costs)
    return costs


@contextlib.contextmanager
def timed_with_callbacks(make_callbacks: Callable[[], list]) -> Iterator[None]:
    """Within this context every timed `fit` (benchmarks and a model's own one-device
    step) runs `make_callbacks()`, fresh ones per model, as a training run does: what they
    add to each step is part of what a run of `scripts/train.py` pays.

    Example:
        >>> with timed_with_callbacks(lambda: timing_callbacks(scratch)):
        ...     costs = machine_costs(devices)
    """
    token = _STEP_CALLBACKS.set(make_callbacks)
    try:
        yield
    finally:
        _STEP_CALLBACKS.reset(token)


def _median_and_spread(samples: list[float], spreads: list[float]) -> float:
    quartiles = statistics.quantiles(samples, n=4)
    median = statistics.median(samples)
    spreads.append((quartiles[2] - quartiles[0]) / median if median > 0 else 0.0)
    return median


class _StepClock(keras.callbacks.Callback):
    """Seconds between consecutive training steps' ends, within one `fit`."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def intervals(self) -> list[float]:
        return [float(t) for t in np.diff(self.ends)]


def _tiny_model(num_layers: int) -> keras.Model:
    inputs = keras.Input((8,))
    x = inputs
    for _ in range(num_layers):
        x = keras.layers.Dense(8)(x)
    return keras.Model(inputs, x)


def interleaved_step_seconds(
    runs, spreads: list[float], rounds: int = 3, builds: int = 1
) -> list[float]:
    """Median seconds per training step of each run's model, the runs' steps interleaved,
    the fastest of `builds` fresh builds.

    Each run is (build, x, y): `build()` returns a compiled model, each step trains on all
    of `x`. Every model is traced first; then `rounds` times, each model trains a few
    steps in turn, so a burst of load from other processes falls on every run alike
    (comparing two runs is what the benchmarks do). A model's step time depends on the
    state it was built into (the same tiny model's median step moves by 1.5x between
    builds in one idle process), so with `builds` > 1 every run is built and timed again
    that many times and its fastest build's median counts, as validation counts a
    layout's fastest run. The counted build's relative spread is added to `spreads`.
    """
    fastest = [None] * len(runs)
    for _ in range(builds):
        for index, (median, spread) in enumerate(_timed_build(runs, rounds)):
            if fastest[index] is None or median < fastest[index][0]:
                fastest[index] = (median, spread)
    spreads.extend(spread for _, spread in fastest)
    return [median for median, _ in fastest]


def _timed_build(runs, rounds: int) -> list[tuple[float, float]]:
    """(median seconds per step, relative spread) of each run's freshly built model, the
    runs' steps interleaved over `rounds`."""
    make_callbacks = _STEP_CALLBACKS.get() or list
    models = []
    try:
        for build, x, y in runs:
            model = build()
            data = tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)).repeat()
            callbacks = make_callbacks()
            models.append((model, data, callbacks))
            with warnings_only():
                model.fit(
                    data, steps_per_epoch=_WARMUP_STEPS, epochs=1, verbose=0, callbacks=callbacks
                )
        samples = [[] for _ in runs]
        for _ in range(rounds):
            for index, (model, data, callbacks) in enumerate(models):
                clock = _StepClock()
                with warnings_only():
                    model.fit(
                        data,
                        steps_per_epoch=_STEPS // rounds + 1,
                        epochs=1,
                        verbose=0,
                        callbacks=[*callbacks, clock],
                    )
                samples[index].extend(clock.intervals())
    finally:
        _release_callbacks(callback for _, _, callbacks in models for callback in callbacks)
    spreads = []
    medians = [_median_and_spread(times, spreads) for times in samples]
    return list(zip(medians, spreads, strict=True))


def _release_callbacks(callbacks) -> None:
    """Keras skips `on_train_end` when `fit` raises (SIGTERM's `Terminated`): a callback
    holding the process's SIGTERM and a scratch directory (`SaveOnPreemption`) gives them
    back through its `release`."""
    for callback in callbacks:
        release = getattr(callback, "release", None)
        if release is not None:
            release()


def _keras_step_seconds(devices: list[str], spreads: list[float]) -> list[float]:
    """Training steps of the small and the large tiny model, on one device or mirrored
    over `devices`."""
    if len(devices) == 1:
        strategy = tf.distribute.OneDeviceStrategy(devices[0])
    else:
        from tfmulti.platform.runtime.distribute_strategy import cross_device_ops

        kind = tf.config.list_logical_devices()[0].device_type
        strategy = tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=cross_device_ops("auto", kind)
        )

    def builder(num_layers):
        def build():
            with strategy.scope():
                model = _tiny_model(num_layers)
                model.compile(optimizer="adam", loss="mse")
            return model

        return build

    data = np.ones((2 * len(devices), 8), "float32")
    runs = [(builder(layers), data, data) for layers in (_SMALL_LAYERS, _LARGE_LAYERS)]
    return interleaved_step_seconds(runs, spreads, builds=_BUILDS)


def _executor_seconds(
    devices: list[str], step_fixed: float, spreads: list[float]
) -> tuple[float, float, float]:
    """(fixed seconds per step, per action, per loop round) of the pipeline executor, beyond
    a one-device step: 1F1B over two tiny stages traced action by action at two
    micro-batch counts (fixed and per action), and run as a rolled loop (per round), the
    three runs' steps interleaved.

    The fixed part may be negative, down to -`step_fixed`: the executor's step runs under
    TensorFlow's default strategy, and can cost less than a `OneDeviceStrategy` step."""
    from tfmulti.pipeline.runtime import PipelineModel

    def run(num_microbatches, rolled):
        def build():
            stages = [_tiny_model(1), _tiny_model(1)]
            model = PipelineModel(stages, devices, num_microbatches, "1f1b", rolled=rolled)
            model.compile(optimizer="adam", loss="mse")
            return model

        data = np.ones((2 * num_microbatches, 8), "float32")
        return build, data, data

    variants = ((2, False), (8, False), (8, True))
    few, many, looped = (
        seconds - step_fixed
        for seconds in interleaved_step_seconds(
            [run(*variant) for variant in variants], spreads, builds=_BUILDS
        )
    )
    # Unrolled, each of the two stages runs a forward and a backward per micro-batch.
    few_actions, many_actions = 4 * 2, 4 * 8
    looped_actions, rounds = executed_actions(build_schedule("1f1b", 2, 8))
    per_action = max(many - few, 0.0) / (many_actions - few_actions)
    fixed = max(few - per_action * few_actions, -step_fixed)
    per_round = max(looped - fixed - per_action * looped_actions, 0.0) / max(rounds, 1)
    return fixed, per_action, per_round


def _executor_replica_seconds(
    devices: list[str], per_action: float, allreduce_latency: float, spreads: list[float]
) -> tuple[float, float]:
    """(per copy, per copy and variable) that a hybrid mesh's data-parallel copies add to
    the pipeline executor's step: one copy of a one-stage pipeline of the small and of the
    large tiny model against one copy per device, their steps interleaved. What the cost
    model adds on its own is left out: each copy's actions and the gradients' all-reduce."""
    from tfmulti.hybrid.hybrid_model import HybridPipelineModel

    data = np.ones((2 * len(devices), 8), "float32")

    def run(layers: int, copies: int):
        def build():
            model = HybridPipelineModel(
                lambda: [_tiny_model(layers)], [[device] for device in devices[:copies]]
            )
            model.compile(optimizer="adam", loss="mse")
            return model

        return build, data, data

    copies = len(devices)
    one_small, many_small, one_large, many_large = interleaved_step_seconds(
        [run(layers, count) for layers in (_SMALL_LAYERS, _LARGE_LAYERS) for count in (1, copies)],
        spreads,
        builds=_BUILDS,
    )
    actions, _ = executed_actions(build_schedule(NO_PIPELINE, 1, 1))
    modelled = (per_action * actions * (copies - 1) + allreduce_latency) / copies
    return _fixed_and_per_variable(
        (many_small - one_small) / copies, (many_large - one_large) / copies, modelled
    )


def _fixed_and_per_variable(
    small: float, large: float, modelled: float = 0.0
) -> tuple[float, float]:
    """(fixed, per trainable variable) seconds from the small and the large tiny model's
    seconds, less `modelled` (what the cost model adds on its own) from the fixed part;
    neither below zero."""
    per_variable = max(large - small, 0.0) / (2 * (_LARGE_LAYERS - _SMALL_LAYERS))
    fixed = max(small - per_variable * 2 * _SMALL_LAYERS - modelled, 0.0)
    return float(fixed), float(per_variable)


def _allreduce_costs(devices: list[str], spreads: list[float]) -> tuple[float, float]:
    """(latency, bytes per second) of an all-reduce over `devices`, from two sizes."""
    if len(devices) < 2:
        return 0.0, 10e9
    from tfmulti.platform.runtime.distribute_strategy import cross_device_ops

    kind = tf.config.list_logical_devices()[0].device_type
    strategy = tf.distribute.MirroredStrategy(
        devices=devices, cross_device_ops=cross_device_ops("auto", kind)
    )
    sizes = (16, 8 << 20)
    seconds = []
    for size in sizes:
        values = strategy.experimental_distribute_values_from_function(
            lambda context, size=size: tf.ones((size // 4,), tf.float32)
        )

        @tf.function
        def reduce(values=values):
            return strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None)

        reduce()
        samples = []
        for _ in range(15):
            start = time.perf_counter()
            reduce().numpy()
            samples.append(time.perf_counter() - start)
        seconds.append(_median_and_spread(samples, spreads))
    group = len(devices)
    traffic = 2 * (group - 1) / group * (sizes[1] - sizes[0])
    bandwidth = traffic / max(seconds[1] - seconds[0], 1e-9)
    return seconds[0], bandwidth


def _tensor_allreduce_costs(
    devices: list[str], spreads: list[float]
) -> tuple[float | None, float | None]:
    """(latency, bytes per second) of a tensor group's all-reduce over `devices` as split
    layers run it: in the step's graph (`replicated.sum_on_every_device`), not a call of
    its own as MirroredStrategy's. A chain of `_CHAIN` all-reduces in one function, less
    the same function without them, at two sizes; (None, None) on one device."""
    if len(devices) < 2:
        return None, None
    sizes = (64 * len(devices), 1 << 20)  # floats: a ring chunk each, and 4 MB
    seconds = []
    for size in sizes:
        values = []
        for device in devices:
            with tf.device(device):
                values.append(tf.ones((1, size), tf.float32))

        runs = {count: _chained_all_reduces(devices, count) for count in (0, _CHAIN)}
        samples = {count: [] for count in runs}
        for run in runs.values():
            run(*values)  # traced
        for _ in range(15):
            for count, run in runs.items():
                start = time.perf_counter()
                run(*values)[0].numpy()
                samples[count].append(time.perf_counter() - start)
        chain, alone = (_median_and_spread(samples[count], spreads) for count in (_CHAIN, 0))
        seconds.append(max(chain - alone, 0.0) / _CHAIN)
    group = len(devices)
    traffic = 2 * (group - 1) / group * (sizes[1] - sizes[0]) * 4
    bandwidth = traffic / max(seconds[1] - seconds[0], 1e-9)
    return float(seconds[0]), float(bandwidth)


def _chained_all_reduces(devices: list[str], count: int) -> Callable:
    """A function of one tensor per device that all-reduces them `count` times in a row,
    as a tensor group's split layers do inside a step, and sums each device's result."""
    from tfmulti.collectives.replicated import sum_on_every_device

    @tf.function
    def run(*tensors):
        tensors = list(tensors)
        for _ in range(count):
            tensors = sum_on_every_device(tensors, devices)
        return [tf.reduce_sum(tensor) for tensor in tensors]

    return run


def _serial_fractions(devices: list[str], spreads: list[float]) -> tuple[float, ...]:
    """The serial fraction of the same matrix products on k devices at once, k = 1..n
    (`overlap_fractions`). A device listed twice runs two independent chains at once."""
    inputs = []
    for device in devices:
        with tf.device(device):
            inputs.append(tf.random.stateless_normal((192, 192), seed=(1, 2)))

    def matrix_chain(index):
        value = matrix = inputs[index]
        for _ in range(24):
            value = tf.tanh(tf.matmul(value, matrix))
        return tf.reduce_sum(value)

    return overlap_fractions(devices, matrix_chain, spreads)


def model_serial_fractions(
    build, x, y, devices: list[str], spreads: list[float]
) -> tuple[float, ...]:
    """The serial fraction of a model's own work on k devices at once, k = 1..n: its
    forward and backward pass on `x` (a copy on each device), as `overlap_fractions`.
    Small ops overlap less than the benchmark's matrix products, so a model's figures are
    the ones its layouts meet.

    Args:
        build: returns the compiled model (called once per device, under that device).
        x, y: one device's batch and its targets.
        devices: the logical devices.
        spreads: the timing's relative spread is appended here.
    """
    copies = []
    for device in devices:
        with tf.device(device):
            copies.append((build(), tf.constant(x), tf.constant(y)))

    def forward_and_backward(index):
        model, inputs, labels = copies[index]
        with tf.GradientTape() as tape:
            predicted = model(inputs, training=True)
            value = model.compute_loss(x=inputs, y=labels, y_pred=predicted)
        gradients = tape.gradient(value, model.trainable_variables)
        return tf.add_n([tf.reduce_sum(gradient) for gradient in gradients])

    return overlap_fractions(devices, forward_and_backward, spreads)


def overlap_fractions(
    devices: list[str], work, spreads: list[float], rounds: int = 15
) -> tuple[float, ...]:
    """The serial fraction of `work` on k devices at once, for every k = 1..n: seconds of
    `work(i)` on devices 0..k-1 at once over k times its seconds on device 0 alone.

    Measured at k = 1, 2, 4, ... and n, the counts timed in turn `rounds` times so a slow
    spell of the machine falls on every count alike (a count's median over its rounds
    counts); counts between are interpolated in speedup (1 / fraction). Each measured
    count's relative spread is appended to `spreads`. `work(i)` builds device i's ops and
    returns a scalar tensor.

    Example:
        >>> overlap_fractions(devices[:4], matrix_chain, [])  # two cores
        (1.0, 0.52, 0.51, 0.5)
    """
    count = len(devices)
    if count < 2:
        return (1.0,)
    measured_counts = sorted({*(2**power for power in range(count.bit_length())), count})
    measured_counts = [k for k in measured_counts if k <= count]

    def at_once(k):
        @tf.function
        def run():
            results = []
            for index, device in enumerate(devices[:k]):
                with tf.device(device):
                    results.append(work(index))
            return results

        return run

    runs = {k: at_once(k) for k in measured_counts}
    for run in runs.values():
        for _ in range(2):  # traced, then warm
            [result.numpy() for result in run()]
    samples = {k: [] for k in measured_counts}
    for _ in range(rounds):
        for k, run in runs.items():
            start = time.perf_counter()
            [result.numpy() for result in run()]
            samples[k].append(time.perf_counter() - start)
    medians = {k: _median_and_spread(samples[k], spreads) for k in measured_counts}
    speedups = {k: k * medians[1] / medians[k] for k in measured_counts}
    return tuple(
        1.0 / min(max(_interpolated(speedups, k), 1.0), float(k)) for k in range(1, count + 1)
    )


def _interpolated(points: dict[int, float], k: int) -> float:
    """`points` (sorted keys) read at `k`, linearly between the nearest keys."""
    below = max(key for key in points if key <= k)
    above = min(key for key in points if key >= k)
    if above == below:
        return points[k]
    share = (k - below) / (above - below)
    return points[below] + share * (points[above] - points[below])
