"""Workers on other hosts: `tfmulti-launch --remote_shell=...` starts each slot's worker on
the slot's host through a remote shell, under `worker_guard`.

The remote shell here is `tests/workers/stand_in_remote_shell.py`, which runs the line as
sshd would (own session, bare environment, the caller's standard input) on this machine;
hosts 127.0.0.2 ... are loopback addresses that are not this machine's name, so the
launcher treats them as other hosts and addresses their workers by them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from script_runner import (
    TWO_EPOCHS,
    assert_same_run,
    read_metrics,
    start_launched_training,
    worker_program,
)
from test_elastic_launcher import (
    group_sizes,
    killed_at_exit,
    launch_command,
    stop_stand_ins,
    wait_for_attempt,
    write_slots,
)
from test_elastic_training import assert_ends_like, launch_elastic, one_device_reference, wait_for
from test_pipeline_across_workers import one_device_two_epochs_dir

from tfmulti.names import PREEMPTED_EXIT_CODE
from tfmulti.platform.launching import worker_guard
from tfmulti.platform.launching.launcher import (
    LaunchError,
    worker_environments,
    worker_process,
    worker_variables,
)
from tfmulti.platform.launching.remote_shell import (
    RemoteShell,
    RemoteShellError,
    remote_command_line,
    remote_python,
)
from tfmulti.platform.launching.worker_group import WorkerExit
from tfmulti.platform.launching.worker_places import WorkerPlace, slot_places

# A pipeline of one stage per worker (one device each).
TWO_STAGES = ("--strategy=pipeline", "--num_stages=2", "--microbatches=2", "--partition=params")
STAND_IN = f"{sys.executable} {worker_program('stand_in_remote_shell')}"
SHELL = RemoteShell.parse(STAND_IN)


def test_the_host_follows_the_shell_or_fills_its_placeholder():
    assert RemoteShell.parse("ssh -p 2222").argv("n2", "hostname") == [
        "ssh",
        "-p",
        "2222",
        "n2",
        "hostname",
    ]
    srun = RemoteShell.parse("srun --nodes=1 -w {host} sh -c")
    assert srun.argv("n2", "true") == ["srun", "--nodes=1", "-w", "n2", "sh", "-c", "true"]


@pytest.mark.parametrize("text", ["", "   ", "ssh 'unclosed"])
def test_an_unusable_remote_shell_is_refused_in_one_line(text):
    with pytest.raises(RemoteShellError, match=r"--remote_shell .*Received: ") as raised:
        RemoteShell.parse(text)
    assert "\n" not in str(raised.value)


def test_the_command_line_carries_the_variables_and_directory_through_a_bare_shell(tmp_path):
    variables = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}}), "ODD": "it's $HOME"}
    program = (
        "import os, json; "
        "print(json.dumps([os.getcwd(), os.environ['TF_CONFIG'], os.environ['ODD']]))"
    )
    line = remote_command_line([sys.executable, "-c", program], variables, str(tmp_path), 5)
    # The input stays open, as the launcher keeps it: its end would stop the worker.
    remote = subprocess.Popen(
        SHELL.argv("127.0.0.2", line), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    output = remote.stdout.read()
    assert remote.wait(timeout=60) == 0
    remote.stdin.close()
    assert json.loads(output) == [str(tmp_path), variables["TF_CONFIG"], "it's $HOME"]


def test_the_guard_runs_the_workers_own_python_or_python3():
    assert remote_python(["/opt/venv/bin/python3.12", "train.py"]) == "/opt/venv/bin/python3.12"
    assert remote_python(["torchrun-like", "train.py"]) == "python3"


def start_guard(program: str, grace_seconds: float = 30) -> subprocess.Popen:
    """`worker_guard` over a Python worker `program`, its input a pipe the test holds."""
    command = [sys.executable, "-m", "tfmulti.platform.launching.worker_guard"]
    return subprocess.Popen(
        [*command, f"--grace_seconds={grace_seconds}", "--", sys.executable, "-c", program],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


# Prints "ready" and waits; on SIGTERM prints "saving" and exits as a preempted worker.
PREEMPTIBLE = (
    "import signal, sys, time\n"
    "def save(*_):\n"
    "    print('saving', flush=True)\n"
    f"    sys.exit({PREEMPTED_EXIT_CODE})\n"
    "signal.signal(signal.SIGTERM, save)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
# As PREEMPTIBLE, but its save takes 1.5 s.
SLOW_TO_SAVE = PREEMPTIBLE.replace("    sys.exit(", "    time.sleep(1.5)\n    sys.exit(")
# Prints "ignored" on each SIGTERM and goes on.
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('ignored', flush=True))\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_term_line_preempts_the_worker_and_the_guard_exits_with_its_code():
    guard = start_guard(PREEMPTIBLE)
    assert guard.stdout.readline() == "ready\n"
    guard.stdin.write(f"{worker_guard.TERMINATE_LINE}\n")
    guard.stdin.flush()
    assert guard.stdout.readline() == "saving\n"
    assert guard.wait(timeout=30) == PREEMPTED_EXIT_CODE


def test_end_of_input_after_a_term_kills_a_worker_that_does_not_stop():
    guard = start_guard(STUBBORN)
    assert guard.stdout.readline() == "ready\n"
    guard.stdin.write(f"{worker_guard.TERMINATE_LINE}\n")
    guard.stdin.flush()
    assert guard.stdout.readline() == "ignored\n"
    guard.stdin.close()
    assert guard.wait(timeout=30) == 128 + signal.SIGKILL


def test_a_lost_connection_terms_the_worker_then_kills_it_after_the_grace():
    preemptible = start_guard(PREEMPTIBLE)
    assert preemptible.stdout.readline() == "ready\n"
    preemptible.stdin.close()
    assert preemptible.stdout.readline() == "saving\n"
    assert preemptible.wait(timeout=30) == PREEMPTED_EXIT_CODE
    stubborn = start_guard(STUBBORN, grace_seconds=0.5)
    assert stubborn.stdout.readline() == "ready\n"
    stubborn.stdin.close()
    assert stubborn.stdout.readline() == "ignored\n"
    assert stubborn.wait(timeout=30) == 128 + signal.SIGKILL


def test_a_signal_to_the_guard_then_end_of_input_still_grants_the_grace():
    """A cancelled SLURM step: SIGTERM to the guard, then its input closes. The worker's
    save (1.5 s) fits the grace (30 s), so it ends preempted, not killed."""
    guard = start_guard(SLOW_TO_SAVE)
    assert guard.stdout.readline() == "ready\n"
    guard.send_signal(signal.SIGTERM)
    assert guard.stdout.readline() == "saving\n"
    guard.stdin.close()
    assert guard.wait(timeout=30) == PREEMPTED_EXIT_CODE


def test_each_slot_is_addressed_on_its_host_on_a_port_the_probe_found():
    places = slot_places(["127.0.0.2:0", "localhost", "127.0.0.2:1"], SHELL, sys.executable, 0)
    assert [place.remote_host for place in places] == ["127.0.0.2", None, "127.0.0.2"]
    # This machine, named localhost beside other hosts, is addressed by its host name,
    # which the other hosts can reach.
    assert [place.address.rpartition(":")[0] for place in places] == [
        "127.0.0.2",
        socket.gethostname(),
        "127.0.0.2",
    ]
    assert [(p.index_on_host, p.workers_on_host) for p in places] == [(0, 2), (0, 1), (1, 2)]
    ports = [int(place.address.rpartition(":")[2]) for place in places]
    assert ports[0] != ports[2] and all(port > 0 for port in ports)  # two on one host


def test_a_host_the_shell_cannot_reach_is_named_in_one_line():
    with pytest.raises(RemoteShellError) as raised:
        slot_places(["node7"], RemoteShell.parse("false"), "python3", 0)
    message = str(raised.value)
    assert message.startswith("could not reach host node7 through --remote_shell='false'")
    assert "`false node7 true` succeeds" in message and "\n" not in message


def gpu_places(workers_on_host, host_gpus):
    return [
        WorkerPlace(f"n{rank}:1", "n", rank, workers_on_host, host_gpus)
        for rank in range(workers_on_host)
    ]


def test_each_worker_sees_its_share_of_its_hosts_gpus():
    environments = worker_environments(2, places=gpu_places(2, 4), base_environment={})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in environments] == ["0,1", "2,3"]
    one_each = worker_environments(2, 1, places=gpu_places(2, 4), base_environment={})
    assert [env["CUDA_VISIBLE_DEVICES"] for env in one_each] == ["0", "1"]
    with pytest.raises(LaunchError, match="2 workers x 3 GPUs need more than the 4 GPUs of n0: "):
        worker_environments(2, 3, places=gpu_places(2, 4), base_environment={})


def stand_in_launch(tmp_path, slots, launch_flags=(), worker_flags=()):
    """The launcher over the stand-in shell and the elastic stand-in worker (no TF)."""
    run_dir, hosts = tmp_path / "run", tmp_path / "hosts"
    run_dir.mkdir()
    write_slots(hosts, slots)
    command = launch_command(
        [f"--hosts_file={hosts}", f"--remote_shell={STAND_IN}", *launch_flags],
        ["--run_dir", str(run_dir), *worker_flags],
    )
    launcher = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    return launcher, run_dir, hosts


def worker_processes_of(run_dir) -> list[int]:
    """Pids of processes whose command line names `run_dir` (stand-in workers, guards)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                if str(run_dir).encode() in handle.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_a_remote_slot_failing_too_often_is_dropped_and_a_local_slot_runs_here(tmp_path):
    stop_file = tmp_path / "stop"
    launcher, run_dir, _ = stand_in_launch(
        tmp_path,
        ["localhost", "127.0.0.2", "127.0.0.3"],
        ["--num_workers=2:3", "--max_restarts_per_worker=0"],
        ["--fail_slots=127.0.0.3", f"--stop_file={stop_file}"],
    )
    with killed_at_exit(launcher):
        wait_for_attempt(run_dir, 1, 2, launcher)
        stdout, stderr = stop_stand_ins(launcher, stop_file)
    assert launcher.returncode == 0, stderr
    assert "launch: worker 2 exited with code 3; stopped the other workers" in stderr
    assert "127.0.0.3 left; 2 workers (localhost, 127.0.0.2); restarting the group" in stderr
    assert group_sizes(run_dir) == [3, 2]
    assert "cannot share a private network" in stderr
    membership = json.loads((run_dir / "1-127.0.0.2").read_text().split(" ", 1)[1])
    assert membership["slots"] == ["localhost", "127.0.0.2"]


