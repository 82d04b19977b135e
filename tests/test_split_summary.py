"""A pipeline's split summary names each stage's blocks, device and parameters, and
predicts the bubble its schedule leaves."""

import json

import keras
import numpy as np
import pytest

from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks
from tfmulti.pipeline.schedules import build_schedule
from tfmulti.pipeline.stages.block_partition import BlockStage
from tfmulti.pipeline.stages.split_summary import predicted_bubble, split_summary
from tfmulti.platform.runtime.devices import logical_device_names


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (3, 1)])
def test_equal_stages_predict_the_textbook_bubble(schedule, stages, microbatches):
    bubble = predicted_bubble(build_schedule(schedule, stages, microbatches), [10] * stages)

    assert bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_a_heavier_stage_predicts_a_larger_bubble():
    schedule = build_schedule("1f1b", 2, 4)

    assert predicted_bubble(schedule, [30, 10]) > predicted_bubble(schedule, [10, 10])


def test_summary_of_a_built_pipeline_lists_each_stages_blocks_device_and_params():
    blocks = [
        keras.layers.Dense(units, name=f"dense_{index}") for index, units in enumerate((8, 8, 8, 3))
    ]
    devices = logical_device_names("CPU")[:2]
    model = PipelineModel(stages_from_blocks(blocks, [1]), devices, 2, "gpipe")
    model(np.zeros((4, 5), "float32"))

    summary = split_summary(model)

    assert [stage.blocks for stage in summary.stages] == [
        ("dense_0",),
        ("dense_1", "dense_2", "dense_3"),
    ]
    assert [stage.device for stage in summary.stages] == devices
    assert [stage.params for stage in summary.stages] == [5 * 8 + 8, 2 * (8 * 8 + 8) + 8 * 3 + 3]
    assert sum(stage.params for stage in summary.stages) == model.count_params()
    assert json.loads(json.dumps(summary.to_dict()))["stages"][1]["blocks"][0] == "dense_1"
    text = str(summary)
    assert "dense_1, dense_2, dense_3" in text
    assert "predicted bubble" in text


def test_a_model_without_stages_has_no_summary():
    assert split_summary(keras.Sequential([keras.layers.Dense(2)])) is None


def test_a_weight_two_stages_share_counts_once_in_the_first():
    shared = keras.layers.Dense(4, name="shared")
    stages = [
        BlockStage([shared], name="first"),
        BlockStage([shared, keras.layers.Dense(2, name="head")], name="second"),
    ]
    model = PipelineModel(stages, logical_device_names("CPU")[:2], 1, "gpipe")
    model(np.zeros((2, 4), "float32"))

    summary = split_summary(model)

    assert [stage.params for stage in summary.stages] == [4 * 4 + 4, 4 * 2 + 2]
