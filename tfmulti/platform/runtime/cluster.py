"""Which workers form the cluster, this process's place in it, and the multi-worker strategy.

Resolving the cluster imports no TensorFlow (except under SLURM), so flags can be
checked before TensorFlow starts. Worker 0 is the chief.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from absl import logging

from tfmulti.platform.launching import network_isolation

COMMUNICATIONS = ("auto", "ring", "nccl")
# MultiWorkerMirroredStrategy knows these jobs; a "chief" job, if present, is worker 0.
_JOBS_IN_RANK_ORDER = ("chief", "worker")
_DEFAULT_SLURM_PORT = 8888


class ClusterError(ValueError):
    """Raised when the cluster description is missing, malformed or inconsistent."""


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in a cluster of workers.

    Args:
        task_index: rank of this worker; 0 is the chief.
        worker_addresses: "host:port" of every worker, in rank order.
        source: where the cluster came from: "flags", "TF_CONFIG" or "SLURM".
        has_chief_job: whether TensorFlow's cluster spec names worker 0 as job "chief"
            (TF_CONFIG written for Keras 2) rather than "worker".
    """

    task_index: int
    worker_addresses: tuple[str, ...]
    source: str
    has_chief_job: bool = False

    @property
    def num_workers(self) -> int:
        return len(self.worker_addresses)

    @property
    def is_chief(self) -> bool:
        return self.task_index == 0

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster as TensorFlow's job -> addresses mapping."""
        if self.has_chief_job:
            return {"chief": [self.worker_addresses[0]], "worker": list(self.worker_addresses[1:])}
        return {"worker": list(self.worker_addresses)}

    def task(self) -> tuple[str, int]:
        """This process's (job name, index in job) as TensorFlow names it."""
        if self.has_chief_job:
            return ("chief", 0) if self.is_chief else ("worker", self.task_index - 1)
        return ("worker", self.task_index)


