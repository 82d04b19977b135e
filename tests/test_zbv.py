"""ZB-V: two chunks per device in a V, split backward; closed forms and one-device equality."""

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


def _simulate(name, p, m, forward, input_grad, weight_grad, chunks=None):
    """`name` simulated with chunk costs F, I, W (a one-chunk schedule gets twice each)."""
    schedule = build_schedule(name, p, m, chunks)
    scale = 2 / schedule.chunks
    costs = CostModel.uniform(
        schedule.num_stages,
        forward * scale,
        (input_grad + weight_grad) * scale,
        weight_grad * scale,
    )
    return simulate(schedule, costs)


GRID = [(p, m) for p in range(1, 9) for m in range(2 * p - 1, 33)]


def test_zbv_puts_stages_d_and_2p_minus_1_minus_d_on_device_d():
    schedule = build_schedule("zbv", 4, 8)
    assert schedule.stage_devices == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.splits_backward and schedule.chunks == 2
    for device, actions in enumerate(schedule.device_actions):
        assert {a.stage for a in actions} == {device, 7 - device}


def test_zbv_takes_exactly_two_chunks():
    assert build_schedule("zbv", 2, 4, 2) == build_schedule("zbv", 2, 4)
    with pytest.raises(ValueError, match="chunks must be 2. Received: chunks=3"):
        build_schedule("zbv", 2, 4, 3)


def test_zbv_validates_for_any_devices_and_micro_batches():
    for p in range(1, 9):
        for m in range(1, 33):
            validate_schedule(build_schedule("zbv", p, m))


@pytest.mark.parametrize(
    "forward, input_grad, weight_grad", [(1, 1, 1), (2, 2, 1), (1, 1, 0.5), (3, 3, 3)]
)
def test_zbv_makespan_is_the_work_plus_p_minus_1_chunk_forwards(forward, input_grad, weight_grad):
    # Closed form for I = F >= W and m >= 2p-1: the busiest device works 2m(F+I+W), and
    # the step takes one chunk forward longer per device the V passes through.
    for p, m in GRID:
        result = _simulate("zbv", p, m, forward, input_grad, weight_grad)
        work = 2 * m * (forward + input_grad + weight_grad)
        assert result.makespan == pytest.approx(work + (p - 1) * forward), (p, m)


def test_zbv_bubble_is_p_minus_1_over_6m_plus_p_minus_1_and_zero_once_steps_overlap():
    # F = I = W: device d starts d chunk forwards late and then never waits.
    for p, m in GRID:
        result = _simulate("zbv", p, m, 1, 1, 1)
        assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1)), (p, m)
        assert result.overlapped_bubble_fraction == 0, (p, m)


def test_zbv_bubble_is_half_of_zb_h1_and_a_sixth_of_1f1b_at_the_same_memory():
    for p, m in GRID:
        if p == 1 or m < p:
            continue
        zbv = _simulate("zbv", p, m, 1, 1, 1)
        zb_h1 = _simulate("zb_h1", p, m, 1, 1, 1)
        one_f_one_b = _simulate("1f1b", p, m, 1, 1, 1)
        assert 2 * zbv.bubble_time == pytest.approx(zb_h1.bubble_time), (p, m)
        assert 6 * zbv.bubble_time == pytest.approx(one_f_one_b.bubble_time), (p, m)
        # 2p chunk activations are p full-device micro-batches: 1F1B's first stage.
        assert zbv.peak_activations == (2 * p,) * p
        assert max(one_f_one_b.peak_activations) == p


EQUALITY_GRID = [
    (num_devices, num_microbatches, optimizer)
    for num_devices in (2, 4)
    for num_microbatches in (4, 8)
    for optimizer in ("sgd", "adam")
]


@pytest.mark.parametrize("num_devices, num_microbatches, optimizer", EQUALITY_GRID)
def test_zbv_trains_to_the_weights_of_one_device(num_devices, num_microbatches, optimizer):
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, "zbv", 2, optimizer
    )
    assert pipeline.schedule.name == "zbv"
    moved = max(np.abs(a - b).max() for a, b in zip(initial, pipeline.get_weights(), strict=True))
    assert moved > 1e-3
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)


@pytest.mark.parametrize("num_devices, num_microbatches", [(2, 8), (4, 16)])
def test_zbv_step_runs_as_one_loop(num_devices, num_microbatches):
    _, pipeline, _, _, _ = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, "zbv", 2, "sgd", steps=1, batch_size=32
    )
    x, y = regression_batches(1, 32)[0]
    assert loops_in_step(pipeline, x, y) == 1
