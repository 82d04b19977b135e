"""Schedules from files and lists: PyTorch's compute_only CSV in and out, per-device lists,
and the text form, which writes DualPipeV's overlapped pairs as the CSV does."""

import os
import re

import numpy as np
import pytest
from pipeline_runtime_models import dense_stages, max_weight_difference, train_pipeline_and_chain
from script_runner import assert_same_training, one_line_error, read_metrics, run_script

from tfmulti.pipeline import (
    SCHEDULE_NAMES,
    Action,
    ScheduleError,
    build_schedule,
    read_schedule_csv,
    schedule_from_csv,
    schedule_from_lists,
    schedule_from_text,
    schedule_grid,
    schedule_to_csv,
    schedule_to_text,
    validate_schedule,
    write_schedule_csv,
)

DATA = os.path.join(os.path.dirname(__file__), "data")
# zb_h1 on 2 ranks, 4 micro-batches, written by hand as PyTorch's _dump_csv writes a
# schedule: one row per rank, idle steps as empty cells.
PYTORCH_CSV = os.path.join(DATA, "zb_h1_2rank_4mb.csv")


def _built_in_schedules():
    for name in SCHEDULE_NAMES:
        for num_devices in (1, 2, 3, 4):
            for num_microbatches in (1, 4, 8, 12):
                for chunks in (None, 3):
                    try:
                        yield build_schedule(name, num_devices, num_microbatches, chunks)
                    except ValueError:
                        continue


def test_every_built_in_schedule_written_as_csv_reads_back_equal(tmp_path):
    names = set()
    for schedule in _built_in_schedules():
        assert schedule_from_csv(schedule_to_csv(schedule), name=schedule.name) == schedule
        path = str(tmp_path / f"{schedule.name}.csv")
        write_schedule_csv(schedule, path)
        assert read_schedule_csv(path) == schedule
        names.add(schedule.name)
    assert names == set(SCHEDULE_NAMES)


def test_every_built_in_schedule_written_as_text_reads_back_equal_pairs_included():
    for schedule in _built_in_schedules():
        assert schedule_from_text(schedule_to_text(schedule)) == schedule


def test_text_writes_an_overlapped_pair_as_one_token_as_the_csv_does():
    schedule = build_schedule("dualpipev", 2, 4)
    text_rows = [
        line.split(": ", 1)[1].split()
        for line in schedule_to_text(schedule).splitlines()
        if line.startswith("device ")
    ]
    # The CSV's cells with each action in tfmulti's spelling (0F3 -> F0.3).
    csv_rows = [
        re.sub(r"(\d+)([FBIW])(\d+)", r"\2\1.\3", row).split(",")
        for row in schedule_to_csv(schedule).splitlines()
    ]
    assert text_rows == csv_rows
    assert text_rows[0][7:9] == ["(F0.3;B3.1)OVERLAP_F_B", "(F3.2;B0.0)OVERLAP_F_B"]
    assert schedule_from_lists(text_rows, name="dualpipev") == schedule


def test_grid_shows_an_overlapped_pair_as_its_two_steps_in_brackets():
    rows = schedule_grid(build_schedule("dualpipev", 2, 4)).splitlines()
    assert rows[0] == "step  dev0    dev1"
    assert rows[8:10] == ["   7  (F0.3;  (F2.2;", "   8  B3.1)   B1.0)"]


@pytest.mark.parametrize(
    "line, error, fragment",
    [
        (
            "device 0: F0.0 (F0.1;X0.0)OVERLAP_F_B B0.1",
            ValueError,
            "Line 1: cannot read action 'X0.0'",
        ),
        (
            "device 0: F0.0 F0.1 (B0.0;B0.1)OVERLAP_F_B",
            ScheduleError,
            "pair B0.0+B0.1 on device 0 must be a forward",
        ),
    ],
)
def test_a_bad_overlapped_pair_in_text_is_refused_naming_it(line, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        validate_schedule(schedule_from_text(line))


def test_csv_cells_are_written_as_pytorch_names_them():
    csv_text = schedule_to_csv(build_schedule("zbv", 2, 4))
    rows = csv_text.splitlines()
    assert rows[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0,")
    assert rows[1].startswith("1F0,2F0,1F1,")


def test_pytorch_csv_with_idle_cells_reads_as_the_built_in_schedule():
    schedule = read_schedule_csv(PYTORCH_CSV, name="zb_h1")
    assert schedule == build_schedule("zb_h1", 2, 4)


def test_per_device_lists_of_actions_or_strings_make_a_schedule():
    from_strings = schedule_from_lists(
        [["0F0", "1F0", "", "1B0", "0B0"], [None, "2F0", "2B0"]], name="mixed"
    )
    from_actions = schedule_from_lists(
        [
            [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)],
            ["F2.0", "B2.0"],
        ],
        name="mixed",
    )
    assert from_strings == from_actions
    assert from_strings.stage_devices == (0, 0, 1)
    assert from_strings.num_microbatches == 1


@pytest.mark.parametrize(
    "rows, fragment",
    [
        # 0B1 left out.
        (["0F0,0F1,0B0", "1F0,1B0,1F1,1B1"], "Missing backward for 0F1"),
        # 1F1 twice.
        (["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1,1F1"], "Action 1F1 appears twice on device 1"),
        # 0B0 before the forward it differentiates.
        (["0B0,0F0,0F1,0B1", "1F0,1B0,1F1,1B1"], "Action 0B0 comes before 0F0 on device 0"),
        # Each device waits for the other.
        (["0F0,0B0,0F1,0B1", "1F1,1F0,1B0,1B1"], "device 1 stuck at 1F1 waiting for 0F1"),
        (["0F0,0X0", "1F0"], "Received: '0X0'"),
        (["0F0,1F0", "1B0"], "Action 1B0 is on device 1, but stage 1 already runs on device 0"),
    ],
)
def test_a_bad_schedule_file_is_refused_in_one_line_naming_the_first_bad_action(
    tmp_path, rows, fragment
):
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ScheduleError) as error:
        read_schedule_csv(str(path))
    message = str(error.value)
    assert fragment in message
    assert "\n" not in message and str(path) in message


