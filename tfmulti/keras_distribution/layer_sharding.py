"""Splitting a built Keras `Dense`, `EinsumDense` or `Embedding` layer's weights as layouts say.

`shard_layer` replaces each weight whose layout splits it by shards on the layout's devices
(`sharded_variable.split_variable`) and gives the layer a call that computes with them
(`sharded_einsum`, and the vocabulary-split lookup of `VocabParallelEmbedding`). Any other
layer, and any layout that cannot be followed, keeps its weights whole, with one
`LayoutNotHonouredWarning` naming the variable.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops

from tfmulti.collectives.device_compute import run_on_device
from tfmulti.collectives.placed_steps import fan_out, gather, reduce_partial_sums
from tfmulti.compat.keras_distribution_tf import (
    install_sharded_call,
    load_in_unsplit_layout,
    own_variables,
    store_weight,
    stored_weight,
)
from tfmulti.compat.keras_internals import layers_within
from tfmulti.keras_distribution.mesh_layout import (
    LayoutNotHonouredWarning,
    ShardPlan,
    UnsupportedLayout,
    plan_for_layout,
)
from tfmulti.keras_distribution.mesh_rows import row_devices
from tfmulti.keras_distribution.row_split_shard import shard_value
from tfmulti.keras_distribution.sharded_einsum import (
    CONTRACTED,
    analyse_split,
    einsum,
    split_einsum,
)
from tfmulti.keras_distribution.sharded_variable import ShardedVariable, split_variable
from tfmulti.tensor_parallel.vocab_embedding import lookup_in_row_shard

SHARDED_LAYER_KINDS = "Dense, EinsumDense, Embedding and ReversibleEmbedding"
DENSE_EQUATION = "...i,io->...o"
_ELEMENTWISE_ACTIVATIONS = (
    "linear elu exponential gelu hard_sigmoid hard_silu leaky_relu mish relu relu6 selu "
    "sigmoid silu softplus softsign tanh"
).split()


def warn_not_honoured(variable, reason: str) -> None:
    """Warns (once per call) that `variable` stays whole, and why."""
    warnings.warn(
        f"tfmulti keeps variable '{variable.path}' whole, not sharded as its layout asks: "
        f"{reason}.",
        LayoutNotHonouredWarning,
        stacklevel=3,
    )


def _is_elementwise(activation) -> bool:
    if activation is None:
        return True
    return any(activation is keras.activations.get(name) for name in _ELEMENTWISE_ACTIVATIONS)


def _activate(activation, outputs):
    return outputs if activation is None else activation(outputs)


def _output_axis_from_end(equation: str, axis: int | None) -> int | None:
    output_spec = equation.replace(" ", "").split("->")[1]
    if axis is None or axis < 0:
        return axis
    return None if "..." in output_spec else axis - len(output_spec)


def _bias_follows(bias, bias_plan: ShardPlan, kernel_plan: ShardPlan, equation, split) -> bool:
    """Whether the bias is split along the same output axis, over the same devices."""
    if split.kind == CONTRACTED or bias_plan.devices != kernel_plan.devices:
        return False
    return bias_plan.axis - len(bias.shape) == _output_axis_from_end(equation, split.output_axis)


def _shard_dense(layer, plans: dict) -> bool:
    """Splits a Dense/EinsumDense kernel (and a bias split alongside it)."""
    equation = getattr(layer, "equation", DENSE_EQUATION)
    kernel, bias = stored_weight(layer, "kernel"), layer.bias
    kernel_plan = plans.pop(id(kernel), None)
    bias_plan = plans.pop(id(bias), None) if bias is not None else None
    if kernel_plan is None:
        if bias_plan is not None:
            warn_not_honoured(bias, "a bias is split only with its kernel")
        return False
    try:
        split = analyse_split(equation, kernel_plan.axis)
    except UnsupportedLayout as error:
        warn_not_honoured(kernel, str(error))
        return False
    if bias_plan is not None and not _bias_follows(bias, bias_plan, kernel_plan, equation, split):
        warn_not_honoured(bias, "a bias is split only along its kernel's split output axis")
        bias_plan = None
    kernel_view = split_variable(layer, kernel, kernel_plan)
    store_weight(layer, "kernel", kernel_view)
    views = [kernel_view]
    if bias_plan is not None:
        store_weight(layer, "bias", split_variable(layer, bias, bias_plan))
        views.append(layer.bias)
    # A split bias is added to each output slice, and an elementwise activation runs there
    # too when no whole bias comes first: a row-split layer reading the output right away
    # then takes the slices where they are. The rest runs on the whole output.
    whole_bias = bias is not None and bias_plan is None
    activate_per_shard = (
        split.kind != CONTRACTED and _is_elementwise(layer.activation) and not whole_bias
    )

    def shard_finish(index, outputs):
        if bias_plan is not None:
            outputs = outputs + shard_value(layer.bias.shards[index])
        return _activate(layer.activation, outputs) if activate_per_shard else outputs

    def finish(outputs):
        if whole_bias:
            outputs = ops.add(outputs, layer.bias)
        return outputs if activate_per_shard else _activate(layer.activation, outputs)

    needs_finish = whole_bias or not activate_per_shard

    def call(inputs, training=None):
        del training
        return split_einsum(
            equation,
            inputs,
            kernel_view.shards,
            row_devices(kernel_plan.devices),
            split,
            shard_finish=shard_finish,
            finish=finish if needs_finish else None,
        )

    install_sharded_call(layer, call, views)
    return True


def _lookup(layer, table, plan: ShardPlan | None, ids):
    """The embedding rows of `ids`, from a whole table or its shards."""
    if plan is None:
        return ops.cast(ops.take(table, ids, axis=0), layer.compute_dtype)
    devices = row_devices(plan.devices)
    rows_per_shard = table.shape[0] // plan.num_shards

    def lookup(index, shard_ids):
        if plan.axis == 0:
            first_row = index * rows_per_shard
            return lookup_in_row_shard(
                shard_value(table.shards[index]), shard_ids, first_row, layer.compute_dtype
            )
        shard = shard_value(table.shards[index])
        return ops.cast(ops.take(shard, shard_ids, axis=0), layer.compute_dtype)

    pieces = [
        run_on_device(device, functools.partial(lookup, index), handle)
        for index, (device, handle) in enumerate(zip(devices, fan_out(ids, devices), strict=True))
    ]
    if plan.axis == 0:
        return reduce_partial_sums(pieces, devices)
    return gather(pieces, devices, -1)


def _project(weight, plan: ShardPlan | None, equation: str, inputs):
    """`einsum(equation, inputs, weight)` from a whole weight or its shards."""
    if plan is None:
        return einsum(equation, inputs, weight)
    split = analyse_split(equation, plan.axis)
    return split_einsum(equation, inputs, weight.shards, row_devices(plan.devices), split)


def _shard_embedding(layer, plans: dict) -> bool:
    """Splits an Embedding's table (rows or columns) and a ReversibleEmbedding's reverse weight."""
    reversible = hasattr(layer, "tie_weights")
    table = stored_weight(layer, "embeddings")
    reverse = getattr(layer, "reverse_embeddings", None) if reversible else None
    table_plan = plans.pop(id(table), None)
    reverse_plan = plans.pop(id(reverse), None) if reverse is not None else None
    if reversible and (layer.mask_zero or layer.reverse_dtype is not None):
        for variable, plan in ((table, table_plan), (reverse, reverse_plan)):
            if plan is not None:
                warn_not_honoured(variable, "mask_zero and reverse_dtype are not sharded")
        return False
    if table_plan is None and reverse_plan is None:
        return False
    views = []
    if table_plan is not None:
        table = split_variable(layer, table, table_plan)
        store_weight(layer, "embeddings", table)
        views.append(table)
    if reverse_plan is not None:
        reverse = split_variable(layer, reverse, reverse_plan)
        store_weight(layer, "reverse_embeddings", reverse)
        views.append(reverse)

    def call(inputs, reverse_projection=False):
        if not reverse_projection:
            ids = inputs
            if keras.backend.standardize_dtype(ids.dtype) not in ("int32", "int64"):
                ids = ops.cast(ids, "int32")
            return _lookup(layer, table, table_plan, ids)
        if layer.tie_weights:
            logits = _project(table, table_plan, "...d,vd->...v", inputs)
        else:
            logits = _project(reverse, reverse_plan, "...d,dv->...v", inputs)
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits

    if reversible:
        install_sharded_call(layer, lambda inputs, reverse=False: call(inputs, reverse), views)
    else:
        install_sharded_call(layer, lambda inputs: call(inputs), views)
    return True


def _sharder_for(layer) -> Callable | None:
    if getattr(layer, "quantization_mode", None) is not None or getattr(
        layer, "lora_enabled", False
    ):
        return None
    if isinstance(layer, keras.layers.Dense | keras.layers.EinsumDense):
        return _shard_dense
    if isinstance(layer, keras.layers.Embedding):
        return _shard_embedding
    return None


def shard_layer(
    layer: keras.layers.Layer,
    layout_of: Callable,
    device_mesh,
    batch_dim_name: str | None = None,
) -> bool:
    """Splits `layer`'s own weights as `layout_of(variable)` says; returns whether any was split.

    Args:
        layer: a built layer; its sublayers are not visited.
        layout_of: returns a variable's `keras.distribution.TensorLayout` (or axis tuple,
            or None for whole).
        device_mesh: the `keras.distribution.DeviceMesh` the layouts name axes of.
        batch_dim_name: its batch axis, along which no weight is split.

    Weights of other layer kinds, or with a layout that cannot be followed, stay whole;
    each gets one `LayoutNotHonouredWarning` naming it.
    """
    if getattr(layer, "sharded_weights", None):
        return False
    plans, variables = {}, {}
    for variable in own_variables(layer):
        try:
            plan = plan_for_layout(layout_of(variable), variable.shape, device_mesh, batch_dim_name)
        except UnsupportedLayout as error:
            warn_not_honoured(variable, str(error))
            continue
        if plan is not None:
            if getattr(variable, "regularizer", None) or getattr(variable, "constraint", None):
                warn_not_honoured(variable, "a regularizer or constraint needs the whole weight")
                continue
            plans[id(variable)], variables[id(variable)] = plan, variable
    if not plans:
        return False
    sharder = _sharder_for(layer)
    reason = None
    if sharder is None:
        reason = (
            f"tfmulti shards {SHARDED_LAYER_KINDS} layers (not quantized or LoRA); "
            f"{type(layer).__name__} '{layer.name}' runs whole on one device"
        )
    elif tf.inside_function():
        # Its variables' values exist only once the traced step runs.
        reason = (
            f"{type(layer).__name__} '{layer.name}' was first built inside a traced training "
            "step; build the model before fit (a keras.Input, or call it on a batch)"
        )
    if reason is not None:
        for variable in variables.values():
            warn_not_honoured(variable, reason)
        return False
    num_weights = len(own_variables(layer))
    sharded = sharder(layer, plans)
    if sharded:
        load_in_unsplit_layout(layer, num_weights)
    for variable_id in plans:
        warn_not_honoured(variables[variable_id], f"{type(layer).__name__} does not split it")
    return sharded


def sharded_views(model: keras.layers.Layer) -> list[ShardedVariable]:
    """The weights of `model` (or any layer) split by `shard_layer`, in layer order."""
    return [
        view
        for layer in layers_within(model)
        for view in getattr(layer, "sharded_weights", ())
        if isinstance(view, ShardedVariable)
    ]
