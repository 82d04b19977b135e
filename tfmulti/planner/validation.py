"""Checking predictions against reality: running layouts with `scripts/train.py`.

Pure Python (subprocesses). Each layout trains for a few short epochs; its measured step
time is the last epoch's `step_time_ms` in `metrics.json` (earlier epochs include
tracing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from tfmulti.planner.costs import ModelCosts
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_flags import train_flags

TRAIN_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "scripts",
    "train.py",
)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A layout's predicted and measured step time.

    Args:
        layout: the layout run.
        flags: the `scripts/train.py` flags it ran with.
        measured_step_time: seconds per step of the last epoch, or None if the run failed.
        error: the run's last line of output when it failed, else None.
    """

    layout: Layout
    flags: tuple[str, ...]
    measured_step_time: float | None
    error: str | None = None


def distinct_layouts(layouts: Sequence[Layout], count: int) -> list[Layout]:
    """The best `count` layouts with different (mesh, schedule, chunks), in ranked order."""
    chosen, seen = [], set()
    for layout in layouts:
        kind = (layout.mesh, layout.schedule, layout.chunks)
        if kind not in seen:
            seen.add(kind)
            chosen.append(layout)
    return chosen[:count]


def training_run_flags(epochs: int, steps_per_epoch: int, model_dir: str) -> list[str]:
    """Flags for a short timing run: one validation step per epoch, no per-step logging."""
    return [
        f"--epochs={epochs}",
        f"--steps_per_epoch={steps_per_epoch}",
        "--validation_steps=1",
        "--log_steps=0",
        f"--model_dir={model_dir}",
    ]


def measure_layouts(
    layouts: Sequence[Layout],
    costs: ModelCosts,
    global_batch: int,
    work_dir: str,
    *,
    epochs: int = 3,
    steps_per_epoch: int = 20,
    timeout: float = 900,
) -> list[Measurement]:
    """Trains each layout with `scripts/train.py` in turn and reads its step time.

    Args:
        layouts: layouts to run, e.g. `distinct_layouts(search_layouts(...), 4)`.
        costs: the model's costs (model, options, dataset).
        global_batch: examples per step over all replicas.
        work_dir: each run writes into `work_dir/layout_<rank>`.
        epochs: epochs per run; the last one is timed.
        steps_per_epoch: training steps per epoch.
        timeout: seconds before a run counts as failed.
    """
    measurements = []
    for rank, layout in enumerate(layouts, 1):
        flags = train_flags(layout, costs, global_batch)
        model_dir = os.path.join(work_dir, f"layout_{rank}")
        command = [
            sys.executable,
            TRAIN_SCRIPT,
            *flags,
            *training_run_flags(epochs, steps_per_epoch, model_dir),
        ]
        environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
        try:
            run = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=environment
            )
        except subprocess.TimeoutExpired:
            measurements.append(Measurement(layout, tuple(flags), None, f"timed out ({timeout}s)"))
            continue
        if run.returncode != 0:
            lines = [line for line in run.stderr.splitlines() if line.strip()] or ["no output"]
            measurements.append(Measurement(layout, tuple(flags), None, lines[-1]))
            continue
        with open(os.path.join(model_dir, "metrics.json")) as file:
            last_epoch = json.load(file)["epochs"][-1]
        measurements.append(
            Measurement(layout, tuple(flags), last_epoch["step_time_ms"] / 1000.0, None)
        )
    return measurements