def test_a_missing_schedule_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such.csv"):
        read_schedule_csv(str(tmp_path / "no-such.csv"))


# Adam (slots, a step-dependent update); the optimizer is not what the file changes.
@pytest.mark.parametrize("optimizer", ["adam"])
def test_pytorch_csv_trains_to_the_weights_of_the_built_in_schedule_and_of_one_device(optimizer):
    from_file = read_schedule_csv(PYTORCH_CSV)
    reference, pipeline, _, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, 2, 4, from_file, 1, optimizer, steps=2
    )
    _, built_in, _, _, built_in_loss = train_pipeline_and_chain(
        dense_stages, 2, 4, "zb_h1", 1, optimizer, steps=2
    )
    for mine, theirs in zip(pipeline.get_weights(), built_in.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(pipeline_loss, built_in_loss, rtol=1e-6)
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)


TRAIN = (
    "--virtual_devices=2",
    "--strategy=pipeline",
    "--num_stages=2",
    "--microbatches=4",
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=32",
    "--steps_per_epoch=2",
    "--validation_steps=1",
    "--epochs=1",
)


# A hybrid mesh pipelines each data replica over pipe=2 devices on the same schedule.
HYBRID = ("--strategy=hybrid", "--virtual_devices=4", "--mesh=data=2,pipe=2")


@pytest.fixture(scope="module")
def built_in_pipeline_run(tmp_path_factory) -> dict:
    """metrics.json of `TRAIN` on the built-in zb_h1, which both CSV runs must equal."""
    model_dir = str(tmp_path_factory.mktemp("built_in") / "run")
    result = run_script("train.py", *TRAIN, "--schedule=zb_h1", f"--model_dir={model_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(model_dir)


@pytest.mark.parametrize("strategy_flags", [(), HYBRID], ids=["pipeline", "hybrid"])
def test_train_script_runs_a_csv_schedule_like_the_same_built_in_one(
    tmp_path, strategy_flags, built_in_pipeline_run
):
    # Both strategies train like one device, so both CSV runs equal the pipeline's
    # built-in one.
    model_dir = str(tmp_path / "csv")
    flags = [f for f in TRAIN if not strategy_flags or "num_stages" not in f]
    result = run_script(
        "train.py",
        *flags,
        *strategy_flags,
        f"--schedule={PYTORCH_CSV}",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), built_in_pipeline_run)


def test_train_script_refuses_a_missing_or_mismatched_csv_in_one_line(tmp_path):
    missing = run_script("train.py", *TRAIN, f"--schedule={tmp_path / 'none.csv'}", timeout=60)
    assert "--schedule must be one of" in one_line_error(missing, 2)
    mismatched = run_script(
        "train.py",
        *TRAIN,
        "--microbatches=8",
        f"--schedule={PYTORCH_CSV}",
        f"--model_dir={tmp_path / 'run'}",
    )
    line = one_line_error(mismatched, 1)
    assert "--microbatches=4" in line and "Received: --num_stages=2" in line


def test_plan_pipeline_writes_a_built_in_schedule_as_csv_and_simulates_it_back(tmp_path):
    import json

    path = str(tmp_path / "zbv.csv")
    written = run_script(
        "plan_pipeline.py", "--schedule=zbv", "--stages=4", "--json", f"--write_csv={path}"
    )
    assert written.returncode == 0, written.stderr
    assert read_schedule_csv(path) == build_schedule("zbv", 4, 8)
    read_back = run_script("plan_pipeline.py", f"--schedule_file={path}", "--json")
    assert read_back.returncode == 0, read_back.stderr
    built_in, from_file = (json.loads(r.stdout.splitlines()[0]) for r in (written, read_back))
    assert from_file == built_in


def test_zbv_without_two_chunks_is_a_one_line_flag_error():
    result = run_script("train.py", "--strategy=pipeline", "--schedule=zbv", timeout=60)
    assert "--chunks must fit --schedule" in one_line_error(result, 2)
