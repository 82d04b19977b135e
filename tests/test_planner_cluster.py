"""The cluster planner: a model's shape on a hardware file, held against published runs.

Pure Python, no TensorFlow: FLOPs and memory formulas, one-line errors, the accuracy goals
over Megatron-LM's Table 1, and plan.py's --json interface.
"""

import functools
import json
import subprocess
import sys

import pytest
from script_runner import REPO_ROOT, script_environment

from tfmulti.pipeline.balance import Block
from tfmulti.pipeline.schedules import build_schedule
from tfmulti.pipeline.simulate import CostModel, simulate
from tfmulti.planner.analytic_costs import embedding_allreduce_seconds, shape_blocks
from tfmulti.planner.cluster_search import search_cluster_layouts
from tfmulti.planner.costs import Hardware
from tfmulti.planner.hardware_files import hardware_from_json, load_hardware
from tfmulti.planner.model_shapes import gpt_shape, megatron_flops, parse_model_shape
from tfmulti.planner.published_runs import MEGATRON_TABLE_1, compare_run
from tfmulti.planner.scoring import _extrapolated_simulation, score_layout
from tfmulti.platform.mesh import HybridMesh
from tfmulti.zero.formulas import zero_state_bytes

A100 = load_hardware("a100_80gb")
ROW_7 = MEGATRON_TABLE_1[6]


@functools.cache
def compared(run):
    """The planner's prediction for a published run, searched once for every test."""
    return compare_run(run, A100)


def test_megatron_flops_match_the_hand_computed_145b_row():
    # 96·B·s·l·h²·(1 + s/6h + V/16lh), B=2304, s=2048, l=80, h=12288, V=51200, by hand:
    # 96 x 2304 x 2048 x 80 x 150994944 = 5.4716e18; x (1 + 0.027778 + 0.003255).
    by_hand = (
        96 * 2304 * 2048 * 80 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 80 * 12288))
    )
    assert megatron_flops(2304, 2048, 80, 12288, 51200) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(5.6413e18, rel=1e-4)
    # Published: 148 TFLOP/s on 1,536 GPUs is a step of FLOPs / (1536 x 148e12).
    assert by_hand / (1536 * 148e12) == pytest.approx(24.8, abs=0.1)


def test_the_shapes_flops_count_is_megatrons_with_and_without_recomputation():
    shape = gpt_shape(80, 12288, 96, 2048, 51200)
    for recompute in (True, False):
        assert shape.model_flops(2304, recompute) == pytest.approx(
            megatron_flops(2304, 2048, 80, 12288, 51200, recompute), rel=1e-9
        )


def test_gpt_parameters_are_12lh2_plus_embeddings():
    shape = gpt_shape(80, 12288, 96, 2048, 51200)
    h = 12288
    assert shape.num_params == 80 * (12 * h * h + 13 * h) + 51200 * h + 2048 * h + 2 * h
    assert shape.num_params / 1e9 == pytest.approx(145.6, abs=0.1)


def test_activation_memory_is_korthikantis_without_and_the_input_with_recomputation():
    h, a, s, t = 12288, 96, 2048, 8
    shape = gpt_shape(80, h, a, s, 51200)
    layer = shape_blocks(shape, 1, t, A100, recompute=False)[1]
    assert layer.activation_bytes == pytest.approx(s * h * (10 + 24 / t) + 5 * a * s * s / t)
    recomputed = shape_blocks(shape, 1, t, A100, recompute=True)[1]
    assert recomputed.activation_bytes == 2 * s * h
    assert recomputed.transient_bytes == layer.activation_bytes
    # 16 bytes a parameter: mixed-precision Adam.
    assert recomputed.param_bytes == pytest.approx(16 * ((12 * h * h + 7 * h) / t + 6 * h))


def test_mixed_precision_zero_state_is_16_bytes_a_parameter_sharded_by_stage():
    assert zero_state_bytes(0, 1000, 4, 2, 2, 12).total == 16000
    assert zero_state_bytes(3, 1000, 4, 2, 2, 12).total == 4000
    assert zero_state_bytes(1, 1000, 4, 2, 2, 12).total == 4000 + 3000


