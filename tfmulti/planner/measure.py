"""Measuring a model's block costs on this machine (imports TensorFlow).

A reference model's blocks are timed (forward, backward) with `measure_blocks` on real
batches of the dataset at two batch sizes, and the times are fitted as fixed +
per-example parts. Each block's functions are traced once per size and timed `rounds`
times; blocks that cost the same (a Transformer's layers) are timed once.

A user's functional model (`--model=package.module:function`) is costed call by call,
the calls `PipelineModel.from_model` cuts between (`call_blocks` over its call graph,
nested models opened), timed the same way at the same two batch sizes.

A block timed on its own pays a function call and a copy of its outputs that it does not
pay inside a training step, where every block runs in one graph. So the whole model's
one-device training step is measured too, at the same two batch sizes, and the blocks'
fixed and per-example parts are scaled so that they add up to it (less the step's
framework cost, `MachineCosts.step_seconds`): the blocks keep their shares, which choose
the stage splits, and add up to what a step really computes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tfmulti.data import dataset_task, first_training_examples, load_source
from tfmulti.models import registry
from tfmulti.pipeline.stages.block_partition import measure_blocks
from tfmulti.planner.costs import AffineTime, BlockCost, ModelCosts
from tfmulti.planner.machine import MachineCosts
from tfmulti.user_code import is_function_reference, load_function

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
    machine: MachineCosts | None = None,
    devices: Sequence[str] = (),
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
        machine: the machine's measured framework costs; when given, the blocks are
            scaled to add up to the model's measured one-device step less the
            framework's cost of that step (`MachineCosts.step_seconds`).
        devices: with `machine` and two or more devices, the model's own serial fraction
            is measured over them (`ModelCosts.serial_fractions`).

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
    x_train, y_train = first_training_examples(source, batch_sizes[-1])
    if len(x_train) < batch_sizes[-1]:
        raise ValueError(
            f"Dataset {dataset!r} has {len(x_train)} training examples, fewer than "
            f"the batch to measure. Received: batch_sizes={batch_sizes}"
        )
    blocks = registry.build_blocks(model, info.input_shape, info.num_classes, seed, **model_options)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1. Received: rounds={rounds}")
    # measured[size][block]
    measured = [measure_blocks(blocks, x_train[:size], rounds=rounds) for size in batch_sizes]
    variables = _built_variable_counts(blocks, x_train[:1])
    shares = _blocks_split_shares(blocks, [x_train[:size] for size in batch_sizes])
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
                variables=variables[index],
                input_grad_share=shares[index][0],
                weight_grad_share=shares[index][1],
            )
        )
    serial_fractions = ()
    if machine is not None:

        def build():
            return registry.build_model(
                model, info.input_shape, info.num_classes, seed, **model_options
            )

        step = _one_device_step(build, x_train, y_train, batch_sizes)
        costs = scaled_to_step(costs, step, machine.step_seconds(sum(variables)))
        serial_fractions = _model_serial_fractions(
            build, x_train, y_train, batch_sizes[-1], devices
        )
    return ModelCosts(
        model=model,
        model_options=model_options,
        dataset=dataset,
        data_path=data_path,
        blocks=tuple(costs),
        tensor_parallel_sizes=_tensor_parallel_sizes(model, blocks),
        measured_batch_sizes=tuple(batch_sizes),
        serial_fraction=serial_fractions[-1] if serial_fractions else None,
        serial_fractions=serial_fractions,
    )


def _blocks_split_shares(blocks, samples) -> list[tuple[float, float]]:
    """Each block's split-backward shares (I / B, W / B), averaged over `samples` (one
    first-block input per measured batch size), on copies of the blocks."""
    import tensorflow as tf

    from tfmulti.costing.cost_cache import block_signature
    from tfmulti.pipeline.stages.block_partition import fresh_copy
    from tfmulti.planner.split_backward import SplitShares

    measured = SplitShares()
    per_sample = []
    for sample in samples:
        inputs = tf.nest.map_structure(tf.convert_to_tensor, sample)
        row = []
        for block in blocks:
            copy = fresh_copy(block)
            outputs = copy(inputs, training=True)
            row.append(measured.of(copy, inputs, block_signature(copy, inputs)))
            inputs = outputs
        per_sample.append(row)
    return mean_shares(per_sample)


def mean_shares(per_sample) -> list[tuple[float, float]]:
    """Per block, the mean of its (input, weight) shares over the samples' rows.

    Example:
        >>> mean_shares([[(0.5, 0.25)], [(1.0, 0.75)]])
        [(0.75, 0.5)]
    """
    return [
        tuple(sum(shares[part] for shares in column) / len(column) for part in (0, 1))
        for column in zip(*per_sample, strict=True)
    ]


def _built_variable_counts(blocks, sample_input) -> list[int]:
    """Trainable variables of each block, built by running `sample_input` through them."""
    outputs = sample_input
    for block in blocks:
        outputs = block(outputs)
    return [len(block.trainable_variables) for block in blocks]


def _compiled(build):
    """`build()`, compiled as train.py trains a model its function did not compile."""
    import keras

    model = build()
    if not getattr(model, "compiled", False) or model.loss is None:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer="adam", loss=loss)
    return model


def _one_device_step(build, x, y, batch_sizes) -> AffineTime:
    """The model's one-device training step (median of steps, the sizes' steps
    interleaved), fitted over batch size."""
    import keras

    from tfmulti.planner.machine_benchmarks import interleaved_step_seconds

    keras.utils.set_random_seed(0)
    runs = [(lambda: _compiled(build), x[:size], y[:size]) for size in batch_sizes]
    return AffineTime.fit(batch_sizes, interleaved_step_seconds(runs, []))


def _model_serial_fractions(build, x, y, batch: int, devices: Sequence[str]) -> tuple[float, ...]:
    """The model's serial fractions on 1..n of `devices` at once (none for fewer than
    two), each device running its share of `batch` (the global batch spread over the
    devices)."""
    from tfmulti.planner.machine_benchmarks import model_serial_fractions

    if len(devices) < 2:
        return ()
    rows = max(1, batch // len(devices))
    fractions = model_serial_fractions(
        lambda: _compiled(build), x[:rows], y[:rows], list(devices), []
    )
    return tuple(float(fraction) for fraction in fractions)


def anchored_to_steps(
    costs: ModelCosts, seconds: Sequence[float], step_framework: float
) -> ModelCosts:
    """`costs` anchored on the one-device steps `seconds`, one per measured batch size
    (`validation.anchor_steps`: scripts/train.py's), given the framework's cost of a
    step.

    The blocks take the steps' cost per example, which the measuring process times
    unsteadily. What the steps' fixed part exceeds the blocks' (with the framework's) by
    is the script's own cost per step (its input pipeline and loop), paid once a step
    whatever the layout: `run_overhead`. When the steps' fixed part is below the
    blocks', the blocks, timed one by one, paid per call what a whole step does not:
    their fixed parts shrink to it, each keeping its share. The one-device prediction
    then matches `seconds`, unless their fixed part is below even the framework's (the
    blocks then keep none).

    Example:
        >>> block = BlockCost("b", 1, AffineTime(2.0, 1.0), AffineTime(2.0, 1.0), 4.0)
        >>> costs = ModelCosts("mlp", {}, "digits", None, (block,), measured_batch_sizes=(1, 3))
        >>> anchored = anchored_to_steps(costs, [8.0, 9.0], 1.0)
        >>> anchored.blocks[0].forward_seconds, anchored.run_overhead
        (AffineTime(fixed=2.0, per_example=0.25), 2.5)
    """
    sizes = costs.measured_batch_sizes
    if len(seconds) != len(sizes) or len(sizes) < 2:
        raise ValueError(
            "Need one step per measured batch size, at least two. Received: "
            f"measured_batch_sizes={list(sizes)}, seconds={list(seconds)}"
        )
    blocks = costs.blocks
    fixed = step_framework + sum(b.forward_seconds.fixed + b.backward_seconds.fixed for b in blocks)
    anchor = AffineTime.fit(sizes, seconds)
    step = AffineTime(min(fixed, anchor.fixed), anchor.per_example)
    return dataclasses.replace(
        costs,
        blocks=tuple(scaled_to_step(blocks, step, step_framework)),
        anchor_steps=tuple(map(float, seconds)),
        run_overhead=max(anchor.fixed - fixed, 0.0),
    )


def scaled_to_step(
    blocks: Sequence[BlockCost], step: AffineTime, step_framework: float
) -> list[BlockCost]:
    """`blocks` with fixed and per-example parts scaled to add up to `step` less `step_framework`.

    A part the blocks measured as 0 throughout (a small model's cost per example can fit
    to 0) is spread over them like the other part, else evenly.

    Example:
        >>> block = BlockCost("b", 1, AffineTime(2.0, 1.0), AffineTime(2.0, 1.0), 4.0)
        >>> scaled_to_step([block], AffineTime(3.0, 1.0), 1.0)[0].forward_seconds
        AffineTime(fixed=1.0, per_example=0.5)
    """
    passes = [(b.forward_seconds, b.backward_seconds) for b in blocks]
    times = [time for pair in passes for time in pair]
    fixed = _spread(
        max(step.fixed - step_framework, 0.0),
        [t.fixed for t in times],
        [t.per_example for t in times],
    )
    per_example = _spread(
        step.per_example, [t.per_example for t in times], [t.fixed for t in times]
    )
    scaled = [AffineTime(f, p) for f, p in zip(fixed, per_example, strict=True)]
    return [
        dataclasses.replace(block, forward_seconds=forward, backward_seconds=backward)
        for block, forward, backward in zip(blocks, scaled[::2], scaled[1::2], strict=True)
    ]


def _spread(total: float, weights: list[float], fallback: list[float]) -> list[float]:
    """`total` split in proportion to `weights`, else (all 0) to `fallback`, else evenly."""
    for shares in (weights, fallback, [1.0] * len(weights)):
        if sum(shares) > 0:
            return [total * share / sum(shares) for share in shares]
    return []


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


def measure_user_model_costs(
    model: str,
    dataset: str,
    model_options: dict | None = None,
    data_path: str | None = None,
    batch_sizes: Sequence[int] = (8, 64),
    seed: int = 0,
    machine: MachineCosts | None = None,
    devices: Sequence[str] = (),
) -> ModelCosts:
    """Times every call of the functional model `model()` returns, as `from_model` cuts it.

    Args:
        model: `package.module:function` returning a functional or Sequential model.
        dataset: a dataset name or `package.module:function`, in any form train.py takes.
        model_options: keyword arguments of the function (`--model_option`).
        data_path: the file(s) of an "npz" or "tfrecord" dataset.
        batch_sizes: two batch sizes, smallest first; times are fitted through both.
        seed: data.
        machine, devices: as for `measure_model_costs`.

    Returns:
        `ModelCosts` with one block per call, named by the call (what
        `--partition=layers:NAME,...` takes); no tensor axis (no split layers).

    Example:
        >>> costs = measure_user_model_costs("my_models:small_cnn", "my_models:arrays")
    """
    from tfmulti.costing.model_graph import call_graph, functional_view
    from tfmulti.pipeline.stages.graph_partition import call_blocks, measure_calls
    from tfmulti.planner.split_backward import SplitShares

    if not is_function_reference(model):
        raise ValueError(f"model must be package.module:function. Received: model={model!r}")
    model_options = dict(model_options or {})
    batch_sizes = sorted(set(batch_sizes))
    source = load_source(dataset, data_path=data_path, seed=seed)
    examples, labels = first_training_examples(source, batch_sizes[-1])
    if len(examples) < batch_sizes[-1]:
        raise ValueError(
            f"The planner times a user's model on at least {batch_sizes[-1]} training "
            f"examples; --dataset={dataset} gives {len(examples)}. Give more or lower "
            "--global_batch."
        )
    function = load_function(model, "--model")
    view = functional_view(function(**model_options))
    graph = call_graph(view, open_nested=True)
    measured = [call_blocks(view, graph, examples[:size]) for size in batch_sizes]
    shares = mean_shares(
        [measure_calls(view, graph, examples[:size], SplitShares().of) for size in batch_sizes]
    )
    seen, costs = set(), []
    for index, node in enumerate(graph.nodes):
        first_call = id(node.operation) not in seen
        seen.add(id(node.operation))
        costs.append(
            BlockCost(
                name=node.name,
                params=measured[-1][index].params,
                forward_seconds=AffineTime.fit(
                    batch_sizes, [per_size[index].forward_time for per_size in measured]
                ),
                backward_seconds=AffineTime.fit(
                    batch_sizes, [per_size[index].backward_time for per_size in measured]
                ),
                activation_bytes_per_example=measured[-1][index].activation_bytes / batch_sizes[-1],
                variables=len(getattr(node.operation, "trainable_variables", ()))
                if first_call
                else 0,
                input_grad_share=shares[index][0],
                weight_grad_share=shares[index][1],
            )
        )
    serial_fractions = ()
    if machine is not None:

        def build():
            return function(**model_options)

        step = _one_device_step(build, examples, labels, batch_sizes)
        costs = scaled_to_step(
            costs, step, machine.step_seconds(sum(block.variables for block in costs))
        )
        serial_fractions = _model_serial_fractions(
            build, examples, labels, batch_sizes[-1], devices
        )
    return ModelCosts(
        model=model,
        model_options=model_options,
        dataset=dataset,
        data_path=data_path,
        blocks=tuple(costs),
        measured_batch_sizes=tuple(batch_sizes),
        serial_fraction=serial_fractions[-1] if serial_fractions else None,
        serial_fractions=serial_fractions,
    )
