"""XLA per stage: `compile(jit_compile=True)` compiles each stage's functions for its own
device, and the pipeline still trains like one device (rolled or not, whole or split
backward, and the Transformer with sparse embedding gradients)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import (
    Chain,
    dense_stages,
    max_weight_difference,
    regression_batches,
    token_transformer_and_stages,
)

from tfmulti.hybrid import HybridPipelineModel, build_hybrid_model
from tfmulti.models import registry
from tfmulti.pipeline.runtime import PipelineModel
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names

STEPS = 2
BATCH_SIZE = 32
# XLA fuses and orders the stage's arithmetic its own way: the sums round differently.
TOLERANCE = 1e-4


def _compiled_functions(model, x, y) -> int:
    """Functions of the traced training step marked to compile with XLA."""

    @tf.function(autograph=False)
    def step(x, y):
        return model.train_step((x, y))

    library = step.get_concrete_function(x, y).graph.as_graph_def().library
    return sum(
        "_XlaMustCompile" in function.attr and function.attr["_XlaMustCompile"].b
        for function in library.function
    )


@pytest.mark.parametrize(
    "schedule, num_microbatches, rolled",
    [("1f1b", 8, None), ("gpipe", 4, False), ("zb_h1", 8, None)],
    ids=["1f1b-rolled", "gpipe-unrolled", "zb_h1-split-backward"],
)
def test_stages_compiled_with_xla_train_like_one_device(schedule, num_microbatches, rolled):
    batches = regression_batches(STEPS, BATCH_SIZE)
    x0, y0 = batches[0]
    devices = logical_device_names("CPU")[:2]
    pipeline = PipelineModel(dense_stages(2), devices, num_microbatches, schedule, rolled=rolled)
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
    pipeline(x0)
    # F and B (or F, I and W) of each of the 2 stages, each compiled on its own.
    pieces = 3 if schedule == "zb_h1" else 2
    assert _compiled_functions(pipeline, x0, y0) == 2 * pieces
    reference = Chain(dense_stages(2))
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=False)
    reference(x0)
    for x, y in batches:
        pipeline_loss = pipeline.train_on_batch(x, y)
        reference_loss = reference.train_on_batch(x, y)
    assert max_weight_difference(reference, pipeline) < TOLERANCE
    np.testing.assert_allclose(pipeline_loss, reference_loss, rtol=TOLERANCE)
    np.testing.assert_allclose(
        pipeline.evaluate(x0, y0, verbose=0), reference.evaluate(x0, y0, verbose=0), TOLERANCE
    )


def test_without_jit_compile_nothing_is_compiled_with_xla():
    x, y = regression_batches(1, BATCH_SIZE)[0]
    pipeline = PipelineModel(dense_stages(2), logical_device_names("CPU")[:2], 4, "1f1b")
    pipeline.compile(optimizer="sgd", loss="mse", jit_compile="auto")
    pipeline(x)
    assert _compiled_functions(pipeline, x, y) == 0
    pipeline.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert _compiled_functions(pipeline, x, y) == 4


def test_compiled_transformer_with_sparse_embedding_gradients_trains_like_the_model():
    (x, y), loss, whole, stages = token_transformer_and_stages(num_layers=2, num_stages=2)
    whole.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, jit_compile=False)
    pipeline = PipelineModel(stages, logical_device_names("CPU")[:2], 8, "1f1b")
    pipeline.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss, jit_compile=True)
    # One epoch of two steps (32 rows in batches of 16).
    whole_history = whole.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    history = pipeline.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(
        history.history["loss"], whole_history.history["loss"], rtol=TOLERANCE
    )
    assert max_weight_difference(whole, pipeline) < TOLERANCE


def test_hybrid_copies_compile_their_stages_with_xla_and_train_like_one_device():
    batches = regression_batches(STEPS, BATCH_SIZE)
    x0, _ = batches[0]
    mesh = parse_mesh("data=2,pipe=2")
    devices = logical_device_names("CPU")[: mesh.num_devices]
    hybrid = HybridPipelineModel(lambda: dense_stages(2), mesh.replica_devices(devices), 4, "1f1b")
    hybrid.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    reference = Chain(dense_stages(2))
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    hybrid(x0)
    reference(x0)
    for x, y in batches:
        hybrid.train_on_batch(x, y)
        reference.train_on_batch(x, y)
    # F and B of each of the 2 stages, compiled once: the second copy calls the first's
    # traced (and so compiled) stage functions with its own weights (shared_traces.py).
    assert _compiled_functions(hybrid, x0, batches[0][1]) == 4
    for replica in hybrid.replicas:
        for mine, theirs in zip(replica.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_stage_split_over_a_tensor_group_is_refused_by_name():
    def split_blocks(devices=None):
        options = {"num_layers": 2, "num_heads": 2, "d_model": 8}
        if devices is not None:
            options.update(tensor_parallel=len(devices), tensor_parallel_devices=list(devices))
        return registry.build_blocks("transformer", (8,), 16, seed=0, **options)

    mesh_text = "data=1,pipe=2,tensor=2"
    hybrid = build_hybrid_model(
        split_blocks,
        mesh_text,
        num_microbatches=2,
        schedule="1f1b",
        devices=logical_device_names("CPU")[: parse_mesh(mesh_text).num_devices],
        make_split_blocks=split_blocks,
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tokens = np.random.default_rng(0).integers(0, 16, (8, 9)).astype("int32")
    hybrid.compile(optimizer="sgd", loss=loss, jit_compile=True)
    with pytest.raises(ValueError, match=r"holds its variables on 2 devices .*one device"):
        hybrid.train_on_batch(tokens[:, :-1], tokens[:, 1:])
    hybrid.compile(optimizer="sgd", loss=loss, jit_compile=False)
    assert np.isfinite(hybrid.train_on_batch(tokens[:, :-1], tokens[:, 1:]))