def test_a_published_layout_holds_its_state_and_1f1b_in_flight_micro_batches():
    shape = gpt_shape(ROW_7.layers, ROW_7.hidden, ROW_7.heads, 2048, 51200)
    (planned,) = [
        p
        for p in search_cluster_layouts(shape, A100, 1536, 2304, layout=ROW_7.mesh)
        if p.layout.schedule == "1f1b" and p.microbatch_size == 1
    ]
    blocks = shape_blocks(shape, 1, 8, A100)
    first_stage = blocks[:11]  # embedding and 10 layers
    state = sum(block.param_bytes for block in first_stage)
    # 1F1B's first stage keeps p = 8 micro-batches' inputs of its 10 layers.
    kept = 8 * sum(block.activation_bytes for block in first_stage)
    transient = max(block.transient_bytes for block in first_stage)
    assert planned.layout.peak_memory == pytest.approx(state + kept + transient, rel=1e-6)
    assert planned.fits


def test_long_schedules_are_extrapolated_along_the_simulated_line():
    costs = CostModel.uniform(8, forward=1.0, backward=2.0, transfer_time=0.1)
    for name, chunks in (("1f1b", None), ("interleaved_1f1b", 2)):
        stages = 8 * (chunks or 1)
        costs = CostModel.uniform(stages, 1.0 / stages, 2.0 / stages, transfer_time=0.01)
        exact = simulate(build_schedule(name, 8, 128, chunks), costs)
        plan = build_schedule(name, 8, 16, chunks)
        extrapolated = _extrapolated_simulation(plan, costs, 128, (16, 24))
        assert extrapolated.makespan == pytest.approx(exact.makespan, rel=1e-9)
        assert extrapolated.peak_activation_bytes == pytest.approx(exact.peak_activation_bytes)


def test_a_cluster_pipeline_send_holds_both_devices_through_its_exchange():
    # Megatron-LM's sends wait for their receives: each F and B of every stage is longer by
    # the exchange (send over the link, all-gather in the tensor group), so each device's
    # m forwards and m backwards add 2m exchanges to a 1F1B step, not just edge delays.
    blocks = [Block(1.0, 2.0, params=10, output_bytes=1e8) for _ in range(4)]
    mesh = HybridMesh(data=1, pipe=2, tensor=2)
    link = {"bandwidth": 1e9, "intra_node_latency": 1e-5, "devices_per_node": 8}
    steps = [
        score_layout(blocks, mesh, "1f1b", 8, 1, (2,), Hardware(**link, blocking_transfers=held))
        for held in (False, True)
    ]
    exchange = (1e-5 + 0.1) + (1e-5 + 0.1)  # the send, then the gather of the other half
    assert steps[1].pipeline_time >= steps[0].pipeline_time + 2 * 8 * exchange - 1e-9
    one_stage = [
        score_layout(
            blocks, HybridMesh(tensor=2), None, 8, 1, (), Hardware(**link, blocking_transfers=held)
        )
        for held in (False, True)
    ]
    assert one_stage[0].step_time == one_stage[1].step_time


def test_a_pipelined_gpt_keeps_a_second_embedding_on_its_last_stage_and_sums_its_gradient():
    vocab, hidden, tensor = 51200, 8192, 8
    shape = gpt_shape(8, hidden, 64, 2048, vocab)
    alone, pipelined = (shape_blocks(shape, 1, tensor, A100, pipelined=p) for p in (False, True))
    assert pipelined[-1].params - alone[-1].params == vocab * hidden // tensor
    assert pipelined[:-1] == alone[:-1]
    # First and last stage on other nodes: two IB messages and V·h/t 16-bit gradients.
    across = HybridMesh(data=32, pipe=2, tensor=8)
    expected = 2 * 10e-6 + 2 * vocab * hidden / tensor / 25e9
    assert embedding_allreduce_seconds(shape, across, A100) == pytest.approx(expected)
    assert embedding_allreduce_seconds(shape, HybridMesh(data=64, tensor=8), A100) == 0.0
    (planned,) = search_cluster_layouts(
        shape, A100, 512, 64, layout=across, max_microbatch_size=1, max_chunks=1
    )[:1]
    assert planned.to_json()["embedding_allreduce_time"] == pytest.approx(expected)


def test_the_one_fitted_constant_reproduces_the_row_it_was_fitted_on():
    # LARGE_MATMUL_EFFICIENCY is fitted so the 145.6B row predicts its published 148
    # TFLOP/s; a change to the cost model that moves it must refit the constant.
    assert compared(ROW_7)["predicted_tflops_per_gpu"] == pytest.approx(148, rel=0.003)


def test_measured_hardware_is_scored_as_before():
    # No devices_per_node: float32 gradients and one link, as measured plans were scored.
    blocks = shape_blocks(gpt_shape(2, 64, 4, 16, 100), 1, 1, A100)
    old = score_layout(blocks, HybridMesh(data=2), None, 1, 1, (), Hardware(bandwidth=1e9))
    grads = sum(block.params for block in blocks) * 4
    assert old.allreduce_time == pytest.approx(grads / 1e9)


