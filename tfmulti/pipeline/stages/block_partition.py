"""Stages from an ordered block list: measuring the blocks and splitting them with the balancer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfmulti.costing.cost_cache import CostCache, block_signature
from tfmulti.pipeline.balance import Block, Partition, balance, parse_partition_spec

_TIMING_REPEATS = 3


class BlockStage(keras.layers.Layer):
    """One pipeline stage: consecutive blocks, each fed the previous one's output.

    Args:
        blocks: the stage's blocks, in order.
        **kwargs: passed to `keras.layers.Layer` (e.g. `name`).
    """

    def __init__(self, blocks: Sequence[keras.layers.Layer], **kwargs):
        super().__init__(**kwargs)
        self.blocks = list(blocks)

    def call(self, inputs, training=None):
        for block in self.blocks:
            inputs = block(inputs, training=training)
        return inputs


def stages_from_blocks(
    blocks: Sequence[keras.layers.Layer], boundaries: Sequence[int]
) -> list[BlockStage]:
    """Groups `blocks` into stages that start at 0 and at each of `boundaries`.

    Args:
        blocks: the model's blocks in order (unbuilt, so the pipeline can place them).
        boundaries: index of the first block of stages 1, 2, ...; strictly increasing.

    Example:
        >>> stages = stages_from_blocks(blocks, [3, 6, 9])  # 4 stages
    """
    edges = [0, *boundaries, len(blocks)]
    if any(start >= end for start, end in zip(edges, edges[1:], strict=False)):
        raise ValueError(
            f"boundaries must increase strictly within 1..{len(blocks) - 1} so that every "
            f"stage has a block. Received: boundaries={list(boundaries)} for {len(blocks)} blocks"
        )
    return [
        BlockStage(blocks[start:end], name=f"stage_{index}")
        for index, (start, end) in enumerate(zip(edges, edges[1:], strict=False))
    ]


def partition_blocks(
    blocks: Sequence[keras.layers.Layer],
    num_stages: int,
    policy: str = "uniform",
    sample_input=None,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    cache: CostCache | None = None,
    costs: Sequence[Block] | None = None,
) -> Partition:
    """Chooses stage boundaries for `blocks` with the balancer, costing the real blocks.

    "params" counts each block's parameters and "time" times each block's forward and
    backward on `sample_input` (one micro-batch). Both measure copies made from the blocks'
    configs, so `blocks` stay unbuilt for the pipeline to place.

    Args:
        blocks: the model's blocks in order.
        num_stages: stages to make (p, or p·v for an interleaved schedule).
        policy: "uniform", "params", "time" or "manual:3,6,9" (first block of each later
            stage).
        sample_input: one micro-batch of model input; needed by "params" and "time".
        num_microbatches: micro-batches per step, for the simulated step time.
        schedule: one-stage-per-device schedule name the balancer simulates.
        cache: block timings kept between runs ("time" only).
        costs: the blocks' costs, as `block_costs` gave them; measured here if None.

    Returns:
        The balancer's `Partition`; pass `partition.boundaries` to `stages_from_blocks`.

    Example:
        >>> partition = partition_blocks(blocks, 2, "time", sample_input=x[:16])
        >>> stages = stages_from_blocks(blocks, partition.boundaries)
    """
    policy_name, boundaries = parse_partition_spec(policy)
    if costs is None:
        costs = block_costs(blocks, policy, sample_input, cache)
    return balance(
        costs,
        num_stages,
        num_microbatches,
        policy_name,
        schedule=schedule,
        boundaries=boundaries,
    )


def block_costs(
    blocks: Sequence[keras.layers.Layer],
    policy: str,
    sample_input=None,
    cache: CostCache | None = None,
) -> list[Block]:
    """The costs `policy` balances `blocks` by: measured for "params" and "time".

    Example:
        >>> costs = block_costs(blocks, "time", x[:16], CostCache("costs.json"))
    """
    policy_name, _ = parse_partition_spec(policy)
    if policy_name not in ("params", "time"):
        return [Block(name=block.name) for block in blocks]
    if sample_input is None:
        raise ValueError(
            f"Partition policy {policy_name!r} measures the blocks on a sample batch. "
            "Received: sample_input=None; pass one micro-batch of inputs."
        )
    return measure_blocks(blocks, sample_input, time_blocks=policy_name == "time", cache=cache)


def measure_blocks(
    blocks: Sequence[keras.layers.Layer],
    sample_input,
    time_blocks: bool = True,
    rounds: int = 1,
    cache: CostCache | None = None,
) -> list[Block]:
    """Parameter counts, output bytes and (optionally) forward/backward seconds per block.

    Blocks that cost the same (equal `block_signature`: a Transformer's layers) are timed
    once; with `cache`, blocks it holds are not timed at all and new timings are saved.

    Args:
        blocks: the model's blocks in order; measured on copies, so they stay unbuilt.
        sample_input: the first block's input.
        time_blocks: time forward and backward; otherwise both count 1.0.
        rounds: times each block's traced functions are timed; the fastest round counts.
        cache: timings kept between runs (`CostCache`).

    Example:
        >>> costs = measure_blocks(blocks, x[:16], cache=CostCache("costs.json"))
    """
    costs = []
    timings = BlockTimings(cache, rounds)
    inputs = tf.nest.map_structure(tf.convert_to_tensor, sample_input)
    for block in blocks:
        copy = fresh_copy(block)
        outputs = copy(inputs, training=True)
        forward_time = backward_time = 1.0
        if time_blocks:
            forward_time, backward_time = timings.seconds(
                copy, inputs, block_signature(copy, inputs), f"{type(copy).__name__} {copy.name}"
            )
        costs.append(
            Block(
                forward_time=forward_time,
                backward_time=backward_time,
                params=int(sum(np.prod(v.shape) for v in copy.trainable_variables)),
                activation_bytes=float(
                    sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(outputs))
                ),
                name=block.name,
            )
        )
        inputs = outputs
    if time_blocks:
        timings.report()
    return costs


class BlockTimings:
    """Forward and backward seconds of blocks, each distinct signature timed once.

    A block whose signature was timed before (in this run, or in `cache`) is not timed
    again; a block without a signature (None) is always timed. Shared by the reference
    models' blocks (`measure_blocks`) and a whole model's calls (`call_blocks`).

    Args:
        cache: timings kept between runs (`CostCache`); new timings are added to it.
        rounds: times each block's traced functions are timed; the fastest round counts.

    Example:
        >>> timings = BlockTimings(CostCache("costs.json"))
        >>> forward, backward = timings.seconds(block, x, block_signature(block, x), "Dense d")
        >>> timings.report()  # one log line; saves the cache
    """

    def __init__(self, cache: CostCache | None = None, rounds: int = 1):
        self.cache = cache
        self.rounds = rounds
        self._seconds: dict[str, tuple[float, float]] = {}
        self._counts = {"timed": 0, "same as another block": 0, "cached": 0}

    def seconds(
        self, block, inputs, signature: str | None, description: str
    ) -> tuple[float, float]:
        """`block`'s (forward, backward) seconds on `inputs`: timed before, cached, or timed now.

        Args:
            block: called as `block(inputs, training=True)`, with `trainable_variables`.
            inputs: what `block` is timed on.
            signature: equal for blocks that cost the same (`block_signature`), or None.
            description: what the cache file says the entry is, e.g. "Dense dense_3".
        """
        if signature in self._seconds:
            self._counts["same as another block"] += 1
            return self._seconds[signature]
        cacheable = self.cache is not None and signature is not None
        seconds = self.cache.get(signature) if cacheable else None
        if seconds is None:
            seconds = time_block(block, inputs, rounds=self.rounds)
            self._counts["timed"] += 1
            if cacheable:
                self.cache.put(signature, seconds, description)
        else:
            self._counts["cached"] += 1
        if signature is not None:
            self._seconds[signature] = seconds
        return seconds

    def report(self) -> None:
        """Logs how many blocks were timed, reused or read from the cache; saves the cache."""
        counted = ", ".join(f"{count} {kind}" for kind, count in self._counts.items() if count)
        if self.cache is None:
            logging.info("Block timing: %s.", counted)
            return
        self.cache.save()
        if self._counts["timed"]:
            logging.info("Block timing: %s; saved to %s.", counted, self.cache.path)
        else:
            logging.info(
                "Block timing: used the cached costs in %s (%s); remeasure=True "
                "(--remeasure_partition) times the blocks again.",
                self.cache.path,
                counted,
            )


def fresh_copy(block: keras.layers.Layer) -> keras.layers.Layer:
    """An unbuilt copy of `block` from its config, to measure without building `block`."""
    try:
        return block.__class__.from_config(block.get_config())
    except Exception as error:
        raise ValueError(
            f"Block {block.name!r} ({type(block).__name__}) cannot be copied from its config "
            "for measuring; give it a get_config, or use partition 'uniform' or "
            "'manual:<split points>'."
        ) from error


def time_block(block: keras.layers.Layer, inputs, rounds: int = 1) -> tuple[float, float]:
    """Returns (forward, backward) seconds of `block` on `inputs`, traced.

    Each round takes the median of `_TIMING_REPEATS` calls; the fastest round counts,
    since other processes on the machine only ever slow a block down. The backward is
    forward+backward less forward.
    """
    differentiable = [t for t in tf.nest.flatten(inputs) if t.dtype.is_floating]

    @tf.function(autograph=False)
    def forward():
        return block(inputs, training=True)

    @tf.function(autograph=False)
    def forward_and_backward():
        with tf.GradientTape() as tape:
            tape.watch(differentiable)
            outputs = tf.nest.flatten(block(inputs, training=True))
            target = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in outputs])
        gradients = tape.gradient(target, differentiable + block.trainable_variables)
        # Embedding gradients arrive as IndexedSlices; densify so the timing waits for them.
        return [tf.convert_to_tensor(g) for g in gradients if g is not None]

    def seconds(function):
        function()
        medians = []
        for _ in range(rounds):
            times = []
            for _ in range(_TIMING_REPEATS):
                start = time.perf_counter()
                tf.nest.map_structure(lambda t: t.numpy(), function())
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times))
        return min(medians)

    forward_time = seconds(forward)
    return forward_time, max(seconds(forward_and_backward) - forward_time, 0.0)
