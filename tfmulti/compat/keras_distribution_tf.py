"""Where tfmulti hooks `keras.distribution` into Keras 3's TensorFlow backend.

Keras' TensorFlow backend leaves `keras.distribution` a stub: a model built under
`ModelParallel(...).scope()` keeps every weight whole on one device, and `DataParallel`
changes nothing. The JAX backend lays each variable out when it is created
(`Variable._initialize_layout`). Here the same happens one step later, after each layer's
`build`: `tfmulti.parallel.keras_distribution` splits the variables its layout names.
Setting a `DataParallel` distribution (`set_distribution`, or its `scope()`) also sets a
`tf.distribute.MirroredStrategy` over the mesh's devices, which Keras' TensorFlow trainer
already knows how to train with.

A split weight's shards stand in the weight lists as one whole-shape view
(`keras_whole_weights`). Every touch of Keras internals lives in these two modules; the
patches apply to the Keras versions checked by tests/test_compat_keras_distribution.py.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence

import keras
import keras.distribution as public_distribution
import tensorflow as tf
from keras.src.backend.common import variables as common_variables
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import distribution_lib as tensorflow_distribution_lib
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.distribution import distribution_lib
from keras.src.layers.layer import Layer

from tfmulti.compat import keras_whole_weights
from tfmulti.compat.keras_multi_worker import Fix, apply_each, keras_version

# Checked on Keras 3.15.1 (tests/test_compat_keras_distribution.py); raise after checking.
FIRST_CHECKED_KERAS = (3, 10)
FIRST_UNCHECKED_KERAS = (3, 16)


def _shard_after_build(original: Callable) -> Callable:
    @functools.wraps(original)
    def _post_build(self):
        original(self)
        if distribution_lib.distribution() is None:
            return
        # Imported here: this module loads while Keras itself is still being imported.
        from tfmulti.parallel import keras_distribution

        keras_distribution.shard_under_current_distribution(self)

    return _post_build


def _strategy_follows_distribution(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_distribution(value):
        original(value)
        from tfmulti.parallel import keras_distribution

        keras_distribution.follow_data_parallel(value)

    return set_distribution


def _then_shard_deferred_layers(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_all_variables():
        original()
        from tfmulti.parallel import keras_distribution

        keras_distribution.shard_deferred_layers()

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
        storage = getattr(reference_variable, "_value", None)
        if not getattr(reference_variable, _STATE_BESIDE, False) or tf.distribute.has_strategy():
            return original(self, reference_variable, *args, **kwargs)
        # Optimizers build inside the first traced step; the variable is then lifted out of
        # the graph, and the colocation upstream asks for is lost with it.
        with tf.device(storage.device):
            return original(self, reference_variable, *args, **kwargs)

    return add_variable_from_reference


def _keep_tensor_layout(tensor, layout):
    """Layouts of intermediate tensors are hints tfmulti does not act on: the tensor as is."""
    del layout
    return tensor


_SPLIT_BY_ROWS = "_tfmulti_split_by_mesh_rows"
_ROW_SPLITTER = "_tfmulti_row_splitter"  # on each layer's wrapped call: its splitter


def _join_rows(outputs: list):
    """The rows' outputs joined along the batch, with their Keras masks joined too."""

    def join(*parts):
        joined = tf.concat(parts, 0)
        masks = [get_keras_mask(part) for part in parts]
        if all(mask is not None for mask in masks):
            set_keras_mask(joined, tf.concat(masks, 0))
        return joined

    return tf.nest.map_structure(join, *outputs)


