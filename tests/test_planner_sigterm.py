"""SIGTERM while the planner times steps: it stops in one line, saving nothing."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np
import pytest
from script_runner import REPO_ROOT, child_pids, script_environment

from tfmulti.errors import Terminated
from tfmulti.planner import save_costs
from tfmulti.planner.costs import AffineTime, BlockCost, ModelCosts
from tfmulti.run.training import timing_callbacks


class _SigtermAtBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            signal.raise_signal(signal.SIGTERM)


def test_sigterm_in_timed_steps_ends_fit_with_terminated_and_gives_sigterm_back(
    tmp_path, monkeypatch
):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((32, 4), "float32"), np.zeros((32, 3), "float32")
    previous = signal.getsignal(signal.SIGTERM)
    finished = []

    class Finished(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            finished.append(batch)

    with pytest.raises(Terminated, match="SIGTERM"):
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=1,
            verbose=0,
            callbacks=[_SigtermAtBatch(1), *timing_callbacks(str(tmp_path)), Finished()],
        )
    # It stopped at the step after the one SIGTERM came in, not at the epoch's end (8).
    assert finished == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is previous
    assert not [name for name in os.listdir(scratch) if name.startswith("tfmulti-preemption-")]


def _sigterm_plan_once(
    tmp_path, flags: list[str], ready, environment: dict | None = None
) -> tuple[int, str]:
    """Starts plan.py with `flags`, sends it SIGTERM once `ready(pid)` holds, and checks it
    ended in one line with the shell's SIGTERM code; returns `ready`'s last result."""
    log = tmp_path / "stderr.txt"
    process = subprocess.Popen(
        [sys.executable, os.path.join(REPO_ROOT, "scripts", "plan.py"), *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env={**script_environment(), **(environment or {})},
    )
    deadline = time.monotonic() + 240
    while not (found := ready(process.pid)):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "plan.py never got there"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=120)
    stderr = log.read_text()

    assert "Traceback" not in stderr, stderr[-3000:]
    assert returncode == 143, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr.strip().splitlines()[-1]
    return found


def test_plan_script_stopped_by_sigterm_while_timing_exits_without_a_traceback(tmp_path):
    """Before the fix, a SIGTERM in a timed step crashed the planner's preemption check
    with a traceback (it had no checkpoint to save)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()

    def preemption_scratch(pid: int) -> list[str]:
        # A timed fit's SIGTERM handler keeps a scratch directory while it is in charge.
        return [name for name in os.listdir(scratch) if name.startswith("tfmulti-preemption-")]

    flags = [
        "--model_option=num_layers=2",
        "--devices=2",
        "--global_batch=8",
        f"--cost_cache={tmp_path / 'costs.json'}",
    ]
    _sigterm_plan_once(tmp_path, flags, preemption_scratch, {"TMPDIR": str(scratch)})

    assert not preemption_scratch(0)


def _timing_children(pid: int) -> list[int]:
    """The processes `pid` started that run a timed `scripts/train.py` (a --model_dir)."""
    timing = []
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                arguments = cmdline.read().split(b"\0")
        except OSError:
            continue
        if any(argument.startswith(b"--model_dir=") for argument in arguments):
            timing.append(child)
    return timing


def test_plan_script_stopped_by_sigterm_while_validating_stops_the_run_it_started(tmp_path):
    """Before the fix, SIGTERM ended plan.py at once and its train.py child ran on."""
    block = BlockCost("dense", 1000, AffineTime(1e-4, 1e-5), AffineTime(2e-4, 2e-5), 256)
    costs = ModelCosts("mlp", {}, "digits", None, (block,) * 4, measured_batch_sizes=(2, 16))
    save_costs(costs, str(tmp_path / "costs.json"))
    flags = [
        f"--costs={tmp_path / 'costs.json'}",
        "--devices=1",
        "--global_batch=16",
        "--machine_costs=none",
        "--validate=1",
        "--validate_repeats=1",
        "--validate_epochs=50",
        "--validate_steps=50",
        f"--validate_dir={tmp_path / 'runs'}",
    ]
    children = _sigterm_plan_once(tmp_path, flags, _timing_children)

    assert not [child for child in children if os.path.exists(f"/proc/{child}")]
