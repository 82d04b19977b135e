"""tfmulti's collective keys never meet each other's or tf.distribute's."""

from tfmulti.collectives import key_ranges, worker_sums


def test_worker_sum_keys_stay_in_their_range_for_every_local_device():
    keys = [
        worker_sums._group_key(f"/device:{kind}:{index}")
        for kind in ("CPU", "GPU")
        for index in range(64)
    ]
    assert len(set(keys)) == len(keys)
    assert all(key in key_ranges.WORKER_SUM_KEYS for key in keys)


def test_tensor_group_keys_start_above_the_worker_sum_range():
    assert key_ranges.TENSOR_GROUP_KEYS_START >= key_ranges.WORKER_SUM_KEYS.stop
