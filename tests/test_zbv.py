"""ZB-V: two chunks per device in a V, split backward; closed forms and one-device equality.

The chunked zero-bubble schedules (ZB-V, interleaved zero bubble, DualPipeV) also train to
one device's weights with recomputation, mixed precision, uneven batches, a whole model cut
by `PipelineModel.from_model`, on a hybrid mesh, and from `scripts/train.py`.
"""

import functools
import os

import keras
import numpy as np
import pytest
from pipeline_graph_models import regression_data, skip_model
from pipeline_runtime_models import (
    FEATURES,
    MIXED_PRECISION_POLICIES,
    OUTPUTS,
    Chain,
    dense_stages,
    loops_in_step,
    max_weight_difference,
    mixed_precision_sgd,
    mixed_precision_stages,
    optimizer_named,
    regression_batches,
    residual_stages,
    token_transformer_and_stages,
    train_pipeline_and_chain,
)
from script_runner import TWO_EPOCHS, assert_same_training, read_metrics, run_script

from tfmulti.hybrid import HybridPipelineModel
from tfmulti.pipeline import CostModel, build_schedule, simulate, validate_schedule
from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names


@functools.cache
def _simulate(name, p, m, forward, input_grad, weight_grad, chunks=None):
    """`name` simulated with chunk costs F, I, W (a one-chunk schedule gets twice each);
    cached: the closed forms below read several of the same simulations, and only read."""
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


# The 2 and 4 devices, 4, 8 and 16 micro-batches, SGD and Adam: each value, and each
# device count with both optimizers, without the whole product (the reference transformer
# below adds 16 micro-batches on 2 devices with Adam). 32 rows: two a micro-batch at 16.
EQUALITY_CASES = [(2, 4, "adam"), (2, 8, "sgd"), (4, 4, "sgd"), (4, 16, "adam")]
# Where the steps overlap, the traced step holds one loop, not one copy per micro-batch.
ONE_LOOP = {(2, 8), (4, 16)}


@pytest.mark.parametrize("num_devices, num_microbatches, optimizer", EQUALITY_CASES)
def test_zbv_trains_to_the_weights_of_one_device(num_devices, num_microbatches, optimizer):
    reference, pipeline, initial, reference_loss, pipeline_loss = train_pipeline_and_chain(
        dense_stages, num_devices, num_microbatches, "zbv", 2, optimizer, batch_size=32
    )
    assert pipeline.schedule.name == "zbv"
    moved = max(np.abs(a - b).max() for a, b in zip(initial, pipeline.get_weights(), strict=True))
    assert moved > 1e-3
    assert max_weight_difference(reference, pipeline) < 1e-5
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)
    if (num_devices, num_microbatches) in ONE_LOOP:
        x, y = regression_batches(1, 32)[0]
        assert loops_in_step(pipeline, x, y) == 1


# (schedule, micro-batches): 2 layers cut into 4 stages over 2 devices; 32 rows, so 2 and
# 4 rows a micro-batch. The V over 4 devices is held by the dense equality cases above and
# test_dualpipev's; here each schedule runs the Transformer (sparse embedding gradients) once.
TRANSFORMER_CASES = [("zbv", 16), ("dualpipev", 8)]
TRANSFORMER_DEVICES, TRANSFORMER_LAYERS, TRANSFORMER_STEPS = 2, 2, 2


@pytest.fixture(scope="module")
def whole_transformers(shared_dir):
    """The reference transformer, trained whole for TRANSFORMER_STEPS Adam steps once for
    both schedules' tests: `num_layers -> (last loss, weights)`."""

    def trained(num_layers):
        def fill(directory):
            (x, y), loss, whole, _ = token_transformer_and_stages(num_layers, num_stages=4)
            whole.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
            for _ in range(TRANSFORMER_STEPS):
                whole_loss = whole.train_on_batch(x, y)
            np.savez(os.path.join(directory, "whole.npz"), whole_loss, *whole.get_weights())

        directory = shared_dir(f"zbv_whole_transformer_{num_layers}", fill)
        with np.load(os.path.join(directory, "whole.npz")) as saved:
            arrays = [saved[f"arr_{index}"] for index in range(len(saved.files))]
        return arrays[0], arrays[1:]

    return trained