def resolve_cluster(
    worker_hosts: Sequence[str] | None = None,
    task_index: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterInfo:
    """Finds the cluster from explicit hosts, else `TF_CONFIG`, else a SLURM step.

    Args:
        worker_hosts: "host:port" of every worker; needs `task_index`.
        task_index: this worker's rank in `worker_hosts` (0 is the chief).
        environ: environment to read; defaults to `os.environ`.

    Returns:
        The resolved `ClusterInfo`.

    Raises:
        ClusterError: nothing describes a cluster, or the description is invalid.

    Example:
        >>> resolve_cluster(["127.0.0.1:2222", "127.0.0.1:2223"], task_index=1).is_chief
        False
    """
    environ = os.environ if environ is None else environ
    if worker_hosts:
        if task_index is None:
            raise ClusterError(
                f"worker_hosts needs task_index (this worker's rank). "
                f"Received: worker_hosts={list(worker_hosts)}, task_index=None"
            )
        return _checked(tuple(worker_hosts), task_index, "flags")
    if task_index is not None:
        raise ClusterError(
            f"task_index needs worker_hosts (every worker's host:port). "
            f"Received: task_index={task_index}, worker_hosts={worker_hosts}"
        )
    if environ.get("TF_CONFIG"):
        return _from_tf_config(environ["TF_CONFIG"])
    if "SLURM_PROCID" in environ and "SLURM_STEP_NODELIST" in environ:
        return _from_slurm(environ)
    raise ClusterError(
        "No cluster found: pass worker_hosts and task_index, set TF_CONFIG, or run inside "
        "a SLURM step (srun). Received: worker_hosts=None, task_index=None, no TF_CONFIG, "
        "no SLURM_PROCID/SLURM_STEP_NODELIST"
    )


def _checked(
    addresses: tuple[str, ...], task_index: int, source: str, has_chief_job: bool = False
) -> ClusterInfo:
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ClusterError(
                f"Each worker address must be host:port with a port in 1..65535. "
                f"Received: {address!r} from {source}"
            )
    if len(set(addresses)) != len(addresses):
        raise ClusterError(f"Worker addresses must be distinct. Received: {list(addresses)}")
    if not isinstance(task_index, int) or not 0 <= task_index < len(addresses):
        raise ClusterError(
            f"task index must be in 0..{len(addresses) - 1} for {len(addresses)} workers. "
            f"Received: task_index={task_index!r} from {source}"
        )
    return ClusterInfo(task_index, addresses, source, has_chief_job)


def _from_tf_config(text: str) -> ClusterInfo:
    try:
        config = json.loads(text)
        cluster = config["cluster"]
        task_type = config["task"]["type"]
        index_in_job = config["task"]["index"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ClusterError(
            'TF_CONFIG must be JSON like {"cluster": {"worker": ["host:port", ...]}, '
            f'"task": {{"type": "worker", "index": 0}}}} ({error}). Received: TF_CONFIG={text!r}'
        ) from None
    unknown_jobs = sorted(set(cluster) - set(_JOBS_IN_RANK_ORDER))
    if unknown_jobs or task_type not in _JOBS_IN_RANK_ORDER:
        raise ClusterError(
            "MultiWorkerMirroredStrategy runs only 'chief' and 'worker' tasks. "
            f"Received: jobs {sorted(cluster)}, task type {task_type!r} in TF_CONFIG"
        )
    chiefs = list(cluster.get("chief", []))
    if len(chiefs) > 1:
        raise ClusterError(f"TF_CONFIG may name at most one chief. Received: chief={chiefs}")
    jobs = {"chief": chiefs, "worker": list(cluster.get("worker", []))}
    if not isinstance(index_in_job, int) or not 0 <= index_in_job < len(jobs[task_type]):
        raise ClusterError(
            f"TF_CONFIG task index must be in 0..{len(jobs[task_type]) - 1} for job "
            f"{task_type!r}. Received: index={index_in_job!r}"
        )
    rank = index_in_job + (len(chiefs) if task_type == "worker" else 0)
    return _checked(tuple(chiefs + jobs["worker"]), rank, "TF_CONFIG", has_chief_job=bool(chiefs))


def _from_slurm(environ: Mapping[str, str]) -> ClusterInfo:
    import tensorflow as tf

    saved_environ = dict(os.environ)
    os.environ.update(environ)
    try:
        # GPUs are left to SLURM (--gpus-per-task sets CUDA_VISIBLE_DEVICES). The
        # resolver pairs each task with a GPU slot and fails with zero GPUs, so it is
        # given one dummy slot per task and told not to set CUDA_VISIBLE_DEVICES.
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=int(environ.get("TFMULTI_SLURM_PORT_BASE", _DEFAULT_SLURM_PORT)),
            gpus_per_node=1024,
            gpus_per_task=1,
            auto_set_gpu=False,
        )
        addresses = tuple(resolver.cluster_spec().as_dict()["worker"])
        rank = resolver.task_id
    except (RuntimeError, ValueError) as error:
        raise ClusterError(f"Cannot read the SLURM step: {error}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
    return _checked(addresses, rank, "SLURM")


def build_multi_worker_strategy(
    cluster: ClusterInfo,
    communication: str = "auto",
    timeout_seconds: float | None = None,
    connect_timeout_seconds: float | None = None,
):
    """Builds a MultiWorkerMirroredStrategy for `cluster`; call before any other TensorFlow work.

    Args:
        cluster: from `resolve_cluster`.
        communication: collective implementation: "auto", "ring" (gRPC) or "nccl" (GPUs).
        timeout_seconds: a collective that takes longer fails with DeadlineExceeded
            instead of hanging; None waits forever.
        connect_timeout_seconds: if set and the workers have not all joined by then, one
            line naming the unreachable peers goes to stderr and the process is killed
            (status 137): TensorFlow waits for peers in C++, where no exception reaches.

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`.

    Raises:
        ClusterError: a bad argument, or TensorFlow was initialised before the strategy.

    Example:
        >>> strategy = build_multi_worker_strategy(resolve_cluster(), communication="ring")
    """
    if communication not in COMMUNICATIONS:
        raise ClusterError(
            f"communication must be one of {COMMUNICATIONS}. Received: {communication!r}"
        )
    for name, value in (
        ("timeout_seconds", timeout_seconds),
        ("connect_timeout_seconds", connect_timeout_seconds),
    ):
        if value is not None and value <= 0:
            raise ClusterError(f"{name} must be positive or None. Received: {name}={value}")
    if cluster.is_chief:
        log_exposure(cluster)
    import tensorflow as tf

    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[communication]
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=implementation, timeout_seconds=timeout_seconds
    )
    task_type, task_id = cluster.task()
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec()),
        task_type=task_type,
        task_id=task_id,
        rpc_layer="grpc",
    )
    watchdog = start_join_watchdog(cluster, connect_timeout_seconds)
    try:
        return _new_strategy(resolver, options)
    except RuntimeError as error:
        raise ClusterError(
            "Build the multi-worker strategy before any other TensorFlow work (tensors, "
            f"models, listing logical devices). TensorFlow said: {error}"
        ) from None
    finally:
        if watchdog is not None:
            watchdog.stdin.close()  # tells the watchdog to stand down
            watchdog.wait()


