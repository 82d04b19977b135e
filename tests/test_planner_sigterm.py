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
from script_runner import REPO_ROOT, script_environment

from tfmulti.errors import Terminated
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


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def test_plan_script_stopped_by_sigterm_while_timing_exits_without_a_traceback(tmp_path):
    """Before the fix, a SIGTERM in a timed step crashed the planner's preemption check
    with a traceback (it had no checkpoint to save)."""
    log = tmp_path / "stderr.txt"
    process = subprocess.Popen(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "scripts", "plan.py"),
            "--model_option=num_layers=2",
            "--devices=2",
            "--global_batch=8",
            f"--cost_cache={tmp_path / 'costs.json'}",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=script_environment(),
    )
    # Wait until a timed fit has taken SIGTERM over (its handler caught, /proc says).
    deadline = time.monotonic() + 240
    while not _catches_sigterm(process.pid) and process.poll() is None:
        assert time.monotonic() < deadline, "plan.py never timed a step"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=120)
    stderr = log.read_text()
    assert "Traceback" not in stderr, stderr[-3000:]
    # In a timed step: one line and the shell's SIGTERM code; between steps: the
    # default action ends the process.
    assert returncode in (143, -signal.SIGTERM), stderr[-3000:]
    if returncode == 143:
        assert "stopped by SIGTERM" in stderr.strip().splitlines()[-1]