class _RowSplitCalls:
    """Splits the batch over the mesh's rows at the outermost call of `model`, or of any
    layer within it (a custom step calling the model's parts), while a step runs.

    Each layer's `call` is wrapped once (`install`); outside `step()` the wrappers pass
    calls through, so a step pays a flag, not a patch per layer. A part's call is split
    only when every tensor it gets with a batch axis has the same first dimension (a
    table or position ids passed beside the batch are not cut); a layer called within a
    split call runs within its row.
    """

    def __init__(self):
        self.rows = None
        self.active = False
        self.within_a_row = False
        self.calls = []

    @classmethod
    def of(cls, model: keras.layers.Layer, rows) -> _RowSplitCalls:
        """The model's splitter (made at the first call), wrapping layers added since."""
        splitter = model.__dict__.get("_tfmulti_row_split_calls")
        if splitter is None:
            splitter = cls()
            object.__setattr__(model, "_tfmulti_row_split_calls", splitter)
        splitter.rows = rows
        for layer in layers_within(model):
            if getattr(layer.__dict__.get("call"), _ROW_SPLITTER, None) is not splitter:
                wrapper = splitter._wrap(layer, layer.call, check_batch=layer is not model)
                object.__setattr__(layer, "call", wrapper)
        return splitter

    def _wrap(self, layer, call: Callable, check_batch: bool) -> Callable:
        from tfmulti.parallel.mesh_rows import call_by_rows

        def call_split_by_rows(*args, **kwargs):
            if (
                not self.active
                or self.within_a_row
                or (check_batch and not _one_batch_axis(args, kwargs))
            ):
                return call(*args, **kwargs)
            self.calls.append(layer)
            self.within_a_row = True
            try:
                return call_by_rows(call, self.rows, args, kwargs, _join_rows, layer)
            finally:
                self.within_a_row = False

        setattr(call_split_by_rows, _ROW_SPLITTER, self)
        return call_split_by_rows

    @contextlib.contextmanager
    def step(self):
        """While open, calls split; yields the list of layers whose calls were split."""
        self.active, self.calls = True, []
        try:
            yield self.calls
        finally:
            self.active = False


def _one_batch_axis(args, kwargs) -> bool:
    """Whether the call's tensors of rank >= 1 all have one first dimension (unknown
    counts as one only with another unknown)."""
    firsts = {
        value.shape[0]
        for value in tf.nest.flatten((args, kwargs))
        if tf.is_tensor(value) and value.shape.rank
    }
    return len(firsts) == 1


def _steps_split_by_mesh_rows(attribute: str) -> Callable:
    """Makes the step function Keras makes (`attribute`) split each batch over mesh rows.

    Only for a model whose layers were built (or `shard`ed) for a mesh whose batch axis
    has several rows; any other model gets Keras' function unchanged.
    """

    def patch(original: Callable) -> Callable:
        @functools.wraps(original)
        def make_function(self, force=False):
            returned = original(self, force)
            function = getattr(self, attribute)
            if function is None or getattr(function, _SPLIT_BY_ROWS, False):
                return returned
            from tfmulti.parallel.mesh_rows import mesh_rows_of

            rows = mesh_rows_of(layers_within(self))
            if rows is None:
                return returned

            splitter = _RowSplitCalls.of(self, rows)
            traced = []  # Keras' step function traces at its first call

            def step_split_by_rows(*args, **kwargs):
                with splitter.step() as calls:
                    outputs = function(*args, **kwargs)
                if not traced:
                    traced.append(True)
                    if not calls:
                        _warn_step_not_split(self, attribute, rows.num_rows)
                return outputs

            setattr(step_split_by_rows, _SPLIT_BY_ROWS, True)
            setattr(self, attribute, step_split_by_rows)
            return step_split_by_rows if returned is not None else None

        return make_function

    return patch


def _warn_step_not_split(model, attribute: str, num_rows: int) -> None:
    from tfmulti.parallel.mesh_layout import LayoutNotHonouredWarning

    step = attribute.removesuffix("_function")
    warnings.warn(
        f"{model.name}'s {step} step calls neither the model nor one of its layers on "
        "tensors that share one batch axis (a custom "
        f"{step}_step?), so each batch runs whole on the first of the mesh's {num_rows} "
        "rows instead of being split over them; call the model (self(x)) or its layers on "
        "the batch in the step to split it.",
        LayoutNotHonouredWarning,
        stacklevel=3,
    )


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


def layers_within(model: keras.layers.Layer) -> list:
    """`model` and every layer nested in it (Keras' own walk; there is no public one)."""
    return list(model._flatten_layers(include_self=True, recursive=True))


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
