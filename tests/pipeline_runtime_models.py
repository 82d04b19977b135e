"""Tiny seeded stages for the pipeline runtime tests, and a one-device model of the same layers."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

FEATURES = 6
OUTPUTS = 2


def _dense(units, seed, activation=None):
    return keras.layers.Dense(
        units, activation=activation, kernel_initializer=keras.initializers.GlorotUniform(seed)
    )


def dense_stages(num_stages: int, seed: int = 0) -> list[keras.layers.Layer]:
    """`num_stages` dense layers, the last one producing OUTPUTS values."""
    hidden = [_dense(8, seed + index, "tanh") for index in range(num_stages - 1)]
    return hidden + [_dense(OUTPUTS, seed + 100)]


class ResidualNormBlock(keras.layers.Layer):
    """x + Dense(LayerNorm(x)): a pre-norm residual block."""

    def __init__(self, width, seed, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.dense = _dense(width, seed, "tanh")

    def call(self, inputs):
        return inputs + self.dense(self.norm(inputs))


def residual_stages(num_stages: int, seed: int = 0) -> list[keras.layers.Layer]:
    """Residual LayerNorm blocks, each stage a small Sequential, with a dense head last."""
    stages = [keras.Sequential([_dense(8, seed), ResidualNormBlock(8, seed + 1)])]
    for index in range(1, num_stages - 1):
        stages.append(ResidualNormBlock(8, seed + 10 * index))
    stages.append(keras.Sequential([ResidualNormBlock(8, seed + 99), _dense(OUTPUTS, seed + 98)]))
    return stages


class SplitStage(keras.layers.Layer):
    """Takes a tensor (or a pair) and hands the next stage a pair: (features, skip)."""

    def __init__(self, seed, **kwargs):
        super().__init__(**kwargs)
        self.dense = _dense(8, seed, "tanh")
        self.skip = _dense(8, seed + 1)

    def call(self, inputs):
        features, skip = inputs if isinstance(inputs, (tuple, list)) else (inputs, inputs)
        return self.dense(features), self.skip(skip)


class MergeStage(keras.layers.Layer):
    """Adds the pair it receives and maps it to the outputs."""

    def __init__(self, seed, **kwargs):
        super().__init__(**kwargs)
        self.dense = _dense(OUTPUTS, seed)

    def call(self, inputs):
        features, skip = inputs
        return self.dense(features + skip)


def two_tensor_stages(num_stages: int, seed: int = 0) -> list[keras.layers.Layer]:
    """Stages passing two tensors across every boundary."""
    return [SplitStage(seed + 2 * index) for index in range(num_stages - 1)] + [
        MergeStage(seed + 50)
    ]


class Chain(keras.Model):
    """The stages called one after the other on the default device: the reference."""

    def __init__(self, stages, **kwargs):
        super().__init__(**kwargs)
        self.chained = list(stages)

    def call(self, inputs, training=None):
        for stage in self.chained:
            inputs = stage(inputs, training=training)
        return inputs


# (policy, weight tolerance against one device under the same policy)
MIXED_PRECISION_POLICIES = [("mixed_float16", 2e-3), ("mixed_bfloat16", 2e-2)]


def mixed_precision_stages(num_stages: int, policy: str) -> list[keras.layers.Layer]:
    """`dense_stages` computing in `policy`, all but the float32 head."""
    layers = dense_stages(num_stages)
    for layer in layers[:-1]:
        layer.dtype_policy = keras.DTypePolicy(policy)
    return layers


def mixed_precision_sgd(policy: str) -> keras.optimizers.Optimizer:
    """SGD(0.1), with loss scaling for float16."""
    sgd = keras.optimizers.SGD(0.1)
    return keras.optimizers.LossScaleOptimizer(sgd) if policy == "mixed_float16" else sgd


def regression_batches(num_batches: int, batch_size: int, seed: int = 0):
    """A list of (x, y) float32 batches."""
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(batch_size, FEATURES)).astype("float32"),
            rng.normal(size=(batch_size, OUTPUTS)).astype("float32"),
        )
        for _ in range(num_batches)
    ]


def optimizer_named(name: str) -> keras.optimizers.Optimizer:
    """SGD(0.1) for "sgd", Adam(0.01) for "adam": the optimizers equality tests train with."""
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def train_pipeline_and_chain(
    make_stages, num_devices, num_microbatches, schedule, chunks, optimizer, steps=3, batch_size=16
):
    """Trains the same seeded stages as a `PipelineModel` on `schedule` and as one `Chain`.

    Args:
        make_stages: `make_stages(num_stages)` builds the stages (twice, same seeds).
        num_devices: logical CPU devices of the pipeline.
        num_microbatches: micro-batches per step.
        schedule: anything `PipelineModel` takes as its schedule.
        chunks: stages per device; the model has `num_devices * chunks` stages.
        optimizer: "sgd" or "adam".

    Returns:
        `(reference, pipeline, initial_pipeline_weights, reference_loss, pipeline_loss)`,
        the losses of the last step.
    """
    from tfmulti.pipeline.runtime import PipelineModel
    from tfmulti.platform.runtime.devices import logical_device_names

    devices = logical_device_names("CPU")[:num_devices]
    num_stages = num_devices * chunks
    reference = Chain(make_stages(num_stages))
    reference.compile(optimizer=optimizer_named(optimizer), loss="mse")
    pipeline = PipelineModel(make_stages(num_stages), devices, num_microbatches, schedule)
    pipeline.compile(optimizer=optimizer_named(optimizer), loss="mse")
    batches = regression_batches(steps, batch_size)
    pipeline(batches[0][0])
    reference(batches[0][0])
    initial = [w.copy() for w in pipeline.get_weights()]
    for x, y in batches:
        reference_loss = reference.train_on_batch(x, y)
        pipeline_loss = pipeline.train_on_batch(x, y)
    return reference, pipeline, initial, reference_loss, pipeline_loss


def max_weight_difference(first: keras.Model, second: keras.Model) -> float:
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(first.get_weights(), second.get_weights(), strict=True)
    )


def device_index(variable) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return spec.device_type, spec.device_index


def token_transformer_and_stages(num_layers: int, num_stages: int, seed: int = 3):
    """Tokens (x, y), their loss, the reference Transformer built whole, and the same model
    (same seed) cut into `num_stages` uniform stages: vocabulary 32, 8 tokens, 32 rows."""
    from tfmulti.models import build_blocks, build_model
    from tfmulti.pipeline.runtime import partition_blocks, stages_from_blocks

    vocab, sequence = 32, 8
    options = dict(num_layers=num_layers, num_heads=2, d_model=16)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(32, sequence + 1)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    whole = build_model("transformer", (sequence,), vocab, seed=seed, **options)
    blocks = build_blocks("transformer", (sequence,), vocab, seed=seed, **options)
    boundaries = partition_blocks(blocks, num_stages, "uniform").boundaries
    return (tokens[:, :-1], tokens[:, 1:]), loss, whole, stages_from_blocks(blocks, boundaries)


def loops_in_step(pipeline, x, y) -> int:
    """How many loops the pipeline's traced training step holds."""

    @tf.function(autograph=False)
    def losses(x, y):
        return pipeline.run_schedule(x, y).losses

    graph = losses.get_concrete_function(x, y).graph.as_graph_def()
    return sum(node.op in ("While", "StatelessWhile") for node in graph.node)
