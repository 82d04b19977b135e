"""Elastic launches (`--num_workers=MIN:MAX`): slots that fail too often are dropped, a
slot list shrinks and grows the group, and too few slots end the job in one line."""

import contextlib
import os
import subprocess
import sys
import time

import pytest
from script_runner import LAUNCH, worker_program

from tfmulti.platform.launching.membership import (
    Change,
    DataReplicas,
    Membership,
    WorkerRange,
    discovered_slots,
)

WORKER = worker_program("elastic_worker")


def launch_command(launch_flags, worker_flags):
    return [sys.executable, LAUNCH, *launch_flags, "--", sys.executable, WORKER, *worker_flags]


def run_launcher(launch_flags, worker_flags):
    command = launch_command(launch_flags, worker_flags)
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def group_sizes(run_dir):
    """Workers started in each attempt, by attempt number."""
    sizes = {}
    for name in os.listdir(run_dir):
        attempt = int(name.split("-", 1)[0])
        sizes[attempt] = sizes.get(attempt, 0) + 1
    return [sizes[attempt] for attempt in sorted(sizes)]


def wait_for_attempt(run_dir, attempt, workers, launcher):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and launcher.poll() is None:
        started = [name for name in os.listdir(run_dir) if name.startswith(f"{attempt}-")]
        if len(started) == workers:
            return
        time.sleep(0.05)
    raise AssertionError(f"attempt {attempt} did not start {workers} workers")


@contextlib.contextmanager
def killed_at_exit(launcher: subprocess.Popen):
    """Yields `launcher`, and kills it on the way out however the block ends, so a failed
    assertion leaves no launcher (and, by their parent-death signal, no worker) behind."""
    try:
        yield launcher
    finally:
        launcher.kill()
        launcher.wait()


def stop_stand_ins(launcher, stop_file) -> tuple[str, str]:
    """Lets the stand-in workers finish (`--stop_file`) and returns the launcher's output."""
    stop_file.touch()
    return launcher.communicate(timeout=60)


def write_slots(path, slots):
    # Atomically, as the guide asks: a reader never sees half a list.
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        handle.write("".join(f"{slot}\n" for slot in slots))
    os.replace(partial, path)


@pytest.mark.parametrize("text, expected", [("3", (3, 3)), ("2:3", (2, 3)), ("1:1", (1, 1))])
def test_num_workers_is_n_or_min_max(text, expected):
    workers = WorkerRange.parse(text)
    assert (workers.minimum, workers.maximum) == expected


@pytest.mark.parametrize("text", ["0", "3:2", "two", "2:", ":3"])
def test_a_bad_worker_range_names_what_was_received(text):
    with pytest.raises(ValueError, match=f"Received: --num_workers={text}"):
        WorkerRange.parse(text)


def test_a_slot_is_dropped_after_more_failures_than_allowed():
    membership = Membership(WorkerRange(2, 3), ["a", "b", "c"], max_failures_per_slot=1)
    assert membership.record_failure("c") is None
    assert membership.record_failure("c") == Change(("a", "b"), left=("c",))
    assert membership.shortfall() is None


def test_a_shrink_keeps_the_largest_size_that_splits_the_global_batch():
    membership = Membership(
        WorkerRange(1, 4), ["a", "b", "c", "d"], max_failures_per_slot=0, global_batch_size=8
    )
    assert membership.record_failure("d") == Change(("a", "b"), left=("c", "d"))


def test_a_grow_that_does_not_split_the_global_batch_is_refused_once_and_the_size_kept():
    membership = Membership(WorkerRange(1, 3), ["a", "b"], global_batch_size=4)
    refusal = membership.offer(["a", "b", "c"])
    assert refusal == "3 workers x 1 replicas do not split --batch_size=4 evenly; keeping 2 workers"
    assert membership.offer(["a", "b", "c"]) is None
    assert membership.slots == ("a", "b")


@pytest.mark.parametrize(
    "replicas, expected",
    [
        (DataReplicas(), [1, 2, 3, 4]),
        (DataReplicas(devices_per_worker=2), [2, 4, 6, 8]),
        # The data axis: each worker's devices over pipe x tensor.
        (DataReplicas(2, "data=auto,pipe=2", "data"), [1, 2, 3, 4]),
        (DataReplicas(4, "data=auto,pipe=2", "data"), [2, 4, 6, 8]),
        (DataReplicas(8, "data=auto,pipe=2,tensor=2", "data"), [2, 4, 6, 8]),
        (DataReplicas(4, "pipe=2,data=auto", "data"), [2, 4, 6, 8]),
        # A fixed data axis fits one worker count only.
        (DataReplicas(2, "data=2,pipe=2", "data"), [0, 2, 0, 0]),
        (DataReplicas(4, "data=4,pipe=2", "data"), [0, 4, 0, 0]),
        # Whole replicas on each worker, or none.
        (DataReplicas(3, "data=auto,pipe=2", "data"), [0, 0, 0, 0]),
        # The pipe axis across workers (the training's default): replicas over all the
        # workers' devices.
        (DataReplicas(3, "data=auto,pipe=2"), [0, 3, 0, 6]),
        (DataReplicas(1, "data=auto,pipe=2", "pipe"), [0, 1, 0, 2]),
        (DataReplicas(2, "data=2,pipe=2", "pipe"), [0, 2, 0, 0]),
        # A pipeline (or model-parallel model) over every worker's devices: one replica.
        (DataReplicas(2, one_replica=True), [1, 1, 1, 1]),
        # Unknown devices, or a mesh the training refuses by itself: not judged.
        (DataReplicas(None, "data=auto,pipe=2", "data"), [None] * 4),
        (DataReplicas(2, "data=2,pipes=2", "data"), [None] * 4),
        (DataReplicas(2, "", "data"), [None] * 4),
    ],
)
def test_data_replicas_are_devices_or_the_hybrid_meshs_data_axis(replicas, expected):
    assert [replicas.count(workers) for workers in (1, 2, 3, 4)] == expected


