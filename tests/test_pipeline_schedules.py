"""Schedules as data: construction, validation, text form; no TensorFlow needed."""

import collections
import subprocess
import sys

import pytest

from tfmulti.pipeline import (
    SCHEDULE_NAMES,
    ScheduleError,
    build_schedule,
    schedule_from_text,
    schedule_grid,
    schedule_to_text,
    simulate,
    validate_schedule,
)

# Every device count; micro-batch counts up to 8, then 12 and 16 (interleaving's multiples
# of 6 and 8 devices): longer steady states add actions, not new code paths.
MICROBATCH_COUNTS = (*range(1, 9), 12, 16)


def _accepted_schedules():
    for name in SCHEDULE_NAMES:
        for num_devices in range(1, 9):
            for num_microbatches in MICROBATCH_COUNTS:
                for chunks in range(1, 5):
                    try:
                        yield build_schedule(name, num_devices, num_microbatches, chunks)
                    except ValueError:
                        continue


def test_every_accepted_schedule_validates_simulates_and_runs_each_action_once():
    built = collections.Counter()
    for schedule in _accepted_schedules():
        built[schedule.name] += 1
        validate_schedule(schedule)
        counts = collections.Counter(a for actions in schedule.device_actions for a in actions)
        assert set(counts.values()) == {1}, schedule.name
        kinds = collections.Counter(a.kind for a in counts)
        pairs = schedule.num_stages * schedule.num_microbatches
        assert kinds["F"] == pairs
        assert kinds["B"] + kinds["I"] == pairs and kinds["I"] == kinds["W"]
        result = simulate(schedule)
        assert len(result.records) == len(counts)
    # Every name must be reachable on the grid, interleaved included.
    assert set(built) == set(SCHEDULE_NAMES)
    assert sum(built.values()) > 700


@pytest.mark.parametrize(
    "name, num_devices, num_microbatches, chunks, fragment",
    [
        ("interleaved_1f1b", 4, 6, 2, "multiple of num_devices"),
        ("interleaved_1f1b", 4, 8, 1, "chunks >= 2"),
        ("gpipe", 4, 8, 2, "chunks must be 1"),
        ("1f1b", 0, 8, None, "num_devices=0"),
        ("zb_h1", 4, 0, None, "num_microbatches=0"),
        ("pipedream", 4, 8, None, "'pipedream'"),
    ],
)
def test_unsupported_arguments_raise_an_error_naming_the_rule(
    name, num_devices, num_microbatches, chunks, fragment
):
    with pytest.raises(ValueError, match=fragment):
        build_schedule(name, num_devices, num_microbatches, chunks)


def test_interleaved_places_stage_i_on_device_i_mod_p():
    schedule = build_schedule("interleaved_1f1b", 3, 6, 3)
    assert schedule.stage_devices == (0, 1, 2, 0, 1, 2, 0, 1, 2)
    assert schedule.chunks == 3


def test_zero_bubble_schedules_split_the_backward():
    assert build_schedule("zb_h1", 4, 8).splits_backward
    assert build_schedule("zb_h2", 4, 8).splits_backward
    assert not build_schedule("1f1b", 4, 8).splits_backward


def _two_stage(device0, device1, num_microbatches=1):
    return schedule_from_text(
        f"name: broken\nmicrobatches: {num_microbatches}\nstage_devices: 0 1\n"
        f"device 0: {device0}\ndevice 1: {device1}"
    )


@pytest.mark.parametrize(
    "device0, device1, message",
    [
        ("F0.0", "F1.0 B1.0", "Missing backward for F0.0"),
        ("F0.0 F0.0 B0.0", "F1.0 B1.0", "F0.0 appears twice"),
        ("B0.0 F0.0", "F1.0 B1.0", "B0.0 comes before F0.0"),
        ("F0.0 I0.0", "F1.0 B1.0", "I0.0 has no matching W0.0"),
        ("F0.0 W0.0 I0.0", "F1.0 B1.0", "W0.0 comes before I0.0"),
        ("F0.0 B0.0 I0.0 W0.0", "F1.0 B1.0", "both B0.0 and a split backward"),
        ("F0.0 B0.0 F1.0", "B1.0", "F1.0 is on device 0"),
        ("B0.0", "F1.0 B1.0", "Missing forward F0.0"),
    ],
)
def test_broken_schedules_are_rejected_naming_the_offending_action(device0, device1, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(_two_stage(device0, device1))


def test_deadlock_reports_what_each_device_is_stuck_at():
    # Device 0 waits for B1.0 before running F0.1, but device 1 needs F1.1 (which needs
    # F0.1) before B1.0: a cycle across devices.
    schedule = _two_stage("F0.0 B0.0 F0.1 B0.1", "F1.0 F1.1 B1.0 B1.1", num_microbatches=2)
    with pytest.raises(ScheduleError) as error:
        validate_schedule(schedule)
    assert "deadlocks" in str(error.value)
    assert "device 0 stuck at B0.0 waiting for B1.0" in str(error.value)
    assert "device 1 stuck at F1.1 waiting for F0.1" in str(error.value)


def test_micro_batch_beyond_the_declared_count_is_rejected():
    with pytest.raises(ScheduleError, match="F0.1 on device 0 names micro-batch 1"):
        validate_schedule(_two_stage("F0.0 B0.0 F0.1", "F1.0 B1.0"))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_text_form_round_trips_every_schedule(name):
    # DualPipeV's overlapped pairs included, written as the CSV writes them.
    schedule = build_schedule(name, 4, 8)
    assert schedule_from_text(schedule_to_text(schedule)) == schedule


def test_text_form_fills_defaults_and_skips_comments():
    schedule = schedule_from_text(
        "# hand-written\ndevice 0: F0.0 F0.1 B0.0 B0.1\n\ndevice 1: F1.0 B1.0 F1.1 B1.1\n"
    )
    assert schedule.name == "custom"
    assert schedule.num_microbatches == 2
    assert schedule.stage_devices == (0, 1)
    validate_schedule(schedule)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("device 0: F0.0 X0.0", "cannot read action 'X0.0'"),
        ("device 1: F0.0", "without gaps"),
        ("stages: 3", "Line 1"),
        ("microbatches: two\ndevice 0: F0.0 B0.0", "must be an integer"),
    ],
)
def test_unreadable_text_names_the_problem(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        schedule_from_text(text)


def test_grid_shows_one_step_per_row_and_bubbles_as_dots():
    grid = schedule_grid(build_schedule("gpipe", 2, 1))
    assert grid.splitlines() == [
        "step  dev0  dev1",
        "   0  F0.0  .",
        "   1  .     F1.0",
        "   2  .     B1.0",
        "   3  B0.0  .",
    ]


def test_planning_modules_do_not_import_tensorflow():
    code = (
        "import sys, tfmulti.pipeline.schedules, tfmulti.pipeline.simulate, "
        "tfmulti.pipeline.validate, tfmulti.pipeline.balance, tfmulti.pipeline.text, "
        "tfmulti.pipeline.timeline; "
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
