"""The planner's accuracy figures, its measured machine costs, and how they enter a step."""

import dataclasses
import json
import os

import numpy as np
import pytest
from script_runner import run_script

from tfmulti.pipeline.schedules import build_schedule
from tfmulti.planner import (
    AffineTime,
    BlockCost,
    Hardware,
    ModelCosts,
    blocks_at,
    load_costs,
    save_costs,
)
from tfmulti.planner.accuracy import (
    _kendall_tau_b,
    accuracy,
    best_gap,
    kendall_tau,
    mean_absolute_percentage_error,
    repeat_error,
)
from tfmulti.planner.machine import MachineCosts, step_uncertainty
from tfmulti.planner.scoring import executed_actions, score_layout
from tfmulti.planner.search import search_layouts
from tfmulti.platform.mesh import HybridMesh


def test_mape_is_the_mean_of_absolute_errors_over_measured():
    # |90-100|/100 = 0.1, |150-120|/120 = 0.25, |50-50|/50 = 0
    assert mean_absolute_percentage_error([90, 150, 50], [100, 120, 50]) == pytest.approx(
        (0.1 + 0.25 + 0.0) / 3
    )


def test_kendall_tau_counts_concordant_and_discordant_pairs():
    # Pairs (1,2) and (1,3) agree, (2,3) disagree: (2 - 1) / 3.
    assert kendall_tau([1, 2, 3], [10, 30, 20]) == pytest.approx(1 / 3)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2], [5, 5]) is None
    assert kendall_tau([1], [2]) is None


def test_kendall_tau_without_scipy_matches_tau_b_with_ties():
    first, second = [1, 2, 2, 3, 5], [2, 1, 4, 4, 6]
    # concordant 7, discordant 1, untied pairs 9 in each: (7 - 1) / sqrt(9 * 9)
    assert _kendall_tau_b(first, second) == pytest.approx(6 / 9)
    assert kendall_tau(first, second) == pytest.approx(6 / 9)


def test_best_gap_is_how_much_slower_the_predicted_best_measured():
    assert best_gap([1.0, 2.0, 3.0], [110.0, 100.0, 120.0]) == pytest.approx(0.1)
    assert best_gap([3.0, 1.0], [50.0, 40.0]) == 0.0


def test_repeat_error_scores_each_layouts_counted_run_against_its_other_runs():
    # Layout 1: counted 0.10 against 0.30 -> 0.2/0.3; layout 2: 0.05 against 0.07 and
    # 0.05 -> 0.02/0.07 and 0; layout 3 ran once and adds nothing.
    runs = [[0.30, 0.10], [0.05, 0.07, 0.05], [0.2]]
    assert repeat_error(runs) == pytest.approx((0.2 / 0.3 + 0.02 / 0.07 + 0.0) / 3)
    assert repeat_error([[0.2], [0.3]]) is None
    figures = accuracy([0.1, 0.05, 0.2], [0.10, 0.05, 0.2], runs)
    assert figures.mape == 0.0 and figures.repeat_error == pytest.approx(repeat_error(runs))
    assert "runs of one layout differ by 31.7% (MAPE)" in figures.summary()
    with pytest.raises(ValueError, match="> 0"):
        repeat_error([[0.1, 0.0]])


