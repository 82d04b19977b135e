"""Keras 3 fit/evaluate/predict on real local workers under MultiWorkerMirroredStrategy."""

import functools
import glob
import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.workers.local_cluster import WORKERS_DIR, assert_all_workers_succeeded, run_local_cluster


def load_worker_module():
    spec = importlib.util.spec_from_file_location(
        "mwms_worker", os.path.join(WORKERS_DIR, "mwms_worker.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def single_process_reference(epochs):
    """Plain Keras, one process, same model, data order and global batch (computed once per
    `epochs`; tests only read it)."""
    worker = load_worker_module()
    x, y = worker.make_data()
    model = worker.make_model()
    history = model.fit(
        x, y, batch_size=worker.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0
    )
    return {
        "weights": model.get_weights(),
        "loss": history.history["loss"],
        "evaluation": model.evaluate(x, y, batch_size=worker.GLOBAL_BATCH, verbose=0),
        "predictions": model.predict(x, batch_size=worker.GLOBAL_BATCH, verbose=0),
    }


def run_workers(directory: Path, devices, epochs=2, model_dir=None, steps_per_execution=1):
    """Trains on two local workers of `devices` devices each; returns their results, model_dir."""
    out = directory / f"out-{devices}-{epochs}"
    out.mkdir()
    model_dir = model_dir or directory / f"model-{devices}"
    flags = [
        f"--devices={devices}",
        f"--epochs={epochs}",
        f"--out={out}",
        f"--model_dir={model_dir}",
        f"--steps_per_execution={steps_per_execution}",
    ]
    assert_all_workers_succeeded(run_local_cluster("mwms_worker.py", flags, timeout_seconds=240))
    return worker_results(out), model_dir


def worker_results(out: Path) -> list:
    return [json.loads((out / f"worker{rank}.json").read_text()) for rank in range(2)]


# Steps per call into TensorFlow of the run on `devices` devices per worker: the 2x2 run
# also takes two steps per call (compat fix steps_per_execution_in_a_plain_loop), the 2x1
# run one.
STEPS_PER_EXECUTION = {1: 1, 2: 2}


@pytest.fixture(scope="module")
def two_epoch_run(shared_dir):
    """`two_epoch_run(devices)`: (results, model_dir) of the two-epoch run on two workers of
    `devices` devices each (`STEPS_PER_EXECUTION[devices]` steps per call), trained once per
    session for every xdist worker; never written."""

    def get(devices):
        def fill(directory: str) -> None:
            run_workers(Path(directory), devices, steps_per_execution=STEPS_PER_EXECUTION[devices])

        directory = Path(shared_dir(f"multi_worker-two_epochs-{devices}", fill))
        return worker_results(directory / f"out-{devices}-2"), directory / f"model-{devices}"

    return get


@pytest.fixture(scope="module", params=[1, 2], ids=["2x1", "2x2"])
def cluster_run(request, two_epoch_run):
    return request.param, *two_epoch_run(request.param)


def test_every_replica_of_every_worker_takes_part(cluster_run):
    devices, results, _ = cluster_run
    assert [result["num_replicas"] for result in results] == [2 * devices] * 2


def test_workers_end_with_identical_weights(cluster_run):
    _, (chief, other), _ = cluster_run
    for chief_weight, other_weight in zip(chief["weights"], other["weights"], strict=True):
        np.testing.assert_array_equal(chief_weight, other_weight)


def test_weights_equal_single_process_training_with_the_same_global_batch(cluster_run):
    _, (chief, _), _ = cluster_run
    reference = single_process_reference(epochs=2)
    for weight, expected in zip(chief["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chief["loss"], reference["loss"], rtol=1e-5)
    # The run must have trained: otherwise equal weights would prove nothing.
    assert not np.allclose(chief["weights"][0], load_worker_module().make_model().get_weights()[0])


def test_evaluate_and_predict_match_single_process_on_every_worker(cluster_run):
    _, results, _ = cluster_run
    reference = single_process_reference(epochs=2)
    for result in results:
        np.testing.assert_allclose(result["evaluation"], reference["evaluation"], rtol=1e-5)
        np.testing.assert_allclose(
            result["predictions"], reference["predictions"], rtol=1e-5, atol=1e-6
        )


def test_steps_per_execution_trains_and_evaluates_like_single_process(two_epoch_run):
    # The 2x2 run: two steps per call into TensorFlow (compat fix
    # steps_per_execution_in_a_plain_loop), on every worker.
    assert STEPS_PER_EXECUTION[2] == 2
    (chief, other), _ = two_epoch_run(2)
    reference = single_process_reference(epochs=2)
    for result in (chief, other):
        for weight, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["loss"], reference["loss"], rtol=1e-5)
        np.testing.assert_allclose(result["evaluation"], reference["evaluation"], rtol=1e-5)
    assert "steps_per_execution_in_a_plain_loop" in chief["active_fixes"]


def test_only_the_chief_writes_into_model_dir(cluster_run):
    _, (_, other), model_dir = cluster_run
    files = sorted(
        os.path.relpath(path, model_dir)
        for path in glob.glob(f"{model_dir}/**", recursive=True)
        if os.path.isfile(path)
    )
    events = [name for name in files if "tfevents" in name]
    assert [name for name in files if name.endswith(".h5")] == [
        "backup/latest.weights.h5",
        "ckpt-1.weights.h5",
        "ckpt-2.weights.h5",
    ]
    assert len(events) == 1, events  # the chief's train log; worker 1 logged to scratch
    assert not os.path.exists(other["scratch_dir"]), "non-chief scratch dir was not removed"


def test_only_the_chief_profiles_since_tensorflow_corrupts_a_non_chief_heap(cluster_run):
    _, (chief, other), model_dir = cluster_run
    traces = sorted(glob.glob(f"{model_dir}/logs/plugins/profile/*/*.xplane.pb"))
    assert [os.path.basename(path) for path in traces] == ["worker0.xplane.pb"]
    assert os.path.getsize(traces[0]) > 0
    assert chief["trace_path"] == traces[0]
    assert other["trace_path"] is None


def test_backup_and_restore_resumes_every_worker_from_the_last_epoch(tmp_path, two_epoch_run):
    # A copy of the shared two-epoch run, trained on to a third epoch: the shared one stays.
    _, trained_dir = two_epoch_run(1)
    model_dir = tmp_path / "model"
    shutil.copytree(trained_dir, model_dir)
    resumed, _ = run_workers(tmp_path, devices=1, epochs=3, model_dir=model_dir)
    reference = single_process_reference(epochs=3)
    for result in resumed:
        assert len(result["loss"]) == 1  # epochs 1 and 2 were restored, only epoch 3 ran
        np.testing.assert_allclose(result["loss"], reference["loss"][2:], rtol=1e-5)
        for weight, expected in zip(result["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(weight, expected, rtol=1e-5, atol=1e-6)
