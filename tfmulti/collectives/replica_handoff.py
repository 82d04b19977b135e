"""Handing a replicated tensor from one tensor-parallel block to the next through Keras.

Keras passes one tensor between layers. A block that ends with a replicated tensor
returns replica 0 (`first_replica`, which sends the gradient back to every replica) and
remembers all replicas in the traced graph; the next block on the same devices, traced
in the same graph, takes them instead of copying its input out again. So within a
stack of blocks nothing is sent between blocks: one copy out where the stack starts
(`broadcast`), one gradient copy back where it ends. Eager calls keep nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tfmulti.collectives.replicated import broadcast, first_replica

# Kept on the graph object, so the replicas live and die with their graph.
_GRAPH_ATTRIBUTE = "_tfmulti_replicas"


def _remembered(graph) -> dict:
    if not hasattr(graph, _GRAPH_ATTRIBUTE):
        setattr(graph, _GRAPH_ATTRIBUTE, {})
    return getattr(graph, _GRAPH_ATTRIBUTE)


def hand_on(replicas: Sequence[tf.Tensor], devices: Sequence[str]) -> tf.Tensor:
    """Returns replica 0 for Keras to pass on, remembering every replica for `replicas_of`.

    Example:
        >>> return hand_on(output_replicas, self.devices)  # end of a block's call
    """
    output = first_replica(replicas, devices)
    if not tf.executing_eagerly():
        _remembered(output.graph)[output.name] = (tuple(devices), list(replicas))
    return output


def replicas_of(tensor: tf.Tensor, devices: Sequence[str]) -> list[tf.Tensor]:
    """The replicas of `tensor` on `devices`: those a block handed on, else broadcast copies.

    Example:
        >>> replicas = replicas_of(inputs, self.devices)  # start of a block's call
    """
    if tf.is_symbolic_tensor(tensor):
        handed_on = _remembered(tensor.graph).get(tensor.name)
        if handed_on is not None and handed_on[0] == tuple(devices):
            return list(handed_on[1])
    return broadcast(tensor, devices)