def test_accuracy_needs_one_positive_measurement_per_prediction():
    figures = accuracy([1.0, 2.0], [1.0, 2.5])
    assert figures.count == 2 and figures.kendall_tau == pytest.approx(1.0)
    assert "MAPE 10.0%" in figures.summary()
    with pytest.raises(ValueError, match="one measured time per predicted"):
        accuracy([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="> 0"):
        accuracy([1.0], [0.0])


MACHINE = MachineCosts(
    step_fixed=0.005,
    per_replica=0.001,
    per_replica_variable=1e-4,
    pipeline_fixed=0.002,
    per_action=3e-4,
    per_round=2e-4,
    allreduce_latency=1e-3,
    allreduce_bandwidth=1e9,
    serial_fraction=0.9,
    pair_fraction=0.8,
    relative_spread=0.05,
    num_devices=4,
)


def _tensor_costs():
    block = BlockCost("block", 1000, AffineTime(1e-3, 1e-4), AffineTime(2e-3, 2e-4), 4096, 2, 0, 2)
    return ModelCosts("transformer", {}, "tokens", None, (block,) * 2, tensor_parallel_sizes=(1, 2))


def _costs(num_blocks=4):
    block = BlockCost("block", 1000, AffineTime(1e-3, 1e-4), AffineTime(2e-3, 2e-4), 4096, 0, 0, 2)
    return ModelCosts("transformer", {}, "tokens", None, (block,) * num_blocks)


def test_mirrored_step_adds_serial_compute_replica_dispatch_and_measured_allreduce():
    costs = _costs()
    hardware = Hardware(machine=MACHINE)
    blocks = blocks_at(costs, 8, 1, hardware)
    layout = score_layout(blocks, HybridMesh(data=4), None, 1, 1, (), hardware, num_variables=8)
    replica_work = sum(b.forward_time + b.backward_time for b in blocks)
    assert layout.pipeline_time == pytest.approx(0.9 * 4 * replica_work)
    assert layout.allreduce_time == pytest.approx(1e-3 + 2 * 3 / 4 * 4 * 4000 / 1e9)
    assert layout.overhead_time == pytest.approx(0.005 + 4 * (0.001 + 1e-4 * 8))
    assert layout.step_time == pytest.approx(
        layout.pipeline_time + layout.allreduce_time + layout.overhead_time
    )
    assert layout.uncertainty == pytest.approx(0.05 * layout.step_time)


def test_a_hybrid_meshs_copies_pay_the_executors_replica_terms_and_mirrored_ones_strategys():
    machine = dataclasses.replace(
        MACHINE, executor_per_replica=2e-4, executor_per_replica_variable=3e-5
    )
    hardware = Hardware(machine=machine)

    def replica_cost(mesh, schedule, boundaries, machine_costs):
        blocks = blocks_at(_costs(), 16 // mesh.data, 1, hardware)
        with_replicas, without = (
            score_layout(
                blocks,
                scored_mesh,
                schedule,
                1,
                1,
                boundaries,
                Hardware(machine=machine_costs),
                num_variables=8,
            ).overhead_time
            for scored_mesh in (mesh, dataclasses.replace(mesh, data=1))
        )
        executor_actions = (mesh.data - 1) * machine_costs.per_action * 2 * mesh.pipe
        return with_replicas - without - executor_actions * (mesh.pipe > 1)

    # Two copies of a two-stage pipeline: the executor's terms, 4 variables per stage.
    hybrid = HybridMesh(data=2, pipe=2)
    assert replica_cost(hybrid, "gpipe", (2,), machine) == pytest.approx(2 * (2e-4 + 3e-5 * 4))
    # Four MirroredStrategy replicas: the strategy's own terms, as before.
    mirrored = HybridMesh(data=4)
    assert replica_cost(mirrored, None, (), machine) == pytest.approx(4 * (1e-3 + 1e-4 * 8))
    # A cost cache measured before the executor's terms existed: the strategy's stand in.
    assert replica_cost(hybrid, "gpipe", (2,), MACHINE) == pytest.approx(2 * (1e-3 + 1e-4 * 4))


def test_the_executors_replica_terms_leave_out_what_the_cost_model_adds_itself(monkeypatch):
    import tensorflow as tf

    from tfmulti.hybrid.hybrid_model import HybridPipelineModel
    from tfmulti.planner import machine_benchmarks

    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:4]
    built = []

    def step_seconds(runs, spreads, builds=1):
        for build, x, _ in runs:
            model = build()
            assert isinstance(model, HybridPipelineModel) and len(x) % len(model.replicas) == 0
            built.append((len(model.replicas), len(model.trainable_variables)))
        # (1 copy, small), (4 copies, small), (1 copy, large), (4 copies, large)
        return [0.010, 0.018, 0.020, 0.036]

    monkeypatch.setattr(machine_benchmarks, "interleaved_step_seconds", step_seconds)
    per_copy, per_variable = machine_benchmarks._executor_replica_seconds(
        devices, per_action=1e-4, allreduce_latency=4e-4, spreads=[]
    )
    assert built == [(1, 4), (4, 4), (1, 32), (4, 32)]
    # Per copy beyond one: small 8 ms / 4, large 16 ms / 4; 28 more variables.
    assert per_variable == pytest.approx((0.004 - 0.002) / 28)
    # Less the small model's 4 variables, 3 more copies' 2 actions, one all-reduce.
    expected = 0.002 - 4 * per_variable - (3 * 2 * 1e-4 + 4e-4) / 4
    assert per_copy == pytest.approx(expected)


def test_each_benchmark_counts_its_fastest_builds_median_step(monkeypatch):
    """Three builds of two models, interleaved: each model's fastest build's median counts,
    and that build's spread, whichever build it was."""
    from tfmulti.planner import machine_benchmarks

    # Per build, (median, spread) of the two runs: run 0 fastest in build 2, run 1 in build 0.
    timed = iter([[(3.0, 0.1), (1.0, 0.2)], [(4.0, 0.3), (2.0, 0.4)], [(2.0, 0.5), (5.0, 0.6)]])
    monkeypatch.setattr(machine_benchmarks, "_timed_build", lambda runs, rounds: next(timed))
    spreads = []
    medians = machine_benchmarks.interleaved_step_seconds(["a", "b"], spreads, builds=3)
    assert medians == [2.0, 1.0] and spreads == [0.5, 0.2]
    with pytest.raises(StopIteration):
        next(timed)


def test_benchmark_steps_run_a_training_runs_callbacks_within_the_context(tmp_path):
    """Each build of each model gets fresh callbacks from the factory, which see every
    step; outside the context no callback but the clock runs."""
    import keras

    from tfmulti.planner import machine_benchmarks
    from tfmulti.run.callbacks import ThroughputLogger
    from tfmulti.run.training import timing_callbacks

    made, steps = [], []

    class CountSteps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append(batch)

    def make_callbacks():
        callbacks = [*timing_callbacks(str(tmp_path)), CountSteps()]
        made.append(callbacks)
        return callbacks

    def build():
        model = machine_benchmarks._tiny_model(1)
        model.compile(optimizer="sgd", loss="mse")
        return model

    data = np.ones((4, 8), "float32")
    with machine_benchmarks.timed_with_callbacks(make_callbacks):
        machine_benchmarks.interleaved_step_seconds([(build, data, data)], [], rounds=2, builds=2)
    per_build = machine_benchmarks._WARMUP_STEPS + 2 * (machine_benchmarks._STEPS // 2 + 1)
    assert len(made) == 2 and len(steps) == 2 * per_build
    assert sum(isinstance(c, ThroughputLogger) for c in made[0]) == 1
    assert len(list(tmp_path.iterdir())) == 2  # one scratch directory per build
    machine_benchmarks.interleaved_step_seconds([(build, data, data)], [])
    assert len(made) == 2 and len(steps) == 2 * per_build


def test_the_executors_terms_come_from_three_interleaved_runs(monkeypatch):
    """Fixed, per action and per round from 1F1B over two stages at m = 2 and m = 8 action
    by action, and m = 8 rolled, timed together and less a one-device step."""
    import tensorflow as tf

    from tfmulti.pipeline.runtime import PipelineModel
    from tfmulti.planner import machine_benchmarks

    calls = []
    actions, rounds = executed_actions(build_schedule("1f1b", 2, 8))

    def step_seconds(runs, spreads, builds=1):
        calls.append(builds)
        built = [build() for build, _, _ in runs]
        assert all(isinstance(model, PipelineModel) for model in built)
        assert [len(x) for _, x, _ in runs] == [4, 16, 16]
        # One-device step 8 ms; executor 2 ms, 0.1 ms per action, 0.05 ms per round.
        return [0.010 + 8 * 1e-4, 0.010 + 32 * 1e-4, 0.010 + actions * 1e-4 + rounds * 5e-5]

    monkeypatch.setattr(machine_benchmarks, "interleaved_step_seconds", step_seconds)
    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:2]
    fixed, per_action, per_round = machine_benchmarks._executor_seconds(devices, 0.008, [])
    assert calls == [machine_benchmarks._BUILDS]
    assert per_action == pytest.approx(1e-4) and fixed == pytest.approx(0.002)
    assert per_round == pytest.approx(5e-5)


def test_an_executor_step_cheaper_than_a_strategys_gives_a_negative_fixed_cost(monkeypatch):
    """The executor runs under TensorFlow's default strategy, whose step can cost less than
    a OneDeviceStrategy one (0.2-0.5 ms on a 2-core EPYC): the difference is kept, down to
    the strategy's whole fixed cost."""
    import tensorflow as tf

    from tfmulti.planner import machine_benchmarks

    actions, rounds = executed_actions(build_schedule("1f1b", 2, 8))

    def step_seconds(runs, spreads, builds=1):
        # One-device step 8 ms; the executor's own fixed cost 7.5 ms, 0.1 ms per action.
        return [0.0075 + 8 * 1e-4, 0.0075 + 32 * 1e-4, 0.0075 + actions * 1e-4]

    monkeypatch.setattr(machine_benchmarks, "interleaved_step_seconds", step_seconds)
    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:2]
    fixed, per_action, per_round = machine_benchmarks._executor_seconds(devices, 0.008, [])
    assert fixed == pytest.approx(-0.0005) and per_action == pytest.approx(1e-4)
    assert per_round == pytest.approx(0.0, abs=1e-12)
    # The executor's own fixed cost (the strategy's plus this) is never below 0, even
    # where the m = 8 step's noise makes its actions look dear.
    monkeypatch.setattr(
        machine_benchmarks, "interleaved_step_seconds", lambda *_, **__: [0.001, 0.101, 0.101]
    )
    fixed, _, _ = machine_benchmarks._executor_seconds(devices, 0.008, [])
    assert fixed == pytest.approx(-0.008)


