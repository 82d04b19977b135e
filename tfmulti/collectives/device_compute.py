"""Runs a shard's computation on its device, forward and backward."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from tfmulti.compat import tf_internals


def run_on_device(device: str, function: Callable, *inputs: tf.Tensor):
    """Returns `function(*inputs)` computed on `device`, whose gradients are computed there too.

    A `tf.GradientTape` places gradient ops by the device scope of the `gradient()` call
    (Keras: none), not by their forward op's device, so without this a shard's backward
    would run on the default device. Here the forward is recorded on an inner tape and
    the backward replays it under `tf.device(device)`. Eager calls (debugging, tests) and
    traces no tape records (a symbolic build, a forward-only call) just run on the device:
    a traced `tf.custom_gradient` registers its backward with TensorFlow for the life of
    the process, keeping every variable the function read (a ZeRO-3 copy's dropped
    storage would never be freed).

    Args:
        device: where the computation and its backward run.
        function: takes `inputs` and returns a tensor or a list of tensors; may read
            variables (their gradients are placed on `device` as well).
        *inputs: tensors; integer ones get no gradient.

    Example:
        >>> y = run_on_device("/CPU:1", lambda x: x * 2.0, tf.ones(3))
    """
    if tf.executing_eagerly() or not tf_internals.any_tape_recording():
        with tf.device(device):
            return function(*inputs)

    @tf.custom_gradient
    def placed(*values):
        differentiable = [value for value in values if value.dtype.is_floating]
        with tf.device(device), tf.GradientTape() as tape:
            tape.watch(differentiable)
            outputs = function(*values)

        def gradient(*output_gradients, variables=()):
            with tf.device(device):
                gradients = tape.gradient(
                    outputs,
                    differentiable + list(variables),
                    output_gradients=list(output_gradients),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            differentiable_gradients = iter(gradients[: len(differentiable)])
            input_gradients = [
                next(differentiable_gradients) if value.dtype.is_floating else None
                for value in values
            ]
            return input_gradients, gradients[len(differentiable) :]

        return outputs, gradient

    with tf.device(device):
        return placed(*inputs)
