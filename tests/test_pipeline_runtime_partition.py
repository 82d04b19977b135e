"""Stages from reference-model blocks: splitting, measuring, and training like the whole model."""

import itertools

import keras
import numpy as np
import pytest

from tfmulti.models import build_blocks, build_model
from tfmulti.pipeline.runtime import PipelineModel, partition_blocks, stages_from_blocks
from tfmulti.platform.runtime.devices import logical_device_names

VOCAB, SEQUENCE = 32, 8
TRANSFORMER = dict(num_layers=2, num_heads=2, d_model=16)


def _tokens(batch_size, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, size=(batch_size, SEQUENCE + 1)).astype("int32")


def test_transparency_transformer_blocks_split_into_stages_train_like_the_whole_model():
    tokens = _tokens(16)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    whole = build_model("transformer", (SEQUENCE,), VOCAB, seed=3, **TRANSFORMER)
    # SGD: Adam turns float noise in near-zero gradients into steps of size ~lr.
    whole.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    blocks = build_blocks("transformer", (SEQUENCE,), VOCAB, seed=3, **TRANSFORMER)
    stages = stages_from_blocks(blocks, partition_blocks(blocks, 2, "manual:2").boundaries)
    pipeline = PipelineModel(stages, logical_device_names("CPU")[:2], 4, "1f1b")
    pipeline.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    for _ in range(2):
        whole.train_on_batch(x, y)
        pipeline.train_on_batch(x, y)
    for a, b in zip(whole.get_weights(), pipeline.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_params_partition_minimises_the_largest_stage_parameter_count():
    blocks = build_blocks("mlp", (6,), 3, hidden_units=(40, 8, 8, 40, 8))
    sample = np.zeros((4, 6), "float32")
    partition = partition_blocks(blocks, 3, "params", sample_input=sample)
    model = build_model("mlp", (6,), 3, hidden_units=(40, 8, 8, 40, 8))
    counts = [sum(int(np.prod(w.shape)) for w in layer.weights) for layer in model.layers[1:]]

    def largest_stage(boundaries):
        edges = [0, *boundaries, len(counts)]
        return max(sum(counts[a:b]) for a, b in itertools.pairwise(edges))

    best = min(largest_stage(split) for split in itertools.combinations(range(1, len(counts)), 2))
    assert largest_stage(partition.boundaries) == best
    assert not any(block.built for block in blocks)


def test_time_partition_measures_copies_and_leaves_blocks_unbuilt():
    blocks = build_blocks("mlp", (6,), 3, hidden_units=(8, 8, 8))
    partition = partition_blocks(blocks, 2, "time", sample_input=np.zeros((4, 6), "float32"))
    assert len(partition.boundaries) == 1
    assert not any(block.built for block in blocks)


def test_stages_from_blocks_refuses_an_empty_stage():
    blocks = build_blocks("mlp", (6,), 3)
    with pytest.raises(ValueError, match=r"Received: boundaries=\[2, 2\]"):
        stages_from_blocks(blocks, [2, 2])


def test_measuring_policies_ask_for_a_sample_input():
    with pytest.raises(ValueError, match="sample_input=None"):
        partition_blocks(build_blocks("mlp", (6,), 3), 2, "params")