def log_exposure(cluster: ClusterInfo) -> None:
    # A launch in a private network (only loopback) is out of everyone else's reach; any
    # other cluster is reachable by whoever reaches its hosts, so the chief says so once.
    if network_isolation.has_only_loopback():
        return
    logging.log_first_n(
        logging.WARNING,
        "This job's %d workers (cluster from %s) listen on %s, on every interface of their "
        "hosts, with no authentication: whoever reaches these ports can run operations in "
        "the workers. Run only on a trusted network (docs/guide/multi_worker.md#security).",
        1,
        cluster.num_workers,
        cluster.source,
        ", ".join(cluster.worker_addresses),
    )


# TensorFlow waits for peers in C++ without releasing the GIL, so neither a thread
# nor a signal handler of this process can act; a separate process can.
_WATCHDOG_CODE = """
import os, select, signal, socket, sys
parent, timeout, rank = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
addresses = sys.argv[4:]
if select.select([sys.stdin], [], [], timeout)[0]:
    sys.exit(0)
def reachable(address):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False
unreachable = [f"worker {peer} at {address}" for peer, address in enumerate(addresses)
               if peer != rank and not reachable(address)]
sys.stderr.write(f"tfmulti: worker {rank}: the {len(addresses)} workers did not all join "
                 f"in {timeout:g} s; unreachable: {', '.join(unreachable) or 'none'}\\n")
sys.stderr.flush()
os.kill(parent, signal.SIGKILL)
"""


def start_join_watchdog(cluster: ClusterInfo, timeout_seconds: float | None):
    if timeout_seconds is None:
        return None
    arguments = [str(os.getpid()), str(timeout_seconds), str(cluster.task_index)]
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG_CODE, *arguments, *cluster.worker_addresses],
        stdin=subprocess.PIPE,
    )


def _new_strategy(resolver, options):
    import tensorflow as tf

    from tfmulti.compat import tf_internals

    cpu = tf.config.list_physical_devices("CPU")[0]
    num_logical_cpus = len(tf.config.get_logical_device_configuration(cpu) or [cpu])
    if tf.config.list_physical_devices("GPU") or num_logical_cpus == 1:
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options
        )

    # Without GPUs the strategy uses only CPU:0 of each worker; this one uses every
    # logical CPU device, so a worker can hold several replicas.
    return tf_internals.multi_worker_strategy_on_logical_cpus(resolver, options, num_logical_cpus)


def worker_output_dir(model_dir: str, cluster: ClusterInfo) -> str:
    """Where this worker writes: `model_dir` on the chief, a private temp dir elsewhere.

    The temp dir is removed when the process exits.

    Example:
        >>> worker_output_dir("/runs/a", resolve_cluster(["h:1", "h:2"], task_index=1))
        '/tmp/tfmulti-worker1-...'
    """
    if cluster.is_chief:
        return model_dir
    path = tempfile.mkdtemp(prefix=f"tfmulti-worker{cluster.task_index}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def resolve_cluster_if_described(
    worker_hosts: Sequence[str] | None = None,
    task_index: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterInfo | None:
    """The cluster a run spans, or None when it runs on this host alone.

    A run spans workers when explicit hosts, `TF_CONFIG` or a SLURM step describe
    more than one worker (see `resolve_cluster`).

    Example:
        >>> resolve_cluster_if_described(environ={}) is None
        True
    """
    environ = os.environ if environ is None else environ
    described = (
        worker_hosts
        or task_index is not None
        or environ.get("TF_CONFIG")
        or ("SLURM_PROCID" in environ and "SLURM_STEP_NODELIST" in environ)
    )
    if not described:
        return None
    cluster = resolve_cluster(worker_hosts, task_index, environ)
    return cluster if cluster.num_workers > 1 else None
