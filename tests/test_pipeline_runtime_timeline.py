"""Measured timelines: what the executor ran, in what order, and the reports written from it."""

import dataclasses
import json
import os

import keras
import pytest
from pipeline_runtime_models import dense_stages, regression_batches

from tfmulti.pipeline.runtime import (
    PipelineModel,
    PipelineTimelineCallback,
    order_deviations,
    peak_stashed_activations,
)
from tfmulti.platform.runtime.devices import logical_device_names


def _traced_model(schedule, num_devices, num_microbatches, chunks=1):
    model = PipelineModel(
        dense_stages(num_devices * chunks),
        logical_device_names("CPU")[:num_devices],
        num_microbatches,
        schedule,
    )
    model.compile(optimizer="adam", loss="mse")
    x, y = regression_batches(1, 16)[0]
    model.set_step_tracing(True)
    model.train_on_batch(x, y)
    return model


# At 4 micro-batches: ZB-H2 (a guarded loop, as 1F1B, ZB-H1 and interleaved 1F1B run
# below) and DualPipeV action by action (no loop: its only unrolled step here; below it
# runs as its steady-state loop). The stash formulas (GPipe: all m micro-batches on every
# stage; 1F1B: p - s on stage s) are held below, on the fill-drain and rolled steps.
@pytest.mark.parametrize(
    "schedule, num_devices, chunks, rolled",
    [("zb_h2", 2, 1, True), ("dualpipev", 2, 2, False)],
)
def test_measured_step_runs_every_action_once_in_schedule_order(
    schedule, num_devices, chunks, rolled
):
    model = _traced_model(schedule, num_devices, 4, chunks)
    assert (model._executor.rolled is not None) == rolled
    records = model.measured_actions()
    assert len(records) == sum(len(actions) for actions in model.schedule.device_actions)
    assert order_deviations(records, model.schedule) == []


@pytest.mark.parametrize(
    "schedule, num_devices, chunks, num_microbatches",
    [
        ("1f1b", 4, 1, 16),
        ("zb_h1", 2, 1, 16),
        ("interleaved_1f1b", 2, 2, 8),
        ("gpipe", 4, 1, 16),
        ("dualpipev", 2, 2, 8),
    ],
)
def test_rolled_step_measures_every_action_once_in_schedule_order(
    schedule, num_devices, chunks, num_microbatches
):
    model = _traced_model(schedule, num_devices, num_microbatches, chunks)
    # GPipe runs as its two phases' loops, the others as one rolled loop.
    assert model._executor.rolled is not None or (
        schedule == "gpipe" and model._executor.fill_drain
    )
    records = model.measured_actions()
    assert len(records) == sum(len(actions) for actions in model.schedule.device_actions)
    assert order_deviations(records, model.schedule) == []
    if schedule == "1f1b":
        # Rounds overlap, yet no stage holds more than 1F1B's p - s micro-batches.
        assert peak_stashed_activations(records, num_devices) == [4, 3, 2, 1]
    if schedule == "gpipe":
        assert peak_stashed_activations(records, num_devices) == [16] * 4


def test_order_deviations_reports_missing_and_reordered_actions():
    model = _traced_model("1f1b", 2, 2)
    records = model.measured_actions()
    first, second = [record for record in records if record.device == 0][:2]
    swap = {id(first): second.action, id(second): first.action}
    reordered = [dataclasses.replace(r, action=swap.get(id(r), r.action)) for r in records]
    assert order_deviations(records[1:], model.schedule)
    assert order_deviations(reordered, model.schedule)


def test_timeline_callback_writes_plan_beside_measurement_for_chosen_steps(tmp_path):
    model = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 2, "zb_h1")
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_batches(1, 32)[0]
    callback = PipelineTimelineCallback(str(tmp_path), steps=(2, 3))
    history = model.fit(x, y, batch_size=8, epochs=1, callbacks=[callback], verbose=0)
    assert len(history.history["loss"]) == 1
    assert [summary["step"] for summary in callback.summaries] == [2, 3]
    directory = tmp_path / "pipeline_timeline"
    for step in (2, 3):
        for suffix in (".png", ".trace.json", ".json"):
            assert os.path.getsize(directory / f"step{step}{suffix}") > 0
    with open(directory / "step3.trace.json") as trace_file:
        events = [e for e in json.load(trace_file)["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * 2 * 3
    summary = callback.summaries[-1]
    assert 0.0 <= summary["measured_bubble_fraction"] < 1.0
    assert (
        summary["measured_peak_stashed_activations"] == summary["planned_peak_stashed_activations"]
    )
    assert os.listdir(tmp_path / "pipeline")
    assert not model._tracing


def test_timeline_callback_refuses_a_model_that_is_not_a_pipeline():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_batches(1, 8)[0]
    with pytest.raises(ValueError, match="Received a Sequential"):
        model.fit(x, y, callbacks=[PipelineTimelineCallback("/tmp/unused")], verbose=0)