def test_pipeline_step_pays_the_executor_per_action_and_per_round():
    hardware = Hardware(machine=MACHINE)
    blocks = blocks_at(_costs(), 2, 1, hardware)
    layout = score_layout(blocks, HybridMesh(pipe=2), "1f1b", 4, 1, (2,), hardware)
    actions, rounds = executed_actions(build_schedule("1f1b", 2, 4))
    assert (actions, rounds) == (24, 6)
    assert layout.overhead_time == pytest.approx(0.005 + 0.002 + 24 * 3e-4 + 6 * 2e-4)


def test_dualpipev_pairs_take_the_machines_pair_fraction_of_their_halves():
    from tfmulti.pipeline.simulate import CostModel, StageCost, simulate

    blocks = blocks_at(_costs(), 2, 1, Hardware())
    plan = build_schedule("dualpipev", 2, 4)
    stages = [StageCost(b.forward_time, b.backward_time) for b in blocks]
    predicted = {}
    for fraction in (1.0, 0.6):
        hardware = Hardware(machine=MachineCosts(pair_fraction=fraction))
        layout = score_layout(blocks, HybridMesh(pipe=2), "dualpipev", 4, 2, (1, 2, 3), hardware)
        # The simulator with every pair's time written out by hand.
        pairs = {}
        for device, actions in enumerate(plan.device_actions):
            for start in plan.pair_starts(device):
                forward, backward = actions[start], actions[start + 1]
                both = stages[forward.stage].forward + stages[backward.stage].backward
                pairs[(forward.stage, backward.stage)] = fraction * both
        assert len(pairs) == 4  # (0, 3), (3, 0), (1, 2), (2, 1)
        transfer = max(b.activation_bytes for b in blocks[:-1]) / hardware.bandwidth
        expected = simulate(plan, CostModel(tuple(stages), transfer, pairs)).makespan
        assert layout.pipeline_time == pytest.approx(expected)
        predicted[fraction] = layout.pipeline_time
    assert predicted[0.6] < predicted[1.0]


def test_without_machine_costs_nothing_is_added():
    blocks = blocks_at(_costs(), 8, 1, Hardware())
    layout = score_layout(blocks, HybridMesh(data=2), None, 1, 1, (), Hardware())
    assert layout.overhead_time == 0.0 and layout.uncertainty == 0.0


def test_uncertainty_adds_the_spreads_in_quadrature():
    assert step_uncertainty(1.0, MachineCosts(relative_spread=0.3), 0.4) == pytest.approx(0.5)


