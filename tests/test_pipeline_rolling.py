"""Rolling a schedule's steady state into rounds (pure Python, no TensorFlow)."""

import pytest

from tfmulti.pipeline.rolling import in_flight_after, is_fill_drain, roll_schedule
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
