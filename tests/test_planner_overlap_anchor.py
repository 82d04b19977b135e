"""The model's overlap curve anchored on train.py's data-parallel step (`overlap_anchor`)."""

import dataclasses
import json

import pytest

from tfmulti.planner import AffineTime, BlockCost, Hardware, ModelCosts, blocks_at
from tfmulti.planner.costs import DataParallelStep
from tfmulti.planner.machine import MachineCosts
from tfmulti.planner.overlap_anchor import anchored_overlap, overlap_scale, scaled_overlap
from tfmulti.planner.scoring import score_layout
from tfmulti.planner.search import search_layouts
from tfmulti.platform.mesh import HybridMesh

# A machine whose devices overlap less the more of them work at once.
MACHINE = MachineCosts(
    step_fixed=0.005,
    per_replica=0.001,
    per_action=3e-4,
    allreduce_latency=1e-3,
    allreduce_bandwidth=1e9,
    serial_fraction=0.6,
    serial_fractions=(1.0, 0.8, 0.7, 0.6),
)


def _costs(data_parallel_step=None):
    block = BlockCost("block", 1000, AffineTime(1e-3, 1e-4), AffineTime(2e-3, 2e-4), 4096, 2, 0, 2)
    return ModelCosts(
        "transformer",
        {},
        "tokens",
        None,
        (block,) * 4,
        tensor_parallel_sizes=(1, 2),
        run_overhead=0.003,
        data_parallel_step=data_parallel_step,
    )


def _data_parallel_time(costs, hardware, devices=4, batch=32):
    blocks = blocks_at(costs, batch / devices, 1, hardware)
    return score_layout(
        blocks, HybridMesh(data=devices), None, 1, 1, (), hardware, 8, run_overhead=0.003
    )


def test_scaling_the_curve_in_speed_up_keeps_one_device_and_spans_serial_to_the_measured():
    unchanged = scaled_overlap(MACHINE, 1.0)
    assert unchanged.serial_fractions == pytest.approx(MACHINE.serial_fractions)
    assert scaled_overlap(MACHINE, 0.0).serial_fractions == (1.0,) * 4
    # Speed-up 1 + a (s - 1): at 4 devices 1/0.6 = 5/3, halved past 1: 4/3.
    half = scaled_overlap(MACHINE, 0.5)
    assert half.serial_fractions[0] == 1.0
    assert 1 / half.serial_fractions[3] == pytest.approx(1 + 0.5 * (5 / 3 - 1))
    assert 1 / half.serial_fraction == pytest.approx(1 + 0.5 * (5 / 3 - 1))
    with pytest.raises(ValueError, match=">= 0"):
        scaled_overlap(MACHINE, -1.0)


def test_the_anchored_curve_predicts_the_data_parallel_step_it_was_anchored_on():
    costs = _costs()
    hardware = Hardware(machine=MACHINE)
    planned = _data_parallel_time(costs, hardware)
    for measured in (0.8 * planned.step_time, 1.1 * planned.step_time):
        step = DataParallelStep(devices=4, batch=32, seconds=measured)
        anchored, scale = anchored_overlap(
            dataclasses.replace(costs, data_parallel_step=step), hardware
        )
        layout = _data_parallel_time(costs, anchored)
        assert layout.step_time == pytest.approx(measured, rel=1e-9)
        # Closed form: the four replicas' summed work over the compute time left.
        replica_work = sum(
            b.forward_time + b.backward_time for b in blocks_at(costs, 8, 1, hardware)
        )
        compute = measured - planned.allreduce_time - planned.overhead_time
        speedup = 4 * replica_work / compute
        assert 1 / anchored.machine.serial_fractions[3] == pytest.approx(speedup)
        assert speedup == pytest.approx(1 + scale * (1 / 0.6 - 1))
        # Only the overlap moved: the all-reduce and the framework's terms did not.
        assert (layout.allreduce_time, layout.overhead_time) == pytest.approx(
            (planned.allreduce_time, planned.overhead_time)
        )


def test_a_step_outside_what_any_overlap_predicts_takes_the_nearest_end():
    costs = _costs()
    hardware = Hardware(machine=MACHINE)
    serial = _data_parallel_time(costs, Hardware(machine=scaled_overlap(MACHINE, 0.0)))
    slower = DataParallelStep(4, 32, 2 * serial.step_time)
    assert overlap_scale(costs, hardware, slower) == 0.0
    faster = DataParallelStep(4, 32, serial.allreduce_time)  # no time left to compute in
    anchored, scale = anchored_overlap(_costs(faster), hardware)
    assert scale == 1e3
    # Fully parallel at most: a replica's own work still takes its time.
    assert _data_parallel_time(costs, anchored).step_time > faster.seconds
    assert anchored_overlap(_costs(), hardware) == (hardware, None)
    assert anchored_overlap(_costs(faster), Hardware()) == (Hardware(), None)


def test_search_scores_layouts_without_a_pipe_axis_on_the_anchored_curve_pipelines_on_the_timed():
    hardware = Hardware(machine=MACHINE)
    plain = {layout.key: layout for layout in search_layouts(_costs(), 4, 32, hardware)}
    measured = 0.7 * plain[_key(plain, HybridMesh(data=4))].step_time
    step = DataParallelStep(4, 32, measured)
    anchored = {layout.key: layout for layout in search_layouts(_costs(step), 4, 32, hardware)}
    assert anchored.keys() == plain.keys()
    assert anchored[_key(plain, HybridMesh(data=4))].step_time == pytest.approx(measured)
    for key, layout in plain.items():
        if layout.mesh.pipe > 1:
            assert anchored[key].step_time == layout.step_time
        elif layout.mesh.num_devices > 1:
            # More overlap than timed: every layout without a pipe axis gets faster.
            assert anchored[key].step_time < layout.step_time
    assert any(layout.mesh.pipe == 1 and layout.mesh.tensor > 1 for layout in plain.values())


