"""What a stage's forward hands its backward (residuals), and that the backward it gets
computes the forward's own gradients."""

import keras
import numpy as np
import tensorflow as tf

from tfmulti.pipeline.runtime.stage_functions import StageFunctions

BATCH, FEATURES = 4, 6


def _traced(layer, x):
    layer(x)  # build
    return StageFunctions(layer, differentiate_inputs=True, remat=False).for_inputs([x], x)


def _input_gradient(traced, x, output_grad):
    results = traced.forward(x)
    sources = {
        "input": [x],
        "residual": list(results[traced.num_outputs :]),
        "output_grad": [output_grad],
    }
    feeds = [sources[feed.source][feed.index] for feed in traced.backward_feeds]
    return results[0], traced.backward(*feeds)[0]


def test_the_backward_reads_the_weights_again_rather_than_receive_them():
    # Two linear layers: the backward needs the input (given), the hidden activation and
    # both kernels; the kernels are the same all step, so only the activation is stashed.
    x = tf.constant(np.random.default_rng(0).normal(size=(BATCH, FEATURES)), tf.float32)
    layer = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(3)])
    traced = _traced(layer, x)
    assert [(tuple(s.shape), s.dtype) for s in traced.residual_specs] == [((BATCH, 8), tf.float32)]
    upstream = tf.ones((BATCH, 3))
    _, gradient = _input_gradient(traced, x, upstream)
    kernels = [dense.kernel for dense in layer.layers]
    expected = upstream @ tf.transpose(kernels[1]) @ tf.transpose(kernels[0])
    np.testing.assert_allclose(gradient, expected, rtol=1e-5)


def test_a_dropout_backward_uses_the_forwards_mask_though_its_seed_moved_on():
    # Dropout's mask comes from a seed variable the forward reads and then advances: the
    # mask must travel to the backward, not be drawn again from the advanced seed.
    x = tf.constant(np.random.default_rng(1).uniform(1.0, 2.0, (BATCH, FEATURES)), tf.float32)
    layer = keras.Sequential([keras.layers.Dropout(0.5, seed=3)])
    traced = _traced(layer, x)
    assert traced.residual_specs  # the mask (or what holds it)
    for _ in range(3):
        outputs, gradient = _input_gradient(traced, x, tf.ones_like(x))
        kept = tf.cast(outputs != 0, tf.float32)
        assert 0 < float(tf.reduce_sum(kept)) < BATCH * FEATURES
        np.testing.assert_allclose(gradient, 2.0 * kept)
