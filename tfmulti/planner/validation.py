"""Checking predictions against reality: running layouts with `scripts/train.py`.

Pure Python (subprocesses). Each layout trains for a few short epochs, logging every
step's time; a run's step time is the median over the steps after the first epoch
(which includes tracing), each epoch's first step left out (it also starts the epoch's
input and ran the last epoch's validation). A median, unlike a fastest epoch, moves
little when other processes on a shared machine load it in bursts, and unlike an
epoch's mean it leaves out what an epoch adds once. With several runs of a layout, the
fastest run's median counts: load only ever slows a run, a slow spell of the machine
can last a whole run, and the model's block costs are measured the same way (their
fastest round counts). Without step lines (an older train.py), the fastest
`step_time_ms` in `metrics.json` after the first epoch counts.

A layout over several hosts runs as its printed command does: `scripts/launch.py` starts
one worker per host on this machine (loopback between them, not a real inter-host link),
and the chief's step lines count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence

from tfmulti.pipeline.schedules import build_schedule
from tfmulti.planner.costs import DataParallelStep, ModelCosts
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_flags import launch_flags, train_flags
from tfmulti.platform.mesh import HybridMesh

_SCRIPTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "scripts",
)
TRAIN_SCRIPT = os.path.join(_SCRIPTS, "train.py")
LAUNCH_SCRIPT = os.path.join(_SCRIPTS, "launch.py")
# The one-device layout: `scripts/train.py --strategy=one_device`, the model's anchor.
ONE_DEVICE = Layout(HybridMesh(), None, 1, 1, (), 0.0, 0.0, 0.0, 0.0, 0.0)
# What scripts/launch.py puts before each line of a worker other than the chief.
_OTHER_WORKER_LINE = re.compile(r"^\[worker [1-9][0-9]*\] ")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A layout's predicted and measured step time.

    Args:
        layout: the layout run.
        flags: the `scripts/train.py` flags it ran with.
        measured_step_time: the fastest run's median step, or None if a run failed.
        samples: seconds of each timed step of every run.
        error: the failed run's last line of output, else None.
        run_step_times: each run's median step, in the order they ran.
    """

    layout: Layout
    flags: tuple[str, ...]
    measured_step_time: float | None
    samples: tuple[float, ...] = ()
    error: str | None = None
    run_step_times: tuple[float, ...] = ()


def distinct_layouts(layouts: Sequence[Layout], count: int) -> list[Layout]:
    """The best `count` layouts of different kinds: first the best of each mesh (so a check
    compares data, pipeline, tensor and hybrid layouts, the choice a user makes, rather
    than near-ties of one mesh), then the next best kinds, all in ranked order. A kind is
    a mesh, its hosts and the axis across them, and what its pipeline devices run (chunk
    placement and per-device actions), so schedules that build the same actions (gpipe
    and 1f1b, or zb_h1 and zb_h2, at one micro-batch) count once."""
    best_of_mesh, rest, kinds, meshes = [], [], set(), set()
    for layout in layouts:
        mesh = (layout.mesh, layout.hosts, layout.cross_host_axis)
        kind = (*mesh, layout.chunks, _actions_run(layout))
        if kind in kinds:
            continue
        kinds.add(kind)
        (rest if mesh in meshes else best_of_mesh).append(layout)
        meshes.add(mesh)
    return (best_of_mesh + rest)[:count]


def _actions_run(layout: Layout) -> tuple | None:
    """Per device, the actions `layout`'s schedule runs, with its stage placement (None
    without a pipeline)."""
    if layout.schedule is None:
        return None
    schedule = build_schedule(
        layout.schedule, layout.mesh.pipe, layout.num_microbatches, layout.chunks
    )
    return schedule.stage_devices, schedule.device_actions


