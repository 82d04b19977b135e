"""Rolling a schedule's steady state into rounds (pure Python, no TensorFlow)."""

import pytest

from tfmulti.pipeline.round_loop import (
    guard_roll,
    in_flight_after,
    is_fill_drain,
    loop_schedule,
    roll_schedule,
)
from tfmulti.pipeline.schedules import build_schedule

ROLLABLE = [("1f1b", 4, None), ("zb_h1", 4, None), ("zb_h2", 4, None), ("interleaved_1f1b", 2, 2)]


def _all_actions(schedule):
    return sorted(action for actions in schedule.device_actions for action in actions)


@pytest.mark.parametrize("name, num_devices, chunks", ROLLABLE)
def test_traced_actions_do_not_grow_with_microbatches(name, num_devices, chunks):
    traced = {}
    for num_microbatches in (16, 32, 64):
        schedule = build_schedule(name, num_devices, num_microbatches, chunks=chunks)
        rolled = roll_schedule(schedule)
        assert rolled is not None and rolled.rounds >= 2
        traced[num_microbatches] = rolled.traced_actions
    assert traced[16] == traced[32] == traced[64]
    assert traced[64] < len(_all_actions(schedule)) / 4


ORDER_CASES = [
    (*case, num_microbatches)
    for case in ROLLABLE
    for num_microbatches in (8, 12, 16)
    if not (case[2] and num_microbatches % case[1])
]


@pytest.mark.parametrize("name, num_devices, chunks, num_microbatches", ORDER_CASES)
def test_rolled_rounds_run_every_action_once_in_each_devices_order(
    name, num_devices, chunks, num_microbatches
):
    schedule = build_schedule(name, num_devices, num_microbatches, chunks=chunks)
    rolled = roll_schedule(schedule)
    if rolled is None:
        return
    order = rolled.unrolled()
    assert sorted(order) == _all_actions(schedule)
    for device, actions in enumerate(schedule.device_actions):
        mine = [a for a in order if schedule.stage_devices[a.stage] == device]
        assert tuple(mine) == actions
    # Every action finds what it reads, and nothing is left in flight at the end.
    assert in_flight_after(order, set(), schedule.num_stages) == set()


def test_rounds_shift_by_the_stride():
    rolled = roll_schedule(build_schedule("1f1b", 2, 8))
    assert rolled.stride == 1
    first, second = rolled.round_actions(0), rolled.round_actions(1)
    assert [(a.kind, a.stage) for a in first] == [(a.kind, a.stage) for a in second]
    assert all(b.microbatch == a.microbatch + 1 for a, b in zip(first, second, strict=True))


def test_gpipe_and_too_few_microbatches_stay_unrolled():
    # GPipe keeps every micro-batch's activations until its backward phase: what is in
    # flight grows from round to round, so it has no loop of one shape.
    assert roll_schedule(build_schedule("gpipe", 4, 32)) is None
    assert roll_schedule(build_schedule("1f1b", 4, 4)) is None


def test_only_gpipe_runs_as_a_fill_and_a_drain_phase():
    # Its two phases each repeat one round: the executor runs them as two loops.
    assert is_fill_drain(build_schedule("gpipe", 4, 32))
    assert is_fill_drain(build_schedule("gpipe", 2, 2))
    assert not is_fill_drain(build_schedule("gpipe", 4, 1))
    for name, num_devices, chunks in ROLLABLE:
        assert not is_fill_drain(build_schedule(name, num_devices, 16, chunks=chunks))


def test_a_read_of_a_value_not_in_flight_is_found():
    schedule = build_schedule("1f1b", 2, 2)
    backward_first = [a for a in _all_actions(schedule) if a.kind == "B"]
    assert in_flight_after(backward_first, set(), schedule.num_stages) is None


GUARDED_CASES = [
    ("1f1b", 4, None, 5),
    ("1f1b", 4, None, 32),
    ("1f1b", 2, None, 3),
    ("zb_h1", 4, None, 8),
    ("zb_h2", 4, None, 16),
    ("interleaved_1f1b", 2, 2, 8),
    ("interleaved_1f1b", 4, 2, 16),
]


@pytest.mark.parametrize("name, num_devices, chunks, num_microbatches", GUARDED_CASES)
def test_a_guarded_loop_runs_the_whole_schedule_in_each_devices_order(
    name, num_devices, chunks, num_microbatches
):
    schedule = build_schedule(name, num_devices, num_microbatches, chunks=chunks)
    rolled = loop_schedule(schedule)
    assert rolled.guarded and rolled.prologue == rolled.epilogue == ()
    # One body: each stage's actions once per micro-batch it moves on.
    kinds_per_microbatch = len(_all_actions(schedule)) // num_microbatches
    assert rolled.traced_actions == kinds_per_microbatch * rolled.stride
    order = rolled.unrolled()
    assert sorted(order) == _all_actions(schedule)
    for device, actions in enumerate(schedule.device_actions):
        assert tuple(a for a in order if schedule.stage_devices[a.stage] == device) == actions
    assert in_flight_after(order, set(), schedule.num_stages) == set()
    # What the loop starts with is on micro-batches before the first: the loop's zeros.
    assert rolled.start_in_flight
    assert all(rolled.microbatch_in_round(label, 0) < 0 for _, _, label in rolled.start_in_flight)
    # rounds_run names exactly the rounds in which each body action is not skipped.
    for action in rolled.body:
        runs = set(rolled.rounds_run(action))
        for round_index in range(rolled.rounds):
            microbatch = rolled.microbatch_in_round(action.microbatch, round_index)
            assert (round_index in runs) == (0 <= microbatch < num_microbatches)


def test_1f1b_guarded_rounds_skip_the_backwards_of_the_warm_up():
    # Each round, each device runs one F and one B; the first device's first rounds skip
    # their B (the warm-up forwards), the last device runs F and B from its first round.
    rolled = loop_schedule(build_schedule("1f1b", 4, 8))
    assert rolled.traced_actions == 8 and rolled.rounds == 12
    per_round = [[str(a) for a in rolled.round_actions(r)] for r in range(rolled.rounds)]
    first_device = [[a for a in actions if a.startswith(("F0", "B0"))] for actions in per_round]
    assert first_device[:5] == [["F0.0"], ["F0.1"], ["F0.2"], ["F0.3"], ["B0.0", "F0.4"]]
    assert first_device[-3:] == [["B0.5"], ["B0.6"], ["B0.7"]]
    last_device = [[a for a in actions if a.startswith(("F3", "B3"))] for actions in per_round]
    assert last_device[2] == ["F3.0", "B3.0"]


def test_a_guarded_loop_is_refused_where_skipping_breaks_a_devices_order():
    # GPipe's steady state does not exist; a body whose extension reorders a device is
    # refused (here: 1F1B's body with its rounds shifted by one device's worth).
    assert loop_schedule(build_schedule("gpipe", 4, 16)) is None
    steady = roll_schedule(build_schedule("1f1b", 4, 16))
    reordered = steady.__class__(
        schedule=build_schedule("gpipe", 4, 16),
        prologue=steady.prologue,
        body=steady.body,
        rounds=steady.rounds,
        stride=steady.stride,
        epilogue=steady.epilogue,
    )
    assert guard_roll(reordered) is None
