"""One program over every worker's devices: the chief drives, the other workers serve.

The chief connects to the cluster (`tf.config.experimental_connect_to_cluster`), after
which the other workers' devices are its own logical devices
(`/job:worker/replica:0/task:1/device:CPU:0`): a `tf.function` placed across them runs as
one program, and TensorFlow's runtime moves the tensors between hosts. Every other worker
only starts a `tf.distribute.Server` with its logical devices and serves until the chief
has gone. This is how a pipeline puts its stages on different workers, and a hybrid mesh its pipe
axis (`mesh_groups_across_workers`). On connecting, the chief refuses a worker started with
other flags or another cluster than its own, and while it trains it takes a serving
worker's SIGTERM as its own (`cluster_agreement`).

Example:
    >>> cluster = resolve_cluster()
    >>> settings = {"--num_stages": "4"}  # the flags every worker must hold alike
    >>> if not cluster.is_chief:
    ...     serve_chief(cluster, settings=settings)  # returns once the chief has finished
    >>> connect_to_workers(cluster, settings=settings)
    >>> devices = devices_across_workers(cluster, 4, "--num_stages=4")
"""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Mapping

from absl import logging

from tfmulti.platform.launching.sigterm import on_main_thread
from tfmulti.platform.mesh import HybridMesh
from tfmulti.platform.runtime import cluster as cluster_lib
from tfmulti.platform.runtime.cluster import ClusterError, ClusterInfo
from tfmulti.platform.runtime.cluster_agreement import (
    WorkerNotices,
    agreed_settings,
    disagreement_message,
)
from tfmulti.platform.runtime.quiet_logs import warnings_only

_POLL_SECONDS = 0.5
# Each look for a serving worker's SIGTERM is a remote operation on every worker: at most
# once a second, and at least every few steps, so a run of fast steps that ends within a
# second of the signal still sees it.
_SIGTERM_CHECK_SECONDS = 1.0
_SIGTERM_CHECK_STEPS = 8
# The workers the chief drives, once connected (TensorFlow's connection is process-wide
# too): (rank, CPU device, notices).
_serving_workers: list[tuple[int, str, WorkerNotices]] = []
_next_sigterm_check = 0.0
_steps_since_sigterm_check = 0


def connect_to_workers(
    cluster: ClusterInfo,
    connect_timeout_seconds: float | None = None,
    settings: Mapping[str, str] | None = None,
) -> None:
    """Makes every worker's devices logical devices of this process (the chief).

    Call before any other TensorFlow work (logical devices may be configured first). The
    call returns once every worker serves and agrees with this process on the cluster
    and `settings`.

    Args:
        cluster: from `resolve_cluster`; this process must be its chief.
        connect_timeout_seconds: if set and the workers have not all joined by then, one
            line naming the unreachable ones goes to stderr and the process is killed.
        settings: what every worker must hold alike besides the cluster, as
            `{"--name": value}`: scripts pass their command line's
            (`tfmulti.flags.agreed_flags`); None compares the cluster alone.

    Raises:
        ClusterError: this process is not the chief, TensorFlow already started, or a
            worker disagrees (the message names the worker and each setting it differs
            on); the workers stop serving once this process has exited.
    """
    if not cluster.is_chief:
        raise ClusterError(
            f"Only the chief connects to the other workers; worker {cluster.task_index} "
            f"serves them (serve_chief). Received: task_index={cluster.task_index}"
        )
    cluster_lib.log_exposure(cluster)
    import tensorflow as tf

    job, task = cluster.task()
    watchdog = cluster_lib.start_join_watchdog(cluster, connect_timeout_seconds)
    # TensorFlow logs the whole session config at INFO while it connects.
    try:
        with warnings_only():
            tf.config.experimental_connect_to_cluster(
                tf.train.ClusterSpec(cluster.cluster_spec()), job_name=job, task_index=task
            )
            tf.config.list_logical_devices()  # waits for the workers that have not joined yet
    except (RuntimeError, ValueError) as error:
        raise ClusterError(
            "Connect to the workers before any other TensorFlow work (tensors, models, "
            f"listing logical devices). TensorFlow said: {error}"
        ) from None
    finally:
        if watchdog is not None:
            watchdog.stdin.close()  # tells the watchdog to stand down
            watchdog.wait()
    _refuse_disagreeing_workers(cluster, settings or {})


