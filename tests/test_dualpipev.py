"""DualPipeV: a V of two chunks per device with overlapped F&B pairs; closed form, equality."""

import dataclasses

import numpy as np
import pytest
from pipeline_runtime_models import (
    dense_stages,
    loops_in_step,
    max_weight_difference,
    regression_batches,
    train_pipeline_and_chain,
)
from script_runner import TWO_EPOCHS, assert_same_training, read_metrics, run_script

from tfmulti.pipeline import (
    Action,
    CostModel,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
    validate_schedule,
)
from tfmulti.pipeline.overlapped_pairs import body_pair_partners, pair_partners
from tfmulti.pipeline.round_loop import loop_schedule

GRID = [(p, m) for p in range(1, 7) for m in range(2 * p, 25)]


def _simulate(p, m, forward, input_grad, weight_grad, pair_time=None):
    """DualPipeV with chunk costs F, I, W and, if given, every overlapped pair taking F&B."""
    schedule = build_schedule("dualpipev", p, m)
    costs = CostModel.uniform(schedule.num_stages, forward, input_grad + weight_grad, weight_grad)
    if pair_time is not None:
        stages = range(schedule.num_stages)
        pair_times = {(f, b): pair_time for f in stages for b in stages}
        costs = CostModel(costs.stages, pair_times=pair_times)
    return simulate(schedule, costs)


def test_dualpipev_puts_stages_d_and_2p_minus_1_minus_d_on_device_d():
    schedule = build_schedule("dualpipev", 4, 8)
    assert schedule.stage_devices == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.chunks == 2 and schedule.splits_backward


def test_dualpipev_pairs_a_forward_of_one_chunk_with_a_backward_of_the_other():
    schedule = build_schedule("dualpipev", 4, 12)
    for device, actions in enumerate(schedule.device_actions):
        starts = schedule.pair_starts(device)
        assert starts, device
        for index in starts:
            forward, backward = actions[index], actions[index + 1]
            assert (forward.kind, backward.kind) == ("F", "B")
            assert {forward.stage, backward.stage} == {device, 7 - device}


def test_dualpipev_order_on_2_devices_is_pytorchs():
    # ScheduleDualPipeV(2 ranks, 4 micro-batches), with its OVERLAP_F_B pairs in brackets.
    expected = [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 [0F3 3B1] [3F2 0B0] 3B2 [3F3 0B1] 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 [2F2 1B0] [1F3 2B1] [2F3 1B1] 2B2 1B2 2I3 1I3 2W3 1W3",
    ]
    schedule = build_schedule("dualpipev", 2, 4)
    for device, actions in enumerate(schedule.device_actions):
        names = [f"{a.stage}{a.kind}{a.microbatch}" for a in actions]
        for index in reversed(schedule.pair_starts(device)):
            names[index : index + 2] = [f"[{names[index]} {names[index + 1]}]"]
        assert " ".join(names) == expected[device]


def test_dualpipev_takes_two_chunks_and_at_least_2p_micro_batches():
    assert build_schedule("dualpipev", 2, 4, 2) == build_schedule("dualpipev", 2, 4)
    with pytest.raises(ValueError, match="chunks must be 2. Received: chunks=1"):
        build_schedule("dualpipev", 2, 4, 1)
    with pytest.raises(ValueError, match="num_microbatches >= 8. Received: num_microbatches=6"):
        build_schedule("dualpipev", 4, 6)


def test_dualpipev_validates_for_any_devices_and_micro_batches():
    for p, m in GRID:
        validate_schedule(build_schedule("dualpipev", p, m))


def test_a_pair_that_is_not_a_forward_then_a_backward_is_refused_in_one_line():
    schedule = build_schedule("1f1b", 1, 2)
    bad = Schedule("pairs", 2, schedule.stage_devices, schedule.device_actions, ((1,),))
    with pytest.raises(ScheduleError, match=r"B0\.0\+F0\.1 on device 0 must be a forward"):
        validate_schedule(bad)
    one_stage = Schedule("pairs", 2, schedule.stage_devices, schedule.device_actions, ((0,),))
    with pytest.raises(ScheduleError, match=r"F0\.0\+B0\.0 on device 0 runs one stage twice"):
        validate_schedule(one_stage)
    past_the_end = Schedule("pairs", 2, schedule.stage_devices, schedule.device_actions, ((3,),))
    with pytest.raises(ScheduleError, match="position 3 on device 0"):
        validate_schedule(past_the_end)