def test_machine_costs_round_trip_and_refuse_negative_terms():
    assert MachineCosts.from_json(MACHINE.to_json()) == MACHINE
    measured = dataclasses.replace(
        MACHINE, executor_per_replica=0.0, executor_per_replica_variable=1e-5
    )
    assert MachineCosts.from_json(json.loads(json.dumps(measured.to_json()))) == measured
    # A cost cache written before the executor's replica terms reads with none.
    old = MACHINE.to_json()
    del old["executor_per_replica"], old["executor_per_replica_variable"]
    assert MachineCosts.from_json(old).executor_per_replica is None
    with pytest.raises(ValueError, match="executor_per_replica_variable"):
        MachineCosts(executor_per_replica_variable=-1.0)
    with pytest.raises(ValueError, match="per_action"):
        MachineCosts(per_action=-1.0)
    # The executor's fixed cost is relative to a strategy's step: below it, not below 0.
    assert MachineCosts(step_fixed=0.003, pipeline_fixed=-0.001).pipeline_fixed == -0.001
    with pytest.raises(ValueError, match="pipeline_fixed"):
        MachineCosts(step_fixed=0.003, pipeline_fixed=-0.004)
    with pytest.raises(ValueError, match="Unknown machine cost fields"):
        MachineCosts.from_json({"per_step": 1.0})


def test_shared_compute_speeds_up_by_the_steps_own_concurrency():
    # Two cores: two devices at work at once run 1.6x as fast; more add nothing.
    machine = MachineCosts(serial_fraction=0.625, serial_fractions=(1.0, 0.8, 0.8 * 2 / 3, 0.4))
    # A step whose devices never overlap (summed busy = makespan) gets no speed-up.
    assert machine.shared_compute(3.0, 3.0) == pytest.approx(3.0)
    # Two devices busy at once on average: 1 / 0.8 = 1.25x.
    assert machine.shared_compute(1.0, 2.0) == pytest.approx(2.0 / 1.25)
    # 1.5 at once: halfway between 1x and 1.25x in speed-up.
    assert machine.shared_compute(2.0, 3.0) == pytest.approx(3.0 / 1.125)
    # Four at once: the four-device figure, as the single fraction would give.
    assert machine.shared_compute(1.0, 4.0) == pytest.approx(4.0 * 0.4)
    # Never faster than the pipeline's own makespan.
    assert machine.shared_compute(1.0, 1.0) == pytest.approx(1.0)
    # Without the curve, the one fraction applies whatever the concurrency.
    assert MachineCosts(serial_fraction=0.625).shared_compute(3.0, 3.0) == pytest.approx(3.0)
    assert MachineCosts(serial_fraction=0.625).shared_compute(1.0, 4.0) == pytest.approx(2.5)


def test_replicas_of_a_sequential_pipeline_overlap_as_two_devices_do():
    # Four devices at once overlap much more than two: the single four-device fraction
    # would make two replicas of a one-micro-batch pipeline (two devices at work at any
    # time) 1.5x too fast.
    machine = dataclasses.replace(MACHINE, serial_fraction=0.6, serial_fractions=(1, 0.9, 0.8, 0.6))
    hardware = Hardware(machine=machine)
    blocks = blocks_at(_costs(), 16, 1, hardware)
    work = sum(b.forward_time + b.backward_time for b in blocks)
    layout = score_layout(blocks, HybridMesh(data=2, pipe=2), "gpipe", 1, 1, (2,), hardware)
    assert layout.pipeline_time == pytest.approx(0.9 * 2 * work, rel=1e-2)
    # Four replicas at once: their summed work at the four-device fraction.
    replica_blocks = blocks_at(_costs(), 8, 1, hardware)
    replica_work = sum(b.forward_time + b.backward_time for b in replica_blocks)
    mirrored = score_layout(replica_blocks, HybridMesh(data=4), None, 1, 1, (), hardware)
    assert mirrored.pipeline_time == pytest.approx(0.6 * 4 * replica_work)


def test_a_tensor_groups_allreduce_waits_take_no_share_of_the_processor():
    from tfmulti.pipeline.balance import Block

    machine = MachineCosts(serial_fraction=0.6, serial_fractions=(1.0, 0.9, 0.8, 0.6))
    hardware = Hardware(machine=machine)
    # Each block's passes take 8 s on every device of the group, 2 s of it waiting.
    blocks = [Block(3.0, 5.0, communication_time=2.0), Block(3.0, 5.0, communication_time=2.0)]
    layout = score_layout(blocks, HybridMesh(tensor=4), None, 1, 1, (), hardware)
    computing = 4 * (16.0 - 4.0)  # four devices' compute, added up
    # Three devices' worth at once on average (48 s over a 16 s makespan): 1 / 0.8 faster;
    # then each device's own 4 s of waiting.
    assert layout.pipeline_time == pytest.approx(computing * 0.8 + 4.0)
    # blocks_at marks what it adds for the all-reduces as waiting.
    split = blocks_at(_tensor_costs(), 8, 2, hardware)[0]
    whole = blocks_at(_tensor_costs(), 8, 1, hardware)[0]
    assert whole.communication_time == 0.0 and split.communication_time > 0.0
    # The per-example part splits two ways; the fixed part and the all-reduces do not.
    assert split.forward_time + split.backward_time == pytest.approx(
        (1e-3 + 1e-4 * 8 / 2) + (2e-3 + 2e-4 * 8 / 2) + split.communication_time
    )


def test_serial_fractions_round_trip_and_are_checked():
    machine = dataclasses.replace(MACHINE, serial_fractions=(1.0, 0.7, 0.6, 0.55))
    assert MachineCosts.from_json(json.loads(json.dumps(machine.to_json()))) == machine
    with pytest.raises(ValueError, match="serial_fractions"):
        MachineCosts(serial_fractions=(1.0, 0.0))
    costs = dataclasses.replace(_costs(), serial_fraction=0.6, serial_fractions=(1.0, 0.6))
    assert ModelCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    # A cost file written before the curve reads with none.
    old = costs.to_json()
    del old["serial_fractions"]
    assert ModelCosts.from_json(old).serial_fractions == ()