def test_a_hybrid_size_is_judged_by_its_data_replicas_not_its_devices():
    # 2 workers x 2 devices hold data=2,pipe=2: 6 rows split over 2 replicas, not 4.
    membership = Membership(
        WorkerRange(1, 3),
        ["a", "b"],
        global_batch_size=6,
        replicas=DataReplicas(2, "data=auto,pipe=2", "data"),
    )
    assert membership.shortfall() is None
    assert membership.offer(["a", "b", "c"]) == Change(("a", "b", "c"), joined=("c",))
    assert membership.offer(["a"]) == Change(("a",), left=("b", "c"))


def test_a_hybrid_grow_that_does_not_split_the_batch_names_the_data_replicas():
    membership = Membership(
        WorkerRange(1, 3),
        ["a", "b"],
        global_batch_size=4,
        replicas=DataReplicas(2, "data=auto,pipe=2", "data"),
    )
    assert membership.offer(["a", "b", "c"]) == (
        "3 workers x 2 devices hold 3 data replicas of --mesh=data=auto,pipe=2, which do not "
        "split --batch_size=4 evenly; keeping 2 workers"
    )
    assert membership.slots == ("a", "b")


def test_an_uneven_split_says_which_batch_sizes_would_work():
    membership = Membership(WorkerRange(3, 3), ["a", "b", "c"], global_batch_size=4)
    assert membership.shortfall() == (
        "3 workers x 1 replicas do not split --batch_size=4 evenly; "
        "give --batch_size a multiple of 3, e.g. 6"
    )


@pytest.mark.parametrize(
    "replicas, fix",
    [
        (
            DataReplicas(2, "data=2,pipe=2", "data"),
            "give the mesh data=auto, so that it follows the workers",
        ),
        (
            DataReplicas(3, "data=auto,pipe=2", "data"),
            "give each worker a multiple of pipe x tensor = 2 devices (--devices_per_worker)",
        ),
        (
            DataReplicas(1, "data=auto,pipe=2", "pipe"),
            "give the workers together a multiple of pipe x tensor = 2 devices",
        ),
    ],
)
def test_workers_that_cannot_hold_the_mesh_are_refused_with_the_fix(replicas, fix):
    membership = Membership(WorkerRange(3, 3), ["a", "b", "c"], replicas=replicas)
    mesh = replicas.mesh
    devices = replicas.devices_per_worker
    assert (
        membership.shortfall() == f"3 workers x {devices} devices cannot hold --mesh={mesh}; {fix}"
    )


def test_a_fixed_hybrid_mesh_does_not_shrink_to_a_size_it_cannot_fill():
    membership = Membership(
        WorkerRange(1, 2),
        ["a", "b"],
        max_failures_per_slot=0,
        replicas=DataReplicas(2, "data=2,pipe=2", "data"),
    )
    assert membership.record_failure("b") == Change(("a",), left=("b",))
    assert membership.shortfall().startswith("1 workers x 2 devices cannot hold --mesh=data=2")


def test_a_starting_list_too_large_for_the_batch_starts_on_the_largest_size_that_splits_it():
    membership = Membership(WorkerRange(1, 3), ["a", "b", "c"], global_batch_size=4)
    assert membership.settle() == (
        "3 workers x 1 replicas do not split --batch_size=4 evenly; starting 2 workers"
    )
    assert membership.slots == ("a", "b")
    assert membership.offer(["a", "b", "c"]) is None  # said once


def test_a_dropped_slot_returns_only_after_leaving_the_list():
    membership = Membership(WorkerRange(1, 2), ["a", "b"], max_failures_per_slot=0)
    membership.record_failure("b")
    assert membership.offer(["a", "b"]) is None
    assert membership.offer(["a"]) is None
    assert membership.offer(["a", "b"]) == Change(("a", "b"), joined=("b",))


def test_slots_already_running_keep_their_ranks_when_the_list_lists_them_later():
    membership = Membership(WorkerRange(1, 3), ["a", "b"])
    assert membership.offer(["c", "b", "a"]) == Change(("a", "b", "c"), joined=("c",))


