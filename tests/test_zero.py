"""ZeRO stages 1-3 (`tfmulti.zero`): the same maths as one device, state held per the formulas."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.run.device_memory import memory_section
from tfmulti.tensor_parallel.transfer_bytes import sent_bytes
from tfmulti.zero import ShardLayout, ZeroDataParallel, zero_state_bytes, zero_step_traffic

NUM_DEVICES = 4
DEVICES = [f"/device:CPU:{index}" for index in range(NUM_DEVICES)]
# 70 rows in batches of 16: a last batch of 6, split 1-2-1-2 over the devices.
ROWS, BATCH = 70, 16


def _data(integer_inputs=False):
    rng = np.random.default_rng(0)
    if integer_inputs:
        x = rng.integers(0, 29, size=(ROWS, 4)).astype("int32")
    else:
        x = rng.normal(size=(ROWS, 10)).astype("float32")
    return x, rng.integers(0, 3, ROWS)


def _mlp():
    # 7 and 3 units: weights whose first axis does not divide by 4 devices (padded).
    return keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(7, activation="relu"), keras.layers.Dense(3)]
    )


def _embedding_model():
    # An embedding's gradient is sparse (IndexedSlices).
    return keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(29, 6),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


def _batchnorm_model():
    return keras.Sequential(
        [
            keras.Input((10,)),
            # No bias before BatchNorm: its gradient is zero up to rounding, which Adam
            # would scale up to steps of the learning rate.
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=3),
}


def _compiled(model, optimizer, **options):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    return model


def _train(build, optimizer="adam", stage=None, integer_inputs=False, **compile_options):
    """Trains two epochs on one device (stage None) or ZeRO `stage` over 4 devices."""
    keras.utils.set_random_seed(1)
    model = build()
    if stage is not None:
        model = ZeroDataParallel(model, DEVICES, stage)
    _compiled(model, OPTIMIZERS[optimizer](), **compile_options)
    x, y = _data(integer_inputs)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, history.history


@functools.cache
def _one_device_mlp(optimizer: str) -> tuple[list, dict]:
    """The MLP's weights and history after one-device training under `optimizer`; the
    stages' tests of each optimizer compare with the same run."""
    reference, history = _train(_mlp, optimizer)
    return reference.get_weights(), history


@functools.cache
def _zero_mlp(stage: int, optimizer: str = "adam"):
    """(model, history) of the MLP trained under ZeRO `stage`, once for every test that
    reads it (none changes it for good)."""
    return _train(_mlp, optimizer, stage)


# Adam at every stage; the other optimizers where their state takes another path: an EMA's
# averages written back into the blocks (and gathered whole again below stage 3), one
# momentum slot, a decoupled weight decay of the blocks.
@pytest.mark.parametrize(
    "optimizer, stage",
    [
        ("adam", 1),
        ("adam", 2),
        ("adam", 3),
        ("adam_ema", 1),
        ("adam_ema", 3),
        ("adamw", 2),
        ("sgd_momentum", 3),
    ],
)
def test_every_stage_trains_to_one_devices_weights_with_the_users_optimizer(stage, optimizer):
    reference_weights, reference_history = _one_device_mlp(optimizer)
    zero, history = _zero_mlp(stage, optimizer)
    for expected, got in zip(reference_weights, zero.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-6)
    np.testing.assert_allclose(history["loss"], reference_history["loss"], rtol=1e-6)
    np.testing.assert_allclose(history["accuracy"], reference_history["accuracy"])


def test_sparse_embedding_gradients_train_as_on_one_device():
    reference, _ = _train(_embedding_model, integer_inputs=True)
    zero, _ = _train(_embedding_model, stage=3, integer_inputs=True)
    for expected, got in zip(reference.get_weights(), zero.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-6)


def test_mixed_precision_and_steps_per_execution_train_as_on_one_device():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        reference, _ = _train(_mlp, steps_per_execution=3)
        zero, _ = _train(_mlp, stage=2, steps_per_execution=3)
        assert type(zero.optimizer).__name__ == "LossScaleOptimizer"
        # Calling the model reads each replica's weights as its steps do (the call's own
        # autocast once read only replica 0's own block in float16).
        x = _data(False)[0][:8]
        # (float16 outputs: the call casts the inputs to float16 first, predict does not.)
        np.testing.assert_allclose(zero(x), zero.predict(x, verbose=0), rtol=1e-2, atol=1e-3)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    for expected, got in zip(reference.get_weights(), zero.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-3)


