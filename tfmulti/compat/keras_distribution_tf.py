"""Where tfmulti hooks `keras.distribution` into Keras 3's TensorFlow backend.

Keras' TensorFlow backend leaves `keras.distribution` a stub: a model built under
`ModelParallel(...).scope()` keeps every weight whole on one device, and `DataParallel`
changes nothing. The JAX backend lays each variable out when it is created
(`Variable._initialize_layout`). Here the same happens one step later, after each layer's
`build`: `tfmulti.keras_distribution`, which registers its `ShardingHooks` here, splits
the variables its layout names.
Setting a `DataParallel` distribution (`set_distribution`, or its `scope()`) also sets a
`tf.distribute.MirroredStrategy` over the mesh's devices, which Keras' TensorFlow trainer
already knows how to train with.

A split weight's shards stand in the weight lists as one whole-shape view
(`keras_whole_weights`). Every touch of Keras internals lives in these two modules; the
patches apply to the Keras versions checked by tests/test_compat_keras_distribution.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import keras
import keras.distribution as public_distribution
import tensorflow as tf
from keras.src.backend.common import variables as common_variables
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import distribution_lib as tensorflow_distribution_lib
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.distribution import distribution_lib
from keras.src.layers.layer import Layer

from tfmulti.compat import keras_whole_weights
from tfmulti.compat.fixes import Fix, apply_each, keras_version
from tfmulti.compat.versions import FIRST_UNCHECKED_KERAS

# Checked on Keras 3.15.1 (tests/test_compat_keras_distribution.py); raise after checking.
FIRST_CHECKED_KERAS = (3, 10)


@dataclasses.dataclass(frozen=True)
class ShardingHooks:
    """What `tfmulti.keras_distribution` does where these patches open Keras up.

    Args:
        after_build: called with each layer just built under a distribution.
        after_distribution_set: called with the distribution just set (or None).
        after_deferred_variables: called once Keras gave deferred variables their values.
        wrap_step: `(model, step_function, attribute)` to the step function to use.
    """

    after_build: Callable
    after_distribution_set: Callable
    after_deferred_variables: Callable
    wrap_step: Callable


# Set by `tfmulti.keras_distribution` when it loads (it is above compat, so it calls in).
_HOOKS: list[ShardingHooks | None] = [None]


def register_sharding_hooks(hooks: ShardingHooks) -> None:
    """Makes the patches call `hooks` (the last registration wins)."""
    _HOOKS[0] = hooks


def _shard_after_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def _post_build(self):
        original(self)
        if distribution_lib.distribution() is not None and _HOOKS[0] is not None:
            _HOOKS[0].after_build(self)

    return _post_build


def _strategy_follows_distribution(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_distribution(value):
        original(value)
        if _HOOKS[0] is not None:
            _HOOKS[0].after_distribution_set(value)

    return set_distribution


def _then_shard_deferred_layers(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_all_variables():
        original()
        if _HOOKS[0] is not None:
            _HOOKS[0].after_deferred_variables()

    return initialize_all_variables


def variables_deferred() -> bool:
    """Whether variables created now only get values later (inside a symbolic call)."""
    return in_stateless_scope()


# Marks a variable whose optimizer state must live on the variable's own device.
_STATE_BESIDE = "_tfmulti_optimizer_state_beside"


def keep_optimizer_state_beside(variable) -> None:
    """Makes optimizers create `variable`'s slots (momentum, ...) on its device."""
    setattr(variable, _STATE_BESIDE, True)