def test_machine_costs_are_measured_once_then_read_from_the_cost_cache(tmp_path, monkeypatch):
    from tfmulti.costing.cost_cache import CostCache
    from tfmulti.planner import machine_benchmarks

    calls = []

    def measure(devices):
        calls.append(list(devices))
        return MACHINE

    monkeypatch.setattr(machine_benchmarks, "measure_machine_costs", measure)
    path = str(tmp_path / "costs.json")
    devices = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
    assert machine_benchmarks.machine_costs(devices, CostCache(path)) == MACHINE
    assert machine_benchmarks.machine_costs(devices, CostCache(path)) == MACHINE
    assert len(calls) == 1
    with open(path) as file:
        assert json.load(file)["machine"]["devices=4,timing=4"] == MACHINE.to_json()
    machine_benchmarks.machine_costs(devices, CostCache(path), remeasure=True)
    assert len(calls) == 2
    # Timed with a training run's callbacks, the costs are another entry, measured anew.
    with machine_benchmarks.timed_with_callbacks(list):
        machine_benchmarks.machine_costs(devices, CostCache(path))
        machine_benchmarks.machine_costs(devices, CostCache(path))
    assert len(calls) == 3
    with open(path) as file:
        assert set(json.load(file)["machine"]) == {
            "devices=4,timing=4",
            "devices=4,timing=4,callbacks",
        }


def test_the_tensor_allreduce_benchmark_times_a_chain_of_all_reduces():
    """What is timed is the chain itself: each all-reduce adds the same ops to the graph
    (the benchmarks themselves run for real in
    test_every_benchmark_runs_with_a_training_runs_callbacks)."""
    import tensorflow as tf

    from tfmulti.planner import machine_benchmarks

    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:2]
    values = [tf.ones((1, 64)) for _ in devices]
    op_counts = [
        len(
            machine_benchmarks._chained_all_reduces(devices, count)
            .get_concrete_function(*values)
            .graph.get_operations()
        )
        for count in (0, 1, 8)
    ]
    assert op_counts[1] > op_counts[0] and op_counts[2] - op_counts[0] == 8 * (
        op_counts[1] - op_counts[0]
    )
    assert machine_benchmarks._tensor_allreduce_costs(devices[:1], []) == (None, None)


def test_a_models_own_overlap_is_measured_on_logical_devices_with_its_copies():
    import keras
    import tensorflow as tf

    from tfmulti.planner import machine_benchmarks

    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:2]
    built = []

    def build():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(3)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        built.append(model)
        return model

    spreads = []
    x, y = np.ones((16, 8), "float32"), np.zeros((16,), "int32")
    serial = machine_benchmarks.model_serial_fractions(build, x, y, devices, spreads)
    assert serial[0] == 1.0 and 0.5 <= serial[1] <= 1.0 and len(spreads) == 2
    # One copy per device, its weights placed there.
    placed = [tf.DeviceSpec.from_string(model.weights[0].value.device) for model in built]
    assert [spec.device_index for spec in placed] == [
        tf.DeviceSpec.from_string(device).device_index for device in devices
    ]


def test_the_models_own_serial_fraction_replaces_the_machines_in_the_search():
    hardware = Hardware(machine=MACHINE)
    machine_only = search_layouts(_costs(), 4, 32, hardware)
    own = search_layouts(dataclasses.replace(_costs(), serial_fraction=0.3), 4, 32, hardware)
    data_parallel = [layout for layout in own if layout.mesh == HybridMesh(data=4)][0]
    blocks = blocks_at(_costs(), 8, 1, hardware)
    replica_work = sum(b.forward_time + b.backward_time for b in blocks)
    assert data_parallel.pipeline_time == pytest.approx(max(0.3 * 4 * replica_work, replica_work))
    assert min(layout.step_time for layout in own) < min(
        layout.step_time for layout in machine_only
    )
    costs = dataclasses.replace(_costs(), serial_fraction=0.3)
    assert ModelCosts.from_json(costs.to_json()) == costs
    # The model's curve, when measured, replaces the machine's too.
    curve = dataclasses.replace(
        _costs(), serial_fraction=0.5, serial_fractions=(1.0, 1.0, 1.0, 0.5)
    )
    layouts = search_layouts(curve, 4, 32, Hardware(machine=MACHINE))
    data_parallel = [layout for layout in layouts if layout.mesh == HybridMesh(data=4)][0]
    assert data_parallel.pipeline_time == pytest.approx(0.5 * 4 * replica_work)


def test_validate_json_reports_mape_kendall_tau_and_best_gap(tmp_path):
    """Also: the anchored one-device step is re-timed among the layouts, its drift since
    planning is reported, and the MAPE with the model anchored on its fastest run."""
    block = BlockCost("dense", 1000, AffineTime(1e-4, 1e-5), AffineTime(2e-4, 2e-5), 256)
    path = str(tmp_path / "costs.json")
    planned_anchor = 10.0  # far slower than any train.py step: a slow spell when planned
    costs = ModelCosts(
        "mlp",
        {},
        "digits",
        None,
        (block,) * 4,
        measured_batch_sizes=(2, 16),
        anchor_steps=(5e-5, planned_anchor),
    )
    save_costs(costs, path)
    result = run_script(
        "plan.py",
        f"--costs={path}",
        "--devices=1",
        "--global_batch=16",
        "--machine_costs=none",
        "--validate=1",
        "--validate_repeats=1",
        "--validate_epochs=2",
        "--validate_steps=4",
        f"--validate_dir={tmp_path / 'runs'}",
        "--json",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout)
    assert {"mape", "kendall_tau", "best_gap", "count"} <= set(output)
    (validated,) = output["validation"]
    assert validated["measured_step_time"] > 0
    assert validated["measured_over_predicted"] == pytest.approx(
        validated["measured_step_time"] / validated["step_time"]
    )
    assert output["best_gap"] == 0.0
    # One run per layout: its run is listed, and there is no second run to compare with.
    assert validated["measured_runs"] == [validated["measured_step_time"]]
    assert output["repeat_error"] is None
    # The anchor ran in the round beside the layout, into its own directory.
    check = output["anchor_check"]
    assert check["batch"] == 16 and check["planned_step_time"] == planned_anchor
    assert check["measured_runs"] == [check["measured_step_time"]] and check["error"] is None
    assert sorted(os.listdir(tmp_path / "runs")) == ["layout_1_1", "layout_2_1"]
    drift = check["measured_step_time"] / planned_anchor
    assert output["machine_drift"] == pytest.approx(drift) and drift < 0.1
    assert output["fastest_anchor_mape"] == pytest.approx(
        abs(validated["measured_step_time"] - drift * validated["step_time"])
        / validated["measured_step_time"]
    )


