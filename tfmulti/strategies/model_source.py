"""What a run trains: a reference model by name, or the model a user's function returns."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import keras

from tfmulti.compat import keras_internals
from tfmulti.config import TrainConfig
from tfmulti.data import DataInfo
from tfmulti.models import registry
from tfmulti.user_code import is_function_reference, load_function


def default_loss_and_metrics() -> tuple[keras.losses.Loss, list[keras.metrics.Metric]]:
    """The reference models' loss and metric: logits against integer labels."""
    return (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


class ModelSource:
    """Builds the run's model on demand, once, where the way of spreading it asks.

    Args:
        name: the `--model` value, named in errors.
        build_model: returns a new keras.Model.
        build_blocks: reference models only: returns the model as a fresh list of blocks,
            with the same weights every call.
        build_split_model: reference models only: returns the model with its layers split
            over K devices, given K.
        build_split_blocks: reference models with split layers only: returns the block list
            with its layers split over the given devices.

    Example:
        >>> source = model_source(config, info)
        >>> with strategy.scope():
        ...     model = source.model()
    """

    def __init__(
        self,
        name: str,
        build_model: Callable[[], keras.Model],
        build_blocks: Callable[[], list[keras.layers.Layer]] | None = None,
        build_split_model: Callable[[int], keras.Model] | None = None,
        build_split_blocks: Callable[[list[str]], list[keras.layers.Layer]] | None = None,
    ):
        self.name = name
        self._build_model = build_model
        self._build_blocks = build_blocks
        self._build_split_model = build_split_model
        self.build_split_blocks = build_split_blocks
        self._model = None

    @property
    def is_reference(self) -> bool:
        """Whether the model is one of tfmulti's reference models (it has a block list)."""
        return self._build_blocks is not None

    def model(self) -> keras.Model:
        """The model, built on the first call (so inside whatever scope the caller opened)."""
        if self._model is None:
            self._model = self._build_model()
        return self._model

    def blocks(self) -> list[keras.layers.Layer]:
        """A fresh block list of a reference model; same weights on every call."""
        return self._build_blocks()

    def split_model(self, num_shards: int) -> keras.Model:
        """A reference model with its layers split over `num_shards` devices."""
        return self._build_split_model(num_shards)

    def loss_and_metrics(self) -> tuple[object, object]:
        """The loss and metrics to compile with.

        A model the user's function compiled keeps its own loss and metrics; any other
        model trains logits against integer labels.
        """
        model = self._model
        if model is None or not getattr(model, "compiled", False) or model.loss is None:
            return default_loss_and_metrics()
        compile_config = model.get_compile_config()
        return (
            keras.saving.deserialize_keras_object(compile_config["loss"]),
            keras.saving.deserialize_keras_object(compile_config["metrics"]),
        )

    def compiled_optimizer(self) -> keras.optimizers.Optimizer | None:
        """A new copy of the optimizer the user's function compiled the model with, or None.

        The copy is made from the optimizer's config, its learning-rate schedule included,
        so it is bound to no variables: ways of spreading that copy or rebuild the model
        train the copy's variables with it.

        Raises:
            ValueError: the optimizer cannot be re-created from its config (a custom class
                that Keras cannot deserialize); one line.
        """
        model = self._model
        if model is None or not getattr(model, "compiled", False):
            return None
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            return None
        return _copy_optimizer(self.name, optimizer)


def model_source(config: TrainConfig, info: DataInfo) -> ModelSource:
    """The `ModelSource` of `config.model.name` for data described by `info`.

    A `package.module:function` model calls `function(**config.model.options)`;
    a reference name builds from `tfmulti.models.registry` with `config.run.seed`.
    """
    if is_function_reference(config.model.name):
        return _user_source(config.model.name, config.model.options, info.num_classes)

    def build(**extra) -> keras.Model:
        return registry.build_model(
            config.model.name,
            info.input_shape,
            info.num_classes,
            config.run.seed,
            **config.model.options,
            **extra,
        )

    def blocks(**extra) -> list[keras.layers.Layer]:
        return registry.build_blocks(
            config.model.name,
            info.input_shape,
            info.num_classes,
            config.run.seed,
            **config.model.options,
            **extra,
        )

    def split_blocks(devices: list[str]) -> list[keras.layers.Layer]:
        return blocks(tensor_parallel=len(devices), tensor_parallel_devices=list(devices))

    splittable = "tensor_parallel" in registry.model_options(config.model.name)
    return ModelSource(
        config.model.name,
        build,
        build_blocks=blocks,
        build_split_model=lambda num_shards: build(tensor_parallel=num_shards),
        build_split_blocks=split_blocks if splittable else None,
    )


def _user_source(reference: str, options: dict, num_classes: int) -> ModelSource:
    function = load_function(reference, "--model")
    try:
        inspect.signature(function).bind(**options)
    except TypeError as error:
        raise ValueError(
            f"--model={reference} does not take the options given ({error}). "
            f"Received: --model_option {options}"
        ) from None
    except ValueError:
        pass  # A builtin without a signature: let the call decide.

    def build() -> keras.Model:
        model = function(**options)
        if not isinstance(model, keras.Model):
            raise ValueError(
                f"--model={reference} must return a keras.Model. Received: {type(model).__name__}"
            )
        _check_scores_cover_labels(reference, model, num_classes)
        return model

    return ModelSource(reference, build)


def _check_scores_cover_labels(reference: str, model: keras.Model, num_classes: int) -> None:
    """Raises a one-line ValueError when a functional model gives fewer scores (last axis
    of its output) than the data has labels (classes, or tokens of a vocabulary)."""
    outputs = getattr(model, "outputs", None)
    if not outputs or len(outputs) != 1:
        return  # a subclassed or multi-output model meets its data in fit
    scores = outputs[0].shape[-1]
    if scores is not None and scores < num_classes:
        raise ValueError(
            f"--model={reference} gives {scores} scores per example, but the data's labels "
            f"go up to {num_classes - 1} ({num_classes} classes); end the model in "
            f"{num_classes} outputs, or check --dataset's labels."
        )


def _copy_optimizer(reference: str, optimizer: keras.optimizers.Optimizer):
    """`optimizer` re-created from its config; its own classes are passed to Keras so that a
    user's optimizer or schedule need not be registered to be copied."""
    optimizers = [optimizer, getattr(optimizer, "inner_optimizer", optimizer)]
    settings = [keras_internals.learning_rate_setting(part) for part in optimizers]
    schedules = [
        setting
        for setting in settings
        if isinstance(setting, keras.optimizers.schedules.LearningRateSchedule)
    ]
    custom_objects = {type(part).__name__: type(part) for part in optimizers + schedules}
    try:
        copy = keras.optimizers.deserialize(
            keras.optimizers.serialize(optimizer), custom_objects=custom_objects
        )
    except Exception as error:  # noqa: BLE001 - any failure means the config cannot rebuild it
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(
            f"--model={reference} compiled its model with {type(optimizer).__name__}, which "
            f"tfmulti cannot re-create from its config ({type(error).__name__}: {reason}); give "
            "it get_config/from_config, or choose one with --optimizer and --learning_rate."
        ) from None
    copy_parts = [copy, getattr(copy, "inner_optimizer", copy)]
    for part, copied in zip(optimizers, copy_parts, strict=True):
        keras_internals.copy_weight_decay_exclusions(part, copied)
    return copy
