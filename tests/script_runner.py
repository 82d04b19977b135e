"""Runs tfmulti's absl-flag scripts as users do: in a subprocess, from the repository root."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from warm_start import WarmServer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO_ROOT, "scripts", "launch.py")


def worker_program(name: str) -> str:
    """The path of `tests/workers/<name>.py`, a program the launcher starts in tests."""
    return os.path.join(REPO_ROOT, "tests", "workers", f"{name}.py")


# The scripts import a user's modules (e.g. `--layout_map=user_layouts:mlp_layout_map`)
# from PYTHONPATH; `tests/user_code` holds the tests' ones.
USER_CODE_ENV = {
    "PYTHONPATH": os.pathsep.join(
        [os.path.join(REPO_ROOT, "tests", "user_code"), os.environ.get("PYTHONPATH", "")]
    )
}


def script_environment() -> dict:
    """This process's environment without TF_CPP_MIN_LOG_LEVEL (conftest sets it for the
    test process): scripts then start TensorFlow as a user's shell would, quietly."""
    return {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}


_WARM = WarmServer(script_environment())


def warm_when_possible(argv: list[str], env: dict) -> list[str]:
    """`argv` (`python path/script.py args...`) as a warm run where one starts as fresh; a
    launch's workers (`python launch.py ... -- python script.py ...`) warm, its launcher cold."""
    if len(argv) < 2 or argv[0] != sys.executable or not argv[1].endswith(".py"):
        return argv
    if os.path.basename(argv[1]) == "launch.py":
        return _WARM.launch_command(argv, env)
    return _WARM.command(argv[1], tuple(argv[2:]), env) or argv


