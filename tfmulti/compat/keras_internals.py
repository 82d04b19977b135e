"""Every private Keras attribute tfmulti reads, each behind a named function.

Keras 3 has no public way to walk a model's nested layers, run a functional graph one
operation at a time, or reach the loss a trainer tracks; tfmulti needs each of these,
so each one is a small function here that says what it reaches and why. A function
whose private attribute is gone fails with one line naming the Keras version
(`MissingKerasInternal`); `tests/test_compat_internals.py` calls every function on a
small real model, so an upstream change shows up there first.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf
from keras.src.backend.common import masking
from keras.src.losses import loss as keras_loss
from keras.src.models import functional as keras_functional

from tfmulti.compat.fixes import keras_version
from tfmulti.compat.versions import FIRST_UNCHECKED_KERAS

# Checked on Keras 3.15.1 by tests/test_compat_internals.py; setup.py allows no newer Keras.
# Raise after running that test on a newer one.
FIRST_CHECKED_KERAS = (3, 10)


class MissingKerasInternal(RuntimeError):
    """A private Keras attribute tfmulti relies on is missing from the installed Keras."""


def _private(owner, name: str, what: str):
    """`owner.<name>`, or a `MissingKerasInternal` naming `what` and the installed Keras."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise MissingKerasInternal(
            f"tfmulti needs Keras' private {what} (`{name}`), which Keras {keras.version()} "
            f"lacks; tfmulti is checked on Keras {_release(FIRST_CHECKED_KERAS)} up to "
            f"{_release(FIRST_UNCHECKED_KERAS)} (exclusive). Received: keras=={keras.version()}"
        ) from None


def _release(version: tuple[int, ...]) -> str:
    return ".".join(str(number) for number in version)


def is_checked_keras() -> bool:
    """Whether the installed Keras is in the range these functions were checked on."""
    return FIRST_CHECKED_KERAS <= keras_version() < FIRST_UNCHECKED_KERAS


# Layers


def layers_within(layer: keras.layers.Layer, include_self: bool = True) -> list:
    """`layer` (unless `include_self` is False) and every layer nested in it, at any depth:
    Keras' own walk (`Layer._flatten_layers`), which has no public counterpart."""
    flatten = _private(layer, "_flatten_layers", "Layer._flatten_layers")
    return list(flatten(include_self=include_self, recursive=True))


def loss_ids(layer: keras.layers.Layer) -> set:
    """`id` of each loss `layer` added inside the current loss-collecting stateless scope
    (`Layer._loss_ids`), to find which nested layer added a loss."""
    return set(_private(layer, "_loss_ids", "Layer._loss_ids"))


def keras_mask(tensor):
    """The Keras mask a layer attached to `tensor`, or None (Keras keeps it on the tensor)."""
    return _private(masking, "get_keras_mask", "masking.get_keras_mask")(tensor)


def attach_keras_mask(tensor, mask) -> None:
    """Attaches `mask` to `tensor` as Keras layers do, so the next layer receives it."""
    _private(masking, "set_keras_mask", "masking.set_keras_mask")(tensor, mask)


# Variables


def variable_storage(variable):
    """The `tf.Variable` behind a Keras variable (`Variable._value`), else None: its public
    `value` goes through autocasting, so it cannot say where the storage lives."""
    storage = getattr(variable, "_value", None)
    return storage if isinstance(storage, tf.Variable) else None


def variable_device(variable) -> str:
    """The device that holds `variable`'s storage (a Keras or a TensorFlow variable).

    Not `variable.value.device`: under a mixed-precision policy, reading `value` inside a
    layer's call gives a float16 copy made on the current device, and a Keras variable's
    `handle` goes through the same autocast.
    """
    storage = variable_storage(variable)
    return storage.device if storage is not None else variable.device


def reinitialize_variable(variable: keras.Variable, value) -> None:
    """Re-creates the `tf.Variable` behind `variable` from `value` (`Variable._initialize`),
    under the caller's device scope; the Keras variable stays the same object."""
    _private(variable, "_initialize", "Variable._initialize")(value)


def initialize_deferred_on_device(variable: keras.Variable, device: str) -> None:
    """Makes a Keras variable whose creation Keras deferred (built inside a symbolic call)
    be created on `device` (`Variable._deferred_initialize`); a created one is left alone."""
    if getattr(variable, "_value", True) is not None:
        return
    initialize = _private(variable, "_deferred_initialize", "Variable._deferred_initialize")

    def initialize_on_device():
        with tf.device(device):
            initialize()

    variable._deferred_initialize = initialize_on_device


# Functional models


def is_functional(model) -> bool:
    """Whether `model` is a Keras functional model, subclasses included (Keras exports no
    `Functional` class to test against)."""
    return isinstance(model, _private(keras_functional, "Functional", "Functional"))


def is_plain_functional(model) -> bool:
    """Whether `model` was made by `keras.Model(inputs, outputs)` itself, not a subclass."""
    return type(model) is _private(keras_functional, "Functional", "Functional")


