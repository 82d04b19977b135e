"""Measuring a reference model's block costs on this machine (imports TensorFlow).

Each block is timed (forward, backward) with `measure_blocks` on real batches of the
dataset at two batch sizes, and the times are fitted as fixed + per-example parts. Each
block's functions are traced once per size and timed `rounds` times; blocks that cost the
same (a Transformer's layers) are timed once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tfmulti.data import dataset_task, load_source
from tfmulti.models import registry
from tfmulti.pipeline.stages.block_partition import measure_blocks
from tfmulti.planner.costs import AffineTime, BlockCost, ModelCosts

# Output all-reduces per pass of a block split Megatron-style: one after attention, one
# after the MLP.
_TENSOR_ALLREDUCES = {"TransformerBlock": 2}


def measure_model_costs(
    model: str,
    dataset: str,
    model_options: dict | None = None,
    data_path: str | None = None,
    batch_sizes: Sequence[int] = (8, 64),
    seed: int = 0,
    rounds: int = 3,
) -> ModelCosts:
    """Times every block of reference model `model` on `dataset` at each of `batch_sizes`.

    Args:
        model: a name in `tfmulti.models.registry.MODEL_NAMES`.
        dataset: a dataset name (`tfmulti.data.DATASET_NAMES`) the model trains on.
        model_options: the model's options, as `--model_option` gives them.
        data_path: the file(s) of an "npz" or "tfrecord" dataset.
        batch_sizes: two (or more) batch sizes, smallest first; times are fitted through
            the first and last.
        seed: weights and data.
        rounds: times each block is measured at each size; the fastest counts, since
            other processes on the machine only ever slow a block down.

    Returns:
        The `ModelCosts`, ready for `search_layouts` or `save_costs`.

    Example:
        >>> costs = measure_model_costs("transformer", "tokens", {"num_layers": 2})
    """
    model_options = dict(model_options or {})
    batch_sizes = sorted(set(batch_sizes))
    if batch_sizes[0] < 1:
        raise ValueError(f"Batch sizes must be >= 1. Received: batch_sizes={batch_sizes}")
    registry.check_model_accepts(model, dataset_task(dataset))
    source = load_source(dataset, data_path=data_path, seed=seed)
    info = source.info
    registry.check_model_accepts(model, info.task, info.input_shape)
    if len(source.x_train) < batch_sizes[-1]:
        raise ValueError(
            f"Dataset {dataset!r} has {len(source.x_train)} training examples, fewer than "
            f"the batch to measure. Received: batch_sizes={batch_sizes}"
        )
    blocks = registry.build_blocks(model, info.input_shape, info.num_classes, seed, **model_options)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1. Received: rounds={rounds}")
    # measured[size][block]
    measured = [
        measure_blocks(blocks, source.x_train[:size], rounds=rounds) for size in batch_sizes
    ]
    costs = []
    for index, block in enumerate(blocks):
        forward = [per_size[index].forward_time for per_size in measured]
        backward = [per_size[index].backward_time for per_size in measured]
        largest = measured[-1][index]
        costs.append(
            BlockCost(
                name=block.name,
                params=largest.params,
                forward_seconds=AffineTime.fit(batch_sizes, forward),
                backward_seconds=AffineTime.fit(batch_sizes, backward),
                activation_bytes_per_example=largest.activation_bytes / batch_sizes[-1],
                tensor_allreduces=_TENSOR_ALLREDUCES.get(type(block).__name__, 0),
                tensor_replicated_bytes=_tensor_replicated_bytes(block),
            )
        )
    return ModelCosts(
        model=model,
        model_options=model_options,
        dataset=dataset,
        data_path=data_path,
        blocks=tuple(costs),
        tensor_parallel_sizes=_tensor_parallel_sizes(model, blocks),
        measured_batch_sizes=tuple(batch_sizes),
    )


def _tensor_replicated_bytes(block) -> float:
    """Bytes of the weights every device of the block's tensor group would read, if it splits."""
    if type(block).__name__ not in _TENSOR_ALLREDUCES:
        return 0.0
    return float(block.replicated_weight_bytes())


def _tensor_parallel_sizes(model: str, blocks) -> tuple[int, ...]:
    """Group sizes that split every splittable block's heads evenly, if the model can split."""
    if "tensor_parallel" not in registry.model_options(model):
        return (1,)
    heads = [
        block.get_config()["num_heads"]
        for block in blocks
        if type(block).__name__ in _TENSOR_ALLREDUCES
    ]
    common = math.gcd(*heads) if heads else 1
    return tuple(size for size in range(1, common + 1) if common % size == 0)
