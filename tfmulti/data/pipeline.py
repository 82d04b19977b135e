"""tf.data pipelines that batch with the global batch size, for any strategy."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfmulti.data.info import ArrayData, DataInfo
from tfmulti.data.sources import load_source
from tfmulti.data.tfrecord import RecordData
from tfmulti.platform.runtime.input_sharding import apply_shard_policy

# Records are streamed, so their shuffle holds at most this many at a time.
_RECORD_SHUFFLE_BUFFER = 10_000
# Spaces the per-pass shuffle seeds of one `seed` apart from those of the next.
_PASS_SEED_STRIDE = 1_000_003
_PASS_GRAPH_SEED = 87_654_321


@dataclasses.dataclass(frozen=True)
class TrainingData:
    """The datasets a training run feeds to `fit`, and how many steps make an epoch.

    Args:
        train: endless (x, y) batches of global_batch_size, reshuffled every pass
            over the data; pass `steps_per_epoch` to `fit` with it.
        validation: one pass of (x, y) batches of global_batch_size; the last
            partial batch is dropped so every replica gets an equal share.
        info: the dataset's DataInfo.
        steps_per_epoch: the steps asked for, or one pass over the training split.
        validation_steps: batches in one pass of `validation`.
    """

    train: tf.data.Dataset
    validation: tf.data.Dataset
    info: DataInfo
    steps_per_epoch: int
    validation_steps: int


def make_datasets(
    name: str,
    global_batch_size: int,
    *,
    seed: int = 0,
    data_path: str | None = None,
    num_examples: int | None = None,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    sequence_length: int | None = None,
    vocab_size: int | None = None,
    steps_per_epoch: int | None = None,
    start_step: int = 0,
    shard_policy: str | None = None,
) -> TrainingData:
    """Loads a named dataset and batches it with the global batch size.

    Args:
        name: one of DATASET_NAMES.
        global_batch_size: examples per step over all replicas; strategies split it.
        seed: seeds generated data and the training order.
        data_path, num_examples, input_shape, num_classes, sequence_length, vocab_size:
            dataset options, see `load_source`.
        steps_per_epoch: steps per epoch; None means one pass over the training split.
        start_step: steps already trained; the stream starts where they left off.
        shard_policy: tf.data auto-shard policy for multi-worker strategies:
            "auto", "file", "data" or "off" (see `tfmulti.platform.runtime.input_sharding`).

    Example:
        >>> data = make_datasets("digits", global_batch_size=64, seed=1)
        >>> model.fit(data.train, validation_data=data.validation,
        ...           steps_per_epoch=data.steps_per_epoch, epochs=3)
    """
    source = load_source(
        name,
        data_path=data_path,
        seed=seed,
        num_examples=num_examples,
        input_shape=input_shape,
        num_classes=num_classes,
        sequence_length=sequence_length,
        vocab_size=vocab_size,
    )
    return make_datasets_from_source(
        source,
        global_batch_size,
        seed=seed,
        steps_per_epoch=steps_per_epoch,
        start_step=start_step,
        shard_policy=shard_policy,
    )


def make_datasets_from_source(
    source: ArrayData | RecordData,
    global_batch_size: int,
    *,
    seed: int = 0,
    steps_per_epoch: int | None = None,
    start_step: int = 0,
    shard_policy: str | None = None,
    total_steps: int | None = None,
) -> TrainingData:
    """Batches loaded data (see `make_datasets`); use it to feed arrays you hold.

    `total_steps` ends the training stream after that many batches (None: endless).
    A stream that ends lets tf.data's threads finish when `fit` returns; destroying
    an endless distributed stream's iterator has been seen to hang.

    Example:
        >>> arrays = load_source("digits")
        >>> data = make_datasets_from_source(arrays, global_batch_size=64, seed=1)
    """
    info = source.info
    _check_batch_size(global_batch_size, info)
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(
            f"steps_per_epoch must be >= 1. Received: steps_per_epoch={steps_per_epoch}"
        )
    if start_step < 0:
        raise ValueError(f"start_step must be >= 0. Received: start_step={start_step}")
    if isinstance(source, ArrayData):
        train = array_training_stream(
            source.x_train, source.y_train, global_batch_size, seed=seed, start_step=start_step
        )
        validation = tf.data.Dataset.from_tensor_slices((source.x_validation, source.y_validation))
    else:
        train = stream_training_batches(
            source.train,
            info.num_train_examples,
            global_batch_size,
            seed=seed,
            start_step=start_step,
        )
        # Its size is known, so Keras starts each evaluation on a fresh pass.
        validation = source.validation.apply(
            tf.data.experimental.assert_cardinality(info.num_validation_examples)
        )
    if total_steps is not None:
        train = train.take(total_steps)
    validation = validation.batch(global_batch_size, drop_remainder=True)
    train, validation = train.prefetch(tf.data.AUTOTUNE), validation.prefetch(tf.data.AUTOTUNE)
    if shard_policy is not None:
        train = apply_shard_policy(train, shard_policy)
        validation = apply_shard_policy(validation, shard_policy)
    return TrainingData(
        train=train,
        validation=validation,
        info=info,
        steps_per_epoch=steps_per_epoch or info.num_train_examples // global_batch_size,
        validation_steps=info.num_validation_examples // global_batch_size,
    )


def array_training_stream(
    x: np.ndarray, y: np.ndarray, global_batch_size: int, *, seed: int, start_step: int = 0
) -> tf.data.Dataset:
    """Endless (x, y) batches; each pass over the examples is a fresh seeded permutation.

    The order depends only on `seed` and the number of examples (stateless random
    ops, not TensorFlow's global seed), so two runs, two processes or a resumed
    run see the same batches. Passes run into each other, so no example is
    skipped for good by the fixed batch size.

    Args:
        x: examples.
        y: targets, same length as x.
        global_batch_size: rows per batch.
        seed: chooses the permutations.
        start_step: batches to skip, e.g. those trained before a restart.
    """
    num_examples = len(x)
    x_tensor, y_tensor = tf.constant(x), tf.constant(y)
    first_example = start_step * global_batch_size
    first_pass, offset = divmod(first_example, num_examples)

    def pass_order(pass_index):
        noise = tf.random.stateless_uniform(
            [num_examples], seed=tf.stack([tf.constant(seed, tf.int64), pass_index])
        )
        return tf.data.Dataset.from_tensor_slices(tf.argsort(noise))

    indices = tf.data.Dataset.counter(start=first_pass).flat_map(pass_order).skip(offset)
    return indices.batch(global_batch_size, drop_remainder=True).map(
        lambda batch: (tf.gather(x_tensor, batch), tf.gather(y_tensor, batch)),
        num_parallel_calls=tf.data.AUTOTUNE,
    )


def stream_training_batches(
    examples: tf.data.Dataset,
    num_examples: int,
    global_batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
) -> tf.data.Dataset:
    """Endless (x, y) batches of streamed examples; each pass is shuffled with its own seed.

    Pass p is shuffled (in a buffer of up to 10,000 examples) with a seed made of `seed`
    and p alone, not by a shuffle that reshuffles on each new iterator: so the batches do
    not depend on how many iterators were made before (upstream Keras draws a batch
    through a throwaway one under a tf.distribute strategy) nor on TensorFlow's global
    seed, and two runs, two processes or a resumed run see the same batches. Passes run
    into each other, as in `array_training_stream`.

    Args:
        examples: unbatched (x, y) examples, the same ones in the same order on each pass.
        num_examples: how many `examples` gives per pass.
        global_batch_size: rows per batch.
        seed: chooses the shuffles.
        start_step: batches to skip, e.g. those trained before a restart.
    """
    first_pass, offset = divmod(start_step * global_batch_size, num_examples)
    buffer_size = min(num_examples, _RECORD_SHUFFLE_BUFFER)

    def pass_order(pass_index):
        # Shuffle seeds pair the graph's seed with the op's. Fixing this function's graph
        # seed keeps TensorFlow's global seed out of the order, and a graph seed of 0
        # would make TensorFlow test the (tensor) op seed as a Python bool.
        tf.compat.v1.set_random_seed(_PASS_GRAPH_SEED)
        pass_seed = tf.constant(seed, tf.int64) * _PASS_SEED_STRIDE + pass_index
        return examples.shuffle(buffer_size, seed=pass_seed, reshuffle_each_iteration=False)

    passes = tf.data.Dataset.counter(start=first_pass).flat_map(pass_order)
    return passes.skip(offset).batch(global_batch_size, drop_remainder=True)


def _check_batch_size(global_batch_size: int, info: DataInfo) -> None:
    if global_batch_size < 1:
        raise ValueError(
            f"global_batch_size must be >= 1. Received: global_batch_size={global_batch_size}"
        )
    smallest = min(info.num_train_examples, info.num_validation_examples)
    if global_batch_size > smallest:
        raise ValueError(
            f"The global batch is larger than a split of dataset {info.name!r} "
            f"({info.num_train_examples} train, {info.num_validation_examples} validation "
            f"examples); use a batch of at most {smallest} or more data. "
            f"Received: global_batch_size={global_batch_size}"
        )