def test_the_summary_says_how_the_anchor_moved_and_scores_the_fastest_anchor():
    from tfmulti.planner.accuracy import accuracy

    # Anchor re-timed 20% faster: the model anchored on it predicts 0.8x.
    faster = accuracy([10.0, 20.0], [8.0, 17.0], machine_drift=0.8)
    assert faster.fastest_anchor_mape == pytest.approx((0 + 1 / 17) / 2)
    assert "ran 20.0% faster among the layouts than when planned" in faster.summary()
    assert "predictions score MAPE 2.9%" in faster.summary()
    # Re-timed slower: the planning runs were the fastest, so nothing changes.
    slower = accuracy([10.0, 20.0], [12.0, 25.0], machine_drift=1.2)
    assert slower.fastest_anchor_mape == slower.mape
    assert "ran 20.0% slower among the layouts" in slower.summary()
    assert "planned" not in accuracy([10.0], [9.0]).summary()
    with pytest.raises(ValueError, match="machine_drift must be > 0"):
        accuracy([10.0], [9.0], machine_drift=0.0)


def test_blocks_are_scaled_to_add_up_to_the_measured_one_device_step():
    from tfmulti.planner.measure import scaled_to_step

    blocks = [
        BlockCost("a", 1, AffineTime(2.0, 1.0), AffineTime(2.0, 1.0), 4.0),
        BlockCost("b", 1, AffineTime(4.0, 0.0), AffineTime(0.0, 2.0), 4.0),
    ]
    # Fixed parts add up to 8, per-example to 4; the step less its framework cost is 4 + 2b.
    scaled = scaled_to_step(blocks, AffineTime(5.0, 2.0), step_framework=1.0)
    assert scaled[0].forward_seconds == AffineTime(1.0, 0.5)
    assert scaled[1].backward_seconds == AffineTime(0.0, 1.0)
    total = sum(b.forward_seconds.at(8) + b.backward_seconds.at(8) for b in scaled)
    assert total == pytest.approx(4.0 + 2.0 * 8)


def test_a_part_the_blocks_measured_as_zero_is_spread_like_the_other():
    from tfmulti.planner.measure import scaled_to_step

    # A small model's cost per example fitted to 0: the step's is spread as the fixed part.
    blocks = [
        BlockCost("a", 1, AffineTime(3.0, 0.0), AffineTime(1.0, 0.0), 4.0),
        BlockCost("b", 1, AffineTime(0.0, 0.0), AffineTime(4.0, 0.0), 4.0),
    ]
    scaled = scaled_to_step(blocks, AffineTime(9.0, 2.0), step_framework=1.0)
    assert [b.forward_seconds for b in scaled] == [AffineTime(3.0, 0.75), AffineTime(0.0, 0.0)]
    assert scaled[1].backward_seconds == AffineTime(4.0, 1.0)
    empty = [BlockCost("c", 1, AffineTime(0.0, 0.0), AffineTime(0.0, 0.0), 4.0)] * 2
    assert scaled_to_step(empty, AffineTime(5.0, 4.0), 1.0)[0].forward_seconds == AffineTime(
        1.0, 1.0
    )


def test_validation_times_the_median_step_after_the_first_epoch_without_epoch_starts():
    from tfmulti.planner.validation import timed_step_seconds

    log = "\n".join(
        f"I1126 10:00:00.0 1 callbacks.py:78] step {step}: 100.0 examples/sec, {ms} ms/step"
        for step, ms in [(1, 900.0), (4, 800.0), (5, 10.0), (6, 12.0), (7, 90.0), (8, 11.0)]
    )
    # 4 steps an epoch: steps 1-4 are the first epoch, step 5 starts the second.
    assert timed_step_seconds(log, 4) == [0.012, 0.09, 0.011]