def test_an_empty_read_of_the_list_is_ignored():
    membership = Membership(WorkerRange(1, 2), ["a", "b"])
    assert membership.offer([]) is None


def test_a_slot_failing_more_than_its_restarts_is_dropped_and_the_job_goes_on_smaller(tmp_path):
    """`--max_restarts_per_worker` alone restarts a failed slot (no `--max_restarts`)."""
    result = run_launcher(
        ["--num_workers=2:3", "--max_restarts_per_worker=1"],
        ["--run_dir", str(tmp_path), "--fail_slots=slot2"],
    )
    assert result.returncode == 0, result.stderr
    assert "restarting all workers (failed slot restarts: slot2 1/1)" in result.stderr
    assert (
        "launch: slot2 failed more than --max_restarts_per_worker=1 times; slot2 left; "
        "2 workers (slot0, slot1); restarting the group" in result.stderr
    )
    assert group_sizes(tmp_path) == [3, 3, 2]
    assert result.stdout.count("done") == 2 + 2 * 2  # slot0 and slot1 of every attempt


def test_fewer_slots_than_min_end_the_job_in_one_line(tmp_path):
    result = run_launcher(
        ["--num_workers=2:3", "--max_restarts_per_worker=0"],
        ["--run_dir", str(tmp_path), "--fail_slots=slot1,slot2"],
    )
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1] == (
        "launch: 1 worker slot(s) left (slot0), fewer than --num_workers=2:3 needs; stopped "
        "(the run's checkpoints are kept: start it again with --resume to continue)"
    )
    assert group_sizes(tmp_path) == [3, 2]


@pytest.mark.parametrize(
    "slot_list",
    ["--hosts_file={hosts}", "--discovery_command=cat {hosts}"],
    ids=["file", "command"],
)
def test_a_slot_leaving_and_rejoining_the_list_shrinks_then_grows_the_group(tmp_path, slot_list):
    run_dir, hosts = tmp_path / "run", tmp_path / "slots"
    run_dir.mkdir()
    write_slots(hosts, ["a", "b", "c"])
    stop_file = tmp_path / "stop"
    launcher = subprocess.Popen(
        launch_command(
            ["--num_workers=2:3", slot_list.format(hosts=hosts), "--grace_seconds=5"],
            ["--run_dir", str(run_dir), f"--stop_file={stop_file}"],
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_attempt(run_dir, 0, 3, launcher)
        write_slots(hosts, ["a", "b"])
        wait_for_attempt(run_dir, 1, 2, launcher)
        write_slots(hosts, ["a", "b", "c"])
        wait_for_attempt(run_dir, 2, 3, launcher)
        stdout, stderr = stop_stand_ins(launcher, stop_file)
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 0, stderr
    assert "launch: c left; 2 workers (a, b); restarting the group" in stderr
    assert "launch: c joined; 3 workers (a, b, c); restarting the group" in stderr
    assert group_sizes(run_dir) == [3, 2, 3]
    assert (run_dir / "2-c").read_text().startswith('3 {"slots": ["a", "b", "c"], "left": []')


def test_a_listed_size_that_does_not_split_the_batch_is_refused_and_the_job_keeps_its_size(
    tmp_path,
):
    run_dir, hosts, messages = tmp_path / "run", tmp_path / "slots", tmp_path / "messages"
    run_dir.mkdir()
    write_slots(hosts, ["a", "b"])
    stop_file = tmp_path / "stop"
    with open(messages, "w") as stderr:
        launcher = subprocess.Popen(
            launch_command(
                ["--num_workers=1:3", f"--hosts_file={hosts}"],
                ["--run_dir", str(run_dir), f"--stop_file={stop_file}", "--batch_size=4"],
            ),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            wait_for_attempt(run_dir, 0, 2, launcher)
            write_slots(hosts, ["a", "b", "c"])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "keeping" not in messages.read_text():
                time.sleep(0.05)
            stop_file.touch()
            launcher.wait(timeout=60)
        finally:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, messages.read_text()
    assert (
        messages.read_text().count(
            "launch: 3 workers x 1 replicas do not split --batch_size=4 evenly; keeping 2 workers\n"
        )
        == 1
    )
    assert group_sizes(run_dir) == [2]


def test_a_discovery_command_lists_the_slots_and_its_failures_list_none(tmp_path):
    listing = tmp_path / "listing"
    listing.write_text("a\nb # comment\n\nb\n")
    assert discovered_slots(f"cat {listing}") == ["a", "b"]
    assert discovered_slots(f"cat {listing}; exit 3") == []
    assert discovered_slots("sleep 5", timeout_seconds=0.2) == []


def test_a_file_and_a_command_both_listing_slots_are_refused_in_one_line(tmp_path):
    result = run_launcher(
        ["--num_workers=1:2", f"--hosts_file={tmp_path}/s", "--discovery_command=echo a"],
        ["--run_dir", str(tmp_path)],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launch.py: error: --hosts_file and --discovery_command both give the slot list; "
        "keep one of them."
    ]
