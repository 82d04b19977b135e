"""Each step of a model sharded over a mesh with several rows splits its batch over them.

The outermost call of the model, or of any layer within it (a custom step calling the
model's parts), runs once per row on that row's part of the batch (`call_by_rows`), and
the rows' outputs are joined back along the batch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from tfmulti.compat import keras_internals
from tfmulti.keras_distribution.mesh_layout import LayoutNotHonouredWarning
from tfmulti.keras_distribution.mesh_rows import call_by_rows, mesh_rows_of

_ROW_SPLITTER = "_tfmulti_row_splitter"  # on each layer's wrapped call: its splitter


def _join_rows(outputs: list):
    """The rows' outputs joined along the batch, with their Keras masks joined too."""

    def join(*parts):
        joined = tf.concat(parts, 0)
        masks = [keras_internals.keras_mask(part) for part in parts]
        if all(mask is not None for mask in masks):
            keras_internals.attach_keras_mask(joined, tf.concat(masks, 0))
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
        for layer in keras_internals.layers_within(model):
            if getattr(layer.__dict__.get("call"), _ROW_SPLITTER, None) is not splitter:
                wrapper = splitter._wrap(layer, layer.call, check_batch=layer is not model)
                object.__setattr__(layer, "call", wrapper)
        return splitter

    def _wrap(self, layer, call: Callable, check_batch: bool) -> Callable:
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


def split_step_over_rows(model: keras.Model, function: Callable, attribute: str) -> Callable:
    """`function` (Keras' `attribute` step) splitting each batch over the mesh's rows.

    Only for a model whose layers were built (or `shard`ed) for a mesh whose batch axis
    has several rows; any other model gets `function` back unchanged.
    """
    rows = mesh_rows_of(keras_internals.layers_within(model))
    if rows is None:
        return function
    splitter = _RowSplitCalls.of(model, rows)
    traced = []  # Keras' step function traces at its first call

    def step_split_by_rows(*args, **kwargs):
        with splitter.step() as calls:
            outputs = function(*args, **kwargs)
        if not traced:
            traced.append(True)
            if not calls:
                _warn_step_not_split(model, attribute, rows.num_rows)
        return outputs

    return step_split_by_rows


def _warn_step_not_split(model, attribute: str, num_rows: int) -> None:
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