def test_batchnorm_trains_as_mirrored_data_parallelism():
    """Per-replica batch statistics differ from one device's by design; ZeRO keeps stage 0's.

    Full batches only: MirroredStrategy leaves a replica empty in a last batch of 6 rows
    over 4 devices, and its BatchNorm turns NaN there (ZeRO splits it 1-2-1-2)."""
    keras.utils.set_random_seed(1)
    strategy = tf.distribute.MirroredStrategy(
        DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        mirrored = _compiled(_batchnorm_model(), OPTIMIZERS["adam"]())
    x, y = (part[:64] for part in _data())
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    mirrored.fit(dataset, epochs=2, verbose=0)
    keras.utils.set_random_seed(1)
    zero = _compiled(ZeroDataParallel(_batchnorm_model(), DEVICES, 3), OPTIMIZERS["adam"]())
    zero.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for expected, got in zip(mirrored.get_weights(), zero.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_checkpoint_saved_on_four_devices_resumes_on_two_with_the_same_state(tmp_path):
    zero, _ = _zero_mlp(3)
    path = str(tmp_path / "state.weights.h5")
    keras.Model.save_weights(zero, path)
    keras.utils.set_random_seed(7)
    resumed = _compiled(ZeroDataParallel(_mlp(), DEVICES[:2], 1), OPTIMIZERS["adam"]())
    keras.Model.load_weights(resumed, path)
    for expected, got in zip(zero.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(got, expected)
    # Optimizer state whole: each weight's moments joined from its blocks match.
    assert zero._whole_state().keys() == resumed._whole_state().keys()
    for key, value in zero._whole_state().items():
        np.testing.assert_array_equal(resumed._whole_state()[key], value, err_msg=key)


def test_saved_model_is_the_plain_model_with_whole_weights(tmp_path):
    zero, _ = _zero_mlp(3)
    path = str(tmp_path / "model.keras")
    zero.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras.Sequential
    x, _ = _data()
    np.testing.assert_allclose(loaded.predict(x, verbose=0), zero.predict(x, verbose=0), atol=1e-6)


def test_a_zero_model_answers_keras_calls_as_the_plain_model():
    zero, _ = _zero_mlp(3)
    plain = _mlp()
    assert zero.count_params() == plain.count_params()
    assert [tuple(w.shape) for w in zero.weights] == [tuple(w.shape) for w in plain.weights]
    lines = []
    zero.summary(print_fn=lambda text, **kwargs: lines.append(text))
    text = "\n".join(lines)
    assert "Dense" in text and "ZeRO stage 3: all state sharded over 4 devices" in text
    trained = zero.get_weights()
    try:
        zero.set_weights([np.ones_like(w) for w in trained])
        for got in zero.get_weights():
            np.testing.assert_array_equal(got, 1.0)
    finally:
        zero.set_weights(trained)  # the shared run, as the other tests read it


def test_user_variables_give_up_their_storage_while_sharded():
    model = _mlp()
    zero = ZeroDataParallel(model, DEVICES, 3)
    assert all(v._value is None for v in model.trainable_variables)
    with zero.whole_weights() as whole:
        assert all(v._value is not None for v in whole.trainable_variables)
    assert all(v._value is None for v in model.trainable_variables)


def _padded_params(model) -> int:
    return sum(
        ShardLayout(tuple(v.shape), NUM_DEVICES).shard_size * NUM_DEVICES
        for v in model.trainable_variables
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_each_device_holds_match_the_zero_formulas(stage):
    """Adam in float32: weights 4Ψ (stage 3: 4Ψ/N), optimizer 8Ψ/N from stage 1 on."""
    keras.utils.set_random_seed(1)
    wide = lambda: keras.Sequential(  # noqa: E731
        [keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(64)]
    )
    if stage == 0:
        with tf.distribute.MirroredStrategy(DEVICES).scope():
            model = _compiled(wide(), keras.optimizers.Adam())
            model.optimizer.build(model.trainable_variables)
        params = model.count_params()
    else:
        plain = wide()
        params = _padded_params(plain)
        model = _compiled(ZeroDataParallel(plain, DEVICES, stage), keras.optimizers.Adam())
    formula = zero_state_bytes(stage, params, NUM_DEVICES)
    memory = memory_section(model, DEVICES)
    for device in DEVICES:
        held = next(v for k, v in memory.items() if k.endswith(device))
        assert held["weights"] == pytest.approx(formula.weights, rel=0.02), device
        assert held["optimizer"] == pytest.approx(formula.optimizer, rel=0.02), device


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_sent_per_step_match_the_formula(stage):
    """2Ψ(N-1)/N per device for stages 1-2; 3Ψ(N-1)/N for stage 3, which gathers each
    layer's weights again for its backward (Ψ counted with the blocks' padding)."""
    zero, _ = _zero_mlp(stage)
    graph = zero.step_graph(tf.TensorSpec((10,)), tf.TensorSpec((), tf.int64))
    sent = sent_bytes(graph, DEVICES[0], skip_scalars=True)
    expected = zero_step_traffic(stage, _padded_params(zero.plain_model), NUM_DEVICES)
    assert sorted(sent) == [("CPU", index) for index in range(NUM_DEVICES)]
    assert set(sent.values()) == {expected}


def test_stage_three_gathers_each_layer_again_for_its_backward_one_layer_ahead():
    """Per replica, each of the MLP's 2 layers gathers its kernel and bias for its forward
    and again for its backward (8 joins); the second layer's forward gathers and the first
    layer's backward gathers wait for an anchor (the previous layer's input, the later
    layer's output gradient), so no gather runs more than one layer ahead."""
    zero, _ = _zero_mlp(3)
    graph = zero.step_graph(tf.TensorSpec((10,)), tf.TensorSpec((), tf.int64))
    for device in DEVICES:
        joins = [
            op
            for op in graph.get_operations()
            if op.type == "ConcatV2" and op.device.endswith(device[-5:])
        ]
        # Control inputs land on the first op made under them: here the join's axis.
        waiting = [op for op in joins if any(i.op.control_inputs for i in op.inputs)]
        assert (len(joins), len(waiting)) == (8, 4), device


def test_layout_pads_rows_and_joins_back():
    layout = ShardLayout((10, 3), 4)
    value = np.arange(30.0).reshape(10, 3)
    pieces = layout.split(value)
    assert [piece.shape for piece in pieces] == [(3, 3)] * 4
    np.testing.assert_array_equal(pieces[-1][1:], 0.0)
    np.testing.assert_array_equal(layout.join(pieces), value)
    scalar = ShardLayout((), 4)
    np.testing.assert_array_equal(scalar.join(scalar.split(np.float32(2.5))), 2.5)


def test_formulas_give_the_papers_float32_adam_figures():
    psi, n = 1000, 4
    assert zero_state_bytes(0, psi, n).total == 16 * psi
    assert zero_state_bytes(1, psi, n).total == 8 * psi + 8 * psi / n
    assert zero_state_bytes(2, psi, n).total == 4 * psi + 12 * psi / n
    assert zero_state_bytes(3, psi, n).total == 16 * psi / n
    assert zero_step_traffic(2, psi, n) == 2 * 4 * psi * (n - 1) / n
    assert zero_step_traffic(3, psi, n) == 3 * 4 * psi * (n - 1) / n


def test_an_unknown_stage_or_stage_zero_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--zero must be one of"):
        zero_state_bytes(4, 1, 1)
    with pytest.raises(ValueError, match="stage 0 is plain data parallelism"):
        ZeroDataParallel(_mlp(), DEVICES, 0)


def test_gather_overlap_counts_gathering_beside_compute_on_other_threads():
    from tfmulti.platform.runtime.trace_events import TraceEvent
    from tfmulti.zero.gather_overlap import gather_overlap

    ops = [
        # A forward gather [0, 2] while a MatMul runs on the other thread over [1, 3].
        TraceEvent("call/dense_1/zero_gather/concat:ConcatV2", 0.0, 2.0, "a"),
        TraceEvent("call/dense/MatMul:MatMul", 1.0, 3.0, "b"),
        # A backward gather (a scope's third use) beside compute on its own thread only.
        TraceEvent("call/zero_regather_2/concat:ConcatV2", 4.0, 6.0, "a"),
        TraceEvent("call/dense/MatMul_1:MatMul", 4.0, 6.0, "a"),
        TraceEvent("call/not_a_zero_gather/concat:ConcatV2", 4.0, 6.0, "b"),
    ]
    overlap = gather_overlap(ops)
    assert (overlap["gather_ops"], overlap["regather_ops"]) == (2, 1)
    assert overlap["gather_op_seconds"] == pytest.approx(4.0)
    assert overlap["overlapped_op_seconds"] == pytest.approx(1.0)
    assert overlap["overlap_fraction"] == pytest.approx(0.25)
    assert overlap["compute_seconds"] == pytest.approx(4.0)  # [1, 3] and [4, 6]
    assert gather_overlap(ops, span=(3.5, 7.0))["overlap_fraction"] == 0.0
