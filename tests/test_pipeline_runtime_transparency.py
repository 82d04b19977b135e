"""Transparency: training through the pipeline gives the weights one-device training gives."""

import numpy as np
import pytest
from pipeline_runtime_models import (
    dense_stages,
    max_weight_difference,
    residual_stages,
    train_pipeline_and_chain,
    two_tensor_stages,
)

# Every schedule on 2 and 4 devices; each schedule and device count with two of the 1, 4
# and 8 micro-batches (every count on every device count, in rotation): one executor runs
# them all, so the whole product adds no code path.
GRID = [
    ("gpipe", 2, 1, 1),
    ("gpipe", 4, 8, 1),
    ("1f1b", 2, 4, 1),
    ("1f1b", 4, 1, 1),
    ("interleaved_1f1b", 2, 8, 2),
    ("interleaved_1f1b", 4, 4, 2),
    ("zb_h1", 2, 1, 1),
    ("zb_h1", 4, 8, 1),
    ("zb_h2", 2, 8, 1),
    ("zb_h2", 4, 4, 1),
]


@pytest.mark.parametrize("schedule, num_devices, num_microbatches, chunks", GRID)
def test_transparency_weights_match_one_device_training(
    schedule, num_devices, num_microbatches, chunks
):
    optimizer = "sgd" if num_microbatches == 4 else "adam"
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, schedule, chunks, optimizer
    )
    assert (
        max(np.abs(a - b).max() for a, b in zip(initial, pipeline.get_weights(), strict=True))
        > 1e-3
    )
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)


@pytest.mark.parametrize(
    "make_stages, schedule, num_devices, num_microbatches",
    [
        (residual_stages, "zb_h1", 2, 8),
        (two_tensor_stages, "gpipe", 4, 4),
        (two_tensor_stages, "zb_h2", 2, 4),
    ],
    ids=["residual-zb_h1", "two_tensors-gpipe", "two_tensors-zb_h2"],
)
def test_transparency_holds_for_residual_blocks_and_two_tensor_boundaries(
    make_stages, schedule, num_devices, num_microbatches
):
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        make_stages, num_devices, num_microbatches, schedule, 1, "adam"
    )
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)
