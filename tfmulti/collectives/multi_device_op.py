"""An operation over tensors on several devices with a gradient of its own, and nothing else moved.

`tf.custom_gradient` wraps all of a function's inputs and outputs in one `IdentityN` op
under the caller's device scope, so an op whose inputs and outputs live on K devices
would send every one of them to that device and back. This records the op on the
gradient tapes directly instead (what `tf.custom_gradient` does after its `IdentityN`),
so the only transfers are those the forward and backward functions place themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfmulti.compat import tf_internals


def multi_device_op(
    name: str,
    forward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    backward: Callable[[list[tf.Tensor]], list[tf.Tensor | None]],
    inputs: Sequence[tf.Tensor],
) -> list[tf.Tensor]:
    """Returns `forward(inputs)`, whose gradient with respect to `inputs` is `backward`'s.

    Args:
        name: the op's name on the tape (shown in errors).
        forward: takes the list of inputs, returns a list of new tensors, each made
            under the `tf.device` it should live on; nothing in it is differentiated.
        backward: takes one gradient per output (None for an output that got none)
            and returns one per input (None: no gradient), each placed by `backward`.
        inputs: the op's tensors; only floating ones receive gradients.

    Example:
        >>> copies = multi_device_op("copy", copy_to_each_device, sum_on_first, [x])
    """
    inputs = list(inputs)
    with tf_internals.stop_recording():
        outputs = list(forward(inputs))
    differentiable = [tensor for tensor in inputs if tensor.dtype.is_floating]
    if not differentiable or not tf_internals.should_record_backprop(differentiable):
        return outputs

    def recorded_backward(*output_gradients):
        gradients = backward(list(output_gradients))
        return [
            gradient
            for tensor, gradient in zip(inputs, gradients, strict=True)
            if tensor.dtype.is_floating
        ]

    tf_internals.record_operation(name, outputs, differentiable, recorded_backward)
    return outputs


def zeros_where_missing(
    gradients: Sequence[tf.Tensor | None], like: Sequence[tf.Tensor], devices: Sequence[str]
) -> list[tf.Tensor]:
    """`gradients` with each None (no gradient reached that output) replaced by zeros shaped
    like the matching tensor of `like`, made on its device."""
    filled = []
    for device, gradient, tensor in zip(devices, gradients, like, strict=True):
        if gradient is None:
            with tf.device(device):
                gradient = tf.zeros_like(tensor)
        filled.append(gradient)
    return filled