def run_script(script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """Runs `python scripts/<script> args...`; returns the CompletedProcess (text mode).

    The run is forked by tests/warm_start.py's server, with TensorFlow imported already,
    where that is the same as a fresh start; else it is a plain `python` process."""
    full_env = {**script_environment(), **(env or {})}
    path = os.path.join(REPO_ROOT, "scripts", script)
    return subprocess.run(
        warm_when_possible([sys.executable, path, *args], full_env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def one_line_error(result, returncode: int) -> str:
    """Asserts the script exited with `returncode` and no traceback; returns its last line."""
    assert result.returncode == returncode, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return last_line(result.stderr)


def last_line(text: str) -> str:
    """The last non-empty line of `text` (TensorFlow may log above it)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid`, read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                parent = int(file.read().rpartition(")")[2].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if parent == pid:
            children.append(int(entry))
    return children


def launch(*args: str, **popen_options) -> subprocess.Popen:
    """Starts `python scripts/launch.py args...` (text mode); the caller waits for it."""
    command = [sys.executable, LAUNCH, *args]
    env = script_environment()
    return subprocess.Popen(
        warm_when_possible(command, env), cwd=REPO_ROOT, env=env, text=True, **popen_options
    )


# Parses each command line of argv[2] (a JSON list of argument lists) with the flags and
# the parser of the script module argv[1], as `scripts/<script>.py` does, one after another
# in this one process; prints [exit code, stderr] of each, and whether TensorFlow was
# imported.
_PARSE_EACH = """
import contextlib, importlib, io, json, sys
from absl import flags
from tfmulti.flags.parsing import parse_flags_or_exit

script = importlib.import_module(sys.argv[1])
program = sys.argv[1].rsplit(".", 1)[1] + ".py"
results = []
for argv in json.loads(sys.argv[2]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            parse_flags_or_exit([program, *argv], usage=script.__doc__, module=script.__name__)
            code = 0
        except SystemExit as exit_request:
            code = exit_request.code
    flags.FLAGS.unparse_flags()
    results.append([code, stderr.getvalue()])
print(json.dumps({"results": results, "tensorflow": "tensorflow" in sys.modules}))
"""


def parse_each(module: str, command_lines: list[list[str]]) -> list[tuple[int, str]]:
    """(exit code, stderr) of the parser of script `module` (e.g. tfmulti.cli.plan) on each
    of `command_lines`, parsed in one fresh process before TensorFlow starts."""
    result = subprocess.run(
        [sys.executable, "-c", _PARSE_EACH, module, json.dumps(command_lines)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed = json.loads(result.stdout.splitlines()[-1])
    assert not parsed["tensorflow"]
    return [tuple(case) for case in parsed["results"]]


# A small run whose result any parallel strategy must reproduce exactly.
COMMON = (
    "--model=mlp",
    "--dataset=digits",
    "--batch_size=32",
    "--steps_per_epoch=5",
    "--validation_steps=4",
    "--optimizer=sgd",
    "--learning_rate=0.1",
    "--log_steps=0",
)
TWO_EPOCHS = (*COMMON, "--epochs=2")


def read_metrics(model_dir: str) -> dict:
    """The run's `metrics.json`."""
    with open(os.path.join(model_dir, "metrics.json")) as handle:
        return json.load(handle)


def assert_same_training(metrics: dict, reference: dict) -> None:
    """Asserts two runs' records show the same losses and accuracy, epoch by epoch."""
    import pytest

    assert metrics["status"] == "completed"
    assert [e["epoch"] for e in metrics["epochs"]] == [e["epoch"] for e in reference["epochs"]]
    for epoch, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(expected["loss"], rel=1e-4)
    assert metrics["final"]["loss"] == pytest.approx(reference["final"]["loss"], rel=1e-4)
    assert metrics["final"]["accuracy"] == pytest.approx(reference["final"]["accuracy"], abs=1e-6)


def start_launched_training(launch_flags, train_args) -> subprocess.Popen:
    """Starts `scripts/launch.py launch_flags... -- python scripts/train.py train_args...`,
    its output and errors merged in `stdout`; the caller waits for it."""
    return launch(
        *launch_flags,
        "--",
        sys.executable,
        "scripts/train.py",
        *train_args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def launch_training(
    *train_args: str, num_workers: int = 2, devices_per_worker: int = 2, timeout: float = 240
):
    """Runs `scripts/train.py train_args...` on local workers via `scripts/launch.py`.

    Returns (exit code, combined output).
    """
    launcher = start_launched_training(
        (f"--num_workers={num_workers}", f"--devices_per_worker={devices_per_worker}"),
        train_args,
    )
    output, _ = launcher.communicate(timeout=timeout)
    return launcher.returncode, output


def model_weights(model_dir: str) -> list:
    """The model's arrays (`layers/...`) in the run's last epoch checkpoint; a one-device
    run's file also holds the optimizer's."""
    import glob

    import h5py

    path = sorted(glob.glob(os.path.join(model_dir, "checkpoints", "epoch-*.weights.h5")))[-1]
    arrays = []
    with h5py.File(path, "r") as handle:
        handle["layers"].visititems(
            lambda name, item: arrays.append(item[()]) if isinstance(item, h5py.Dataset) else None
        )
    return arrays


def assert_same_run(model_dir: str, reference_dir: str) -> None:
    """Asserts the run ended like `reference_dir`'s: per-epoch losses within rel 1e-5 and
    final weights within rtol 1e-5, atol 1e-6 (float32 sums of the same gradients in
    another order)."""
    import numpy as np
    import pytest

    metrics, reference = read_metrics(model_dir), read_metrics(reference_dir)
    assert metrics["status"] == "completed"
    for epoch, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    for weight, expected in zip(
        model_weights(model_dir), model_weights(reference_dir), strict=True
    ):
        np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)


# A user's functional model (`--model=cross_worker_models:deep_mlp`) for launched workers,
# which import it from PYTHONPATH (see `use_deep_mlp_module`).
DEEP_MLP_MODULE = """
import keras


def deep_mlp(width=32):
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Flatten()(inputs)
    for index in range(3):
        initializer = keras.initializers.GlorotUniform(seed=index)
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=initializer)(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))
"""
DEEP_MLP_MODEL = "--model=cross_worker_models:deep_mlp"


def user_module_environment(shared_dir, module: str, source: str) -> dict:
    """Environment whose PYTHONPATH holds `module`.py with `source`, written once per session
    into a `shared_dir` directory, as a user's project would hold it."""

    def fill(directory: str) -> None:
        with open(os.path.join(directory, f"{module}.py"), "w") as handle:
            handle.write(source)

    directory = shared_dir(f"{module}-user_project", fill)
    return {"PYTHONPATH": os.pathsep.join([directory, os.environ.get("PYTHONPATH", "")])}


def use_deep_mlp_module(directory, monkeypatch) -> None:
    """Writes `DEEP_MLP_MODULE` as `directory/cross_worker_models.py` and puts `directory`
    on the PYTHONPATH that scripts, and the workers they launch, inherit."""
    with open(os.path.join(directory, "cross_worker_models.py"), "w") as handle:
        handle.write(DEEP_MLP_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(directory))


def assert_split_recorded(result, metrics: dict, num_stages: int) -> dict:
    """Asserts a pipelined run logged its split once and kept it in `metrics.json`: every
    stage with its blocks, device and parameters, which add up to the model's. Returns it."""
    split = metrics["run"]["split"]
    assert len(split["stages"]) == num_stages
    assert result.stderr.count("Pipeline split:") == 1, result.stderr[-3000:]
    for stage in split["stages"]:
        assert stage["blocks"] and stage["device"] and stage["params"] > 0
        assert stage["device"].split("/")[-1] in result.stderr
        assert ", ".join(stage["blocks"][:2]) in result.stderr
    assert sum(stage["params"] for stage in split["stages"]) == metrics["run"]["parameters"]
    assert 0 < split["predicted_bubble"] < 1
    assert f"predicted bubble (stage cost = parameters): {split['predicted_bubble']:.1%}" in (
        result.stderr
    )
    return split


def worker_pid(model_dir: str, rank: int) -> int | None:
    """The pid of launched worker `rank`'s training process whose command line names
    `model_dir` (its TF_CONFIG says its index)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().decode(errors="replace")
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = handle.read().decode(errors="replace")
        except OSError:
            continue
        if f"--model_dir={model_dir}" in command and "train.py" in command:
            if f'"index": {rank}' in environ:
                return int(pid)
    return None
