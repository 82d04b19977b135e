"""Placed and tensor-parallel models save as plain single-device Keras models.

`save("file.keras")` → `keras.saving.load_model` in a fresh process (which builds no
placement and no split layers; one process loads both saved models) → the same predictions
as the parallel model.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from tfmulti.models import registry
from tfmulti.parallel import (
    ColumnParallelDense,
    RowParallelDense,
    TensorParallelLayer,
    VocabParallelEmbedding,
    place,
    unsplit_model,
)

DEVICES = ["/CPU:0", "/CPU:1"]

# Loads each model in turn in one fresh process and writes its predictions, where its
# layers come from, and whether tfmulti was imported by then; `imports` are each model's
# own modules (none for plain Keras layers), imported just before it loads.
LOADER = textwrap.dedent(
    """
    import importlib, json, sys
    import numpy as np
    import keras
    reports = []
    for model_file, inputs, predictions, imports in json.loads(sys.argv[1]):
        for module in imports:
            importlib.import_module(module)
        model = keras.saving.load_model(model_file)
        np.save(predictions, model.predict(np.load(inputs), verbose=0))
        layer_modules = sorted({type(layer).__module__ for layer in model._flatten_layers()})
        reports.append({"layer_modules": layer_modules,
                        "tfmulti_loaded": "tfmulti" in sys.modules})
    print(json.dumps(reports))
    """
)


def _load_in_one_fresh_process(tmp_path, models):
    """[(predictions, report)] of each (model_file, inputs, imports) of `models`, loaded in
    that order by one new Python process."""
    jobs = []
    for index, (model_file, inputs, imports) in enumerate(models):
        np.save(tmp_path / f"inputs_{index}.npy", inputs)
        jobs.append(
            (
                str(model_file),
                str(tmp_path / f"inputs_{index}.npy"),
                str(tmp_path / f"predictions_{index}.npy"),
                list(imports),
            )
        )
    result = subprocess.run(
        [sys.executable, "-c", LOADER, json.dumps(jobs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(result.stdout.strip().splitlines()[-1])
    return [(np.load(job[2]), report) for job, report in zip(jobs, reports, strict=True)]


def _sequential_classifier():
    return keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(16, activation="relu", name="middle"),
            keras.layers.Dense(3, name="logits"),
        ]
    )


def _train_a_few_steps(model, x, y):
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)


def test_placed_model_saves_the_users_model_which_loads_without_tfmulti(loaded_fresh):
    model, placed, x, (predictions, report) = loaded_fresh["placed"]

    assert placed.to_model() is model
    np.testing.assert_allclose(predictions, placed.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # Loaded first in the fresh process, before anything imported tfmulti.
    assert not report["tfmulti_loaded"]
    assert all(module.startswith("keras.") for module in report["layer_modules"])


def test_placed_model_weight_files_load_into_the_unplaced_model(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 3, 64)
    placed = place(_sequential_classifier(), balance="params", devices=DEVICES, print_fn=None)
    _train_a_few_steps(placed, x, y)
    placed.save_weights(tmp_path / "placed.weights.h5")

    single = _sequential_classifier()
    single.load_weights(tmp_path / "placed.weights.h5")
    np.testing.assert_allclose(
        single.predict(x, verbose=0), placed.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


@pytest.fixture(scope="module")
def trained_tensor_parallel_transformer():
    """The reference Transformer split over two devices, trained a few Adam steps."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 32, size=(32, 17)).astype("int32")
    model = registry.build_model(
        "transformer", (16,), 32, seed=0, tensor_parallel=2, num_layers=2, d_model=16, num_heads=2
    )
    _train_a_few_steps(model, tokens[:, :-1], tokens[:, 1:])
    return model, tokens[:, :-1]


@pytest.fixture(scope="module")
def loaded_fresh(tmp_path_factory, trained_tensor_parallel_transformer):
    """A placed model and the tensor-parallel Transformer, each trained and saved, then
    loaded by one fresh process (the placed model first, before tfmulti is imported):
    {"placed": (model, placed, x, (predictions, report)),
     "transformer": (model, tokens, (predictions, report))}."""
    tmp_path = tmp_path_factory.mktemp("parallel_export")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 12)).astype("float32"), rng.integers(0, 3, 64)
    model = _sequential_classifier()
    placed = place(model, {"hidden": 0, ".*": 1}, devices=DEVICES, print_fn=None)
    _train_a_few_steps(placed, x, y)
    placed.save(tmp_path / "placed.keras")
    transformer, tokens = trained_tensor_parallel_transformer
    transformer.save(tmp_path / "transformer.keras")
    placed_loaded, transformer_loaded = _load_in_one_fresh_process(
        tmp_path,
        [
            (tmp_path / "placed.keras", x, ()),
            (tmp_path / "transformer.keras", tokens, ("tfmulti.models.transformer",)),
        ],
    )
    return {
        "placed": (model, placed, x, placed_loaded),
        "transformer": (transformer, tokens, transformer_loaded),
    }


def test_tensor_parallel_transformer_saves_unsplit_and_predicts_the_same(loaded_fresh):
    model, tokens, (predictions, report) = loaded_fresh["transformer"]

    np.testing.assert_allclose(predictions, model.predict(tokens, verbose=0), rtol=1e-4, atol=1e-5)
    # Only the model's own layers and Keras's: no split layers were rebuilt.
    assert set(report["layer_modules"]) <= {"tfmulti.models.transformer"} | {
        module for module in report["layer_modules"] if module.startswith("keras.")
    }


def test_unsplit_transformer_is_the_tensor_parallel_1_model_with_joined_weights(
    trained_tensor_parallel_transformer,
):
    model, tokens = trained_tensor_parallel_transformer
    plain = model.to_model()
    reference = registry.build_model(
        "transformer", (16,), 32, seed=0, num_layers=2, d_model=16, num_heads=2
    )
    reference.set_weights(plain.get_weights())

    assert not any(isinstance(layer, TensorParallelLayer) for layer in plain._flatten_layers())
    assert [type(layer).__name__ for layer in plain._flatten_layers()] == [
        type(layer).__name__ for layer in reference._flatten_layers()
    ]
    np.testing.assert_allclose(
        reference.predict(tokens, verbose=0), model.predict(tokens, verbose=0), rtol=1e-4, atol=1e-5
    )


def test_split_dense_and_embedding_layers_unsplit_to_dense_and_embedding():
    ids = keras.Input((6,), dtype="int32")
    x = VocabParallelEmbedding(16, 8, DEVICES, name="tokens")(ids)
    x = ColumnParallelDense(12, DEVICES, activation="relu", name="up")(x)
    outputs = RowParallelDense(4, DEVICES, name="down")(x)
    model = keras.Model(ids, outputs)
    inputs = np.random.default_rng(3).integers(0, 16, size=(5, 6)).astype("int32")

    plain = unsplit_model(model)

    assert [type(layer).__name__ for layer in plain.layers[1:]] == ["Embedding", "Dense", "Dense"]
    np.testing.assert_allclose(
        plain.predict(inputs, verbose=0), model.predict(inputs, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_split_layer_without_a_plain_twin_is_a_one_line_error_naming_it():
    inputs = keras.Input((8,))
    slices = ColumnParallelDense(8, DEVICES, gather_output=False, name="sliced")(inputs)
    model = keras.Model(inputs, RowParallelDense(2, DEVICES, input_is_parallel=True)(slices))
    with pytest.raises(ValueError, match="'sliced'") as raised:
        unsplit_model(model)
    assert "\n" not in str(raised.value)