def _slots_on_variable_device(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        if not getattr(reference_variable, _STATE_BESIDE, False) or tf.distribute.has_strategy():
            return original(self, reference_variable, *args, **kwargs)
        # Imported here: it imports Keras, whose import runs this module's `apply_patches`.
        from tfmulti.compat.keras_internals import variable_device

        # Optimizers build inside the first traced step; the variable is then lifted out of
        # the graph, and the colocation upstream asks for is lost with it.
        with tf.device(variable_device(reference_variable)):
            return original(self, reference_variable, *args, **kwargs)

    return add_variable_from_reference


def _keep_tensor_layout(tensor, layout):
    """Layouts of intermediate tensors are hints tfmulti does not act on: the tensor as is."""
    del layout
    return tensor


_SPLIT_BY_ROWS = "_tfmulti_split_by_mesh_rows"


def _steps_split_by_mesh_rows(attribute: str) -> Callable:
    """Lets the registered hooks wrap the step function Keras makes (`attribute`), so a
    model sharded over a mesh with several rows splits each batch over them."""

    def patch(original: Callable) -> Callable:
        @functools.wraps(original)
        def make_function(self, force=False):
            returned = original(self, force)
            function = getattr(self, attribute)
            hooks = _HOOKS[0]
            if function is None or getattr(function, _SPLIT_BY_ROWS, False) or hooks is None:
                return returned
            wrapped = hooks.wrap_step(self, function, attribute)
            if wrapped is function:
                return returned
            setattr(wrapped, _SPLIT_BY_ROWS, True)
            setattr(self, attribute, wrapped)
            return wrapped if returned is not None else None

        return make_function

    return patch


def _checked_patch(name: str, owner, attribute: str, make_replacement: Callable) -> Fix:
    return Fix(name, owner, attribute, make_replacement, FIRST_CHECKED_KERAS, FIRST_UNCHECKED_KERAS)


PATCHES = (
    _checked_patch("shard_layers_after_build", Layer, "_post_build", _shard_after_build),
    # `Distribution.scope()` calls the module's function; users call the public one.
    _checked_patch(
        "data_parallel_on_mirrored_strategy",
        distribution_lib,
        "set_distribution",
        _strategy_follows_distribution,
    ),
    _checked_patch(
        "public_set_distribution_follows_too",
        public_distribution,
        "set_distribution",
        _strategy_follows_distribution,
    ),
    # A layer built inside an enclosing layer's symbolic call gets its variable values
    # when the call's stateless scope ends; it is split then.
    _checked_patch(
        "shard_layers_built_symbolically",
        common_variables,
        "initialize_all_variables",
        _then_shard_deferred_layers,
    ),
    _checked_patch(
        "optimizer_state_beside_shards",
        TFOptimizer,
        "add_variable_from_reference",
        _slots_on_variable_device,
    ),
    # fit, evaluate and predict of a model sharded over a mesh with a batch axis > 1.
    *(
        _checked_patch(
            f"{kind}_step_split_by_mesh_rows",
            TensorFlowTrainer,
            f"make_{kind}_function",
            _steps_split_by_mesh_rows(f"{kind}_function"),
        )
        for kind in ("train", "test", "predict")
    ),
    # A split weight is listed whole in `weights`; training differentiates its shards.
    *(_checked_patch(*spec) for spec in keras_whole_weights.PATCH_SPECS),
)

_ORIGINALS: dict[str, Callable] = {}


def apply_patches() -> list[str]:
    """Applies the patches the installed Keras takes (idempotent); returns their names."""
    if keras.backend.backend() != "tensorflow":
        return []
    apply_each(PATCHES, _ORIGINALS)
    version = keras_version()
    if FIRST_CHECKED_KERAS <= version < FIRST_UNCHECKED_KERAS and not hasattr(
        tensorflow_distribution_lib, "distribute_tensor"
    ):
        # `Layer.__call__` relays outputs whose path the layout map names; the TensorFlow
        # backend lacks the function, so such a layout map would fail in every call.
        tensorflow_distribution_lib.distribute_tensor = _keep_tensor_layout
    return active_patch_names()


def active_patch_names() -> list[str]:
    """Names of the patches currently applied."""
    return [patch.name for patch in PATCHES if patch.name in _ORIGINALS]


# Where Keras layers keep the weights whose public name is a property.
_STORED_AS = {"kernel": "_kernel", "embeddings": "_embeddings"}


def stored_weight(layer: keras.layers.Layer, name: str):
    """The weight a layer keeps as `name` ("kernel", "bias", "embeddings", ...)."""
    return getattr(layer, _STORED_AS.get(name, name), None)


def store_weight(layer: keras.layers.Layer, name: str, value) -> None:
    """Puts `value` where the layer reads its weight `name` from."""
    setattr(layer, _STORED_AS.get(name, name), value)


def install_sharded_call(layer: keras.layers.Layer, call: Callable, views: list) -> None:
    """Makes `layer` compute with `call` and list `views` as its `sharded_weights`.

    Instance attributes, outside Keras' tracking: the layer's class and config stay the
    same, so the model saves and reloads as the unsharded one. Each shard runs on its
    device, so the layer no longer supports XLA (which compiles a step for one device).
    """
    object.__setattr__(layer, "call", call)
    object.__setattr__(layer, "sharded_weights", views)
    object.__setattr__(layer, "supports_jit", False)


def own_variables(layer: keras.layers.Layer) -> list:
    """The variables `layer` created itself (not those of its sublayers), in weight order."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def load_in_unsplit_layout(layer: keras.layers.Layer, num_weights: int) -> None:
    """Makes `layer` accept saved weights in its unsplit layout: `num_weights` of them.

    Keras' layers check a weights file against the variables they track, which are the
    shards now; their own loading assigns through the views, which split the values.
    """

    def check_load_own_variables(store):
        if len(store.keys()) != num_weights:
            raise ValueError(
                f"Layer '{layer.name}' expected {num_weights} weights in the unsharded layout. "
                f"Received: {len(store.keys())} weights"
            )

    object.__setattr__(layer, "_check_load_own_variables", check_load_own_variables)


def replace_own_variable(layer: keras.layers.Layer, variable, replacements: Sequence) -> None:
    """Puts `replacements` where `layer` tracked its own `variable`, keeping the weight order."""
    tracker = layer._tracker
    store_name = "trainable_variables" if variable.trainable else "non_trainable_variables"
    store = tracker.config[store_name][1]
    index = next(position for position, held in enumerate(store) if held is variable)
    was_locked = tracker.locked
    tracker.unlock()
    try:
        tracker.untrack(variable)
        for offset, replacement in enumerate(replacements):
            # The plain list: a TrackedList's own insert would track (append) it again.
            list.insert(store, index + offset, replacement)
            tracker.stored_ids[store_name].add(id(replacement))
    finally:
        if was_locked:
            tracker.lock()