def accepts_flags(flags: Sequence[str]) -> bool:
    """Whether `scripts/train.py` parses `flags` (some layouts need flags it may not have)."""
    run = subprocess.run(
        [sys.executable, TRAIN_SCRIPT, *flags, "--only_check_args"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run.returncode == 0


# ThroughputLogger's line for one logged window of steps.
_STEP_LINE = re.compile(r"\] step (\d+): [0-9.]+ examples/sec, ([0-9.]+) ms/step")


def training_run_flags(epochs: int, steps_per_epoch: int, model_dir: str) -> list[str]:
    """Flags for a short timing run: one validation step per epoch, every step logged."""
    return [
        f"--epochs={epochs}",
        f"--steps_per_epoch={steps_per_epoch}",
        "--validation_steps=1",
        "--log_steps=1",
        f"--model_dir={model_dir}",
    ]


def training_command(layout: Layout, flags: Sequence[str]) -> list[str]:
    """The argv that trains `layout` with `flags`: train.py, under the launcher over hosts."""
    train = [sys.executable, TRAIN_SCRIPT, *flags]
    if layout.hosts == 1:
        return train
    return [sys.executable, LAUNCH_SCRIPT, *launch_flags(layout), "--", *train]


def chief_lines(output: str) -> str:
    """`output` without the lines of launched workers other than the chief.

    Example:
        >>> chief_lines("[worker 0] a\n[worker 1] b\nc")
        '[worker 0] a\nc'
    """
    return "\n".join(line for line in output.splitlines() if not _OTHER_WORKER_LINE.match(line))


def timed_step_seconds(log: str, steps_per_epoch: int) -> list[float]:
    """Seconds of each step logged in `log` after the first epoch, each epoch's first left out.

    Example:
        >>> timed_step_seconds("I1 x.py:79] step 12: 640.0 examples/sec, 50.00 ms/step", 10)
        [0.05]
    """
    seconds = []
    for match in _STEP_LINE.finditer(log):
        step = int(match.group(1))
        if step > steps_per_epoch and (step - 1) % steps_per_epoch:
            seconds.append(float(match.group(2)) / 1000.0)
    return seconds


def measure_layouts(
    layouts: Sequence[Layout],
    costs: ModelCosts,
    global_batch: int,
    work_dir: str,
    *,
    epochs: int = 3,
    steps_per_epoch: int = 20,
    repeats: int = 2,
    timeout: float = 900,
) -> list[Measurement]:
    """Trains each layout with `scripts/train.py` and reads its step time.

    The layouts run in turn, `repeats` rounds over all of them, so a burst of load from
    other processes hits every layout alike; each layout's fastest run counts (the
    median step of each run).

    Args:
        layouts: layouts to run, e.g. `distinct_layouts(search_layouts(...), 4)`.
        costs: the model's costs (model, options, dataset).
        global_batch: examples per step over all replicas.
        work_dir: each run writes into `work_dir/layout_<rank>_<round>`.
        epochs: epochs per run (>= 2); all but the first are timed.
        steps_per_epoch: training steps per epoch.
        repeats: runs of each layout.
        timeout: seconds before a run counts as failed.
    """
    flags = [train_flags(layout, costs, global_batch) for layout in layouts]
    runs, errors = _timed_runs(
        list(zip(layouts, flags, strict=True)),
        work_dir,
        "layout",
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        repeats=repeats,
        timeout=timeout,
    )
    return [
        Measurement(
            layout,
            tuple(flags[rank]),
            min(map(statistics.median, runs[rank])) if rank not in errors else None,
            tuple(step for run in runs[rank] for step in run),
            errors.get(rank),
            tuple(map(statistics.median, runs[rank])),
        )
        for rank, layout in enumerate(layouts)
    ]


def run_timed_training(
    command: Sequence[str],
    model_dir: str,
    timeout: float,
    steps_per_epoch: int,
    environment: dict[str, str] | None = None,
) -> tuple[list[float] | None, str | None]:
    """Runs a training `command` (flags of `training_run_flags`) with `environment` added:
    (seconds of each timed step, None), or (None, why it failed)."""
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(environment or {})}
    try:
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=environment
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    # A launched run's workers print to the launcher's stdout, the launcher to stderr.
    output = chief_lines(run.stdout + "\n" + run.stderr)
    if run.returncode != 0:
        lines = [line for line in output.splitlines() if line.strip()] or ["no output"]
        return None, lines[-1]
    step_times = timed_step_seconds(output, steps_per_epoch)
    if step_times:
        return step_times, None
    with open(os.path.join(model_dir, "metrics.json")) as file:
        epochs = json.load(file)["epochs"][1:]
    return [min(epoch["step_time_ms"] for epoch in epochs) / 1000.0], None


def anchor_steps(
    costs: ModelCosts,
    batch_sizes: Sequence[int],
    work_dir: str,
    *,
    data_parallel: tuple[int, int] | None = None,
    epochs: int = 3,
    steps_per_epoch: int = 10,
    repeats: int = 2,
    counted_runs: int | None = None,
    timeout: float = 900,
) -> tuple[list[float], DataParallelStep | None]:
    """`scripts/train.py`'s one-device step of `costs.model` at each of `batch_sizes`, and
    with `data_parallel` = (devices, global batch) its data-parallel step there
    (`--strategy=mirrored`), run and timed as `measure_layouts` runs a layout (all in
    turn, `repeats` rounds). Each one's step is the fastest of `counted_runs` runs, as
    a layout run `counted_runs` times counts: with more runs than that, its expected
    value over them (`expected_fastest`), steadier than one fastest run.

    A step measured inside another process can differ from train.py's by a third
    (what else that process built and ran changes it), so the planner anchors the
    model on these steps (`measure.anchored_to_steps`, `overlap_anchor`), the ones its
    layouts are checked against.

    Returns:
        (the one-device steps in the order of `batch_sizes`, the data-parallel step or None).

    Raises:
        ValueError: a run failed; the message names the run and its last line.
    """
    runs = [(ONE_DEVICE, train_flags(ONE_DEVICE, costs, size)) for size in batch_sizes]
    names = [f"on one device at batch {size}" for size in batch_sizes]
    skips = ["--anchor_repeats=0"] * len(batch_sizes)
    if data_parallel is not None:
        devices, global_batch = data_parallel
        layout = dataclasses.replace(ONE_DEVICE, mesh=HybridMesh(data=devices))
        runs.append((layout, train_flags(layout, costs, global_batch)))
        names.append(f"data-parallel on {devices} devices at batch {global_batch}")
        skips.append("--noanchor_data_parallel")
    times, errors = _timed_runs(
        runs,
        work_dir,
        "anchor",
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        repeats=repeats,
        timeout=timeout,
    )
    if errors:
        index, error = min(errors.items())
        raise ValueError(
            f"scripts/train.py failed {names[index]}: {error} "
            f"(fix the model or data, or pass {skips[index]} to plan.py)"
        )
    counted = repeats if counted_runs is None else min(counted_runs, repeats)
    fastest = [
        expected_fastest(list(map(statistics.median, times[index])), counted)
        for index in range(len(runs))
    ]
    if data_parallel is None:
        return fastest, None
    *one_device, data_parallel_seconds = fastest
    return one_device, DataParallelStep(*data_parallel, data_parallel_seconds)


def expected_fastest(values: Sequence[float], draws: int) -> float:
    """The expected fastest of `draws` of `values` drawn at random without replacement:
    an L-estimator over the sorted values, weighting the i-th fastest (from 0) by the
    chance that it is the fastest drawn, C(n - 1 - i, draws - 1) / C(n, draws). All of
    them: the fastest; one: the mean.

    Example:
        >>> expected_fastest([3.0, 1.0, 2.0], 2)  # pairs 1|2, 1|3, 2|3
        1.3333333333333333
    """
    count = len(values)
    if not 1 <= draws <= count:
        raise ValueError(f"Need 1 <= draws <= {count} values. Received: draws={draws}")
    ordered = sorted(values)
    total = math.comb(count, draws)
    return sum(
        value * math.comb(count - 1 - index, draws - 1) / total
        for index, value in enumerate(ordered)
    )


def _timed_runs(
    runs: Sequence[tuple[Layout, list[str]]],
    work_dir: str,
    name: str,
    *,
    epochs: int,
    steps_per_epoch: int,
    repeats: int,
    timeout: float,
) -> tuple[dict[int, list[list[float]]], dict[int, str]]:
    """Runs each (layout, train.py flags) in turn, `repeats` rounds, each into
    `work_dir/<name>_<index>_<round>`: (each one's runs' step times, each failed one's error).
    A run that fails is not run again."""
    if epochs < 2:
        raise ValueError(
            f"The first epoch includes tracing, so timing needs epochs >= 2. Received: {epochs}"
        )
    times = {index: [] for index in range(len(runs))}
    errors = {}
    for round_index in range(repeats):
        for index, (layout, flags) in enumerate(runs):
            if index in errors:
                continue
            model_dir = os.path.join(work_dir, f"{name}_{index + 1}_{round_index + 1}")
            step_times, error = run_timed_training(
                training_command(
                    layout, [*flags, *training_run_flags(epochs, steps_per_epoch, model_dir)]
                ),
                model_dir,
                timeout,
                steps_per_epoch,
            )
            if error is not None:
                errors[index] = error
            else:
                times[index].append(step_times)
    return times, errors
