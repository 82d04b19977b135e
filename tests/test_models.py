"""Promises of the reference models: blocks and model agree, seeds fix weights, they learn."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.data import DATASET_NAMES, dataset_task, make_datasets
from tfmulti.models import (
    MODEL_NAMES,
    MODEL_SPECS,
    build_blocks,
    build_model,
    chain_blocks,
    check_model_accepts,
)

# Tiny sizes: each case is (model name, input shape, outputs, options).
CASES = {
    "mlp": ("mlp", (8, 8, 1), 10, {"hidden_units": (16, 16, 16)}),
    "convnet": ("convnet", (8, 8, 1), 10, {"filters": (4, 8), "hidden_units": 16}),
    "resnet": ("resnet", (8, 8, 1), 10, {"stage_filters": (4, 8)}),
    "resnet_layer_norm": (
        "resnet",
        (8, 8, 1),
        10,
        {"stage_filters": (4, 8), "normalization": "layer"},
    ),
    "transformer": (
        "transformer",
        (8,),
        16,
        {"num_layers": 2, "num_heads": 2, "d_model": 16},
    ),
}


def _inputs(name, input_shape, num_outputs, batch=3, seed=0):
    rng = np.random.default_rng(seed)
    if MODEL_SPECS[name].input_dtype == "int32":
        return rng.integers(num_outputs, size=(batch, *input_shape)).astype("int32")
    return rng.random((batch, *input_shape), dtype=np.float32)


def _weights_equal(first, second):
    first, second = first.get_weights(), second.get_weights()
    return len(first) == len(second) and all(
        a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, second, strict=True)
    )


def test_every_model_has_a_case():
    assert {case[0] for case in CASES.values()} == set(MODEL_NAMES)


@pytest.mark.parametrize("case", list(CASES))
def test_block_list_run_in_turn_gives_the_built_models_outputs(case):
    name, input_shape, num_outputs, options = CASES[case]
    x = _inputs(name, input_shape, num_outputs)
    model = build_model(name, input_shape, num_outputs, seed=3, **options)
    blocks = build_blocks(name, input_shape, num_outputs, seed=3, **options)
    outputs = x
    for block in blocks:
        outputs = block(outputs)
    np.testing.assert_allclose(outputs, model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_chained_model_layers_are_the_blocks_in_order(case):
    name, input_shape, num_outputs, options = CASES[case]
    blocks = build_blocks(name, input_shape, num_outputs, seed=0, **options)
    model = chain_blocks(blocks, input_shape, input_dtype=MODEL_SPECS[name].input_dtype)
    assert model.layers[1:] == blocks
    block_weights = [weight for block in blocks for weight in block.weights]
    assert [id(weight) for weight in model.weights] == [id(weight) for weight in block_weights]


@pytest.mark.parametrize("case", list(CASES))
def test_output_shape_is_logits_per_example_or_per_position(case):
    name, input_shape, num_outputs, options = CASES[case]
    model = build_model(name, input_shape, num_outputs, seed=0, **options)
    outputs = model(_inputs(name, input_shape, num_outputs, batch=2))
    expected = (2, *input_shape, num_outputs) if name == "transformer" else (2, num_outputs)
    assert tuple(outputs.shape) == expected
    assert outputs.dtype == "float32"


@pytest.mark.parametrize("case", list(CASES))
def test_same_seed_gives_same_weights_whatever_the_global_seed(case):
    name, input_shape, num_outputs, options = CASES[case]
    tf.random.set_seed(1)
    first = build_model(name, input_shape, num_outputs, seed=5, **options)
    tf.random.set_seed(2)
    keras.utils.set_random_seed(7)
    second = build_model(name, input_shape, num_outputs, seed=5, **options)
    third = build_model(name, input_shape, num_outputs, seed=6, **options)
    assert _weights_equal(first, second)
    assert not _weights_equal(first, third)


@pytest.mark.parametrize("case", list(CASES))
def test_each_block_builds_alone_from_its_input_shape(case):
    name, input_shape, num_outputs, options = CASES[case]
    chained = build_blocks(name, input_shape, num_outputs, seed=2, **options)
    model = chain_blocks(chained, input_shape, input_dtype=MODEL_SPECS[name].input_dtype)
    activations = _inputs(name, input_shape, num_outputs)
    alone = build_blocks(name, input_shape, num_outputs, seed=2, **options)
    for index, (in_model, block) in enumerate(zip(chained, alone, strict=True)):
        block.build(in_model.input.shape)
        assert block.built, f"block {index} did not build from {in_model.input.shape}"
        assert [w.shape for w in block.weights] == [w.shape for w in in_model.weights]
        expected = in_model(activations)
        np.testing.assert_allclose(block(activations), expected, rtol=1e-5, atol=1e-6)
        activations = expected
    assert model.layers[1:] == chained


@pytest.mark.parametrize("case", ["resnet", "transformer"])
def test_saved_weights_load_into_a_model_built_with_another_seed(case, tmp_path):
    name, input_shape, num_outputs, options = CASES[case]
    x = _inputs(name, input_shape, num_outputs)
    source = build_model(name, input_shape, num_outputs, seed=1, **options)
    source.save_weights(tmp_path / "model.weights.h5")
    target = build_model(name, input_shape, num_outputs, seed=2, **options)
    target.load_weights(tmp_path / "model.weights.h5")
    np.testing.assert_allclose(target(x), source(x), rtol=1e-6)
    source.save(tmp_path / "model.keras")
    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    np.testing.assert_allclose(reloaded(x), source(x), rtol=1e-6)


@pytest.mark.parametrize("case", ["mlp", "resnet", "transformer"])
def test_logits_are_float32_under_mixed_precision(case):
    name, input_shape, num_outputs, options = CASES[case]
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = build_model(name, input_shape, num_outputs, seed=0, **options)
        outputs = model(_inputs(name, input_shape, num_outputs))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.layers[1].compute_dtype == "float16"
    assert outputs.dtype == "float32"


def test_transformer_logits_do_not_depend_on_later_tokens():
    name, input_shape, num_outputs, options = CASES["transformer"]
    model = build_model(name, input_shape, num_outputs, seed=0, **options)
    tokens = _inputs(name, input_shape, num_outputs)
    changed = tokens.copy()
    changed[:, 5:] = (changed[:, 5:] + 1) % num_outputs
    before, after = np.asarray(model(tokens)), np.asarray(model(changed))
    np.testing.assert_allclose(before[:, :5], after[:, :5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(before[:, 5:], after[:, 5:])


@pytest.mark.parametrize("case", list(CASES))
def test_a_few_sgd_steps_lower_the_loss_on_the_matching_dataset(case):
    name, input_shape, num_outputs, options = CASES[case]
    if name == "transformer":
        data = make_datasets(
            "tokens",
            32,
            seed=0,
            num_examples=256,
            sequence_length=input_shape[0],
            vocab_size=num_outputs,
        )
    else:
        data = make_datasets("digits", 32, seed=0)
    model = build_model(name, data.info.input_shape, data.info.num_classes, seed=0, **options)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = next(iter(data.validation))
    loss_before = model.evaluate(x, y, verbose=0)
    model.fit(data.train, steps_per_epoch=15, epochs=1, verbose=0)
    assert model.evaluate(x, y, verbose=0) < loss_before


def test_transformer_is_rejected_for_classification_data_in_one_line():
    with pytest.raises(ValueError, match="'transformer' trains on language_model") as error:
        check_model_accepts("transformer", dataset_task("digits"))
    assert "\n" not in str(error.value)


def test_image_models_reject_flat_examples():
    with pytest.raises(ValueError, match=r"input_shape=\(32,\)"):
        check_model_accepts("convnet", "classification", (32,))
    with pytest.raises(ValueError, match=r"input_shape=\(32,\)"):
        build_model("resnet", (32,), 10)
    check_model_accepts("mlp", "classification", (32,))


def test_unknown_model_and_unknown_option_are_named_in_the_error():
    with pytest.raises(ValueError, match="Received: 'gpt5'"):
        build_model("gpt5", (8,), 10)
    with pytest.raises(ValueError, match="d_model"):
        build_blocks("mlp", (8,), 10, d_model=32)


@pytest.mark.parametrize(
    "name, option, value, wanted",
    [
        ("mlp", "hidden_units", 32, "a tuple of sizes"),
        ("transformer", "num_layers", 1.5, "an integer"),
        ("transformer", "num_heads", True, "an integer"),
        ("mlp", "activation", 1, "a name"),
    ],
)
def test_an_option_of_the_wrong_kind_is_named_in_one_line(name, option, value, wanted):
    input_shape = (32,) if name == "transformer" else (8,)
    with pytest.raises(ValueError, match=rf"option '{option}' takes {wanted}, e\.g\. ") as error:
        build_blocks(name, input_shape, 64, **{option: value})
    assert "\n" not in str(error.value)


def test_transformer_rejects_a_vocab_size_other_than_its_outputs():
    with pytest.raises(ValueError, match="vocab_size=10, num_outputs=16"):
        build_blocks("transformer", (8,), 16, vocab_size=10)


def test_every_dataset_with_a_fixed_task_has_a_model_for_it():
    model_tasks = {spec.task for spec in MODEL_SPECS.values()}
    for name in DATASET_NAMES:
        assert dataset_task(name) in model_tasks | {None}