def serve_chief(
    cluster: ClusterInfo,
    connect_timeout_seconds: float | None = None,
    settings: Mapping[str, str] | None = None,
) -> None:
    """Lends this worker's logical devices to the chief until the chief has gone.

    Posts the cluster as this worker sees it and `settings` for the chief to check, starts
    a `tf.distribute.Server` at this worker's address in `cluster` with as many logical
    CPU devices as this process was configured with (`configure_logical_devices`), then
    waits: first for the chief to listen, then for it to stop listening. Once the chief
    listens, SIGTERM does not end this worker: it tells the chief, which saves a step
    checkpoint (reading this worker's variables) and stops the group (on the main thread;
    elsewhere SIGTERM keeps its handler).

    Args:
        cluster: from `resolve_cluster`; this process must not be its chief.
        connect_timeout_seconds: seconds to wait for the chief to listen; None waits
            forever.
        settings: what every worker must hold alike besides the cluster, as
            `{"--name": value}`: scripts pass their command line's
            (`tfmulti.flags.agreed_flags`); None posts the cluster alone.

    Raises:
        ClusterError: this process is the chief, or the chief never listened.
    """
    if cluster.is_chief:
        raise ClusterError("The chief connects to the workers (connect_to_workers), not serves.")
    notices = WorkerNotices(cluster.worker_addresses[cluster.task_index])
    notices.post_settings(agreed_settings(cluster, settings or {}))
    try:
        _serve_until_the_chief_has_gone(cluster, connect_timeout_seconds, notices)
    finally:
        notices.remove()


def serving_worker_got_sigterm() -> int | None:
    """The rank of a worker the chief drives that got SIGTERM, else None.

    Called once a step. On the chief after `connect_to_workers`, it looks once a second
    or every `_SIGTERM_CHECK_STEPS` calls, whichever comes first; elsewhere it returns
    None at once.
    """
    global _next_sigterm_check, _steps_since_sigterm_check
    if not _serving_workers:
        return None
    _steps_since_sigterm_check += 1
    if time.monotonic() < _next_sigterm_check and _steps_since_sigterm_check < _SIGTERM_CHECK_STEPS:
        return None
    _next_sigterm_check = time.monotonic() + _SIGTERM_CHECK_SECONDS
    _steps_since_sigterm_check = 0
    return next(
        (rank for rank, device, notices in _serving_workers if notices.got_sigterm(device)), None
    )


def _refuse_disagreeing_workers(cluster: ClusterInfo, settings: Mapping[str, str]) -> None:
    """Reads every serving worker's posted settings on its host; raises on the first
    worker that differs from this process (the chief)."""
    chief = agreed_settings(cluster, settings)
    tasks = _tasks_in_rank_order(cluster)
    _serving_workers.clear()
    for rank in range(1, cluster.num_workers):
        job, task = tasks[rank]
        device = f"/job:{job}/replica:0/task:{task}/device:CPU:0"
        notices = WorkerNotices(cluster.worker_addresses[rank])
        worker = notices.read_settings(device)
        if worker is None:
            logging.warning(
                "Worker %d posted no settings at %s on its host (its TMPDIR may differ from "
                "the chief's), so its flags are not checked against the chief's.",
                rank,
                notices.settings_path,
            )
        elif message := disagreement_message(rank, chief, worker):
            raise ClusterError(message)
        _serving_workers.append((rank, device, notices))


def _serve_until_the_chief_has_gone(
    cluster: ClusterInfo, connect_timeout_seconds: float | None, notices: WorkerNotices
) -> None:
    import tensorflow as tf

    job, task = cluster.task()
    tf.distribute.Server(
        tf.train.ClusterSpec(cluster.cluster_spec()),
        job_name=job,
        task_index=task,
        protocol="grpc",
        config=tf.compat.v1.ConfigProto(device_count={"CPU": _logical_cpu_count()}),
    )
    chief = cluster.worker_addresses[0]
    deadline = (
        None if connect_timeout_seconds is None else time.monotonic() + connect_timeout_seconds
    )
    while not _listens(chief):
        if deadline is not None and time.monotonic() > deadline:
            raise ClusterError(
                f"Worker {cluster.task_index}: the chief at {chief} did not listen within "
                f"{connect_timeout_seconds:g} s (--connect_timeout)."
            )
        time.sleep(_POLL_SECONDS)
    # A SIGTERM (preemption, or the launcher stopping the group) is the chief's to act on:
    # told by the notice, it saves a step checkpoint, which reads this worker's
    # variables, so this worker serves on until the chief has gone. Off the main thread
    # (Ray Train) no handler can be installed: the engine that runs us stops the group.
    if on_main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: notices.post_sigterm())
    from tfmulti.platform.runtime.allocator_peaks import local_peaks

    while _listens(chief):
        notices.post_memory(_as_served(local_peaks(), job, task))
        time.sleep(_POLL_SECONDS)


def _as_served(peaks: dict, job: str, task: int) -> dict:
    """This worker's device names as the chief sees them (its job and task, replica 0)."""
    import tensorflow as tf

    served = {}
    for name, peak in peaks.items():
        spec = tf.DeviceSpec.from_string(name).replace(job=job, replica=0, task=task)
        served[spec.to_string()] = peak
    return served


def posted_worker_peaks() -> dict[str, int | None]:
    """The allocator peaks every serving worker posted, by device as the chief names it."""
    peaks: dict[str, int | None] = {}
    for _, device, notices in _serving_workers:
        peaks.update(notices.read_memory(device))
    return peaks


