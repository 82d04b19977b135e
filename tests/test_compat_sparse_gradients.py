"""Keras 3's optimizers count each repeat of a sparse gradient's row apart; tfmulti merges
repeats first, so a repeated row trains like its summed gradient (and like a dense one)."""

import keras
import numpy as np
import tensorflow as tf

from tfmulti.compat import keras_sparse_gradients

SHAPE = (3, 2)


def _repeated_rows():
    """Row 0 twice (values 1 and 2) and row 2 once: the gradient [[3, 3], [0, 0], [1, 1]]."""
    values = tf.constant([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]])
    return tf.IndexedSlices(values, tf.constant([0, 2, 0]), tf.constant(SHAPE))


def _adam_step(gradient, apply=None):
    variable = keras.Variable(np.zeros(SHAPE, "float32"))
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([variable])
    (apply or type(optimizer).apply)(optimizer, [gradient], [variable])
    return variable.numpy()


def test_upstream_keras_still_counts_repeated_rows_apart():
    # Fails once Keras merges repeats itself: then remove keras_sparse_gradients.
    original = keras_sparse_gradients.original_apply()
    dense = _adam_step(tf.convert_to_tensor(_repeated_rows()), original)
    repeated = _adam_step(_repeated_rows(), original)
    assert np.abs(repeated - dense).max() > 1e-3, (
        "upstream Keras merges repeated sparse rows now: remove the fix "
        "tfmulti/compat/keras_sparse_gradients.py"
    )


def test_with_the_fix_repeated_rows_train_like_the_dense_gradient():
    assert "merge_repeated_sparse_gradient_rows" in keras_sparse_gradients.FIX_SET.apply()
    dense = _adam_step(tf.convert_to_tensor(_repeated_rows()))
    np.testing.assert_allclose(_adam_step(_repeated_rows()), dense, rtol=1e-6)


def test_merging_sums_each_row_once():
    merged = keras_sparse_gradients.merge_repeated_rows(_repeated_rows())
    assert sorted(merged.indices.numpy().tolist()) == [0, 2]
    np.testing.assert_array_equal(
        tf.convert_to_tensor(merged).numpy(), [[3.0, 3.0], [0.0, 0.0], [1.0, 1.0]]
    )
