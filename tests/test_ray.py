"""tfmulti on Ray Train: `train` runs off the main thread, and a real local Ray cluster,
inside a loopback-only network namespace, trains every way docs/guide/ray.md says.

One module-scoped fixture starts one Ray cluster (2 CPUs, no dashboard) and runs, in turn:
the page's two Python blocks (`tfmulti.ray.trainer`, and `TensorflowTrainer` calling
`train` directly), one chief-driven run across 2 Ray workers, and the page's run again
with Ray worker 1 killed mid-epoch. Ray's start-up and each run take seconds, so the runs
are few and shared.

The chief-driven run is `hybrid` with its pipe axis across the Ray workers (stage s of
each data replica on Ray worker s): it takes the one path `pipeline` and `hybrid` share on
Ray (`chief_drives_workers`: the chief trains, the other worker serves it its devices,
one report at the end) with pipeline stages on another Ray worker's devices, so it holds
both; `pipeline` across launched workers is tests/test_pipeline_across_workers.py's.

Tolerance: as tests/script_runner.py's `assert_same_training` and `assert_same_run`
(float32 sums of the same gradients in another order).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest
import yaml
from script_runner import (
    REPO_ROOT,
    USER_CODE_ENV,
    assert_same_run,
    assert_same_training,
    read_metrics,
    script_environment,
    worker_program,
)

from tfmulti.config import TrainConfig
from tfmulti.errors import Preempted
from tfmulti.platform.launching.network_isolation import IsolationUnavailable, PrivateNetwork

PAGE = os.path.join(REPO_ROOT, "docs", "guide", "ray.md")
# docs/guide/ray.md's run: tests/script_runner.py's TWO_EPOCHS, as TrainConfig keys.
SMALL_RUN = {
    "model": "mlp",
    "dataset": "digits",
    "batch_size": 32,
    "steps_per_epoch": 5,
    "validation_steps": 4,
    "optimizer": "sgd",
    "learning_rate": 0.1,
    "epochs": 2,
}
# Worker 1 kills itself at global step 8 (epoch 2, step 3), after the step checkpoint
# at global step 6.
KILL_STEP = 8


def _ray_runs(directory: str) -> list[dict]:
    def run(name, **settings):
        return {
            "name": name,
            "num_workers": 2,
            "devices_per_worker": 2,
            "max_failures": settings.pop("max_failures", 0),
            "config": {**SMALL_RUN, **settings, "model_dir": os.path.join(directory, name)},
        }

    return [
        # The pipe axis crosses the workers (the default `cross_host_axis`).
        run("chief_driven", strategy="hybrid", mesh="data=2,pipe=2", microbatches=2),
        run(
            "killed",
            strategy="multi_worker",
            checkpoint_steps=2,
            callbacks="ray_kill:callbacks",
            max_failures=1,
        ),
    ]


def _kill_processes_in(namespace: str) -> None:
    """SIGKILLs every process whose network namespace is `namespace` (`net:[inode]`)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == namespace:
                os.kill(int(entry), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue


@pytest.fixture(scope="module")
def ray_runs(tmp_path_factory):
    """(directory, {run name: {"metrics", "error"}}) of the runs, "page" for the page's
    first block; each run's model_dir is `directory/<name>`, the page's `runs/ray` and
    `runs/ray_plain`."""
    pytest.importorskip("ray.train")
    try:
        network = PrivateNetwork()
    except IsolationUnavailable as error:
        pytest.skip(f"no loopback-only network namespace here: {error}")
    directory = str(tmp_path_factory.mktemp("ray"))
    with open(os.path.join(directory, "runs.json"), "w") as handle:
        json.dump(_ray_runs(directory), handle)
    # Short: Ray's socket paths live under it.
    ray_temp = tempfile.mkdtemp(prefix="tfray-")
    env = {
        **script_environment(),
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, USER_CODE_ENV["PYTHONPATH"]]),
        "HOME": directory,  # Ray's default storage, ~/ray_results
        "RAY_TMPDIR": ray_temp,
        "RAY_KILL_MARKER": os.path.join(directory, "killed-once"),
        "RAY_KILL_STEP": str(KILL_STEP),
    }
    command = [
        sys.executable,
        worker_program("ray_runs"),
        PAGE,
        "runs.json",
        "results.json",
        os.path.join(directory, "ray_storage"),
    ]
    try:
        with open(os.path.join(directory, "driver.log"), "w") as log:
            driver = subprocess.Popen(
                command,
                cwd=directory,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=network.enter,
            )
            namespace = os.readlink(f"/proc/{driver.pid}/ns/net")
            try:
                driver.wait(timeout=600)
            finally:
                driver.kill()
                driver.wait()
                # Ray's daemons outlive a driver that did not shut down: every process in
                # the private network is this fixture's.
                _kill_processes_in(namespace)
    finally:
        network.close()
        shutil.rmtree(ray_temp, ignore_errors=True)
    with open(os.path.join(directory, "driver.log")) as log:
        assert driver.returncode == 0, log.read()[-5000:]
    with open(os.path.join(directory, "results.json")) as handle:
        return directory, json.load(handle)


