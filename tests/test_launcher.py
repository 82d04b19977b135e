"""The local launcher: failures are reported and contained, groups restart, output is labelled."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO_ROOT, "scripts", "launch.py")
WORKER = os.path.join(REPO_ROOT, "tests", "workers", "launcher_worker.py")


def run_launcher(launch_flags, worker_flags, timeout=60):
    command = [sys.executable, LAUNCH, *launch_flags, "--", sys.executable, WORKER, *worker_flags]
    result = subprocess.run(command, capture_output=True, timeout=timeout)
    # Decoded by hand: text mode would turn the progress bar's carriage returns into newlines.
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    return result


def recorded_pids(pid_dir):
    pids = []
    for path in glob.glob(os.path.join(pid_dir, "*")):
        with open(path) as file:
            pids.extend(int(pid) for pid in file.read().split())
    return pids


def is_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as file:  # a zombie is dead, only not yet reaped
        return file.read().split(")")[-1].split()[0] != "Z"


def assert_no_survivors(pid_dir):
    deadline = time.monotonic() + 5  # orphaned children are reaped by init asynchronously
    while time.monotonic() < deadline and any(is_alive(pid) for pid in recorded_pids(pid_dir)):
        time.sleep(0.05)
    survivors = [pid for pid in recorded_pids(pid_dir) if is_alive(pid)]
    assert not survivors, f"processes left running: {survivors}"


def test_worker_exit_code_is_reported_and_the_others_are_stopped(tmp_path):
    result = run_launcher(
        ["--num_workers=3", "--grace_seconds=2"],
        ["--pid_dir", str(tmp_path), "--fail_rank=1", "--run_seconds=60"],
    )
    assert result.returncode == 3
    assert "worker 1 exited with code 3" in result.stderr
    assert len(recorded_pids(tmp_path)) == 6
    assert_no_survivors(tmp_path)


def test_sigkilled_worker_is_reported_and_no_process_survives(tmp_path):
    result = run_launcher(
        ["--num_workers=2", "--grace_seconds=2"],
        ["--pid_dir", str(tmp_path), "--fail_rank=1", "--fail_with=sigkill", "--run_seconds=60"],
    )
    assert result.returncode == 128 + signal.SIGKILL
    assert "worker 1 was killed by SIGKILL" in result.stderr
    assert_no_survivors(tmp_path)


def test_workers_ignoring_sigterm_are_killed_after_the_grace_period(tmp_path):
    result = run_launcher(
        ["--num_workers=2", "--grace_seconds=1"],
        ["--pid_dir", str(tmp_path), "--fail_rank=1", "--ignore_sigterm", "--run_seconds=60"],
    )
    assert result.returncode == 3
    assert_no_survivors(tmp_path)


def test_max_restarts_restarts_the_whole_group_which_then_succeeds(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    marker = tmp_path / "failed_once"
    result = run_launcher(
        ["--num_workers=2", "--max_restarts=1", "--grace_seconds=2"],
        ["--pid_dir", str(pid_dir), "--fail_rank=1", f"--fail_once_marker={marker}"],
    )
    assert result.returncode == 0, result.stderr
    assert "worker 1 exited with code 3" in result.stderr
    assert "restarting all workers (1/1)" in result.stderr
    assert len(list(pid_dir.iterdir())) == 4  # two attempts of two workers
    # Both workers of the second attempt finish. Worker 0 of the first may finish too
    # before worker 1 fails (it runs 0.5 s, worker 1 fails 0.3 s after starting, and a
    # loaded machine can start worker 1 late): "done" twice or three times.
    assert result.stdout.count("done") in (2, 3), result.stdout
    assert result.stdout.count("[worker 1] done") == 1
    assert_no_survivors(pid_dir)


def test_failure_beyond_max_restarts_is_final(tmp_path):
    result = run_launcher(
        ["--num_workers=2", "--max_restarts=1", "--grace_seconds=2"],
        ["--pid_dir", str(tmp_path), "--fail_rank=0"],
    )
    assert result.returncode == 3
    assert result.stderr.count("worker 0 exited with code 3") == 2


def test_output_is_prefixed_by_rank_and_the_chief_progress_bar_keeps_carriage_returns(tmp_path):
    result = run_launcher(
        ["--num_workers=2", "--devices_per_worker=2"], ["--pid_dir", str(tmp_path)]
    )
    assert result.returncode == 0, result.stderr
    assert "[worker 0] tf_config task 0 devices 2\n" in result.stdout
    assert "[worker 1] tf_config task 1 devices 2\n" in result.stdout
    assert "[worker 0] step 1/2\r[worker 0] step 2/2\n" in result.stdout
    assert "[worker 1] step 2/2\n" in result.stdout
    assert "[worker 1] step 1/2" not in result.stdout


def test_sigterm_to_the_launcher_stops_every_worker(tmp_path):
    command = [
        sys.executable,
        LAUNCH,
        "--num_workers=2",
        "--grace_seconds=2",
        "--",
        sys.executable,
        WORKER,
        "--pid_dir",
        str(tmp_path),
        "--run_seconds=60",
    ]
    launcher, stderr = _sigterm_launcher_once_workers_run(command, tmp_path)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM" in stderr
    assert_no_survivors(tmp_path)


def test_sigterm_to_the_launcher_exits_42_once_the_workers_saved(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    command = [
        sys.executable,
        LAUNCH,
        "--num_workers=2",
        "--",
        sys.executable,
        WORKER,
        "--pid_dir",
        str(pid_dir),
        "--run_seconds=60",
        "--save_on_sigterm",
    ]
    launcher, stderr = _sigterm_launcher_once_workers_run(command, pid_dir)
    # As a cluster manager reads it: saved, restart me.
    assert launcher.returncode == 42, stderr
    assert "workers saved a checkpoint and stopped (code 42" in stderr
    assert sorted(p.name for p in pid_dir.glob("sigterm-*")) == ["sigterm-0", "sigterm-1"]


def test_preempted_worker_lets_its_peers_finish_their_save_before_the_group_restarts(tmp_path):
    marker = tmp_path / "preempted-once"
    result = run_launcher(
        ["--num_workers=2", "--max_restarts=1", "--grace_seconds=5"],
        [
            "--pid_dir",
            str(tmp_path),
            "--fail_rank=1",
            "--fail_with=preempted",
            f"--fail_once_marker={marker}",
            "--run_seconds=1.5",
            "--save_on_sigterm",
        ],
    )
    assert result.returncode == 0, result.stderr
    assert "worker 1 was preempted and saved a checkpoint (code 42)" in result.stderr
    assert "restarting all workers (1/1)" in result.stderr
    # Worker 0 was not sent SIGTERM: it ran to its end within the grace period.
    assert not list(tmp_path.glob("sigterm-*"))
    assert result.stdout.count("done") == 3


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--num_workers=0"], "--num_workers"),
        (["--num_workers=2", "--max_restarts=-1"], "--max_restarts"),
        (["--num_workers=2", "--grace_seconds=0"], "--grace_seconds"),
        (["--num_workers=2", "--devices_per_worker=0"], "--devices_per_worker"),
        ([], "--num_workers"),
    ],
)
def test_bad_flag_gives_one_line_naming_the_flag(flags, named):
    result = subprocess.run(
        [sys.executable, LAUNCH, *flags, "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def run_printing_worker(launch_flags, worker_flags):
    """The launcher over a worker that prints and exits; `worker_flags` are for the launcher
    to read (the worker ignores them)."""
    command = [
        sys.executable,
        LAUNCH,
        *launch_flags,
        "--",
        sys.executable,
        "-c",
        "print('ran')",
        *worker_flags,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_a_hybrid_batch_is_checked_against_the_data_axis_not_the_devices():
    # 2 workers x 2 devices hold data=2,pipe=2: 6 rows split over its 2 replicas.
    result = run_printing_worker(
        ["--num_workers=2", "--devices_per_worker=2"],
        ["--strategy=hybrid", "--mesh=data=auto,pipe=2", "--batch_size=6"],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("ran") == 2


@pytest.mark.parametrize(
    "launch_flags, worker_flags, line",
    [
        (
            ["--num_workers=3", "--devices_per_worker=2"],
            ["--strategy=hybrid", "--mesh", "data=auto,pipe=2", "--cross_host_axis=data"]
            + ["--batch_size=4"],
            "launch: 3 workers x 2 devices hold 3 data replicas of --mesh=data=auto,pipe=2, "
            "which do not split --batch_size=4 evenly; give --batch_size a multiple of 3, e.g. 6",
        ),
        (
            ["--num_workers=1", "--devices_per_worker=8"],
            ["--strategy=hybrid", "--mesh=data=auto,pipe=2,tensor=2", "--batch_size=5"],
            "launch: 1 workers x 8 devices hold 2 data replicas of "
            "--mesh=data=auto,pipe=2,tensor=2, which do not split --batch_size=5 evenly; "
            "give --batch_size a multiple of 2, e.g. 6",
        ),
        (
            ["--num_workers=3", "--devices_per_worker=2"],
            ["--strategy=hybrid", "--mesh=data=2,pipe=2", "--cross_host_axis", "data"]
            + ["--batch_size=4"],
            "launch: 3 workers x 2 devices cannot hold --mesh=data=2,pipe=2; give the mesh "
            "data=auto, so that it follows the workers",
        ),
        (
            # The pipe axis crosses the workers by default, so pipe=2 needs 1 or 2 workers.
            ["--num_workers=3", "--devices_per_worker=2"],
            ["--strategy=hybrid", "--mesh=data=auto,pipe=2", "--batch_size=6"],
            "launch: --cross_host_axis=pipe lays --mesh=data=auto,pipe=2's pipe axis over 3 "
            "workers, so pipe must be a multiple of 3; use --cross_host_axis=data or another "
            "mesh. Received: pipe=2",
        ),
        (
            ["--num_workers=1:2", "--devices_per_worker=2"],
            ["--strategy=hybrid", "--mesh=data=auto,pipe=2", "--batch_size=4"],
            "launch: an elastic job resizes a hybrid mesh along its data axis, so the data "
            "axis must cross the workers: add --cross_host_axis=data to the worker command. "
            "Received: --num_workers=1:2 with --cross_host_axis=pipe",
        ),
        (
            ["--num_workers=3"],
            ["--strategy=multi_worker", "--batch_size=4"],
            "launch: 3 workers x 1 replicas do not split --batch_size=4 evenly; "
            "give --batch_size a multiple of 3, e.g. 6",
        ),
    ],
    ids=[
        "hybrid data axis",
        "hybrid with tensor",
        "fixed mesh",
        "pipe across too many workers",
        "elastic with the pipe axis across",
        "multi_worker",
    ],
)
def test_an_uneven_split_is_refused_in_one_line_naming_the_fix(launch_flags, worker_flags, line):
    result = run_printing_worker(launch_flags, worker_flags)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]
    assert "ran" not in result.stdout


def test_an_elastic_start_too_large_for_the_batch_starts_on_a_size_that_splits_it():
    result = run_printing_worker(["--num_workers=2:3"], ["--batch_size=4"])
    assert result.returncode == 0, result.stderr
    assert (
        "launch: 3 workers x 1 replicas do not split --batch_size=4 evenly; starting 2 workers"
        in result.stderr
    )
    assert result.stdout.count("ran") == 2


def test_missing_worker_command_gives_one_line():
    result = subprocess.run(
        [sys.executable, LAUNCH, "--num_workers=2"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "after --" in result.stderr


def _sigterm_launcher_once_workers_run(command: list[str], pid_dir) -> tuple:
    """Starts the launcher, SIGTERMs it once both workers wrote their pid; returns it (ended)
    and its stderr."""
    launcher = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while len(list(pid_dir.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
        launcher.wait()
    return launcher, stderr