def test_a_layouts_fastest_run_counts_so_a_slow_spell_over_one_run_does_not(monkeypatch):
    """Load only slows a run, and a slow spell of the machine can cover a whole run: with
    two rounds, each layout's measured step is its faster run's median, not the median of
    every step (which a slow run would drag halfway up)."""
    from tfmulti.planner import validation
    from tfmulti.planner.report import format_validation, validation_accuracy

    runs = iter(
        [
            [0.30, 0.31, 0.29],  # round 1, layout 1: a slow spell
            [0.05, 0.06, 0.05],  # round 1, layout 2
            [0.10, 0.11, 0.10],  # round 2, layout 1
            [0.07, 0.07, 0.08],  # round 2, layout 2: slower than its first run
        ]
    )
    monkeypatch.setattr(validation, "run_timed_training", lambda *args: (next(runs), None))
    layouts = search_layouts(_costs(), 2, 8, Hardware())[:2]
    measured = validation.measure_layouts(layouts, _costs(), 8, "/nonexistent", repeats=2)
    assert [m.measured_step_time for m in measured] == [0.10, 0.05]
    assert len(measured[0].samples) == 6
    assert [m.run_step_times for m in measured] == [(0.30, 0.10), (0.05, 0.07)]
    figures = validation_accuracy(measured)
    assert figures.repeat_error == pytest.approx((0.2 / 0.3 + 0.02 / 0.07) / 2)
    table = format_validation(measured)
    assert "+200%" in table and "+40%" in table and "slowest run" in table
    assert "model's anchor" not in table
    # With the anchor re-timed among them, the table ends with its drift.
    retimed = format_validation(measured, machine_drift=0.5)
    assert retimed.splitlines()[-1].startswith(
        "The one-device step (the model's anchor) ran 50.0% faster among the layouts"
    )


def test_anchor_steps_run_train_py_at_each_size_in_rounds_and_keep_the_fastest(
    monkeypatch,
):
    from tfmulti.planner import validation

    commands = []
    # Round 1: batch 4, batch 32; round 2: batch 4, batch 32 (each run's step times).
    runs = iter([[0.03, 0.02, 0.03], [0.09], [0.01, 0.02, 0.02], [0.08, 0.08, 0.10]])

    def run_layout(command, *args):
        commands.append(command)
        return next(runs), None

    monkeypatch.setattr(validation, "run_timed_training", run_layout)
    costs = ModelCosts("mlp", {}, "digits", None, (), measured_batch_sizes=(4, 32))
    steps, data_parallel = validation.anchor_steps(costs, [4, 32], "/nonexistent", repeats=2)
    assert steps == [0.02, 0.08] and data_parallel is None
    sizes = [[a for a in command if a.startswith("--batch_size=")] for command in commands]
    assert sizes == [["--batch_size=4"], ["--batch_size=32"]] * 2
    assert all("--strategy=one_device" in command for command in commands)
    monkeypatch.setattr(validation, "run_timed_training", lambda *args: (None, "Killed"))
    with pytest.raises(ValueError, match="at batch 4: Killed .*--anchor_repeats=0"):
        validation.anchor_steps(costs, [4, 32], "/nonexistent")


def test_anchoring_takes_the_steps_cost_per_example_and_its_excess_fixed_part_once():
    from tfmulti.planner.measure import anchored_to_steps

    # 4 blocks: fixed 3 ms each, 0.3 ms per example; with the framework (2 ms) a step of
    # 14 ms + 1.2 ms x b. train.py's steps: 30 ms at 4, 58 ms at 32 = 26 ms + 1 ms x b.
    costs = dataclasses.replace(_costs(), measured_batch_sizes=(4, 32))
    anchored = anchored_to_steps(costs, [0.030, 0.058], step_framework=0.002)
    assert anchored.run_overhead == pytest.approx(0.026 - 0.014)
    blocks = anchored.blocks
    assert sum(b.forward_seconds.fixed + b.backward_seconds.fixed for b in blocks) == (
        pytest.approx(0.012)
    )
    for size in (4, 16, 32):
        total = sum(b.forward_seconds.at(size) + b.backward_seconds.at(size) for b in blocks)
        assert 0.002 + anchored.run_overhead + total == pytest.approx(0.026 + 0.001 * size)
    assert anchored.anchor_steps == (0.030, 0.058)
    assert ModelCosts.from_json(json.loads(json.dumps(anchored.to_json()))) == anchored
    # Steps with a smaller fixed part than the blocks' (6 ms + 1 ms x b against 14 ms)
    # leave no script overhead and lower the blocks' fixed parts to theirs: one device
    # still predicts the steps, and each block keeps its share of the fixed part.
    lowered = anchored_to_steps(costs, [0.010, 0.038], 0.002)
    assert lowered.run_overhead == 0.0
    for size in (4, 32):
        total = sum(
            b.forward_seconds.at(size) + b.backward_seconds.at(size) for b in lowered.blocks
        )
        assert 0.002 + total == pytest.approx(0.006 + 0.001 * size)
    shares = [b.forward_seconds.fixed / 0.004 for b in lowered.blocks]
    assert shares == pytest.approx([b.forward_seconds.fixed / 0.012 for b in costs.blocks])
    # Not below the framework's: a fit whose fixed part is under it leaves the blocks none.
    bare = anchored_to_steps(costs, [0.005, 0.033], 0.002)
    assert all(b.forward_seconds.fixed == b.backward_seconds.fixed == 0.0 for b in bare.blocks)
    with pytest.raises(ValueError, match="one step per measured batch size"):
        anchored_to_steps(costs, [0.01], 0.0)


def test_the_scripts_overhead_is_paid_once_a_step_whatever_the_layout():
    hardware = Hardware(machine=MACHINE)
    blocks = blocks_at(_costs(), 8, 1, hardware)
    for mesh, schedule, boundaries in [
        (HybridMesh(data=4), None, ()),
        (HybridMesh(pipe=2), "1f1b", (2,)),
    ]:
        bare, anchored = (
            score_layout(blocks, mesh, schedule, 4, 1, boundaries, hardware, run_overhead=extra)
            for extra in (0.0, 0.005)
        )
        assert anchored.step_time - bare.step_time == pytest.approx(0.005)
        assert anchored.overhead_time - bare.overhead_time == pytest.approx(0.005)