def graph_run_by(operation):
    """The functional model whose graph `operation` runs through Keras' own `call` (itself,
    or a Sequential's inner `_functional`), else None: such a call can be opened."""
    functional_class = _private(keras_functional, "Functional", "Functional")
    if isinstance(operation, keras.Sequential):
        inner = _private(operation, "_functional", "Sequential._functional")
        own_call = keras.Sequential.call
    else:
        inner, own_call = operation, functional_class.call
    if not isinstance(inner, functional_class) or type(operation).call is not own_call:
        return None
    return inner


def nodes_by_depth(model) -> dict:
    """A functional model's graph nodes by depth (`Functional._nodes_by_depth`); the
    deepest depth runs first."""
    return _private(model, "_nodes_by_depth", "Functional._nodes_by_depth")


def inputs_structure(model):
    """The structure a functional model's inputs were given in (`_inputs_struct`): a
    tensor, list or dict of `keras.Input`s."""
    return _private(model, "_inputs_struct", "Functional._inputs_struct")


def outputs_structure(model):
    """The structure a functional model returns its outputs in (`_outputs_struct`)."""
    return _private(model, "_outputs_struct", "Functional._outputs_struct")


def standardize_inputs(model, inputs) -> list:
    """`inputs` as the flat list a functional model's graph takes, matched by position or
    name as `model(inputs)` matches them (`Functional._standardize_inputs`)."""
    return _private(model, "_standardize_inputs", "Functional._standardize_inputs")(inputs)


def operation_call(operation, training=None) -> Callable:
    """A function that calls `operation` as a functional model does in its graph: with
    `training` passed to operations that take it (`functional.operation_fn`)."""
    make_call = _private(keras_functional, "operation_fn", "functional.operation_fn")
    return make_call(operation, training=training)


def unpack_singleton(value):
    """`value[0]` for a one-element list or tuple, else `value`: how a functional model
    returns a single output (`functional.unpack_singleton`)."""
    return _private(keras_functional, "unpack_singleton", "functional.unpack_singleton")(value)


def run_through_graph(model, inputs: list, operation_fn: Callable) -> object:
    """Runs a functional model's graph on flat `inputs`, calling each operation through
    `operation_fn(operation)` (`Function._run_through_graph`), and returns its outputs."""
    run = _private(model, "_run_through_graph", "Function._run_through_graph")
    return run(inputs, operation_fn=operation_fn)


class OperationWrappingFunctional:
    """Mixin for a functional `keras.Model` subclass that runs each operation of its graph
    through `wrap_operation`, e.g. under a device scope.

    Keras runs a functional graph in the private `Function._run_through_graph`, whose
    `operation_fn` argument is the only hook into each operation's call; this mixin
    overrides it so that no class outside `tfmulti/compat/` does.

    Example:
        >>> class OnDevices(OperationWrappingFunctional, keras.Model):
        ...     def wrap_operation(self, operation, function):
        ...         return function
    """

    def wrap_operation(self, operation, function: Callable) -> Callable:
        """The function to call in place of `function`, which calls `operation`."""
        return function

    def _run_through_graph(self, inputs, operation_fn=lambda op: op, call_fn=None):
        run = _private(super(), "_run_through_graph", "Function._run_through_graph")
        return run(inputs, lambda op: self.wrap_operation(op, operation_fn(op)), call_fn)


# Training


