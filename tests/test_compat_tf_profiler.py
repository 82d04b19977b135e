"""TensorFlow's profiler on non-chief workers: guarded while it corrupts their heap."""

import pytest

from tests.workers.local_cluster import assert_all_workers_succeeded, run_local_cluster
from tfmulti.compat import tf_profiler


@pytest.mark.parametrize(
    ("is_multi_worker", "is_chief", "safe"),
    [(False, True, True), (True, True, True), (True, False, False)],
)
def test_only_non_chief_workers_of_affected_tensorflow_skip_the_profiler(
    is_multi_worker, is_chief, safe
):
    assert tf_profiler.tensorflow_version() >= tf_profiler.FIRST_BROKEN_TENSORFLOW
    assert tf_profiler.host_profiler_is_safe(is_multi_worker, is_chief) is safe


def test_the_chief_profiles_many_windows_without_a_crash():
    """The guard's premise: the group leader's heap survives what kills a non-chief's."""
    results = run_local_cluster(
        "profiler_probe.py", ["--windows=96", "--profiling_rank=0"], timeout_seconds=300
    )
    assert_all_workers_succeeded(results)
    assert "probe finished 96" in results[0][1]