def test_an_overlapped_pair_starts_when_both_halves_have_their_inputs_and_ends_together():
    # Device 1 pairs F1.1 with B1.0; B1.0 waits for nothing but F1.0 on the same device.
    actions = (
        (Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)),
        (Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)),
    )
    plain = Schedule("plain", 2, (0, 1), actions)
    paired = Schedule("paired", 2, (0, 1), actions, ((), (1,)))
    costs = CostModel(CostModel.uniform(2, forward=1, backward=2).stages, pair_times={(1, 1): 2})
    # Plain: F1.1 runs 2..3 and B1.0 3..5. Paired: both run 2..4, and B0.0 waits until 4.
    plain_times = {r.action: (r.start, r.end) for r in simulate(plain, costs).records}
    paired_times = {r.action: (r.start, r.end) for r in simulate(paired, costs).records}
    assert plain_times[Action("B", 1, 0)] == (3, 5)
    assert paired_times[Action("F", 1, 1)][0] == 2 and paired_times[Action("B", 1, 0)][1] == 4
    assert paired_times[Action("B", 0, 0)][0] == 4


@pytest.mark.parametrize(
    "forward, input_grad, weight_grad", [(1, 1, 1), (2, 2, 1), (3, 3, 1), (1, 1, 0.5)]
)
def test_dualpipev_idles_p_minus_1_times_fb_plus_b_minus_3w_run_as_f_then_b(
    forward, input_grad, weight_grad
):
    # DualPipe's bubble (PP/2-1)(F&B+B-3W) (deepseek-ai/DualPipe README), which DualPipeV
    # has on p = PP/2 devices, with F&B = F+B as tfmulti's executor runs a pair. It is exact
    # for F = I >= W; with I != F the simulated bubble differs by (p-1)|F-I|.
    backward = input_grad + weight_grad
    for p, m in GRID:
        result = _simulate(p, m, forward, input_grad, weight_grad)
        work = 2 * m * (forward + backward)
        assert result.busy_time == pytest.approx((work,) * p), (p, m)
        expected = (p - 1) * (forward + backward + backward - 3 * weight_grad)
        assert result.makespan - work == pytest.approx(expected), (p, m)


@pytest.mark.parametrize("pair_time", [2.0, 2.5, 3.0])
def test_dualpipev_device_at_the_turn_idles_p_minus_1_times_fb_plus_b_minus_3w(pair_time):
    # With pairs faster than F+B (F=I=W=1), devices run different numbers of pairs; the
    # closed form holds for the busiest, the last two devices, and the others idle less.
    for p, m in GRID:
        result = _simulate(p, m, 1, 1, 1, pair_time)
        idle = [result.makespan - busy for busy in result.busy_time]
        expected = (p - 1) * (pair_time + 2 - 3)
        assert idle[-1] == pytest.approx(expected), (p, m)
        assert max(idle) == pytest.approx(expected), (p, m)


def test_dualpipev_run_as_f_then_b_idles_twice_zbv_and_holds_one_chunk_more():
    # DualPipeV gains on ZB-V only where a pair runs faster than F+B: at F = I = W, a pair
    # must take 2 (not 3) for its bubble to fall to ZB-V's.
    for p, m in GRID:
        dualpipev = _simulate(p, m, 1, 1, 1)
        zbv = simulate(build_schedule("zbv", p, m), CostModel.uniform(2 * p, 1, 2, 1))
        assert dualpipev.bubble_time == pytest.approx(2 * zbv.bubble_time), (p, m)
        assert _simulate(p, m, 1, 1, 1, 2.0).makespan <= zbv.makespan, (p, m)
        # 2p+1 chunk activations: DualPipe's PP+1, against ZB-V's 2p.
        assert dualpipev.peak_activations == (2 * p + 1,) * p, (p, m)