def test_a_sigterm_to_the_launcher_preempts_remote_workers_and_leaves_none_behind(tmp_path):
    launcher, run_dir, _ = stand_in_launch(
        tmp_path,
        ["127.0.0.2", "127.0.0.3"],
        ["--num_workers=2", "--grace_seconds=20"],
        [f"--stop_file={tmp_path / 'never'}"],
    )
    with killed_at_exit(launcher):
        wait_for_attempt(run_dir, 0, 2, launcher)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == PREEMPTED_EXIT_CODE, stderr
    assert "workers saved a checkpoint and stopped" in stderr
    assert worker_processes_of(run_dir) == []


def test_remote_shell_without_hosts_is_refused_in_one_line(tmp_path):
    command = launch_command(["--num_workers=2", f"--remote_shell={STAND_IN}"], ["--run_dir=x"])
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "launch: --remote_shell starts each slot's worker on the slot's host: name the hosts "
        "with --hosts_file, --discovery_command or --slots_from=slurm"
    )


def test_training_over_remote_hosts_shrinks_on_the_list_and_ends_like_one_device(
    tmp_path, shared_dir
):
    """Three workers on three hosts; one host leaves the list once step checkpoint 10 exists:
    the group saves on the preemption path through the guards, restarts on two hosts and
    ends like the uninterrupted run."""
    model_dir, hosts = str(tmp_path / "run"), tmp_path / "hosts"
    write_slots(hosts, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    launcher = launch_elastic(
        model_dir,
        "--num_workers=2:3",
        f"--hosts_file={hosts}",
        f"--remote_shell={STAND_IN}",
        grace_seconds=20,
    )
    with killed_at_exit(launcher):
        checkpoint = os.path.join(model_dir, "backup", f"step-{10:09d}.json")
        wait_for(lambda: os.path.exists(checkpoint), launcher, "step checkpoint 10")
        write_slots(hosts, ["127.0.0.2", "127.0.0.3"])
        output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "launch: 127.0.0.4 left; 2 workers (127.0.0.2, 127.0.0.3); restarting the group" in (
        output
    )
    grown, shrunk = read_metrics(model_dir)["membership"]
    assert (grown["workers"], shrunk["workers"], shrunk["left"]) == (3, 2, ["127.0.0.4"])
    assert shrunk["global_step"] >= 10
    assert_ends_like(model_dir, one_device_reference(shared_dir))


def test_a_pipeline_from_here_to_a_remote_host_checks_its_worker_and_trains_like_one_device(
    tmp_path, shared_dir
):
    """Stage 0 on this machine's worker (the chief), stage 1 on the remote host's: the chief
    finds the remote worker's posted settings in the launcher's scratch directory, which the
    guard made there, and checks them."""
    model_dir, hosts = str(tmp_path / "run"), tmp_path / "hosts"
    write_slots(hosts, ["localhost", "127.0.0.2"])
    launcher = start_launched_training(
        (
            "--num_workers=2",
            "--devices_per_worker=1",
            f"--hosts_file={hosts}",
            f"--remote_shell={STAND_IN}",
        ),
        (*TWO_EPOCHS, *TWO_STAGES, "--schedule=1f1b", f"--model_dir={model_dir}"),
    )
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output[-3000:]
    assert "posted no settings" not in output
    devices = [stage["device"] for stage in read_metrics(model_dir)["run"]["split"]["stages"]]
    assert [device.split("/")[3] for device in devices] == ["task:0", "task:1"]
    assert_same_run(model_dir, one_device_two_epochs_dir(shared_dir))


def test_the_guard_makes_the_scratch_directory_and_leaves_it_to_the_hosts_other_workers(
    tmp_path,
):
    scratch = tmp_path / "tfmulti-launch-x"
    program = (
        "import os, tempfile; print(tempfile.gettempdir(), os.path.isdir(os.environ['TMPDIR']))"
    )
    for _ in range(2):  # two workers of one host, one after the other
        guard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tfmulti.platform.launching.worker_guard",
                "--",
                sys.executable,
                "-c",
                program,
            ],
            env={**os.environ, "TMPDIR": str(scratch)},
            stdin=subprocess.PIPE,  # held open while the worker runs, as the launcher does
            stdout=subprocess.PIPE,
            text=True,
        )
        assert guard.stdout.read() == f"{scratch} True\n"
        assert guard.wait(timeout=60) == 0
        guard.stdin.close()
        assert scratch.is_dir()  # a guard never removes it: the host's other workers use it
    SHELL.remove_directory("127.0.0.2", str(scratch))  # the launcher's, at the end
    assert not scratch.exists()


