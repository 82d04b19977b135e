"""Packing many tensors into one TensorList per dtype, and taking parts out again."""

import numpy as np
import tensorflow as tf

from tfmulti.pipeline.runtime.tensor_packing import empty_packing, pack, unpack


def _tensors():
    rng = np.random.default_rng(0)
    return [
        tf.constant(rng.normal(size=(2, 3)), tf.float32),
        tf.constant([[1, 2]], tf.int32),
        tf.constant(rng.normal(size=(4,)), tf.float32),
        tf.constant([True, False]),
        tf.constant(rng.normal(size=()), tf.float32),
    ]


def test_packed_tensors_come_back_whole_and_in_part_with_their_shapes():
    tensors = _tensors()
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in tensors]

    @tf.function(autograph=False)
    def round_trip(*flat):
        lists = pack(flat)
        assert sorted(lists) == ["bool", "float32", "int32"]
        whole = unpack(lists, specs, range(len(specs)))
        part = unpack(lists, specs, range(2, 4))
        assert [t.shape for t in whole] == [s.shape for s in specs]  # known when traced
        return whole, part

    whole, part = round_trip(*tensors)
    for got, expected in zip(whole, tensors, strict=True):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(part[0], tensors[2])
    np.testing.assert_array_equal(part[1], tensors[3])


def test_an_empty_packing_has_the_keys_of_a_full_one():
    tensors = _tensors()
    assert sorted(empty_packing(t.dtype for t in tensors)) == sorted(pack(tensors))