def devices_across_workers(cluster: ClusterInfo, count: int, purpose: str) -> list[str]:
    """`count` devices, the same number on each worker, in rank order, then device order.

    Consecutive pipeline stages thus share a worker and only the stage boundaries between
    workers cross hosts: with 2 workers of 2 devices, stages 0-1 run on worker 0, 2-3 on
    worker 1. Call on the chief after `connect_to_workers`.

    Args:
        count: how many devices are needed.
        purpose: what needs them, for the message, e.g. "--num_stages=4".

    Raises:
        ValueError: `count` does not split evenly over the workers, or a worker has too
            few devices; the message names the devices each worker has.
    """
    from tfmulti.platform.runtime.devices import accelerator_type, logical_device_names

    names = logical_device_names(accelerator_type())
    per_worker = [_devices_of(names, job, task) for job, task in _tasks_in_rank_order(cluster)]
    share, remainder = divmod(count, cluster.num_workers)
    available = [len(devices) for devices in per_worker]
    if remainder or share == 0 or min(available) < share:
        raise ValueError(
            f"{purpose} over {cluster.num_workers} workers needs the same number of devices "
            f"on each, at most as many as each has; use a multiple of {cluster.num_workers} "
            f"up to {cluster.num_workers * min(available)}, or give the workers more devices "
            f"(--devices_per_worker). Received: {count} devices, workers with {available}"
        )
    return [name for devices in per_worker for name in devices[:share]]


def mesh_groups_across_workers(cluster: ClusterInfo, mesh: HybridMesh) -> list[list[list[str]]]:
    """Per data replica and pipeline stage, its tensor devices, with the pipe axis across
    the workers: each worker holds pipe / workers consecutive stages of every replica.

    A stage's data and tensor groups then stay inside one worker (gradient sums and
    tensor all-reduces never cross hosts); only activations and their gradients at the
    stage boundaries between workers do. Call on the chief after `connect_to_workers`.

    Raises:
        ValueError: the pipe axis does not split evenly over the workers, or a worker has
            too few devices.

    Example:
        >>> mesh_groups_across_workers(cluster, parse_mesh("data=2,pipe=2"))  # 2 x 2 devices
        [[['/job:worker/.../task:0/device:CPU:0'], ['/job:worker/.../task:1/device:CPU:0']],
         [['/job:worker/.../task:0/device:CPU:1'], ['/job:worker/.../task:1/device:CPU:1']]]
    """
    if mesh.pipe % cluster.num_workers:
        raise ValueError(
            f"--cross_host_axis=pipe lays mesh {mesh}'s pipe axis over {cluster.num_workers} "
            f"workers, so pipe must be a multiple of {cluster.num_workers}; use "
            f"--cross_host_axis=data or another mesh. Received: pipe={mesh.pipe}"
        )
    devices = devices_across_workers(cluster, mesh.num_devices, f"--mesh={mesh}")
    return pipe_major_groups(devices, mesh)


def pipe_major_groups(devices: list[str], mesh: HybridMesh) -> list[list[list[str]]]:
    """Splits `devices`, in rank order, into per replica and stage its tensor devices, in
    Megatron's rank order: tensor fastest, then data, then pipe.

    Example:
        >>> pipe_major_groups(["a", "b", "c", "d"], parse_mesh("data=2,pipe=2"))
        [[['a'], ['c']], [['b'], ['d']]]
    """
    return [
        [
            [
                devices[(stage * mesh.data + replica) * mesh.tensor + rank]
                for rank in range(mesh.tensor)
            ]
            for stage in range(mesh.pipe)
        ]
        for replica in range(mesh.data)
    ]


def lost_worker_message(error_text: str) -> str:
    """One line for TensorFlow's UnavailableError when a connected worker has gone away.

    Example:
        >>> lost_worker_message(str(error))
        'Lost a worker: TensorFlow could not reach /job:worker/replica:0/task:1/device:CPU:0 ...'
    """
    target = re.search(r"remote target (\S+) while", error_text)
    reason = re.search(r'grpc_message:"([^"]+)"', error_text)
    return (
        f"Lost a worker: TensorFlow could not reach {target[1] if target else 'a worker'}"
        f"{f' ({reason[1]})' if reason else ''}; check that worker's log. Under "
        "scripts/launch.py, --max_restarts restarts the group from the last step checkpoint."
    )


def _tasks_in_rank_order(cluster: ClusterInfo) -> list[tuple[str, int]]:
    spec = cluster.cluster_spec()
    return [(job, index) for job in ("chief", "worker") for index in range(len(spec.get(job, [])))]


def _devices_of(names: list[str], job: str, task: int) -> list[str]:
    import tensorflow as tf

    specs = [(tf.DeviceSpec.from_string(name), name) for name in names]
    owned = [
        (spec.device_index, name) for spec, name in specs if (spec.job, spec.task) == (job, task)
    ]
    return [name for _, name in sorted(owned)]


def _logical_cpu_count() -> int:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    return len(tf.config.get_logical_device_configuration(cpu) or [cpu])


def _listens(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
        return True
    except OSError:
        return False