# The 2 and 4 devices, 4, 8 and 16 micro-batches (at least 2p), SGD and Adam: each
# value once, without the whole product (test_zbv's reference transformer adds 8
# micro-batches on 2 devices with Adam). 32 rows: two a micro-batch at 16.
EQUALITY_CASES = [(2, 4, "sgd"), (2, 8, "adam"), (4, 16, "adam")]
# Where the steps overlap, the traced step holds one loop, not one copy per micro-batch.
ONE_LOOP = {(2, 8), (4, 16)}


@pytest.mark.parametrize("num_devices, num_microbatches, optimizer", EQUALITY_CASES)
def test_dualpipev_trains_to_the_weights_of_one_device(num_devices, num_microbatches, optimizer):
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, "dualpipev", 2, optimizer, batch_size=32
    )
    assert pipeline.schedule.name == "dualpipev"
    moved = max(np.abs(a - b).max() for a, b in zip(initial, pipeline.get_weights(), strict=True))
    assert moved > 1e-3
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)
    if (num_devices, num_microbatches) in ONE_LOOP:
        x, y = regression_batches(1, 32)[0]
        assert loops_in_step(pipeline, x, y) == 1


@pytest.mark.parametrize("num_devices, num_microbatches", [(2, 8), (4, 16), (4, 32)])
def test_the_rolled_step_runs_every_pair_of_the_schedule_overlapped(num_devices, num_microbatches):
    # Prologue and epilogue pair as the schedule does; the loop body's pairs, moved to
    # each round's micro-batches, must give the rest: no pair of the schedule runs F then B.
    schedule = build_schedule("dualpipev", num_devices, num_microbatches)
    rolled = loop_schedule(schedule)
    partners = pair_partners(schedule)
    run_overlapped = {
        (action, partners[action])
        for action in rolled.prologue + rolled.epilogue
        if action in partners
    }
    for second, first in body_pair_partners(rolled).items():
        for r in range(rolled.rounds):
            run_overlapped.add(
                tuple(
                    Action(a.kind, a.stage, rolled.microbatch_in_round(a.microbatch, r))
                    for a in (second, first)
                )
            )
    assert run_overlapped == set(partners.items())
    assert len(partners) == sum(map(len, schedule.overlapped_pairs))


def _depends_on(tensor, target) -> bool:
    """Whether `tensor`'s op waits, by data or control, for `target`'s op."""
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op is target.op:
            return True
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False


def test_a_pairs_second_action_waits_for_what_the_first_waited_for_not_for_the_first():
    import tensorflow as tf

    from tfmulti.pipeline.runtime import PipelineModel
    from tfmulti.platform.runtime.devices import logical_device_names

    num_microbatches = 4
    pipeline = PipelineModel(
        dense_stages(4), logical_device_names("CPU")[:2], num_microbatches, "dualpipev"
    )
    x, y = regression_batches(1, 8)[0]
    pipeline(x)
    schedule = pipeline.schedule

    stamps = {}  # the step graph's own tensors (its outputs would be copies)

    @tf.function(autograph=False)
    def step(x, y):
        parts = tf.split(x, num_microbatches), tf.split(y, num_microbatches)

        def loss(microbatch, outputs):
            value = tf.reduce_mean(tf.square(outputs - parts[1][microbatch]))
            return value, value

        stamps.update(pipeline._executor.run(parts[0], loss, trace=True).stamps)
        return tf.constant(0.0)

    step.get_concrete_function(x, y)
    checked = 0
    for device, actions in enumerate(schedule.device_actions):
        starts = set(schedule.pair_starts(device))
        for index in range(1, len(actions)):
            (_, previous_end), (start, _) = (stamps[a] for a in actions[index - 1 : index + 1])
            if index - 1 in starts:  # the second of a pair: runs beside the first
                assert not _depends_on(start, previous_end), actions[index]
                after = actions[index + 1] if index + 1 < len(actions) else None
                if after is not None:
                    assert _depends_on(stamps[after][0], previous_end), after
                checked += 1
            else:
                assert _depends_on(start, previous_end), actions[index]
    assert checked == sum(map(len, schedule.overlapped_pairs)) > 0


