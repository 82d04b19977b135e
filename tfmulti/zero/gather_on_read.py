"""ZeRO stage 3's reads of weights: gathered just before a layer runs, gathered again for its
backward, freed in between.

`GatherOnRead` is a Keras stateless scope in which reading a sharded weight joins its
blocks on the replica's device. `regathered_layers` wraps each leaf layer (one that owns
trainable weights and has no sublayers) so that its call gathers its weights, runs, and
keeps only its inputs and the block reads for the backward, which gathers the weights
again and recomputes the layer's forward to differentiate it (FSDP's
`reshard_after_forward`, at the cost of one more forward per layer and, per step, a third
pass of weight traffic: 3Ψ(N-1)/N sent per device instead of 2Ψ(N-1)/N). Each gather waits
for the previous layer's input, so the next layer's weights arrive while the current one
computes (FSDP's prefetch of one layer), and no earlier. Weights read outside such a layer
are gathered where read and kept until the backward has used them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from tfmulti.compat.keras_internals import (
    autocast_dtype,
    autocast_scope,
    layers_within,
    own_non_trainable_variables,
    own_trainable_variables,
    sublayers,
)
from tfmulti.zero.gather_overlap import BACKWARD_GATHER, FORWARD_GATHER
from tfmulti.zero.sharded_weights import ShardedWeights


class GatherOnRead(keras.StatelessScope):
    """A stateless scope where a sharded weight reads as its blocks joined on `device`.

    Args:
        sharded: the model's weight blocks.
        replica: the index of the replica (and device) this forward runs on.
        state_mapping: (variable, value) of the non-trainable state, as for
            `keras.StatelessScope`.
    """

    def __init__(self, sharded: ShardedWeights, replica: int, state_mapping):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.sharded = sharded
        self.replica = replica
        # Whole weights a wrapped layer gathered for its own call, by variable id.
        self.live: dict[int, tf.Tensor] = {}
        self.forward_anchor: tf.Tensor | None = None
        self.backward_anchor: tf.Tensor | None = None

    def get_current_value(self, variable):
        value = self.live.get(id(variable))
        if value is not None:
            return value
        weight = self.sharded.index_of(variable)
        if weight is not None:
            with tf.device(self.sharded.devices[self.replica]), tf.name_scope(FORWARD_GATHER):
                return self.sharded.join(weight, self.sharded.block_reads(weight))
        return super().get_current_value(variable)


@dataclasses.dataclass
class _LayerWeights:
    layer: keras.layers.Layer
    weights: list[int]  # indices into ShardedWeights.variables
    variables: list
    state: list  # the layer's own non-trainable variables


def regatherable_layers(model: keras.Model, sharded: ShardedWeights) -> list:
    """The leaf layers of `model` whose weights are all sharded: those `regathered_layers` wraps."""
    found = []
    for layer in layers_within(model, include_self=False):
        variables = own_trainable_variables(layer)
        if not variables or sublayers(layer):
            continue
        weights = [sharded.index_of(variable) for variable in variables]
        if None not in weights:
            found.append(
                _LayerWeights(layer, weights, variables, own_non_trainable_variables(layer))
            )
    return found


@contextlib.contextmanager
def regathered_layers(layers: list, scope: GatherOnRead):
    """While inside, each of `layers` (from `regatherable_layers`) gathers its weights for
    its call and again for its backward; the class's `call` is back afterwards."""
    previous = {}
    for entry in layers:
        previous[id(entry.layer)] = entry.layer.__dict__.get("call")
        object.__setattr__(entry.layer, "call", _regathering_call(entry, entry.layer.call, scope))
    try:
        yield
    finally:
        for entry in layers:
            held = previous[id(entry.layer)]
            if held is None:
                object.__delattr__(entry.layer, "call")
            else:
                object.__setattr__(entry.layer, "call", held)


def _regathering_call(entry: _LayerWeights, call, scope: GatherOnRead):
    sharded = scope.sharded
    device = sharded.devices[scope.replica]

    def gather(blocks_per_weight: list[list[tf.Tensor]], anchor, name: str) -> list[tf.Tensor]:
        with (
            tf.device(device),
            tf.name_scope(name),
            tf.control_dependencies([anchor] if anchor is not None else []),
        ):
            return [
                sharded.join(weight, blocks)
                for weight, blocks in zip(entry.weights, blocks_per_weight, strict=True)
            ]

    def regathering_call(*args, **kwargs):
        flat = tf.nest.flatten((args, kwargs))
        tensor_places = [i for i, item in enumerate(flat) if tf.is_tensor(item)]
        tensors = [flat[i] for i in tensor_places]
        blocks = [sharded.block_reads(weight) for weight in entry.weights]
        num_blocks = len(sharded.devices)
        state_before = [(v, scope.get_current_value(v)) for v in entry.state]
        compute_dtype = autocast_dtype()

        def rebuild(values):
            items = list(flat)
            for place, value in zip(tensor_places, values, strict=True):
                items[place] = value
            return tf.nest.pack_sequence_as((args, kwargs), items)

        def regroup(flat_blocks):
            return [
                list(flat_blocks[k * num_blocks : (k + 1) * num_blocks])
                for k in range(len(entry.weights))
            ]

        @tf.custom_gradient
        def run(*inputs):
            layer_inputs, flat_blocks = inputs[: len(tensors)], inputs[len(tensors) :]
            whole = gather(regroup(flat_blocks), scope.forward_anchor, FORWARD_GATHER)
            if layer_inputs:
                scope.forward_anchor = layer_inputs[0]
            scope.live.update({id(v): w for v, w in zip(entry.variables, whole, strict=True)})
            try:
                call_args, call_kwargs = rebuild(layer_inputs)
                outputs = call(*call_args, **call_kwargs)
            finally:
                for variable in entry.variables:
                    scope.live.pop(id(variable), None)

            def backward(*output_gradients, variables=None):
                anchor = scope.backward_anchor
                scope.backward_anchor = output_gradients[0]
                # Read the blocks anew: reusing the forward's reads would keep what this
                # device received of them alive from the forward to here.
                with tf.control_dependencies([anchor] if anchor is not None else []):
                    fresh = [sharded.block_reads(weight) for weight in entry.weights]
                again = gather(fresh, anchor, BACKWARD_GATHER)
                differentiable = [t for t in layer_inputs if t.dtype.is_floating]
                with tf.device(device), tf.GradientTape() as tape:
                    tape.watch(differentiable + again)
                    mapping = list(zip(entry.variables, again, strict=True)) + state_before
                    with keras.StatelessScope(state_mapping=mapping), autocast_scope(compute_dtype):
                        call_args, call_kwargs = rebuild(layer_inputs)
                        recomputed = call(*call_args, **call_kwargs)
                    gradients = tape.gradient(
                        tf.nest.flatten(recomputed),
                        differentiable + again,
                        output_gradients=list(output_gradients),
                    )
                input_gradients = iter(gradients[: len(differentiable)])
                weight_gradients = [
                    tf.zeros_like(whole) if gradient is None else tf.convert_to_tensor(gradient)
                    for whole, gradient in zip(again, gradients[len(differentiable) :], strict=True)
                ]
                with tf.device(device):
                    block_gradients = [
                        piece
                        for weight, gradient in zip(entry.weights, weight_gradients, strict=True)
                        for piece in sharded.split(weight, gradient)
                    ]
                returned = [
                    next(input_gradients) if t.dtype.is_floating else None for t in layer_inputs
                ]
                return returned + block_gradients, [None] * len(variables or [])

            return outputs, backward

        return run(*tensors, *[block for weight in blocks for block in weight])

    return regathering_call
