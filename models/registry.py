"""The reference models by name: what data each takes, and building blocks or a model."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

import keras

from tfmulti.models import convnet, mlp, resnet, transformer
from tfmulti.models.blocks import chain_blocks
from tfmulti.parallel import TensorParallelModel, has_tensor_parallel_layers
from tfmulti.user_code import is_function_reference

CLASSIFICATION = "classification"
LANGUAGE_MODEL = "language_model"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a reference model needs and how it is built.

    Args:
        name: the model's name, e.g. "resnet".
        task: the data it trains on: "classification" or "language_model".
        input_dtype: dtype of its input: "float32" features or "int32" tokens.
        input_rank: rank of one example it takes (3 for images), None for any.
        build_blocks: the module's `build_blocks(input_shape, num_outputs, seed, **options)`.
    """

    name: str
    task: str
    input_dtype: str
    input_rank: int | None
    build_blocks: Callable[..., list[keras.layers.Layer]]


MODEL_SPECS = {
    "mlp": ModelSpec("mlp", CLASSIFICATION, "float32", None, mlp.build_blocks),
    "convnet": ModelSpec("convnet", CLASSIFICATION, "float32", 3, convnet.build_blocks),
    "resnet": ModelSpec("resnet", CLASSIFICATION, "float32", 3, resnet.build_blocks),
    "transformer": ModelSpec("transformer", LANGUAGE_MODEL, "int32", 1, transformer.build_blocks),
}
MODEL_NAMES = tuple(MODEL_SPECS)


def model_spec(name: str) -> ModelSpec:
    """Returns the ModelSpec of a model in MODEL_NAMES, or raises ValueError."""
    if name not in MODEL_SPECS:
        raise ValueError(f"Unknown model; use one of {list(MODEL_NAMES)}. Received: {name!r}")
    return MODEL_SPECS[name]


def model_options(name: str) -> tuple[str, ...]:
    """Returns the names of the options `build_blocks(name, ...)` accepts.

    Example:
        >>> "d_model" in model_options("transformer")
        True
    """
    parameters = inspect.signature(model_spec(name).build_blocks).parameters
    return tuple(parameters)[3:]


def check_model_accepts(
    name: str, task: str | None, input_shape: Sequence[int] | None = None
) -> None:
    """Raises a one-line ValueError when model `name` cannot train on the data described.

    A user's model (`package.module:function`) is not checked here: it meets its data
    when Keras first calls it.

    Args:
        name: a model in MODEL_NAMES, or package.module:function.
        task: the data's task, "classification" or "language_model"; None skips the check
            (e.g. an npz file not yet read).
        input_shape: shape of one example; None skips the shape check.

    Example:
        >>> check_model_accepts("transformer", "classification")
        Traceback (most recent call last):
        ValueError: Model 'transformer' trains on language_model data ...
    """
    if is_function_reference(name):
        return
    spec = model_spec(name)
    if task is not None and task != spec.task:
        suitable = [other for other, other_spec in MODEL_SPECS.items() if other_spec.task == task]
        raise ValueError(
            f"Model {name!r} trains on {spec.task} data, not {task} data; use a "
            f"{spec.task} dataset, or one of the models {suitable}. "
            f"Received: model={name!r}, task={task!r}"
        )
    if input_shape is not None and spec.input_rank is not None:
        if len(input_shape) != spec.input_rank:
            raise ValueError(
                f"Model {name!r} takes examples of rank {spec.input_rank}"
                f"{' (height, width, channels)' if spec.input_rank == 3 else ''}; "
                f"use data of that shape or the 'mlp' model. "
                f"Received: model={name!r}, input_shape={tuple(input_shape)}"
            )


def build_blocks(
    name: str, input_shape: Sequence[int], num_outputs: int, seed: int = 0, **options
) -> list[keras.layers.Layer]:
    """Builds a reference model as an ordered list of blocks (unbuilt Keras layers).

    Block 0 takes the model input and each later block takes the previous
    block's output; each block holds its own skip connections, so any cut
    between blocks is a valid pipeline-stage boundary. Weights come from
    explicitly seeded initializers: the same `seed` gives the same weights,
    whatever TensorFlow's global seed.

    Args:
        name: a model in MODEL_NAMES.
        input_shape: shape of one example, e.g. DataInfo.input_shape.
        num_outputs: classes, or vocabulary size for the transformer.
        seed: seeds every weight.
        **options: sizes of the model; see `model_options(name)`.

    Example:
        >>> blocks = build_blocks("transformer", (32,), 64, seed=0, num_layers=2)
        >>> len(blocks)
        4
    """
    spec = model_spec(name)
    unknown = sorted(set(options) - set(model_options(name)))
    if unknown:
        raise ValueError(
            f"Model {name!r} has no option {unknown}; its options are "
            f"{list(model_options(name))}. Received: {options}"
        )
    _check_option_types(name, options)
    check_model_accepts(name, None, input_shape)
    return spec.build_blocks(tuple(input_shape), num_outputs, seed, **options)


# The kinds of value an option takes, by its default's type: a test of a given value,
# what to say it takes, and an example. A default of another type is not checked.
_KINDS = {
    bool: (lambda value: isinstance(value, bool), "True or False", "True"),
    int: (
        lambda value: isinstance(value, int) and not isinstance(value, bool),
        "an integer",
        "4",
    ),
    float: (
        lambda value: isinstance(value, int | float) and not isinstance(value, bool),
        "a number",
        "0.1",
    ),
    tuple: (lambda value: isinstance(value, tuple | list), "a tuple of sizes", "'(64, 64)'"),
    str: (lambda value: isinstance(value, str), "a name", "relu"),
}


def _check_option_types(name: str, options: dict) -> None:
    """Raises a one-line ValueError for an option whose value is not of its default's kind
    (an int where a tuple of sizes goes, a float where a count goes)."""
    parameters = inspect.signature(model_spec(name).build_blocks).parameters
    for option, value in options.items():
        default = parameters[option].default
        kind = tuple if isinstance(default, list) else type(default)
        if kind in _KINDS and not _KINDS[kind][0](value):
            _, wanted, example = _KINDS[kind]
            raise ValueError(
                f"Model {name!r} option {option!r} takes {wanted}, e.g. "
                f"--model_option={option}={example}. Received: {option}={value!r}"
            )


def build_model(
    name: str, input_shape: Sequence[int], num_outputs: int, seed: int = 0, **options
) -> keras.Model:
    """Builds a reference model as one functional keras.Model over its blocks.

    The model's layers after the input are `build_blocks(...)` in order, with
    the same weights. Outputs are logits (train with `from_logits=True`), in
    float32 even under a mixed precision policy. With `tensor_parallel=K` > 1 it is a
    `TensorParallelModel`, whose `save` writes the unsplit model.

    Args:
        name, input_shape, num_outputs, seed, **options: as for `build_blocks`.

    Example:
        >>> model = build_model("mlp", (8, 8, 1), 10, seed=0)
        >>> model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """
    blocks = build_blocks(name, input_shape, num_outputs, seed, **options)
    model = chain_blocks(blocks, input_shape, input_dtype=model_spec(name).input_dtype, name=name)
    # Built from split layers, it saves as the same model unsplit, for one device.
    return TensorParallelModel(model) if has_tensor_parallel_layers(model) else model
