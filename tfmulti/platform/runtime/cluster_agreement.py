"""What the workers of a chief-driven run must agree on, and a serving worker's notices.

When the chief drives every worker's devices (`connected_cluster`), a serving worker runs
nothing of its own, so its flags choose nothing: a worker started with another model,
stage count or cluster than the chief's is a launch gone wrong that would train the
chief's model unnoticed. So each serving worker posts its settings in a small file on
its own host before its server starts, and once connected the chief reads every
worker's with `tf.io.read_file` placed on that worker's CPU (TensorFlow's runtime
carries the bytes; no socket of ours) and refuses a worker that disagrees in one line.
A serving worker that gets SIGTERM posts a notice next to it, which the chief polls the
same way and takes as its own SIGTERM (`tfmulti.run.preemption`).

The settings are plain values the caller gives, as `{"--name": value}`: scripts collect
their command line's flags with `tfmulti.flags.agreed_flags` (this module reads no flags).

The files live in the temporary directory (`TMPDIR`), named by the worker's address, so
the chief finds them when the hosts share that setting, as under `scripts/launch.py`;
where they do not, the chief says so and trains without the check.

Example:
    >>> chief = agreed_settings(cluster, {"--num_stages": "4"})
    >>> worker = agreed_settings(cluster, {"--num_stages": "2"})
    >>> disagreement_message(1, chief, worker)
    'Worker 1 disagrees with the chief on --num_stages (chief 4, worker 2); start every
    worker with the same flags.'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Mapping

from tfmulti.platform.runtime.cluster import ClusterInfo

CLUSTER_SETTING = "the cluster"


def agreed_settings(cluster: ClusterInfo, settings: Mapping[str, str]) -> dict[str, str]:
    """`settings` with the cluster as this process sees it: every worker's address in
    rank order, and whether worker 0 is TensorFlow's job "chief"."""
    chief_job = " (worker 0 as job chief)" if cluster.has_chief_job else ""
    return {CLUSTER_SETTING: ",".join(cluster.worker_addresses) + chief_job, **settings}


def disagreement_message(rank: int, chief: Mapping[str, str], worker: Mapping[str, str]) -> str:
    """One line naming every setting worker `rank` holds otherwise than the chief; ""
    when they agree.

    Example:
        >>> disagreement_message(1, {"--schedule": "1f1b"}, {"--schedule": "gpipe"})
        'Worker 1 disagrees with the chief on --schedule (chief 1f1b, worker gpipe); start
        every worker with the same flags.'
    """
    differences = [
        f"{name} (chief {chief.get(name, 'not given')}, worker {worker.get(name, 'not given')})"
        for name in [*chief, *(name for name in worker if name not in chief)]
        if chief.get(name) != worker.get(name)
    ]
    if not differences:
        return ""
    return (
        f"Worker {rank} disagrees with the chief on {' and '.join(differences)}; start every "
        "worker with the same flags."
    )


class WorkerNotices:
    """The files a serving worker posts for the chief: its settings, and a SIGTERM notice.

    Args:
        address: the worker's "host:port" in the cluster; the chief names the same files
            from its own view of the cluster.
    """

    def __init__(self, address: str):
        stem = os.path.join(
            tempfile.gettempdir(), "tfmulti-worker-" + re.sub(r"[^\w.-]", "_", address)
        )
        self.settings_path = stem + ".json"
        self.sigterm_path = stem + ".sigterm"
        self.memory_path = stem + ".memory.json"

    def post_settings(self, settings: Mapping[str, str]) -> None:
        """Writes `settings` whole (a reader never sees half a file) and clears a notice a
        killed worker of an earlier run at this address may have left."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.sigterm_path)
        scratch = f"{self.settings_path}.{os.getpid()}"
        with open(scratch, "w") as handle:
            json.dump(dict(settings), handle)
        os.replace(scratch, self.settings_path)

    def post_sigterm(self) -> None:
        """Tells the chief this worker got SIGTERM (safe in a signal handler)."""
        with open(self.sigterm_path, "w"):
            pass

    def post_memory(self, peaks: Mapping[str, int | None]) -> None:
        """Writes this worker's allocator peaks by device, whole, for the chief's record."""
        scratch = f"{self.memory_path}.{os.getpid()}"
        with open(scratch, "w") as handle:
            json.dump(dict(peaks), handle)
        os.replace(scratch, self.memory_path)

    def read_memory(self, device: str) -> dict[str, int | None]:
        """The peaks posted on `device`'s host, read there by TensorFlow; {} if none."""
        import tensorflow as tf

        try:
            with tf.device(device):
                return json.loads(tf.io.read_file(self.memory_path).numpy())
        except tf.errors.NotFoundError:
            return {}

    def remove(self) -> None:
        for path in (self.settings_path, self.sigterm_path, self.memory_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def read_settings(self, device: str) -> dict[str, str] | None:
        """The settings posted on `device`'s host, read there by TensorFlow; None if none
        were posted at this path."""
        import tensorflow as tf

        try:
            with tf.device(device):
                text = tf.io.read_file(self.settings_path).numpy()
        except tf.errors.NotFoundError:
            return None
        return json.loads(text)

    def got_sigterm(self, device: str) -> bool:
        """Whether a SIGTERM notice is posted on `device`'s host, looked up there."""
        import tensorflow as tf

        with tf.device(device):
            return tf.io.matching_files(self.sigterm_path).shape[0] > 0