@pytest.mark.parametrize(
    "text, field",
    [
        ("gpt:layers=2,hidden=64,heads=5,seq=16,vocab=100", "heads must divide hidden"),
        ("gpt:layers=2,hidden=64,seq=16,vocab=100", "field heads is missing"),
        ("gpt:layers=2,hidden=64,heads=4,seq=16,vocab=100,depth=3", "field 'depth'"),
        ("gpt:layers=0,hidden=64,heads=4,seq=16,vocab=100", "field layers"),
        ("bert:layers=2", "--model_shape is gpt:"),
    ],
)
def test_a_bad_shape_names_its_field_in_one_line(text, field):
    with pytest.raises(ValueError, match=field) as error:
        parse_model_shape(text)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"peak_flops": -1}, "peak_flops"),
        ({"inter_node_bandwidth": None}, "inter_node_bandwidth"),
        ({"devices_per_node": 2.5}, "devices_per_node"),
        ({"nvlink": 1}, "Unknown hardware field nvlink"),
    ],
)
def test_a_bad_hardware_file_names_its_field_in_one_line(change, field):
    data = {**json.load(open(f"{REPO_ROOT}/tfmulti/planner/hardware/a100_80gb.json")), **change}
    data = {key: value for key, value in data.items() if value is not None}
    with pytest.raises(ValueError, match=field) as error:
        hardware_from_json(data)
    assert "\n" not in str(error.value)


def test_an_unknown_preset_and_a_layout_of_too_many_devices_are_refused():
    with pytest.raises(ValueError, match="Unknown hardware preset.*a100_80gb"):
        load_hardware("tpu_v5")
    shape = gpt_shape(2, 64, 4, 16, 100)
    with pytest.raises(ValueError, match="must use all --devices=16"):
        search_cluster_layouts(shape, A100, 16, 16, layout=HybridMesh(data=4, pipe=2, tensor=4))


def test_published_rows_are_predicted_within_10_percent_mape_and_fit_in_80_gb():
    errors = []
    for run in MEGATRON_TABLE_1:
        row = compared(run)
        assert row["published_layout_fits"], (
            f"{run.billions}B's published layout predicted not to fit"
        )
        assert row["published_layout"]["memory_per_device"] <= 80e9
        errors.append(abs(row["predicted_tflops_per_gpu"] / run.tflops_per_gpu - 1))
    assert sum(errors) / len(errors) <= 0.10
    assert max(errors) <= 0.10


# The planner predicts smaller tensor groups with a short interleaved pipeline faster for
# these two rows (18.4B: data 64 x pipe 2 x tensor 2, by 9.7%; 39.1B: 32 x 4 x 4, by 7.9%),
# whose published layouts follow Megatron-LM's heuristic of tensor = 8 first: at h/t =
# 768-1024 the six tensor all-reduces of each layer and micro-batch cost about a fifth of
# its matmuls (docs/planner_cluster.md, "Why two rows miss").
KNOWN_GAP_MISSES = {18.4, 39.1}


@pytest.mark.parametrize(
    "run",
    [
        pytest.param(
            run,
            id=f"{run.billions}B",
            marks=[pytest.mark.xfail(strict=True, reason="gap above 5%")]
            if run.billions in KNOWN_GAP_MISSES
            else [],
        )
        for run in MEGATRON_TABLE_1
    ],
)
def test_the_published_layout_is_within_5_percent_of_the_predicted_best(run):
    assert compared(run)["gap_to_best"] <= 0.05


def test_plan_py_json_lists_layouts_best_first_with_their_predictions():
    command = [
        sys.executable,
        f"{REPO_ROOT}/scripts/plan.py",
        "--hardware=a100_80gb",
        "--model_shape=gpt:layers=80,hidden=12288,heads=96,seq=2048,vocab=51200",
        "--devices=1536",
        "--global_batch=2304",
        "--json",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, env=script_environment(), timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    layouts = json.loads(result.stdout)["layouts"]
    assert layouts and all(layout["fits"] for layout in layouts)
    steps = [layout["step_time"] for layout in layouts]
    assert steps == sorted(steps)
    for layout in layouts:
        assert all(isinstance(layout[axis], int) for axis in ("data", "pipe", "tensor"))
        assert layout["data"] * layout["pipe"] * layout["tensor"] == 1536
        assert layout["tflops_per_device"] > 0 and 0 < layout["memory_per_device"] <= 80e9