@pytest.mark.parametrize("schedule, num_microbatches", TRANSFORMER_CASES)
def test_the_reference_transformer_trains_like_the_whole_model(
    whole_transformers, schedule, num_microbatches
):
    # 2p stages over p devices in V order, Adam, sparse embedding gradients: the whole
    # model's weights after TRANSFORMER_STEPS steps.
    num_devices, num_layers = TRANSFORMER_DEVICES, TRANSFORMER_LAYERS
    num_stages = 2 * num_devices
    (x, y), loss, _, stages = token_transformer_and_stages(num_layers, num_stages)
    devices = logical_device_names("CPU")[:num_devices]
    pipeline = PipelineModel(stages, devices, num_microbatches, schedule)
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    pipeline(x)
    v_order = tuple(range(num_devices)) + tuple(reversed(range(num_devices)))
    assert pipeline.schedule.name == schedule and pipeline.schedule.stage_devices == v_order
    for _ in range(TRANSFORMER_STEPS):
        pipeline_loss = pipeline.train_on_batch(x, y)
    whole_loss, whole_weights = whole_transformers(num_layers)
    np.testing.assert_allclose(pipeline_loss, whole_loss, rtol=1e-5)
    for expected, actual in zip(whole_weights, pipeline.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-5)


# Two devices, two chunks each: four stages.
CHUNKED_ZERO_BUBBLE = ["zbv", "interleaved_zb", "dualpipev"]


def _train_both(pipeline, reference, optimizer, batches):
    """Trains `pipeline` and the one-device `reference` (the same seeded layers) on
    `batches`; returns the pipeline's initial weights and both models' last losses."""
    for model in (pipeline, reference):
        model.compile(optimizer=optimizer(), loss="mse")
        model(batches[0][0])
    initial = [w.copy() for w in pipeline.get_weights()]
    for x, y in batches:
        reference_loss = reference.train_on_batch(x, y)
        pipeline_loss = pipeline.train_on_batch(x, y)
    return initial, reference_loss, pipeline_loss


def _assert_moved_to_the_same_weights(reference, trained, initial, tolerance=1e-5):
    weights = trained.get_weights()
    assert max(np.abs(a - b).max() for a, b in zip(initial, weights, strict=True)) > 1e-3
    assert max_weight_difference(reference, trained) < tolerance


@pytest.mark.parametrize(
    "schedule, remat",
    [("zbv", True), ("interleaved_zb", True), ("dualpipev", [True, False, True, False])],
)
def test_recomputation_trains_to_the_weights_of_one_device(schedule, remat):
    # DualPipeV's device 0 pairs the forward of recomputed stage 0 with the backward of
    # stage 3, which keeps its activations.
    pipeline = PipelineModel(
        residual_stages(4), logical_device_names("CPU")[:2], 4, schedule, remat=remat
    )
    reference = Chain(residual_stages(4))
    initial, reference_loss, pipeline_loss = _train_both(
        pipeline, reference, lambda: optimizer_named("adam"), regression_batches(2, 16)
    )
    _assert_moved_to_the_same_weights(reference, pipeline, initial)
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)


# Each schedule once, each policy at least once (the policies share every other line).
@pytest.mark.parametrize(
    "schedule, policy, tolerance",
    [
        (schedule, *MIXED_PRECISION_POLICIES[index % len(MIXED_PRECISION_POLICIES)])
        for index, schedule in enumerate(CHUNKED_ZERO_BUBBLE)
    ],
)
def test_mixed_precision_trains_like_one_device_mixed_precision(schedule, policy, tolerance):
    pipeline = PipelineModel(
        mixed_precision_stages(4, policy), logical_device_names("CPU")[:2], 4, schedule
    )
    reference = Chain(mixed_precision_stages(4, policy))
    initial, _, pipeline_loss = _train_both(
        pipeline, reference, lambda: mixed_precision_sgd(policy), regression_batches(2, 16)
    )
    assert np.isfinite(pipeline_loss)
    assert pipeline.stages[0].compute_dtype == policy.removeprefix("mixed_")
    _assert_moved_to_the_same_weights(reference, pipeline, initial, tolerance)