def test_plan_scales_the_measured_blocks_to_train_py_one_device_steps(tmp_path):
    """plan.py with machine costs (read from the cache) times train.py on one device at
    each measured batch size and data-parallel on all devices, as --validate times a
    layout, and anchors the saved costs on those steps."""
    from tfmulti.costing.cost_cache import CostCache
    from tfmulti.planner.machine_benchmarks import machine_key, timed_with_callbacks

    cache = CostCache(str(tmp_path / "cache.json"))
    with timed_with_callbacks(list):
        key = machine_key(2)
    machine = MachineCosts(step_fixed=1e-4, num_devices=2, serial_fractions=(1.0, 0.6))
    cache.put_machine(key, machine.to_json())
    cache.save()
    saved = tmp_path / "costs.json"
    result = run_script(
        "plan.py",
        "--model=mlp",
        "--dataset=digits",
        "--devices=2",
        "--global_batch=16",
        "--measure_rounds=1",
        # The anchor runs as --validate would run a layout: once, 2 epochs of 3 steps.
        "--validate_repeats=1",
        "--anchor_repeats=1",
        "--validate_epochs=2",
        "--validate_steps=3",
        "--top=100",
        f"--cost_cache={tmp_path / 'cache.json'}",
        f"--save_costs={saved}",
        "--json",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    costs = load_costs(str(saved))
    assert costs.measured_batch_sizes == (2, 16) and len(costs.anchor_steps) == 2
    assert json.loads(result.stdout)["model_anchor_steps"] == list(costs.anchor_steps)
    # The blocks take train.py's cost per example; what its fixed part exceeds theirs by
    # is paid once a step, by every layout.
    line = AffineTime.fit(costs.measured_batch_sizes, costs.anchor_steps)
    blocks = costs.blocks
    per_example = sum(
        b.forward_seconds.per_example + b.backward_seconds.per_example for b in blocks
    )
    assert per_example == pytest.approx(line.per_example)
    fixed = machine.step_fixed + sum(
        b.forward_seconds.fixed + b.backward_seconds.fixed for b in blocks
    )
    assert costs.run_overhead == pytest.approx(max(line.fixed - fixed, 0.0))
    output = json.loads(result.stdout)
    layouts = output["layouts"]
    assert all(layout["overhead_time"] >= costs.run_overhead for layout in layouts)
    # train.py's data-parallel step on both devices ran in the same rounds; the 2 x 1 x 1
    # layout is predicted on the overlap curve anchored on it.
    step = costs.data_parallel_step
    assert (step.devices, step.batch) == (2, 16) and step.seconds > 0
    assert output["model_data_parallel_step"] == dataclasses.asdict(step)
    (mirrored,) = [
        layout for layout in layouts if layout["mesh"]["data"] == 2 and layout["zero"] == 0
    ]
    scale = output["overlap_scale"]
    if 0.0 < scale < 1e3:
        assert mirrored["step_time"] == pytest.approx(step.seconds, rel=1e-6)
    else:  # the step lay beyond what no overlap or full overlap predicts
        assert (mirrored["step_time"] < step.seconds) == (scale == 0.0)


def test_every_benchmark_runs_with_a_training_runs_callbacks(tmp_path, monkeypatch):
    """The whole benchmark suite over two logical devices, each step with train.py's
    callbacks (one build each, to stay short): every model it fits accepts them."""
    import tensorflow as tf

    from tfmulti.planner import machine_benchmarks
    from tfmulti.run.training import timing_callbacks

    monkeypatch.setattr(machine_benchmarks, "_BUILDS", 1)
    made = []

    def make_callbacks():
        made.append(1)
        return timing_callbacks(str(tmp_path))

    # Each benchmark's answer and the spreads it adds, as the suite calls it (spied on,
    # each still runs for real).
    seen = {}

    def spy(name):
        real = getattr(machine_benchmarks, name)

        def measured(devices, *args):
            spreads = args[-1]
            before = len(spreads)
            result = real(devices, *args)
            seen.setdefault(name, []).append((len(devices), result, len(spreads) - before))
            return result

        monkeypatch.setattr(machine_benchmarks, name, measured)

    for name in (
        "_allreduce_costs",
        "_serial_fractions",
        "_executor_replica_seconds",
        "_tensor_allreduce_costs",
    ):
        spy(name)
    devices = [device.name for device in tf.config.list_logical_devices("CPU")][:2]
    with machine_benchmarks.timed_with_callbacks(make_callbacks):
        costs = machine_benchmarks.measure_machine_costs(devices)
    # Keras one device and mirrored (2 models each), the executor (3), its copies (4).
    assert len(made) == 2 + 2 + 3 + 4
    assert costs.step_fixed + costs.per_variable > 0 and costs.num_devices == 2
    # All-reduce and device overlap, measured on the logical devices.
    ((_, (latency, bandwidth), allreduce_spreads),) = seen["_allreduce_costs"]
    assert latency > 0 and bandwidth > 0
    (_, serial, serial_spreads), (_, pair, pair_spreads) = seen["_serial_fractions"]
    assert serial[0] == 1.0 and len(serial) == 2 and 0.5 <= serial[1] <= 1.0
    # Two chains at once on one device: an overlapped pair's share of its halves.
    assert 0.5 <= pair[-1] <= 1.0
    # One spread per all-reduce size and per device count timed.
    assert allreduce_spreads + serial_spreads + pair_spreads == 6
    # The hybrid executor's copies, timed for real: one spread per model timed.
    ((_, terms, executor_spreads),) = seen["_executor_replica_seconds"]
    assert executor_spreads == 4 and all(term >= 0 for term in terms)
    # A tensor group's all-reduce inside a step: a chain of them, less none, at two sizes.
    ((_, (in_graph_latency, in_graph_bandwidth), tensor_spreads),) = seen["_tensor_allreduce_costs"]
    assert in_graph_latency >= 0 and in_graph_bandwidth > 0 and tensor_spreads == 4
