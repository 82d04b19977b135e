"""A `TensorflowTrainer` that runs `tfmulti.run.training.train` on each Ray worker.

Ray starts one actor per worker, gives each a `TF_CONFIG` naming all of them and runs
`train_loop` in it (off the actor's main thread). tfmulti does the rest as under its own
launcher: logical devices, the strategy (`multi_worker` trains on every worker;
`pipeline` and `hybrid` are driven by the chief, the others serving it their devices),
step checkpoints in `model_dir` and exact resume. When Ray restarts the worker group
after a failure (`FailureConfig(max_failures=N)`), the run resumes from its last step
checkpoint, as after a restart by `scripts/launch.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading

import ray.train
from ray.train import RunConfig, ScalingConfig
from ray.train.tensorflow import TensorflowTrainer

from tfmulti.config import TrainConfig

# Written by the chief at a run's first start: a later start of the same Ray run (same
# experiment name) is Ray's restart after a failure, which resumes.
RAY_RUN_FILE = "ray_run.json"


def trainer(
    config: TrainConfig,
    num_workers: int,
    devices_per_worker: int = 0,
    cpus_per_worker: float = 1,
    run_config: RunConfig | None = None,
) -> TensorflowTrainer:
    """A Ray Train trainer for the run `config` describes, on `num_workers` Ray workers.

    Args:
        config: the run; `model_dir` (made absolute on the driver) must be a directory
            every worker reaches: local on one machine, shared storage across several.
        num_workers: Ray workers, one tfmulti worker each.
        devices_per_worker: logical CPU devices each worker splits its CPU into
            (`--devices_per_worker` of `scripts/launch.py`); 0 keeps the physical ones.
        cpus_per_worker: the CPUs Ray reserves for each worker.
        run_config: Ray's run settings, e.g. `RunConfig(failure_config=FailureConfig(
            max_failures=2))` to restart the group after a failure.

    Returns:
        The trainer; `.fit()` runs it and returns Ray's `Result`, whose `metrics` hold the
        last epoch's logs and the final validation (`final_loss`, ...).

    Raises:
        ValueError: `num_workers` is under 1. Received: the value.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be 1 or more. Received: num_workers={num_workers}")
    # Ray workers do not start in the driver's working directory.
    model_dir = os.path.abspath(config.run.model_dir)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, model_dir=model_dir))
    return TensorflowTrainer(
        train_loop,
        train_loop_config={"config": config, "devices_per_worker": devices_per_worker},
        scaling_config=ScalingConfig(
            num_workers=num_workers, resources_per_worker={"CPU": cpus_per_worker}
        ),
        run_config=run_config,
    )


def train_loop(loop_config: dict) -> None:
    """Ray Train's function for each worker: trains `loop_config["config"]` with tfmulti.

    Args:
        loop_config: `{"config": TrainConfig, "devices_per_worker": int}`.
    """
    # Ray sets this for tf.keras 2; tfmulti trains Keras 3.
    os.environ.pop("TF_USE_LEGACY_KERAS", None)
    if loop_config.get("devices_per_worker"):
        from tfmulti.platform.runtime.devices import configure_logical_devices

        configure_logical_devices(loop_config["devices_per_worker"])
    from tfmulti.ray.reporting import ReportToRay, as_numbers, report
    from tfmulti.run.training import train
    from tfmulti.strategies import get_training_strategy

    config = loop_config["config"]
    context = ray.train.get_context()
    if _restarted_by_ray(config.run.model_dir, context):
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, resume=True))
    training_strategy = get_training_strategy(
        config.distribution.strategy, config.distribution.zero
    )
    # A hybrid mesh is chief-driven only when its pipe axis crosses the workers.
    training_strategy.resolve_cluster(config)
    if training_strategy.chief_drives_workers and context.get_world_size() > 1:
        _train_driven_by_chief(config, context.get_world_rank())
        return
    reporter = ReportToRay(config.run.model_dir)
    record = train(config, callbacks=[reporter])
    final = {f"final_{name}": value for name, value in as_numbers(record.get("final")).items()}
    report({**reporter.last, **final}, config.run.model_dir, config.run.epochs)


def _train_driven_by_chief(config: TrainConfig, rank: int) -> None:
    """Trains on the chief while the other workers serve it; reports once, at the end.

    `ray.train.report` waits for every worker; a serving worker waits there (serving on
    from another thread) until the chief has trained and reports its final metrics.
    """
    from tfmulti.ray.reporting import as_numbers, report
    from tfmulti.run.training import train

    if rank == 0:
        record = train(config)
        last = as_numbers(record["epochs"][-1] if record.get("epochs") else {})
        final = {f"final_{n}": v for n, v in as_numbers(record.get("final")).items()}
        report({**last, **final}, config.run.model_dir, config.run.epochs)
        return
    threading.Thread(target=train, args=(config,), daemon=True).start()
    report({}, config.run.model_dir, config.run.epochs)


def _restarted_by_ray(model_dir: str, context) -> bool:
    """Whether this start of the Ray run is a restart after a failure; every worker gets
    the chief's answer. The chief writes `RAY_RUN_FILE` at the run's first start."""
    from ray.train.collective import broadcast_from_rank_zero

    restarted = None
    if context.get_world_rank() == 0:
        path = os.path.join(model_dir, RAY_RUN_FILE)
        name = context.get_experiment_name()
        try:
            with open(path) as handle:
                restarted = json.load(handle).get("experiment") == name
        except (OSError, ValueError):
            restarted = False
        if not restarted:
            os.makedirs(model_dir, exist_ok=True)
            with open(path, "w") as handle:
                json.dump({"experiment": name}, handle)
    return broadcast_from_rank_zero(restarted)