def _key(layouts, mesh):
    return next(key for key, layout in layouts.items() if layout.mesh == mesh)


def test_the_cost_file_keeps_the_data_parallel_step_and_rejects_a_bad_one():
    costs = _costs(DataParallelStep(4, 32, 0.05))
    assert ModelCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    assert ModelCosts.from_json(_costs().to_json()).data_parallel_step is None
    data = costs.to_json()
    data["data_parallel_step"] = {"devices": 1, "batch": 32, "seconds": 0.05}
    with pytest.raises(ValueError, match="2 or more devices"):
        ModelCosts.from_json(data)


def test_the_anchor_times_the_data_parallel_step_in_the_one_device_steps_rounds(monkeypatch):
    from tfmulti.planner import validation

    commands = []
    # Each round: batch 4, batch 32 on one device, then batch 32 on 2 devices.
    runs = iter([[0.03], [0.09], [0.07, 0.06], [0.02], [0.08], [0.05, 0.05, 0.09]])

    def run_layout(command, *args):
        commands.append(command)
        return next(runs), None

    monkeypatch.setattr(validation, "run_timed_training", run_layout)
    costs = ModelCosts("mlp", {}, "digits", None, (), measured_batch_sizes=(4, 32))
    steps, data_parallel = validation.anchor_steps(
        costs, [4, 32], "/nonexistent", data_parallel=(2, 32), repeats=2
    )
    assert steps == [0.02, 0.08]
    assert data_parallel == DataParallelStep(devices=2, batch=32, seconds=0.05)
    strategies = [[a for a in command if a.startswith("--strategy=")] for command in commands]
    assert strategies == ([["--strategy=one_device"]] * 2 + [["--strategy=mirrored"]]) * 2
    assert "--virtual_devices=2" in commands[2] and "--batch_size=32" in commands[2]

    def fail_mirrored(command, *args):
        return (None, "Killed") if "--strategy=mirrored" in command else ([0.01], None)

    monkeypatch.setattr(validation, "run_timed_training", fail_mirrored)
    with pytest.raises(
        ValueError,
        match="data-parallel on 2 devices at batch 32: Killed .*--noanchor_data_parallel",
    ):
        validation.anchor_steps(costs, [4, 32], "/nonexistent", data_parallel=(2, 32))


def test_the_expected_fastest_of_k_runs_is_the_mean_over_every_k_of_them():
    import itertools
    import statistics

    from tfmulti.planner.validation import expected_fastest

    runs = [0.031, 0.027, 0.044, 0.029, 0.035, 0.030]
    for draws in range(1, len(runs) + 1):
        every = [min(subset) for subset in itertools.combinations(runs, draws)]
        assert expected_fastest(runs, draws) == pytest.approx(statistics.mean(every))
    assert expected_fastest(runs, len(runs)) == min(runs)
    assert expected_fastest(runs, 1) == pytest.approx(statistics.mean(runs))
    with pytest.raises(ValueError, match="draws <= 6"):
        expected_fastest(runs, 7)


def test_anchor_runs_beyond_the_counted_ones_count_as_their_expected_fastest(monkeypatch):
    from tfmulti.planner import validation

    # Four runs of the one-device step at batch 8 (one round each): medians 4, 1, 3, 2.
    runs = iter([[0.004], [0.001], [0.003], [0.002]])
    monkeypatch.setattr(validation, "run_timed_training", lambda *args: (next(runs), None))
    costs = ModelCosts("mlp", {}, "digits", None, (), measured_batch_sizes=(8,))
    steps, _ = validation.anchor_steps(costs, [8], "/nonexistent", repeats=4, counted_runs=2)
    # Of the six pairs, 1 is the fastest of three, 2 of two, 3 of one.
    assert steps == [pytest.approx((3 * 0.001 + 2 * 0.002 + 0.003) / 6)]


def test_a_tensor_groups_all_reduces_cost_the_in_graph_terms_when_measured():
    costs = _costs()
    strategy_only = dataclasses.replace(MACHINE, allreduce_latency=1e-3, allreduce_bandwidth=1e9)
    in_graph = dataclasses.replace(
        strategy_only, tensor_allreduce_latency=5e-5, tensor_allreduce_bandwidth=4e9
    )
    activation_bytes = 4096 * 8
    for machine, (latency, bandwidth) in ((strategy_only, (1e-3, 1e9)), (in_graph, (5e-5, 4e9))):
        blocks = blocks_at(costs, 8, 2, Hardware(machine=machine))
        one = latency + 2 * 1 / 2 * activation_bytes / bandwidth  # ring of two
        assert blocks[0].communication_time == pytest.approx(2 * 2 * one)
    # The data-parallel gradient sum keeps MirroredStrategy's all-reduce.
    assert in_graph.allreduce_seconds(1e6, 2) == strategy_only.allreduce_seconds(1e6, 2)
    assert MachineCosts.from_json(in_graph.to_json()) == in_graph
    old_cache = {k: v for k, v in in_graph.to_json().items() if not k.startswith("tensor_")}
    assert MachineCosts.from_json(old_cache).tensor_allreduce_latency is None
    with pytest.raises(ValueError, match="tensor_allreduce_bandwidth"):
        dataclasses.replace(in_graph, tensor_allreduce_bandwidth=0.0)
