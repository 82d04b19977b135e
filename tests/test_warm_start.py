"""The suite's warm script runs (tests/warm_start.py) behave as fresh `python script` runs:
the same training to the bit, their own arguments, environment, directory, streams and
random seeds, exit codes and signals passed through, and a killed client's run killed."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from script_runner import _WARM, LAUNCH, TWO_EPOCHS, model_weights, read_metrics, run_script
from warm_start import COLD_ENV, can_run_warm

PROBE = """
import json, os, random, signal, sys, time
import numpy as np
action = sys.argv[1]
if action == "describe":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "value": os.environ.get("PROBE"),
                      "path": sys.path[:2], "tensorflow": "tensorflow" in sys.modules,
                      "random": random.random(), "numpy": float(np.random.random()),
                      "pid": os.getpid()}))
    sys.stderr.write("to stderr\\n")
elif action == "exit":
    sys.exit(int(sys.argv[2]))
elif action == "raise":
    raise RuntimeError("raised by the probe")
elif action == "die":
    os.kill(os.getpid(), signal.SIGKILL)
elif action == "network":
    import tempfile
    with open("/proc/net/dev") as file:
        interfaces = sorted(line.split(":")[0].strip() for line in file.read().splitlines()[2:])
    print(json.dumps({"tensorflow": "tensorflow" in sys.modules, "interfaces": interfaces,
                      "tmpdir": tempfile.gettempdir(), "TMPDIR": os.environ.get("TMPDIR")}))
elif action == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    print(os.getpid(), flush=True)
    time.sleep(120)
"""


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def _warm(probe: str, *args: str, env: dict | None = None) -> list[str]:
    command = _WARM.command(probe, args, {**_WARM.env, **(env or {})})
    assert command is not None, "the warm server did not start; see the warning above"
    return command


def test_a_warm_run_trains_to_the_bit_as_a_cold_one(tmp_path, one_device_metrics, shared_dir):
    cold = str(tmp_path / "cold")
    run = (*TWO_EPOCHS, "--strategy=one_device")
    result = run_script("train.py", *run, f"--model_dir={cold}", env={COLD_ENV: "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    warm = shared_dir("one_device_two_epochs", None)  # conftest's run, warm
    numbers = ("loss", "accuracy", "val_loss", "val_accuracy")
    for cold_epoch, warm_epoch in zip(
        read_metrics(cold)["epochs"], one_device_metrics["epochs"], strict=True
    ):
        assert [cold_epoch[key] for key in numbers] == [warm_epoch[key] for key in numbers]
    for cold_weight, warm_weight in zip(model_weights(cold), model_weights(warm), strict=True):
        np.testing.assert_array_equal(cold_weight, warm_weight)


def test_a_warm_run_has_its_own_arguments_environment_directory_and_seeds(probe, tmp_path):
    runs = [
        subprocess.run(
            _warm(probe, "describe", "--flag=1"),
            cwd=tmp_path,
            env={**_WARM.env, "PROBE": f"run {index}", "PYTHONPATH": "/extra/path"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        for index in range(2)
    ]
    described = [json.loads(result.stdout) for result in runs]
    for index, (result, run) in enumerate(zip(runs, described, strict=True)):
        assert result.returncode == 0 and result.stderr.endswith("to stderr\n"), result.stderr
        assert run["argv"] == [probe, "describe", "--flag=1"]
        assert run["cwd"] == str(tmp_path) and run["value"] == f"run {index}"
        assert run["path"] == [os.path.dirname(probe), "/extra/path"]
        assert run["tensorflow"]  # imported by the server, not by the probe
    assert described[0]["pid"] != described[1]["pid"]
    assert described[0]["random"] != described[1]["random"]
    assert described[0]["numpy"] != described[1]["numpy"]


@pytest.mark.parametrize(
    "args, returncode, stderr",
    [
        (("exit", "3"), 3, ""),
        (("raise",), 1, "RuntimeError: raised by the probe"),
        (("die",), -signal.SIGKILL, ""),
    ],
)
def test_a_warm_run_ends_with_the_code_or_signal_of_a_cold_one(probe, args, returncode, stderr):
    results = [
        subprocess.run(command, capture_output=True, text=True, timeout=60)
        for command in (_warm(probe, *args), [sys.executable, probe, *args])
    ]
    assert [result.returncode for result in results] == [returncode, returncode]
    for result in results:
        assert stderr in result.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until_gone(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_signal_to_the_client_reaches_the_run(probe):
    client = subprocess.Popen(_warm(probe, "wait"), stdout=subprocess.PIPE, text=True)
    run = int(client.stdout.readline())
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=60) == 42
    assert _wait_until_gone(run)


def test_a_killed_client_takes_its_run_with_it(probe):
    client = subprocess.Popen(_warm(probe, "wait"), stdout=subprocess.PIPE, text=True)
    run = int(client.stdout.readline())
    assert _alive(run)
    client.kill()
    client.wait(timeout=60)
    assert _wait_until_gone(run)


@pytest.mark.parametrize(
    "script, args, env, warm",
    [
        ("train.py", ("--epochs=1",), {}, True),
        ("launch.py", ("--num_workers=2",), {}, False),
        ("train.py", ("--help",), {}, False),
        ("train.py", ("--tf_log_level=0",), {}, False),
        ("train.py", (), {"TF_CPP_MIN_LOG_LEVEL": "0"}, False),
        ("train.py", (), {"TF_ENABLE_ONEDNN_OPTS": "0"}, False),
        ("train.py", (), {COLD_ENV: "1"}, False),
        ("train.py", (), {"TF_CONFIG": "{}", "PYTHONPATH": "/x"}, True),
    ],
)
def test_runs_go_cold_where_a_fork_would_not_start_fresh(script, args, env, warm):
    assert can_run_warm(script, args, {"A": "1", **env}, {"A": "1"}) is warm


def test_a_client_whose_server_is_gone_runs_the_script_cold(probe, tmp_path):
    command = _warm(probe, "exit", "7")
    command[command.index("run") + 1] = str(tmp_path / "no-server")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 7
    assert "running cold" in result.stderr


def _launched_probes(probe: str, env: dict) -> list[dict]:
    command = [sys.executable, LAUNCH, "--num_workers=2", "--", sys.executable, probe, "network"]
    result = subprocess.run(
        _WARM.launch_command(command, env), env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.partition("] ")[2] for line in result.stdout.splitlines() if "{" in line]
    return [json.loads(line) for line in lines]


def test_launched_workers_run_warm_in_the_launchs_private_network_and_scratch(probe):
    warm = _launched_probes(probe, _WARM.env)
    cold = _launched_probes(probe, {**_WARM.env, COLD_ENV: "1"})
    assert [worker["tensorflow"] for worker in warm] == [True, True]
    assert [worker["tensorflow"] for worker in cold] == [False, False]
    # The launcher's private network (only loopback where this machine allows one), and
    # the launch's scratch directory (TMPDIR, set by the launcher), as for cold workers.
    assert [w["interfaces"] for w in warm] == [w["interfaces"] for w in cold]
    assert all(w["TMPDIR"] and w["tmpdir"] == w["TMPDIR"] for w in warm + cold)


def test_a_launched_worker_whose_import_time_variables_differ_runs_cold(probe):
    env = {**_WARM.env, "TF_CPP_MIN_LOG_LEVEL": "1"}
    assert [worker["tensorflow"] for worker in _launched_probes(probe, env)] == [False, False]