def test_the_rolled_step_builds_the_second_action_of_each_pair_beside_the_first(monkeypatch):
    from tfmulti.pipeline.runtime import executor

    paired = []
    gate_for = executor.PairGates.gate_for

    def recording_gate_for(self, action):
        gate = gate_for(self, action)
        if gate is not None:
            paired.append(action)
        return gate

    monkeypatch.setattr(executor.PairGates, "gate_for", recording_gate_for)
    x, y = regression_batches(1, 32)[0]
    pipeline = train_pipeline_and_chain(dense_stages, 2, 8, "dualpipev", 2, "sgd", steps=1)[1]
    assert loops_in_step(pipeline, x, y) == 1
    rolled = loop_schedule(pipeline.schedule)
    partners = pair_partners(pipeline.schedule)
    in_prologue_and_epilogue = [a for a in rolled.prologue + rolled.epilogue if a in partners]
    expected = in_prologue_and_epilogue + list(body_pair_partners(rolled))
    # Each trace of the step (training, then `loops_in_step`) builds every pair once.
    assert paired and sorted(map(str, paired)) == sorted(map(str, expected * 2))


def test_a_measured_pair_counts_once_as_busy_time_and_gives_the_plan_its_pair_time():
    from tfmulti.pipeline import TimedAction
    from tfmulti.pipeline.runtime.measured import bubble_fraction, order_deviations
    from tfmulti.pipeline.runtime.timeline_report import measured_costs

    schedule = build_schedule("dualpipev", 2, 4)
    # Device 0 runs its first pair in 4 time units, F and B side by side (F 0-2, B 1-4);
    # every other action takes one unit, one after another.
    first_pair = schedule.pair_starts(0)[0]
    records, clock = [], [0.0, 0.0]
    for device, actions in enumerate(schedule.device_actions):
        for index, action in enumerate(actions):
            start = clock[device]
            if device == 0 and index == first_pair:
                start, end = start, start + 2
            elif device == 0 and index == first_pair + 1:
                start, end = start - 1, start + 2
            else:
                end = start + 1
            records.append(TimedAction(device, action, start, end))
            clock[device] = end
    assert order_deviations(records, schedule) == []
    # Both devices are busy from 0 to their last end: the pair's overlap counts once.
    span = max(clock)
    assert bubble_fraction(records, 2) == pytest.approx(1 - sum(clock) / (2 * span))
    forward, backward = schedule.device_actions[0][first_pair : first_pair + 2]
    costs = measured_costs(records, schedule)
    assert costs.pair_times[(forward.stage, backward.stage)] == pytest.approx(4.0)
    # Two actions of device 1 that are not a pair may not overlap.
    unpaired = schedule.device_actions[1][1]
    overlapping = [
        dataclasses.replace(r, start=r.start - 0.5) if r.action == unpaired else r for r in records
    ]
    assert order_deviations(overlapping, schedule) == [
        f"device 1: {unpaired} started before {schedule.device_actions[1][0]} ended"
    ]


# A hybrid mesh pipelines each of its two data replicas over pipe=2 devices.
HYBRID = ("--strategy=hybrid", "--virtual_devices=4", "--mesh=data=2,pipe=2")
PIPELINE = ("--strategy=pipeline", "--virtual_devices=2", "--num_stages=2")


@pytest.mark.parametrize("strategy_flags", [PIPELINE, HYBRID], ids=["pipeline", "hybrid"])
def test_train_script_runs_dualpipev_to_the_losses_of_one_device(
    tmp_path, one_device_metrics, strategy_flags
):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        *strategy_flags,
        "--chunks=2",
        "--microbatches=4",
        "--schedule=dualpipev",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), one_device_metrics)
