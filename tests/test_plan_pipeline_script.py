"""scripts/plan_pipeline.py: text, JSON and files; one-line flag errors."""

import json
import os
import subprocess
import sys

import pytest

from tfmulti.pipeline.schedules import SCHEDULE_NAMES

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "plan_pipeline.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCHEDULES = list(SCHEDULE_NAMES)


def _run(*args):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120
    )


def test_single_schedule_prints_grid_and_per_device_table_and_writes_png_and_trace(tmp_path):
    completed = _run("--schedule=1f1b", "--stages=4", "--microbatches=8", f"--out={tmp_path}")
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0] == "step  dev0  dev1  dev2  dev3"
    assert "makespan=33  bubble=0.2727" in completed.stdout
    assert "peak act (mb)" in completed.stdout
    png = tmp_path / "1f1b_p4_m8_v1.png"
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    trace = json.loads((tmp_path / "1f1b_p4_m8_v1.trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * 4 * 8


def test_compare_json_prints_one_object_per_schedule_with_the_promised_keys():
    completed = _run("--compare", "--json", "--stages=4", "--microbatches=8", "--costs=1,2,1")
    assert completed.returncode == 0, completed.stderr
    objects = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [o["schedule"] for o in objects] == SCHEDULES
    for entry in objects:
        assert {"schedule", "stages", "microbatches", "chunks", "makespan"} <= set(entry)
        assert len(entry["peak_activations"]) == 4
        assert 0 <= entry["bubble_fraction"] < 1
    by_name = {o["schedule"]: o for o in objects}
    assert by_name["1f1b"]["peak_activations"] == [4, 3, 2, 1]
    assert by_name["interleaved_1f1b"]["chunks"] == 2


def test_compare_text_lists_every_schedule_and_skips_unsupported_ones():
    completed = _run("--compare", "--stages=4", "--microbatches=6")
    assert completed.returncode == 0, completed.stderr
    for name in SCHEDULES:
        assert name in completed.stdout
    assert "skipped: interleaved_1f1b sends micro-batches" in completed.stdout


def test_costs_file_with_per_stage_entries_is_used(tmp_path):
    costs = tmp_path / "costs.json"
    stages = [{"forward": 1, "backward": 2, "activation_bytes": 5}] * 3
    stages.append({"forward": 2, "backward": 4, "activation_bytes": 5})
    costs.write_text(json.dumps({"stages": stages, "transfer": 0.5}))
    completed = _run("--json", "--stages=4", "--microbatches=4", f"--costs={costs}")
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout)
    assert summary["peak_activation_bytes"] == [20, 15, 10, 5]
    assert summary["makespan"] > (4 + 3) * 3


def test_custom_schedule_file_is_validated_and_simulated(tmp_path):
    schedule = tmp_path / "mine.txt"
    schedule.write_text("name: mine\ndevice 0: F0.0 F0.1 B0.0 B0.1\ndevice 1: F1.0 B1.0 F1.1 B1.1")
    completed = _run("--json", f"--schedule_file={schedule}")
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["schedule"] == "mine"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--stages=0"], "--stages"),
        (["--microbatches=-1"], "--microbatches"),
        (["--schedule=pipedream"], "--schedule"),
        (["--costs=1,x"], "--costs"),
        (["--costs=1,2,3"], "--costs"),
        (["--transfer=-1"], "--transfer"),
        (["--schedule=gpipe", "--chunks=2"], "--chunks"),
        (["--schedule=interleaved_1f1b", "--stages=4", "--microbatches=6"], "--microbatches"),
    ],
)
def test_bad_flag_values_exit_nonzero_with_one_line_naming_the_flag(args, flag):
    completed = _run(*args)
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert flag in completed.stderr


def test_broken_custom_schedule_is_one_line_naming_the_action(tmp_path):
    schedule = tmp_path / "broken.txt"
    schedule.write_text("device 0: F0.0 F0.1 B0.0\ndevice 1: F1.0 B1.0 F1.1 B1.1")
    completed = _run(f"--schedule_file={schedule}")
    assert completed.returncode == 2
    assert len(completed.stderr.strip().splitlines()) == 1
    assert "Missing backward for F0.1" in completed.stderr
