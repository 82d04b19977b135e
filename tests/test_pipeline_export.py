"""A pipeline saves as a plain Keras model that loads in a fresh process and predicts the
same; its weight files are the single-device model's; built stages train like unbuilt."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from pipeline_graph_models import (
    gpt2_causal_lm,
    regression_data,
    skip_model,
    token_data,
)
from pipeline_runtime_models import (
    Chain,
    dense_stages,
    device_index,
    max_weight_difference,
    regression_batches,
)

from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks
from tfmulti.platform.runtime.devices import first_logical_devices

BATCH = 8

# Loads every saved model with Keras alone (no tfmulti) and writes its predictions.
_LOAD_AND_PREDICT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    import keras_hub  # noqa: F401  (the GPT-2 task's classes)

    cases = json.load(open(sys.argv[1]))
    classes = {}
    for name, case in cases.items():
        model = keras.saving.load_model(case["model"])
        inputs = dict(np.load(case["inputs"]))
        x = inputs["x"] if list(inputs) == ["x"] else inputs
        np.save(case["predictions"], np.asarray(model.predict(x, verbose=0)))
        classes[name] = type(model).__name__
    assert "tfmulti" not in sys.modules
    print(json.dumps(classes))
    """
)


def _one_step(pipe, x, y, loss="mse"):
    pipe.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    pipe.train_on_batch(x, y)
    return pipe


def _block_stage_pipeline():
    keras.utils.set_random_seed(4)
    blocks = [keras.layers.Dense(8, activation="tanh") for _ in range(3)] + [keras.layers.Dense(2)]
    return PipelineModel(stages_from_blocks(blocks, [2]), first_logical_devices(2, "stages"), 2)


def test_save_loads_in_a_fresh_process_and_predicts_like_the_pipeline(tmp_path):
    devices = first_logical_devices(2, "stages")
    skip_x, skip_y = regression_data(skip_model(), BATCH)
    token_x, token_y = token_data(BATCH)
    dense_x, dense_y = regression_batches(1, BATCH)[0]
    pipes = {
        "skip": (
            _one_step(PipelineModel.from_model(skip_model(), devices, 2), skip_x, skip_y),
            {"x": skip_x},
        ),
        "gpt2": (
            _one_step(
                PipelineModel.from_model(gpt2_causal_lm(), devices, 2, partition="uniform"),
                token_x,
                token_y,
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            ),
            token_x,
        ),
        "stage_list": (
            _one_step(PipelineModel(dense_stages(2), devices, 2), dense_x, dense_y),
            {"x": dense_x},
        ),
        "block_stages": (_one_step(_block_stage_pipeline(), dense_x, dense_y), {"x": dense_x}),
    }
    cases = {}
    for name, (pipe, inputs) in pipes.items():
        cases[name] = {
            "model": str(tmp_path / f"{name}.keras"),
            "inputs": str(tmp_path / f"{name}_inputs.npz"),
            "predictions": str(tmp_path / f"{name}_predictions.npy"),
        }
        pipe.save(cases[name]["model"])
        np.savez(cases[name]["inputs"], **inputs)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "load.py").write_text(_LOAD_AND_PREDICT)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, str(tmp_path / "load.py"), str(tmp_path / "cases.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    classes = json.loads(result.stdout.strip().splitlines()[-1])
    assert classes["gpt2"] == "GPT2CausalLM"
    assert classes["skip"] == "Functional"
    for name, (pipe, inputs) in pipes.items():
        x = inputs["x"] if list(inputs) == ["x"] else inputs
        loaded = np.load(cases[name]["predictions"])
        np.testing.assert_allclose(loaded, pipe.predict(x, verbose=0), atol=1e-5)


def test_save_weights_files_are_the_single_device_models(tmp_path):
    x, y = regression_data(skip_model(), BATCH)
    pipe = _one_step(
        PipelineModel.from_model(skip_model(), first_logical_devices(2, "stages"), 2), x, y
    )
    pipe.save_weights(tmp_path / "pipe.weights.h5")
    single = skip_model(seed=7)
    single.load_weights(tmp_path / "pipe.weights.h5")
    np.testing.assert_allclose(single.predict(x, verbose=0), pipe.predict(x, verbose=0), atol=1e-6)

    other = skip_model(seed=11)
    other.save_weights(tmp_path / "other.weights.h5")
    pipe.load_weights(tmp_path / "other.weights.h5")
    np.testing.assert_allclose(pipe.predict(x, verbose=0), other.predict(x, verbose=0), atol=1e-6)
    # Loading keeps every variable on its stage's device.
    for stage in pipe.stages:
        assert {device_index(v) for v in stage.trainable_variables} == {
            device_index(stage.trainable_variables[0])
        }


# Building is before any schedule runs: one schedule, with its split backward (zb_h1).
@pytest.mark.parametrize("schedule", ["zb_h1"])
def test_built_stages_train_like_unbuilt_ones(schedule):
    devices = first_logical_devices(4, "stages")
    batches = regression_batches(2, 16)
    built = dense_stages(4, seed=5)
    Chain(built)(batches[0][0])
    built_pipe = PipelineModel(built, devices, 4, schedule)
    unbuilt_pipe = PipelineModel(dense_stages(4, seed=5), devices, 4, schedule)
    reference = Chain(dense_stages(4, seed=5))
    for model in (built_pipe, unbuilt_pipe, reference):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    for x, y in batches:
        for model in (built_pipe, unbuilt_pipe, reference):
            model.train_on_batch(x, y)
    assert max_weight_difference(built_pipe, unbuilt_pipe) < 1e-6
    assert max_weight_difference(built_pipe, reference) < 1e-5
    for stage, device in zip(built_pipe.stages, devices, strict=True):
        for variable in stage.variables:
            assert device_index(variable)[1] == int(device.rsplit(":", 1)[1])


def test_stage_list_to_model_before_any_input_is_refused_in_one_line():
    pipe = PipelineModel(dense_stages(2), first_logical_devices(2, "stages"))
    with pytest.raises(ValueError, match="has not seen an input yet") as error:
        pipe.to_model()
    assert "\n" not in str(error.value)