def compute_loss(model: keras.Model, x, y, y_pred, sample_weight=None, training=True):
    """`model`'s compiled loss on one batch, through `Trainer._compute_loss`, which calls a
    user's `compute_loss` override with or without its `training` argument."""
    compute = _private(model, "_compute_loss", "Trainer._compute_loss")
    return compute(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def track_loss(model: keras.Model, loss, sample_weight) -> None:
    """Adds a step's `loss` to the "loss" `fit` reports (`Trainer._loss_tracker`), unscaled
    for the distribution strategy as Keras' own `train_step` does."""
    tracker = _private(model, "_loss_tracker", "Trainer._loss_tracker")
    unscale = _private(
        keras_loss, "unscale_loss_for_distribution", "losses.loss.unscale_loss_for_distribution"
    )
    tracker.update_state(unscale(loss), sample_weight=sample_weight)


def copy_weight_decay_exclusions(
    source: keras.optimizers.Optimizer, target: keras.optimizers.Optimizer
) -> None:
    """Gives `target` what `source.exclude_from_weight_decay` excluded, which an optimizer's
    config leaves out (`BaseOptimizer._exclude_from_weight_decay` and `..._pattern`): the
    name patterns hold for any copy of the model; the variables listed, for those same
    variables only."""
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(source, name):
            value = getattr(source, name)
            setattr(target, name, set(value) if isinstance(value, set) else value)
    target._exclude_from_weight_decay_cache = {}


def learning_rate_setting(optimizer: keras.optimizers.Optimizer):
    """The learning rate `optimizer` was given (`Optimizer._learning_rate`): a number or a
    `LearningRateSchedule`, where the public `learning_rate` is its current value."""
    return _private(optimizer, "_learning_rate", "BaseOptimizer._learning_rate")


# Sharded state (ZeRO)


def release_storage(variables) -> None:
    """Drops the `tf.Variable` behind each Keras variable (`Variable._value`), freeing its
    memory; the variable is then read only through a stateless call's values."""
    for variable in variables:
        _private(variable, "_value", "Variable._value")
        variable._value = None


def share_storage(variable, source) -> None:
    """Makes Keras `variable` read and write the `tf.Variable` behind `source`
    (`Variable._value`), dropping its own (freed once nothing else refers to it)."""
    _private(variable, "_value", "Variable._value")
    variable._value = variable_storage(source)


def restore_storage(variables, values, device: str) -> None:
    """Re-creates the storage `release_storage` dropped, from `values`, on `device`."""
    with tf.init_scope(), tf.device(device):
        for variable, value in zip(variables, values, strict=True):
            variable._value = None
            reinitialize_variable(variable, value)


def epoch_dataset(iterator):
    """The tf.data dataset (or distributed dataset) a `fit` or `evaluate` epoch iterator
    reads, already made from any input Keras takes: `TFEpochIterator._distributed_dataset`."""
    return _private(iterator, "_distributed_dataset", "TFEpochIterator._distributed_dataset")


def symbolic_build(model: keras.Model, data_batch) -> None:
    """Builds what `model`'s first step would (layers, compiled metrics and loss, optimizer)
    from `data_batch`'s shapes, without a step: `Trainer._symbolic_build`."""
    _private(model, "_symbolic_build", "Trainer._symbolic_build")(data_batch=data_batch)


def build_compiled_metrics_and_loss(model: keras.Model, x, y, y_pred, sample_weight) -> None:
    """Builds `model`'s unbuilt compiled metrics and loss from KerasTensors like a batch and
    its outputs, as `Trainer._symbolic_build` does after its symbolic call of the model."""
    from keras.src import backend

    metrics = compiled_metrics(model)
    if metrics is not None and not metrics.built:
        backend.compute_output_spec(
            model.compute_metrics, x, y, y_pred, sample_weight=sample_weight
        )
    loss = _private(model, "_compile_loss", "Trainer._compile_loss")
    if loss is not None and not loss.built:
        compute_loss = _private(model, "_compute_loss", "Trainer._compute_loss")
        backend.compute_output_spec(
            compute_loss, x, y, y_pred, sample_weight=sample_weight, training=False
        )


def compiled_metrics(model: keras.Model):
    """The metrics `compile` was given (`Trainer._compile_metrics`), or None."""
    return _private(model, "_compile_metrics", "Trainer._compile_metrics")


def autocast_dtype() -> str | None:
    """The dtype float variables are cast to where this runs (inside a mixed-precision
    layer's call: its compute dtype), else None; `backend.get_autocast_scope`."""
    from keras.src.backend.common import variables as keras_variables

    scope = _private(keras_variables, "get_autocast_scope", "get_autocast_scope")()
    return None if scope is None else scope.dtype


def autocast_scope(dtype: str | None):
    """Casts float variables read inside to `dtype` (nothing when None), as a layer's call
    does under a mixed-precision policy; `backend.AutocastScope`."""
    import contextlib

    from keras.src.backend.common import variables as keras_variables

    if dtype is None:
        return contextlib.nullcontext()
    return _private(keras_variables, "AutocastScope", "AutocastScope")(dtype)


def own_trainable_variables(layer: keras.layers.Layer) -> list:
    """The trainable variables `layer` created itself, not its sublayers'
    (`Layer._trainable_variables`)."""
    return list(_private(layer, "_trainable_variables", "Layer._trainable_variables"))


def own_non_trainable_variables(layer: keras.layers.Layer) -> list:
    """The non-trainable variables `layer` created itself (`Layer._non_trainable_variables`)."""
    return list(_private(layer, "_non_trainable_variables", "Layer._non_trainable_variables"))


def sublayers(layer: keras.layers.Layer) -> list:
    """`layer`'s direct sublayers (`Layer._layers`)."""
    return list(_private(layer, "_layers", "Layer._layers"))


def call_takes_training(layer: keras.layers.Layer) -> bool:
    """Whether `layer.call` takes a `training` argument (`Layer._call_has_training_arg`)."""
    return bool(_private(layer, "_call_has_training_arg", "Layer._call_has_training_arg"))


def skip_gradient_all_reduce(optimizer: keras.optimizers.Optimizer) -> None:
    """Makes `optimizer` take its gradients as already summed over replicas.

    Outside a strategy, Keras' TensorFlow optimizer still passes every gradient through the
    default replica context's all-reduce (`TFOptimizer._all_reduce_sum_gradients`): an
    identity with no device, which TensorFlow places on the first device, so each
    gradient would travel there and back. For an optimizer (or a LossScaleOptimizer's
    inner one) whose caller has reduced the gradients itself.
    """
    for target in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if target is None:
            continue
        _private(target, "_all_reduce_sum_gradients", "TFOptimizer._all_reduce_sum_gradients")
        object.__setattr__(target, "_all_reduce_sum_gradients", lambda pairs: list(pairs))
