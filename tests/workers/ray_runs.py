"""Runs tfmulti on one local Ray cluster: a page's Python blocks, then `tfmulti.ray.trainer`
runs.

Usage: python ray_runs.py PAGE RUNS_JSON RESULTS_JSON STORAGE_DIR
PAGE: a Markdown page whose ```python blocks run first, in order, in the working directory
(the first starts the cluster; its `result` is kept as "page").
RUNS_JSON: [{"name", "config" (TrainConfig.from_flat keys), "num_workers",
"devices_per_worker", "max_failures"}].
RESULTS_JSON gets {name: {"metrics", "error"}}.
Run it inside a loopback-only network namespace: Ray puts the machine's interface address
in TF_CONFIG otherwise.
"""

import json
import re
import sys

import ray
from ray.train import FailureConfig, RunConfig

from tfmulti.config import TrainConfig
from tfmulti.ray import trainer

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def as_result(result) -> dict:
    return {
        "metrics": result.metrics,
        "error": None if result.error is None else repr(result.error),
    }


def main(page: str, runs_path: str, results_path: str, storage_dir: str) -> None:
    with open(page) as handle:
        blocks = PYTHON_BLOCK.findall(handle.read())
    results = {}
    for index, block in enumerate(blocks):
        namespace = {"__name__": "__main__"}
        exec(compile(block, f"{page} python block {index + 1}", "exec"), namespace)
        if "result" in namespace:
            results["page"] = as_result(namespace["result"])
    with open(runs_path) as handle:
        runs = json.load(handle)
    for run in runs:
        result = trainer(
            TrainConfig.from_flat(**run["config"]),
            num_workers=run["num_workers"],
            devices_per_worker=run["devices_per_worker"],
            run_config=RunConfig(
                name=run["name"],
                storage_path=storage_dir,
                failure_config=FailureConfig(max_failures=run.get("max_failures", 0)),
            ),
        ).fit()
        results[run["name"]] = as_result(result)
    with open(results_path, "w") as handle:
        json.dump(results, handle)
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
