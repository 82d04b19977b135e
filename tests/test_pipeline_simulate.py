"""The simulator reproduces the closed forms; timelines and traces are written."""

import json

import pytest

from tfmulti.pipeline import CostModel, StageCost, build_schedule, simulate
from tfmulti.pipeline.timeline import (
    TimelinePanel,
    save_timeline_png,
    timeline_title,
    write_chrome_trace,
)

GRID = [(p, m) for p in range(1, 9) for m in range(1, 33)]
# (F, B, W): B = I + W.
COSTS = [(1.0, 2.0, 1.0), (1.0, 3.0, 1.0), (2.0, 3.0, 1.0), (1.0, 2.0, 0.5)]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(name, p, m, forward, backward, weight_grad, chunks=None):
    schedule = build_schedule(name, p, m, chunks)
    costs = CostModel.uniform(p, forward, backward, weight_grad)
    return simulate(schedule, costs.split_into_chunks(schedule.chunks))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("forward, backward, weight_grad", COSTS)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    name, forward, backward, weight_grad
):
    for p, m in GRID:
        result = _run(name, p, m, forward, backward, weight_grad)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m)
        assert result.makespan == pytest.approx((m + p - 1) * (forward + backward))


def test_1f1b_stage_s_holds_p_minus_s_micro_batches_and_gpipe_holds_m():
    for p, m in GRID:
        one_f_one_b = _run("1f1b", p, m, 1, 2, 1)
        gpipe = _run("gpipe", p, m, 1, 2, 1)
        assert one_f_one_b.peak_activations == tuple(min(p - s, m) for s in range(p))
        assert gpipe.peak_activations == (m,) * p


@pytest.mark.parametrize("forward, backward, weight_grad", COSTS)
def test_zb_h1_bubble_time_is_p_minus_1_times_f_plus_b_minus_2w(forward, backward, weight_grad):
    for p, m in GRID:
        if m < p:
            continue
        zb_h1 = _run("zb_h1", p, m, forward, backward, weight_grad)
        one_f_one_b = _run("1f1b", p, m, forward, backward, weight_grad)
        work = m * (forward + backward)
        assert zb_h1.makespan - work == pytest.approx(
            (p - 1) * (forward + backward - 2 * weight_grad)
        )
        assert one_f_one_b.makespan - work == pytest.approx((p - 1) * (forward + backward))
        assert max(zb_h1.peak_activations) == max(one_f_one_b.peak_activations) == p


def test_zb_h1_bubble_is_a_third_of_1f1b_when_f_i_w_are_equal():
    zb_h1 = _run("zb_h1", 4, 8, 1, 2, 1)
    one_f_one_b = _run("1f1b", 4, 8, 1, 2, 1)
    assert zb_h1.bubble_time / 4 == pytest.approx(one_f_one_b.bubble_time / 4 / 3)


@pytest.mark.parametrize("forward, backward, weight_grad", COSTS)
def test_zb_h2_leaves_only_the_unavoidable_bubble(forward, backward, weight_grad):
    input_grad = backward - weight_grad
    for p, m in GRID:
        if m < 2 * p:
            continue
        result = _run("zb_h2", p, m, forward, backward, weight_grad)
        # (p-1)(F+I-2W) per the paper, but never less than the start stagger (p-1)F.
        expected = (p - 1) * max(forward, forward + input_grad - 2 * weight_grad)
        assert result.makespan - m * (forward + backward) == pytest.approx(expected)
        assert max(result.peak_activations) == 2 * p - 1


def test_zb_h2_has_zero_bubble_when_steps_overlap_and_f_i_w_are_equal():
    for p, m in GRID:
        if m >= 2 * p:
            assert _run("zb_h2", p, m, 1, 2, 1).overlapped_bubble_fraction == 0, (p, m)


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1_and_shrinks_with_v():
    for p, m in GRID:
        if m % p:
            continue
        bubbles = []
        for v in (2, 3, 4):
            result = _run("interleaved_1f1b", p, m, 1, 2, 1, chunks=v)
            assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
            bubbles.append(result.bubble_fraction)
        one_f_one_b = _run("1f1b", p, m, 1, 2, 1).bubble_fraction
        if p > 1:
            assert one_f_one_b > bubbles[0] > bubbles[1] > bubbles[2]


def test_transfer_time_delays_each_hop_of_the_fill_and_drain():
    transfer = 0.25
    for p, m in [(2, 4), (4, 8), (8, 8)]:
        schedule = build_schedule("gpipe", p, m)
        result = simulate(schedule, CostModel.uniform(p, 1, 2, transfer_time=transfer))
        assert result.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * transfer)


def test_peak_bytes_follow_each_stages_activation_size():
    stages = tuple(StageCost(1, 2, activation_bytes=10 * (s + 1)) for s in range(4))
    result = simulate(build_schedule("1f1b", 4, 8), CostModel(stages))
    assert result.peak_activation_bytes == (40, 60, 60, 40)


def test_utilisation_and_bubble_agree():
    result = _run("1f1b", 4, 8, 1, 2, 1)
    assert sum(result.utilisation) / 4 == pytest.approx(1 - result.bubble_fraction)


def test_cost_model_must_match_the_number_of_stages():
    with pytest.raises(ValueError, match="one StageCost per stage \\(8\\)"):
        simulate(build_schedule("interleaved_1f1b", 4, 8), CostModel.uniform(4))


def test_weight_grad_longer_than_backward_is_rejected():
    with pytest.raises(ValueError, match="weight_grad=3"):
        StageCost(forward=1, backward=2, weight_grad=3)


def test_timeline_png_and_comparison_are_valid_pngs(tmp_path):
    planned = _run("interleaved_1f1b", 4, 8, 1, 2, 1)
    measured = _run("zb_h1", 4, 8, 1, 2, 1)
    path = tmp_path / "compare.png"
    save_timeline_png(
        str(path),
        [
            TimelinePanel(planned.records, timeline_title(planned), planned.schedule.stage_devices),
            TimelinePanel(measured.records, "measured"),
        ],
    )
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    assert "v=2" in timeline_title(planned) and "bubble=15.8%" in timeline_title(planned)


def test_chrome_trace_has_one_complete_event_per_action_and_a_process_per_device(tmp_path):
    result = _run("zb_h1", 4, 8, 1, 2, 1)
    path = tmp_path / "trace.json"
    write_chrome_trace(str(path), result.records)
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(result.records)
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {
        f"pipeline device {d}" for d in range(4)
    }
