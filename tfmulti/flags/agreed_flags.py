"""The flags every worker of a chief-driven run must hold alike, read from the command line.

When the chief drives every worker's devices (`tfmulti.platform.runtime.connected_cluster`), a
serving worker's flags choose nothing, so a worker started with other flags than the
chief's is a launch gone wrong; `tfmulti.platform.runtime.cluster_agreement` compares what this
module collects. Library code never reads flags: scripts pass these values on, through
`TrainConfig.cluster.agreed_flags` (`training_flags.config_from_flags`) or directly.

Example:
    >>> flags.FLAGS(["train.py", "--num_stages=4"])
    >>> agreed_flags()["--num_stages"]
    '4'
"""

from __future__ import annotations

from absl import flags

# Flags that may rightly differ between workers: who this worker is, where it keeps its
# files (a chief-driven run reads and writes only the chief's), the devices it lends (a
# share that does not fit is refused by `devices_across_workers`), how long it waits and
# what it prints.
PER_WORKER_FLAGS = frozenset(
    {
        "task_index",
        "worker_hosts",  # compared as the cluster it describes
        "model_dir",
        "data_path",
        "resume",
        "virtual_devices",
        "connect_timeout",
        "collective_timeout",
        "tf_log_level",
        "verbose_workers",
    }
)


def agreed_flags() -> dict[str, str]:
    """Every flag this process was started with (absl's own and `PER_WORKER_FLAGS`
    aside), as `{"--name": value}`; empty when no flags were parsed.

    All of the script's flags count, not only the training settings, because what the
    workers must agree on is exactly their command lines, whatever script (training,
    benchmark) they run.
    """
    if not flags.FLAGS.is_parsed():
        return {}
    return {
        f"--{flag.name}": _shown(flag.value)
        for module, module_flags in flags.FLAGS.flags_by_module_dict().items()
        if not module.startswith("absl")
        for flag in module_flags
        if flag.name not in PER_WORKER_FLAGS
    }


def _shown(value) -> str:
    """A flag's value as a person would type it."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)
