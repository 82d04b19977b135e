"""Interleaved zero bubble: looped chunks, split backward; closed form, equal to one device."""

import numpy as np
import pytest
from pipeline_runtime_models import (
    dense_stages,
    loops_in_step,
    max_weight_difference,
    regression_batches,
    train_pipeline_and_chain,
)

from tfmulti.pipeline import CostModel, build_schedule, simulate, validate_schedule


def _simulate(name, p, m, chunks, forward, input_grad, weight_grad):
    """`name` simulated with chunk costs F, I, W on every one of its p·v stages."""
    schedule = build_schedule(name, p, m, chunks)
    costs = CostModel.uniform(schedule.num_stages, forward, input_grad + weight_grad, weight_grad)
    return simulate(schedule, costs)


def _fits_rounds(p, m):
    return m % max(1, m // p) == 0


GRID = [
    (p, m, v) for p in range(1, 7) for m in range(p, 25) for v in (2, 3, 4) if _fits_rounds(p, m)
]


def test_interleaved_zb_places_stage_i_on_device_i_mod_p_and_splits_the_backward():
    schedule = build_schedule("interleaved_zb", 3, 6, 3)
    assert schedule.stage_devices == (0, 1, 2) * 3
    assert schedule.splits_backward and schedule.chunks == 3
    assert build_schedule("interleaved_zb", 2, 4) == build_schedule("interleaved_zb", 2, 4, 2)


@pytest.mark.parametrize(
    "num_devices, num_microbatches, chunks, fragment",
    [
        (2, 4, 1, "needs chunks >= 2"),
        (4, 9, 2, r"must divide into them \(try 8 or 10\)"),
        (0, 4, 2, "num_devices=0"),
    ],
)
def test_interleaved_zb_refuses_what_it_cannot_run_naming_the_rule(
    num_devices, num_microbatches, chunks, fragment
):
    with pytest.raises(ValueError, match=fragment):
        build_schedule("interleaved_zb", num_devices, num_microbatches, chunks)


def test_interleaved_zb_validates_for_any_devices_micro_batches_and_chunks():
    for p in range(1, 7):
        for m in range(1, 25):
            if _fits_rounds(p, m):
                for v in (2, 3, 4):
                    validate_schedule(build_schedule("interleaved_zb", p, m, v))


@pytest.mark.parametrize(
    "forward, input_grad, weight_grad", [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 0.5)]
)
def test_interleaved_zb_idles_p_minus_1_times_f_plus_b_minus_2w_of_a_chunk(
    forward, input_grad, weight_grad
):
    # ZB1P's bubble, (p-1)(F+B-2W) (deepseek-ai/DualPipe README), in chunk costs: v chunks
    # per device make it v times smaller than ZB-H1's on the same model.
    backward = input_grad + weight_grad
    for p, m, v in GRID:
        if m < p:
            continue
        result = _simulate("interleaved_zb", p, m, v, forward, input_grad, weight_grad)
        work = v * m * (forward + backward)
        assert result.busy_time == pytest.approx((work,) * p), (p, m, v)
        expected = (p - 1) * (forward + backward - 2 * weight_grad)
        assert result.makespan - work == pytest.approx(expected), (p, m, v)


def test_interleaved_zb_bubble_is_p_minus_1_over_3vm_plus_p_minus_1_a_third_of_interleaved_1f1b():
    for p, m, v in GRID:
        if m < p:
            continue
        result = _simulate("interleaved_zb", p, m, v, 1, 1, 1)
        assert result.bubble_fraction == pytest.approx((p - 1) / (3 * v * m + p - 1)), (p, m, v)
        if m % p == 0:
            interleaved = _simulate("interleaved_1f1b", p, m, v, 1, 1, 1)
            assert 3 * result.bubble_time == pytest.approx(interleaved.bubble_time), (p, m, v)


def test_interleaved_zb_holds_v_minus_1_rounds_plus_p_chunk_activations_on_every_device():
    # With rounds of p micro-batches that is p·v chunks: p full micro-batches, as 1F1B's
    # first stage holds.
    for p, m, v in GRID:
        if m >= p:
            per_round = m // max(1, m // p)
            result = _simulate("interleaved_zb", p, m, v, 1, 1, 1)
            assert result.peak_activations == ((v - 1) * per_round + p,) * p, (p, m, v)


# 2 and 4 devices; 4 and 16 micro-batches (a round each, and four rounds), 6 (rounds of
# uneven size); SGD and Adam. 32 rows: two a micro-batch at 16.
EQUALITY_GRID = [(2, 4, "sgd"), (2, 6, "adam"), (4, 16, "adam")]
# Warm-up, steady state and cool-down as one loop, not one copy per micro-batch.
ONE_LOOP = {(2, 4), (4, 16)}


@pytest.mark.parametrize("num_devices, num_microbatches, optimizer", EQUALITY_GRID)
def test_interleaved_zb_trains_to_the_weights_of_one_device_in_one_loop(
    num_devices, num_microbatches, optimizer
):
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, "interleaved_zb", 2, optimizer, batch_size=32
    )
    assert pipeline.schedule.name == "interleaved_zb"
    moved = max(np.abs(a - b).max() for a, b in zip(initial, pipeline.get_weights(), strict=True))
    assert moved > 1e-3
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)
    if (num_devices, num_microbatches) in ONE_LOOP:
        x, y = regression_batches(1, 32)[0]
        assert loops_in_step(pipeline, x, y) == 1