# 100 rows in batches of 32 with 8 micro-batches (the last batch has 4 rows, so half its
# micro-batches are empty), with sample weights and Adam, and in batches of 30 with 4
# (8, 8, 7, 7 rows; the last batch 10), with SGD: each schedule once, each batching at
# least once.
@pytest.mark.parametrize(
    "schedule, batch_size, num_microbatches, optimizer, weighted",
    [
        ("zbv", 32, 8, "adam", True),
        ("interleaved_zb", 30, 4, "sgd", False),
        ("dualpipev", 30, 4, "sgd", False),
    ],
)
def test_fit_on_uneven_batches_matches_one_device_training(
    schedule, batch_size, num_microbatches, optimizer, weighted
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, FEATURES)).astype("float32")
    y = rng.normal(size=(100, OUTPUTS)).astype("float32")
    weights = rng.uniform(0.0, 2.0, size=100).astype("float32") if weighted else None
    pipeline = PipelineModel(
        dense_stages(4), logical_device_names("CPU")[:2], num_microbatches, schedule
    )
    reference = Chain(dense_stages(4))
    histories = []
    for model in (pipeline, reference):
        model.compile(optimizer=optimizer_named(optimizer), loss="mse")
        model(x[:1])
    initial = [w.copy() for w in pipeline.get_weights()]
    for model in (pipeline, reference):
        fitted = model.fit(
            x, y, sample_weight=weights, batch_size=batch_size, shuffle=False, verbose=0
        )
        histories.append(fitted.history["loss"])
    _assert_moved_to_the_same_weights(reference, pipeline, initial)
    np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)


@pytest.mark.parametrize("schedule", CHUNKED_ZERO_BUBBLE)
def test_a_whole_model_from_model_trains_to_the_weights_of_one_device(schedule):
    # The stem's output skips over the cuts; in the V it comes back to the device it left.
    reference, model = skip_model(), skip_model()
    initial = [w.copy() for w in model.get_weights()]
    pipeline = PipelineModel.from_model(
        model, logical_device_names("CPU")[:2], 4, schedule, chunks=2, partition="uniform"
    )
    x, y = regression_data(model, 2 * 16)
    for trained in (reference, pipeline):
        trained.compile(optimizer=optimizer_named("adam"), loss="mse", jit_compile=False)
    for step in range(2):
        rows = slice(step * 16, (step + 1) * 16)
        reference_loss = reference.train_on_batch(x[rows], y[rows])
        pipeline_loss = pipeline.train_on_batch(x[rows], y[rows])
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=1e-5)
    _assert_moved_to_the_same_weights(reference, pipeline.to_model(), initial)


@pytest.mark.parametrize(
    "schedule, optimizer",
    [("zbv", "sgd"), ("interleaved_zb", "sgd"), ("dualpipev", "adam")],
)
def test_a_data2_pipe2_mesh_trains_to_the_weights_of_one_device(schedule, optimizer):
    mesh = parse_mesh("data=2,pipe=2")
    devices = mesh.replica_devices(logical_device_names("CPU")[: mesh.num_devices])
    hybrid = HybridPipelineModel(lambda: dense_stages(4), devices, 4, schedule)
    reference = Chain(dense_stages(4))
    initial, reference_loss, hybrid_loss = _train_both(
        hybrid, reference, lambda: optimizer_named(optimizer), regression_batches(2, 16)
    )
    assert hybrid.replicas[0].schedule.name == schedule
    _assert_moved_to_the_same_weights(reference, hybrid.replicas[0], initial)
    for replica in hybrid.replicas[1:]:
        for expected, actual in zip(
            hybrid.replicas[0].get_weights(), replica.get_weights(), strict=True
        ):
            np.testing.assert_array_equal(actual, expected)
    np.testing.assert_allclose(hybrid_loss, reference_loss, rtol=1e-5)


# One subprocess for the chunked split-backward path of train.py (--chunks=2 with a zero
# bubble schedule); interleaved_zb runs the same path and trains in process above.
@pytest.mark.parametrize("schedule", ["zbv"])
def test_train_script_runs_a_chunked_zero_bubble_schedule_to_the_losses_of_one_device(
    tmp_path, one_device_metrics, schedule
):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--strategy=pipeline",
        "--virtual_devices=2",
        "--num_stages=2",
        "--chunks=2",
        "--microbatches=4",
        f"--schedule={schedule}",
        f"--model_dir={model_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_training(read_metrics(model_dir), one_device_metrics)
