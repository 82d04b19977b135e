"""Measured pipeline timelines next to the plan: PNG, Chrome trace, JSON and TensorBoard."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence

import keras
import tensorflow as tf

from tfmulti.pipeline.actions import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Schedule
from tfmulti.pipeline.overlapped_pairs import pair_partners
from tfmulti.pipeline.runtime.measured import bubble_fraction, peak_stashed_activations
from tfmulti.pipeline.simulate import CostModel, StageCost, simulate
from tfmulti.pipeline.timeline import TimelinePanel, save_timeline_png, write_chrome_trace


def measured_costs(records: Sequence, schedule: Schedule) -> CostModel:
    """Per stage, the mean measured F, backward and W times, and per overlapped pair of
    stages the mean measured pair time, as a cost model for the simulator."""
    durations = {}
    for record in records:
        key = (record.action.stage, record.action.kind)
        durations.setdefault(key, []).append(record.end - record.start)

    def mean(stage, kind):
        return statistics.fmean(durations.get((stage, kind), [0.0]))

    stages = []
    for stage in range(schedule.num_stages):
        if (stage, WEIGHT_GRAD) in durations:
            weight_grad = mean(stage, WEIGHT_GRAD)
            backward = mean(stage, INPUT_GRAD) + weight_grad
        else:
            backward = mean(stage, BACKWARD)
            weight_grad = backward / 2
        stages.append(StageCost(mean(stage, FORWARD), backward, weight_grad))
    return CostModel(tuple(stages), pair_times=_measured_pair_times(records, schedule))


def _measured_pair_times(records: Sequence, schedule: Schedule) -> dict:
    """Per (forward stage, backward stage), the mean measured time of an overlapped pair:
    from its first action's start to its last action's end."""
    by_action = {record.action: record for record in records}
    spans = {}
    for second, first in pair_partners(schedule).items():
        if first in by_action and second in by_action:
            both = (by_action[first], by_action[second])
            key = (first.stage, second.stage)
            spans.setdefault(key, []).append(max(r.end for r in both) - min(r.start for r in both))
    return {key: statistics.fmean(times) for key, times in spans.items()}


def write_timeline_report(records: Sequence, schedule: Schedule, directory: str, step: int) -> dict:
    """Writes the measured step beside its plan and returns the summary.

    The plan is the simulator's timeline for the same schedule with each stage's measured
    mean action times, so both panels share one time axis.

    Files in `directory`: `step<N>.png` (planned above measured), `step<N>.trace.json`
    (Chrome trace of the measured step), `step<N>.json` (the summary).

    Returns:
        A dict: step, schedule, measured and planned step time (s) and bubble fraction, and
        measured and planned peak stashed activations per stage.
    """
    os.makedirs(directory, exist_ok=True)
    planned = simulate(schedule, measured_costs(records, schedule))
    measured_span = max(r.end for r in records) - min(r.start for r in records)
    summary = {
        "step": step,
        "schedule": schedule.name,
        "stages": schedule.num_stages,
        "devices": schedule.num_devices,
        "microbatches": schedule.num_microbatches,
        "measured_step_s": measured_span,
        "planned_step_s": planned.makespan,
        "measured_bubble_fraction": bubble_fraction(records, schedule.num_devices),
        "planned_bubble_fraction": planned.bubble_fraction,
        "measured_peak_stashed_activations": peak_stashed_activations(records, schedule.num_stages),
        "planned_peak_stashed_activations": peak_stashed_activations(
            planned.records, schedule.num_stages
        ),
    }
    stem = os.path.join(directory, f"step{step}")
    title = f"{schedule.name} p={schedule.num_devices} m={schedule.num_microbatches}"
    save_timeline_png(
        stem + ".png",
        [
            TimelinePanel(
                planned.records,
                f"planned {title}: {planned.makespan * 1e3:.1f} ms, "
                f"bubble {planned.bubble_fraction:.1%}",
                schedule.stage_devices,
            ),
            TimelinePanel(
                records,
                f"measured step {step}: {measured_span * 1e3:.1f} ms, "
                f"bubble {summary['measured_bubble_fraction']:.1%}",
                schedule.stage_devices,
            ),
        ],
    )
    write_chrome_trace(stem + ".trace.json", records, microseconds_per_unit=1e6, name=title)
    with open(stem + ".json", "w") as summary_file:
        json.dump(summary, summary_file, indent=2)
    return summary


def log_timeline_summary(writer, summary: dict, png_path: str) -> None:
    """Writes a report's scalars and timeline picture to a tf.summary writer."""
    step = summary["step"]
    with writer.as_default():
        for key in ("measured_step_s", "planned_step_s"):
            tf.summary.scalar(f"pipeline/{key}", summary[key], step=step)
        for key in ("measured_bubble_fraction", "planned_bubble_fraction"):
            tf.summary.scalar(f"pipeline/{key}", summary[key], step=step)
        for stage, peak in enumerate(summary["measured_peak_stashed_activations"]):
            tf.summary.scalar(f"pipeline/peak_stashed_activations/stage_{stage}", peak, step=step)
        image = tf.image.decode_png(tf.io.read_file(png_path), channels=4)
        tf.summary.image("pipeline/timeline", image[tf.newaxis], step=step)
    writer.flush()


class PipelineTimelineCallback(keras.callbacks.Callback):
    """Measures chosen training steps of a PipelineModel and reports them beside the plan.

    For each traced step it writes `<log_dir>/pipeline_timeline/step<N>.{png,trace.json,json}`
    (see `write_timeline_report`) and logs measured and planned bubble fraction, step time and
    peak stashed activations per stage, and the picture, to TensorBoard under `log_dir`.
    Every step of the `fit` runs the step function that records times (switching functions
    for the chosen steps would trace and optimise the whole step a second time); the
    records cost two host callbacks per action.

    Args:
        log_dir: directory for the files and the TensorBoard events.
        steps: training step numbers to trace, counted from 1 over the whole `fit`.

    Example:
        >>> model.fit(data, callbacks=[PipelineTimelineCallback("runs/x", steps=(3, 4))])
    """

    def __init__(self, log_dir: str, steps: Iterable[int] = (3, 4)):
        super().__init__()
        self.log_dir = log_dir
        self.steps = {int(step) for step in steps}
        if not self.steps or min(self.steps) < 1:
            raise ValueError(f"steps must be step numbers >= 1. Received: steps={steps!r}")
        self.summaries = []
        self._step = 0
        self._writer = None

    def on_train_batch_begin(self, batch, logs=None):
        if not hasattr(self.model, "set_step_tracing"):
            raise ValueError(
                "PipelineTimelineCallback measures PipelineModel steps. "
                f"Received a {type(self.model).__name__}."
            )
        self._step += 1
        self.model.set_step_tracing(True)

    def on_train_batch_end(self, batch, logs=None):
        if self._step not in self.steps:
            return
        directory = os.path.join(self.log_dir, "pipeline_timeline")
        summary = write_timeline_report(
            self.model.measured_actions(), self.model.schedule, directory, self._step
        )
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "pipeline"))
        log_timeline_summary(
            self._writer, summary, os.path.join(directory, f"step{self._step}.png")
        )
        self.summaries.append(summary)

    def on_train_end(self, logs=None):
        self.model.set_step_tracing(False)
