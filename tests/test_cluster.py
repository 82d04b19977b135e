"""Cluster resolution, strategy arguments, input sharding and unreachable peers."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tfmulti.platform.launching.worker_places import free_ports
from tfmulti.platform.runtime import cluster as cluster_lib
from tfmulti.platform.runtime import input_sharding

HOSTS = ["127.0.0.1:2222", "127.0.0.1:2223", "127.0.0.1:2224"]


def tf_config(cluster, task_type="worker", index=0):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_explicit_hosts_win_over_tf_config():
    info = cluster_lib.resolve_cluster(HOSTS, 2, environ=tf_config({"worker": HOSTS[:2]}))
    assert (info.task_index, info.num_workers, info.is_chief, info.source) == (2, 3, False, "flags")
    assert info.cluster_spec() == {"worker": HOSTS}


def test_tf_config_worker_zero_is_chief():
    info = cluster_lib.resolve_cluster(environ=tf_config({"worker": HOSTS}, index=0))
    assert info.is_chief and info.worker_addresses == tuple(HOSTS) and info.source == "TF_CONFIG"


def test_tf_config_with_a_chief_job_ranks_the_chief_first():
    environ = tf_config({"chief": HOSTS[:1], "worker": HOSTS[1:]}, index=1)
    info = cluster_lib.resolve_cluster(environ=environ)
    assert info.task_index == 2 and info.task() == ("worker", 1)
    assert info.cluster_spec() == {"chief": HOSTS[:1], "worker": HOSTS[1:]}


def test_slurm_step_is_used_when_nothing_else_is_given():
    environ = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    }
    info = cluster_lib.resolve_cluster(environ=environ)
    assert info.worker_addresses == ("node1:8888", "node2:8888")
    assert (info.task_index, info.source) == (1, "SLURM")
    assert "SLURM_PROCID" not in os.environ


@pytest.mark.parametrize(
    "hosts, task_index, environ, message",
    [
        (None, None, {}, "No cluster found"),
        (HOSTS, None, {}, "needs task_index"),
        (None, 1, {}, "needs worker_hosts"),
        (HOSTS, 3, {}, "task_index=3"),
        (["127.0.0.1"], 0, {}, "'127.0.0.1'"),
        (["h:1", "h:1"], 0, {}, "distinct"),
        (None, None, {"TF_CONFIG": "{not json"}, "TF_CONFIG='{not json'"),
        (None, None, {"TF_CONFIG": '{"cluster": {}}'}, "TF_CONFIG must be JSON like"),
        (None, None, tf_config({"worker": HOSTS}, index=5), "index=5"),
        (None, None, tf_config({"worker": HOSTS, "ps": HOSTS[:1]}), "'ps'"),
    ],
)
def test_bad_cluster_input_names_what_was_received(hosts, task_index, environ, message):
    with pytest.raises(cluster_lib.ClusterError) as error:
        cluster_lib.resolve_cluster(hosts, task_index, environ=environ)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_communication_is_rejected_before_tensorflow_starts():
    info = cluster_lib.resolve_cluster(HOSTS, 0)
    with pytest.raises(cluster_lib.ClusterError, match="Received: 'mpi'"):
        cluster_lib.build_multi_worker_strategy(info, communication="mpi")


def test_unreachable_peer_gives_a_one_line_error_within_the_connect_timeout():
    hosts = [f"127.0.0.1:{port}" for port in free_ports(2)]
    code = (
        "from tfmulti.platform.runtime import cluster\n"
        f"info = cluster.resolve_cluster({hosts!r}, 0)\n"
        "cluster.build_multi_worker_strategy(info, connect_timeout_seconds=3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == -signal.SIGKILL
    lines = [line for line in result.stderr.splitlines() if line.startswith("tfmulti:")]
    assert lines == [
        f"tfmulti: worker 0: the 2 workers did not all join in 3 s; "
        f"unreachable: worker 1 at {hosts[1]}"
    ]


def test_apply_shard_policy_sets_the_auto_shard_option():
    import tensorflow as tf

    dataset = input_sharding.apply_shard_policy(tf.data.Dataset.range(8).batch(4), "data")
    policy = dataset.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA
    with pytest.raises(input_sharding.ShardingError, match="Received: 'rows'"):
        input_sharding.apply_shard_policy(dataset, "rows")


def test_file_sharding_with_fewer_files_than_workers_is_refused():
    input_sharding.check_file_sharding(num_files=2, num_workers=2)
    with pytest.raises(input_sharding.ShardingError, match="num_files=1, num_workers=2"):
        input_sharding.check_file_sharding(num_files=1, num_workers=2)