def test_the_pages_ray_run_trains_multi_worker_to_one_devices_losses(ray_runs, one_device_metrics):
    directory, results = ray_runs
    metrics = read_metrics(os.path.join(directory, "runs", "ray"))
    assert metrics["run"]["num_replicas"] == 4  # 2 Ray workers of 2 logical devices
    assert_same_training(metrics, one_device_metrics)
    reported = results["page"]["metrics"]
    assert results["page"]["error"] is None
    assert reported["epoch"] == 2
    assert reported["loss"] == pytest.approx(metrics["epochs"][-1]["loss"])
    assert reported["final_loss"] == pytest.approx(metrics["final"]["loss"])


def test_train_called_by_a_plain_tensorflow_trainer_trains_to_one_devices_losses(
    ray_runs, one_device_metrics
):
    directory, _ = ray_runs
    metrics = read_metrics(os.path.join(directory, "runs", "ray_plain"))
    assert metrics["run"]["num_replicas"] == 2
    assert_same_training(metrics, one_device_metrics)


def test_chief_driven_pipeline_stages_across_ray_workers_train_to_one_devices_losses(
    ray_runs, one_device_metrics
):
    directory, results = ray_runs
    assert results["chief_driven"]["error"] is None
    metrics = read_metrics(os.path.join(directory, "chief_driven"))
    # 2 data replicas, each a pipeline whose stage s is on Ray worker s.
    assert metrics["run"]["num_replicas"] == 2
    stages = metrics["run"]["split"]["stages"]
    assert [re.search(r"/task:(\d+)/", stage["device"])[1] for stage in stages] == ["0", "1"]
    assert_same_training(metrics, one_device_metrics)
    reported = results["chief_driven"]["metrics"]
    assert reported["final_loss"] == pytest.approx(metrics["final"]["loss"])


def test_a_killed_ray_worker_is_restarted_and_ends_with_the_uninterrupted_weights(ray_runs):
    directory, results = ray_runs
    assert results["killed"]["error"] is None
    assert os.path.exists(os.path.join(directory, "killed-once"))
    killed = os.path.join(directory, "killed")
    (resume,) = read_metrics(killed)["resumes"]
    assert resume["epoch"] == 2 and 0 < resume["step"] < KILL_STEP - SMALL_RUN["steps_per_epoch"]
    assert_same_run(killed, os.path.join(directory, "runs", "ray"))


def _one_device_config(model_dir: str, **settings) -> TrainConfig:
    return TrainConfig.from_flat(
        **{**SMALL_RUN, "strategy": "one_device", "model_dir": model_dir, **settings}
    )


def _on_another_thread(function, *args, **kwargs):
    """`function(*args, **kwargs)` run on a new thread; returns its result or raises its
    exception."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed back to the caller
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_train_runs_off_the_main_thread_like_on_it(tmp_path, one_device_metrics):
    from tfmulti.run.training import train

    record = _on_another_thread(train, _one_device_config(str(tmp_path / "run")))
    assert_same_training(record, one_device_metrics)


def test_request_preemption_stops_a_run_off_the_main_thread_at_a_step_it_resumes_from(
    tmp_path, one_device_metrics
):
    import time

    import keras

    from tfmulti.run.preemption import request_preemption
    from tfmulti.run.training import train

    class PreemptAtStep3(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                request_preemption()
                time.sleep(1.5)  # the handler polls the request once a second

    model_dir = str(tmp_path / "run")
    with pytest.raises(Preempted) as preempted:
        _on_another_thread(train, _one_device_config(model_dir), callbacks=[PreemptAtStep3()])
    # The request is polled once a second: the step after it, or the next.
    assert preempted.value.epoch == 0 and 3 <= preempted.value.step < 5
    record = _on_another_thread(train, _one_device_config(model_dir, resume=True))
    assert_same_training(record, one_device_metrics)


def _rayjob_manifest() -> dict:
    with open(PAGE) as handle:
        (manifest,) = re.findall(r"^```yaml\n(.*?)^```", handle.read(), re.MULTILINE | re.DOTALL)
    return yaml.safe_load(manifest)


def test_the_pages_rayjob_manifest_has_the_fields_kuberay_requires():
    job = _rayjob_manifest()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    assert spec["entrypoint"].endswith("train_on_ray.py")
    assert "MODEL_DIR" in yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    cluster = spec["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert isinstance(group["rayStartParams"], dict)
        assert all(isinstance(value, str) for value in group["rayStartParams"].values())
        pod = group["template"]["spec"]
        mounted = {mount["name"] for c in pod["containers"] for mount in c["volumeMounts"]}
        assert mounted <= {volume["name"] for volume in pod["volumes"]}
        assert all(container["image"] and container["name"] for container in pod["containers"])
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    import ray

    assert cluster["rayVersion"] == ray.__version__
