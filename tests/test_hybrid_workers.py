"""Hybrid data x pipeline across two real local workers (2 x 2 logical devices, data=2,pipe=2):
every worker ends with the weights one-device training on the global batch gives."""

import importlib.util
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from pipeline_runtime_models import Chain

from tests.workers.local_cluster import WORKERS_DIR, assert_all_workers_succeeded, run_local_cluster
from tfmulti.hybrid import worker_rows
from tfmulti.platform.runtime.cluster import resolve_cluster, resolve_cluster_if_described


def _load_worker_module():
    spec = importlib.util.spec_from_file_location(
        "hybrid_worker", os.path.join(WORKERS_DIR, "hybrid_worker.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_workers")
    flags = ["--mesh=data=2,pipe=2", "--devices=2", "--schedule=zb_h1", f"--out={out}"]
    assert_all_workers_succeeded(run_local_cluster("hybrid_worker.py", flags, timeout_seconds=240))
    return [json.loads((out / f"worker{rank}.json").read_text()) for rank in range(2)]


def _one_device_reference():
    worker = _load_worker_module()
    batches = worker.training_batches()
    model = Chain(worker.make_stages(2))
    model.compile(optimizer=keras.optimizers.Adam(worker.LEARNING_RATE), loss="mse")
    model(batches[0][0])
    initial = model.get_weights()
    history = model.fit(
        np.concatenate([x for x, _ in batches]),
        np.concatenate([y for _, y in batches]),
        batch_size=worker.GLOBAL_BATCH,
        shuffle=False,
        verbose=0,
    )
    return initial, model.get_weights(), history.history["loss"]


def test_every_worker_ends_with_the_weights_of_one_device_training(worker_results):
    initial, expected, expected_loss = _one_device_reference()
    assert max(np.abs(a - b).max() for a, b in zip(initial, expected, strict=True)) > 1e-3
    for result in worker_results:
        (weights,) = result["replica_weights"]  # one local replica per worker
        for actual, wanted in zip(weights, expected, strict=True):
            np.testing.assert_allclose(actual, wanted, rtol=1e-5, atol=1e-6)
        # The reported loss is the global batch's, on every worker.
        np.testing.assert_allclose(result["loss"], expected_loss, rtol=1e-5)


def test_each_worker_keeps_its_pipeline_stages_on_its_own_two_devices(worker_results):
    for rank, result in enumerate(worker_results):
        (devices,) = result["replica_devices"]
        # Each dense stage has a kernel and a bias: stage 0 on CPU:0, stage 1 on CPU:1.
        assert devices == [
            f"/job:worker/replica:0/task:{rank}/device:CPU:{index}" for index in (0, 0, 1, 1)
        ]


def test_each_worker_keeps_its_contiguous_share_of_every_global_batch():
    x = np.arange(16, dtype="float32").reshape(16, 1)
    y = -x
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    cluster = resolve_cluster(["h:1", "h:2"], task_index=1)
    batches = [(bx.numpy().ravel(), by.numpy().ravel()) for bx, by in worker_rows(dataset, cluster)]
    assert [list(bx) for bx, _ in batches] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert [list(by) for _, by in batches] == [[-4, -5, -6, -7], [-12, -13, -14, -15]]


def test_hybrid_runs_on_one_host_unless_a_cluster_of_several_workers_is_described():
    assert resolve_cluster_if_described(environ={}) is None
    one_worker = json.dumps(
        {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}
    )
    assert resolve_cluster_if_described(environ={"TF_CONFIG": one_worker}) is None
    cluster = resolve_cluster_if_described(["h:1", "h:2"], task_index=1, environ={})
    assert (cluster.num_workers, cluster.task_index) == (2, 1)