def test_a_remote_worker_gets_every_variable_the_launcher_sets_even_one_set_here(monkeypatch):
    """PYTHONUNBUFFERED=1 set here too still reaches the remote worker, and TMPDIR goes as
    the launcher's scratch directory; variables the launcher does not set stay here."""
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv("SOMETHING_OF_MINE", "x")
    place = WorkerPlace("127.0.0.2:1", "127.0.0.2", 0, 1, 0)
    (variables,) = worker_variables([place], devices_per_worker=2)
    variables["TMPDIR"] = "/tmp/tfmulti-launch-x"
    worker = worker_process(["python", "train.py"], variables, place, SHELL, 5)
    line = worker.command[-1]
    for name in ("TF_CONFIG", "PYTHONUNBUFFERED", "TFMULTI_VIRTUAL_DEVICES", "TMPDIR"):
        assert f" {name}=" in line or f" '{name}=" in line, (name, line)
    assert "SOMETHING_OF_MINE" not in line and worker.remote


def test_a_worker_killed_on_its_host_is_reported_by_its_signal():
    guard = start_guard("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    returncode = guard.wait(timeout=60)
    guard.stdin.close()
    assert returncode == 128 + signal.SIGKILL
    assert WorkerExit(1, returncode, remote=True).describe() == (
        "worker 1 exited with code 137 (killed by SIGKILL)"
    )


def test_a_host_that_does_not_answer_fails_its_slot_until_dropped(tmp_path, monkeypatch):
    """127.0.0.4 is down from the start: each start's probe of it fails as its worker would,
    and after more than --max_restarts_per_worker failures it is dropped."""
    monkeypatch.setenv("STAND_IN_DOWN_HOSTS", "127.0.0.4")
    stop_file = tmp_path / "stop"
    launcher, run_dir, _ = stand_in_launch(
        tmp_path,
        ["127.0.0.2", "127.0.0.3", "127.0.0.4"],
        ["--num_workers=2:3", "--max_restarts_per_worker=1", "--max_restarts=1"],
        [f"--stop_file={stop_file}"],
    )
    with killed_at_exit(launcher):
        wait_for_attempt(run_dir, 2, 2, launcher)
        stdout, stderr = stop_stand_ins(launcher, stop_file)
    assert launcher.returncode == 0, stderr
    assert stderr.count("launch: could not reach host 127.0.0.4 through --remote_shell=") == 2
    # The per-slot budget restarts the failed slot on its own count, not --max_restarts'.
    assert "launch: restarting all workers (failed slot restarts: 127.0.0.4 1/1)" in stderr
    assert (
        "launch: 127.0.0.4 failed more than --max_restarts_per_worker=1 times; 127.0.0.4 left; "
        "2 workers (127.0.0.2, 127.0.0.3); restarting the group" in stderr
    )
    assert group_sizes(run_dir) == [2]  # attempts 0 and 1 never started: the probe failed


def test_a_killed_launcher_leaves_no_remote_worker_behind(tmp_path):
    """SIGKILL to the launcher: its remote shells die with it, each guard's input ends,
    and the guards stop their workers (SIGTERM: the stand-in worker exits at once)."""
    launcher, run_dir, _ = stand_in_launch(
        tmp_path,
        ["127.0.0.2", "127.0.0.3"],
        ["--num_workers=2", "--grace_seconds=5"],
        [f"--stop_file={tmp_path / 'never'}"],
    )
    with killed_at_exit(launcher):
        wait_for_attempt(run_dir, 0, 2, launcher)
        assert len(worker_processes_of(run_dir)) >= 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while worker_processes_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert worker_processes_of(run_dir) == []


def test_namespace_isolation_with_a_remote_shell_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "hosts").write_text("127.0.0.2\n")
    command = launch_command(
        [
            "--num_workers=1",
            "--isolation=namespace",
            f"--hosts_file={tmp_path / 'hosts'}",
            f"--remote_shell={STAND_IN}",
        ],
        ["--run_dir=x"],
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "launch: refusing to start workers other machines could reach: workers on other "
        "hosts (--remote_shell) cannot share a private network; restrict their ports with a "
        "firewall and use --isolation=auto, or drop --remote_shell"
    )
