"""The suite's promises stay visible and its time profile adds up.

docs/design/test_promises.md names, for each promise, the tests that hold it; here every test
file is named there and every test it names exists, so no promise loses its last test
silently. `tests/suite_profile.py` (`make test-profile`) runs at its smallest size.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from script_runner import REPO_ROOT
from suite_profile import estimated_wall_seconds, markdown, read_promises, summarize


def test_every_test_file_holds_a_listed_promise_and_every_listed_test_exists():
    promises = read_promises()
    named = {(file, name) for tests in promises.values() for file, name in tests}
    files = {os.path.relpath(path, REPO_ROOT) for path in glob.glob(f"{REPO_ROOT}/tests/test_*.py")}

    assert files - {file for file, _ in named} == set()
    for file, name in named:
        assert file in files, f"docs/design/test_promises.md names {file}, which does not exist"
        if name:
            with open(os.path.join(REPO_ROOT, file)) as handle:
                source = handle.read()
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"no {file}::{name}"


@pytest.mark.parametrize(
    "promise",
    [
        "every strategy",
        "exact resume",
        "preemption",
        "elastic membership",
        "isolation",
        "every script",
        "every documented command",
        "keras contracts",
        "zero",
    ],
)
def test_each_promise_the_suite_must_keep_has_a_row_with_tests(promise):
    rows = [row for row in read_promises() if promise in row.lower()]

    assert rows, f"docs/design/test_promises.md has no row for {promise!r}"


def _test(nodeid, worker, start, seconds, outcome="passed"):
    return {
        "nodeid": nodeid,
        "worker": worker,
        "start": start,
        "stop": start + seconds,
        "seconds": seconds,
        "outcome": outcome,
    }


def test_the_profile_adds_up_by_file_and_promise_and_estimates_two_idle_workers():
    tests = [
        _test("tests/test_a.py::test_slow[x]", "gw0", 0, 30),
        _test("tests/test_a.py::test_fast", "gw1", 0, 5),
        _test("tests/test_b.py::test_one", "gw1", 5, 10, outcome="failed"),
        _test("tests/test_b.py::test_two", "gw1", 15, 40),
    ]
    promises = {
        "slow ones": [("tests/test_a.py", "test_slow")],
        "file b": [("tests/test_b.py", None)],
    }

    summary = summarize(tests, promises, top=2)

    assert summary["worker_seconds"] == 85
    assert summary["wall_seconds"] == 55 and summary["tail_seconds"] == 25
    # Whole files, longest first, on two idle workers: b's 50 on one, a's 35 on the other.
    assert summary["estimated_idle_wall_seconds"] == estimated_wall_seconds(tests) == 50
    assert [t["seconds"] for t in summary["slowest"]] == [40, 30]
    assert summary["failed"] == ["tests/test_b.py::test_one"]
    assert summary["files"] == [
        {"file": "tests/test_b.py", "tests": 2, "seconds": 50},
        {"file": "tests/test_a.py", "tests": 2, "seconds": 35},
    ]
    assert summary["promises"] == {
        "slow ones": {"tests": 1, "seconds": 30},
        "file b": {"tests": 2, "seconds": 50},
    }
    assert "| `tests/test_b.py` | 2 | 50 | 58.8% |" in markdown(summary)


def test_the_profile_script_times_a_run_of_the_suite_and_writes_its_summary(tmp_path):
    # Its smallest size: one test of a file without TensorFlow, on one xdist worker.
    selection = "tests/test_pipeline_rolling.py::test_rounds_shift_by_the_stride"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "tests", "suite_profile.py"),
            f"--out={tmp_path}",
            "--",
            "-q",
            "-n",
            "1",
            "-p",
            "no:cacheprovider",
            selection,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(tmp_path / "profile.json") as handle:
        profile = json.load(handle)
    (test,) = profile["all"]
    assert test["nodeid"] == selection and test["worker"] == "gw0" and test["seconds"] > 0
    assert profile["files"] == [
        {"file": "tests/test_pipeline_rolling.py", "tests": 1, "seconds": round(test["seconds"], 1)}
    ]
    assert (tmp_path / "profile.md").read_text() in result.stdout
