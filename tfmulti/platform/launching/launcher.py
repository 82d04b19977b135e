"""Run N copies of a training command as a local multi-worker cluster, like torchrun.

Each worker gets its own process group, loopback port and `TF_CONFIG`. If any
worker fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) and the failure is reported; optionally the whole group restarts with
fresh ports. Where Linux allows it, the workers share a private network holding only
loopback, so their unauthenticated gRPC ports are out of reach of other machines
(`network_isolation.py`). No TensorFlow is imported here.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TextIO

from tfmulti.names import PREEMPTED_EXIT_CODE, RESTART_COUNT_VARIABLE
from tfmulti.platform.launching.membership import (
    MEMBERSHIP_VARIABLE,
    SLOT_VARIABLE,
    Change,
    DataReplicas,
    Membership,
    SlotListWatcher,
    WorkerRange,
    slot_source,
)
from tfmulti.platform.launching.network_isolation import (
    ISOLATION_VARIABLE,
    ISOLATIONS,
    IsolationUnavailable,
    PrivateNetwork,
)
from tfmulti.platform.launching.remote_shell import (
    FORWARDED_VARIABLES,
    HOST_PLACEHOLDER,
    RemoteShell,
    RemoteShellError,
    remote_command_line,
    remote_python,
)
from tfmulti.platform.launching.slurm_nodes import allocation_slots, host_of, is_this_machine
from tfmulti.platform.launching.worker_group import WorkerGroup, WorkerProcess
from tfmulti.platform.launching.worker_places import (
    WorkerPlace,
    loopback_places,
    slot_places,
    visible_gpu_count,
)

VIRTUAL_DEVICES_ENV = "TFMULTI_VIRTUAL_DEVICES"
# The exit status of a launch stopped by a host the remote shell could not reach (ssh's).
_UNREACHABLE_STATUS = 255
# Where an elastic launch's slots come from, besides a file or a command.
SLOT_ORIGINS = ("slurm",)


class LaunchError(ValueError):
    """Raised for a launch request that cannot be carried out."""


def worker_variables(
    places: Sequence[WorkerPlace], devices_per_worker: int | None = None
) -> list[dict[str, str]]:
    """The variables the launcher sets for each worker: `TF_CONFIG` naming every worker's
    address, unbuffered output, and its devices (a CUDA_VISIBLE_DEVICES slice of its host's
    GPUs, else TFMULTI_VIRTUAL_DEVICES logical CPU devices when `devices_per_worker` is set).
    """
    if devices_per_worker is not None and devices_per_worker < 1:
        raise LaunchError(
            f"devices_per_worker must be >= 1. Received: devices_per_worker={devices_per_worker}"
        )
    addresses = [place.address for place in places]
    assigned = []
    for rank, place in enumerate(places):
        variables = {
            "TF_CONFIG": json.dumps(
                {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
            ),
            # Progress bars and prefixed lines appear as they are printed, not at exit.
            "PYTHONUNBUFFERED": "1",
        }
        gpu_ids = _gpu_slice(place, devices_per_worker)
        if gpu_ids:
            variables["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpu_ids)
        elif devices_per_worker is not None:
            variables[VIRTUAL_DEVICES_ENV] = str(devices_per_worker)
        assigned.append(variables)
    return assigned


def worker_environments(
    num_workers: int,
    devices_per_worker: int | None = None,
    num_gpus: int = 0,
    base_environment: dict[str, str] | None = None,
    places: Sequence[WorkerPlace] | None = None,
) -> list[dict[str, str]]:
    """Environment of each worker: `base_environment` (default os.environ) with
    `worker_variables`.

    Args:
        num_workers: workers in the group, all here on fresh loopback ports, when `places`
            (where each worker runs, `worker_places`) is not given.
        devices_per_worker: GPUs per worker when its host has GPUs (default: an even
            share of them), else logical CPU devices, passed as TFMULTI_VIRTUAL_DEVICES.
        num_gpus: GPUs on this machine, when `places` is not given.
        base_environment: copied into every worker's environment; default os.environ.
        places: where each worker runs.

    Example:
        >>> worker_environments(2, devices_per_worker=2)[1]["TF_CONFIG"]
        '{"cluster": {"worker": ["127.0.0.1:...", "127.0.0.1:..."]}, "task": {...}}'
    """
    if num_workers < 1:
        raise LaunchError(f"num_workers must be >= 1. Received: num_workers={num_workers}")
    places = list(places) if places is not None else loopback_places(num_workers, num_gpus)
    base = dict(os.environ if base_environment is None else base_environment)
    return [{**base, **variables} for variables in worker_variables(places, devices_per_worker)]


def _gpu_slice(place: WorkerPlace, devices_per_worker: int | None) -> range:
    """The GPUs of its host a worker sees: its share, by its position on the host."""
    if not place.host_gpus:
        return range(0)
    per_worker = devices_per_worker or place.host_gpus // place.workers_on_host
    if per_worker * place.workers_on_host > place.host_gpus:
        host = place.address.rpartition(":")[0]
        raise LaunchError(
            f"{place.workers_on_host} workers x {per_worker} GPUs need more than the "
            f"{place.host_gpus} GPUs of {host}: lower --devices_per_worker or list fewer "
            f"slots on {host}. Received: devices_per_worker={devices_per_worker}"
        )
    first = place.index_on_host * per_worker
    return range(first, first + per_worker)


def launch(
    command: Sequence[str],
    num_workers: int | str,
    devices_per_worker: int | None = None,
    max_restarts: int = 0,
    grace_seconds: float = 10.0,
    stream: TextIO | None = None,
    messages: TextIO | None = None,
    isolation: str | None = None,
    max_restarts_per_worker: int | None = None,
    hosts_file: str | None = None,
    discovery_command: str | None = None,
    global_batch_size: int | None = None,
    rendezvous_timeout: float = 60.0,
    slots_from: str | None = None,
    mesh: str | None = None,
    cross_host_axis: str = "pipe",
    remote_shell: str | None = None,
    one_replica: bool = False,
) -> int:
    """Runs `command` as `num_workers` workers and returns the exit status (0: success).

    Args:
        command: the worker command, e.g. ["python", "scripts/train.py", "--strategy=multi_worker"].
        num_workers: workers to start: N, or "MIN:MAX" for an elastic job that starts
            MAX (or as many as the slot list holds) and goes on with as few as MIN.
        devices_per_worker: GPUs or logical CPU devices per worker (see `worker_environments`).
        max_restarts: how many times the whole group restarts, on fresh ports, after a failure;
            each worker sees the attempt number in `TFMULTI_RESTART_COUNT`, and
            `scripts/train.py` resumes its run when it is above 0.
        grace_seconds: time between SIGTERM and SIGKILL when stopping workers.
        stream: where workers' prefixed output goes; default sys.stdout.
        messages: where the launcher's own messages go; default sys.stderr.
        isolation: "auto" runs the workers in a private network holding only loopback
            where Linux allows it, else warns in one line naming the open ports;
            "namespace" refuses to start (status 1, one line) without that network;
            "none" warns and does not try. Default: `$TFMULTI_ISOLATION`, else "auto".
        max_restarts_per_worker: a failed slot's worker restarts (the whole group) up to
            this many times, whatever `max_restarts` is; a slot that fails more often is
            dropped and the group restarts on the rest, if at least MIN. None: failures
            count against `max_restarts` only, and slots are never dropped for them.
        hosts_file: the slots, one a line, re-read while the job runs: a slot that leaves
            or joins stops the group on the preemption path (a step checkpoint at an
            agreed step) and restarts it on the new slots.
        discovery_command: instead of `hosts_file`: a shell command printing the slots,
            one a line, run again every half second (Horovod's host-discovery script).
        global_batch_size: the training's global batch, if known: sizes whose data
            replicas do not split it are refused: workers x `devices_per_worker`, or
            with `mesh` its data axis (see `DataReplicas`).
        rendezvous_timeout: with a slot list, how long to wait for MIN slots before
            giving up.
        slots_from: "slurm": the slots are the tasks of the SLURM job's allocation
            (`slurm_nodes.allocation_slots`), read once; without `remote_shell` an
            allocation naming another host than this one is refused.
        mesh, cross_host_axis: the worker command's hybrid `--mesh` and
            `--cross_host_axis`, whose data axis is what splits the global batch.
        one_replica: the worker command spreads one model over all the workers' devices
            (`--strategy=pipeline` or `model_parallel`), so any global batch splits.
        remote_shell: how to reach other hosts, e.g. "ssh -o BatchMode=yes"
            (`remote_shell.RemoteShell`): each slot (`host` or `host:index`) then runs on
            its host, this machine's directly and others' through the shell, in the same
            working directory. None: every worker runs here, whatever the slots are called.

    Example:
        >>> launch(["python", "train.py", "--strategy=multi_worker"], num_workers=2)
        0
    """
    if not command:
        raise LaunchError("No worker command given. Received: command=[]")
    workers = WorkerRange.parse(num_workers)
    if max_restarts < 0:
        raise LaunchError(f"max_restarts must be >= 0. Received: max_restarts={max_restarts}")
    if grace_seconds <= 0:
        raise LaunchError(f"grace_seconds must be > 0. Received: grace_seconds={grace_seconds}")
    stream = stream or sys.stdout
    messages = messages or sys.stderr
    isolation = isolation or os.environ.get(ISOLATION_VARIABLE) or "auto"
    if isolation not in ISOLATIONS:
        messages.write(
            f"launch: {ISOLATION_VARIABLE} must be one of {', '.join(ISOLATIONS)}. "
            f"Received: {isolation!r}\n"
        )
        return 2
    try:
        shell = RemoteShell.parse(remote_shell) if remote_shell else None
        list_slots = slot_source(hosts_file, discovery_command)
        offered = _starting_slots(workers, list_slots, slots_from, other_hosts=shell is not None)
    except ValueError as error:
        messages.write(f"launch: {error}\n")
        return 2
    membership = Membership(
        workers,
        offered,
        max_restarts_per_worker,
        global_batch_size,
        DataReplicas(devices_per_worker, mesh, cross_host_axis, one_replica),
    )
    settled = membership.settle()
    if settled:
        messages.write(f"launch: {settled}\n")
    misfit = len(membership.slots) >= workers.minimum and membership.misfit(len(membership.slots))
    if misfit:
        messages.write(f"launch: {'; '.join(misfit)}\n")
        return 2
    network, exposed_because = _private_network(isolation, shell)
    if network is None and isolation == "namespace":
        fix = (
            "restrict their ports with a firewall and use --isolation=auto, or drop --remote_shell"
            if shell is not None
            else "run where unprivileged user namespaces are allowed, "
            "or use --isolation=auto to start them with a warning"
        )
        messages.write(
            f"launch: refusing to start workers other machines could reach: {exposed_because}; "
            f"{fix}\n"
        )
        return 1
    num_gpus = visible_gpu_count()
    should_stop = threading.Event()
    received_signals: list[int] = []

    def request_stop(signum, frame):
        received_signals.append(signum)
        should_stop.set()

    previous_handlers = {
        signum: signal.signal(signum, request_stop) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    watcher = SlotListWatcher(
        membership, list_slots, should_stop, lambda line: messages.write(f"launch: {line}\n")
    )
    # Non-chief workers keep scratch files under TMPDIR; a private one is removed
    # even when a worker is killed before it can clean up.
    scratch_root = tempfile.mkdtemp(prefix="tfmulti-launch-")
    remote_hosts: set[str] = set()
    change, restarts = Change(membership.slots), 0

    def restart_after(failed_slots: Sequence[str], status: int) -> int | None:
        """Counts a failure of `failed_slots` (none for a preemption): None to restart the
        group (smaller, if a slot is dropped), or the status to stop with."""
        nonlocal change, restarts
        before = membership.slots
        dropped = [slot for slot in failed_slots if membership.record_failure(slot)]
        if dropped:
            left = tuple(slot for slot in before if slot not in membership.slots)
            change = Change(membership.slots, left=left)
            messages.write(
                f"launch: {', '.join(dropped)} failed more than "
                f"--max_restarts_per_worker={max_restarts_per_worker} times; "
                f"{change.describe()}; restarting the group\n"
            )
            return None
        within_slot_budget = [
            slot for slot in failed_slots if slot in membership.slots and max_restarts_per_worker
        ]
        if within_slot_budget:
            # A per-slot budget restarts a failed slot on its own count, with or without
            # --max_restarts, until the slot is dropped.
            change = Change(membership.slots)
            counts = ", ".join(
                f"{slot} {membership.failures[slot]}/{max_restarts_per_worker}"
                for slot in within_slot_budget
            )
            messages.write(f"launch: restarting all workers (failed slot restarts: {counts})\n")
            return None
        if restarts == max_restarts:
            return status
        restarts += 1
        change = Change(membership.slots)
        messages.write(f"launch: restarting all workers ({restarts}/{max_restarts})\n")
        return None

    try:
        failure = None
        for attempt in itertools.count():
            shortfall = membership.shortfall()
            if shortfall and list_slots:
                change = watcher.wait_for_enough(rendezvous_timeout) or change
                shortfall = membership.shortfall()
            if shortfall:
                messages.write(
                    f"launch: {shortfall}; stopped (the run's checkpoints are kept: "
                    "start it again with --resume to continue)\n"
                )
                return failure.exit_status if failure else 1
            slots = membership.slots
            try:
                places = (
                    slot_places(slots, shell, remote_python(command), num_gpus)
                    if shell
                    else loopback_places(len(slots), num_gpus)
                )
                assigned = worker_variables(places, devices_per_worker)
            except RemoteShellError as error:
                # A host that does not answer fails its slots, as a crashed worker would.
                messages.write(f"launch: {error}\n")
                unreachable = [slot for slot in slots if host_of(slot) == error.host]
                stop_status = restart_after(unreachable, _UNREACHABLE_STATUS)
                if stop_status is not None:
                    return stop_status
                continue
            except LaunchError as error:
                messages.write(f"launch: {error}\n")
                return failure.exit_status if failure else 1
            remote_hosts.update(place.remote_host for place in places if place.remote_host)
            for slot, variables in zip(slots, assigned, strict=True):
                variables["TMPDIR"] = scratch_root
                # As torchrun's restart count: a restarted worker knows to resume its run.
                variables[RESTART_COUNT_VARIABLE] = str(attempt)
                variables[SLOT_VARIABLE] = slot
                variables[MEMBERSHIP_VARIABLE] = json.dumps(dataclasses.asdict(change))
            if network is None:
                messages.write(_exposure_warning(exposed_because, places))
            workers_to_start = [
                worker_process(command, variables, place, shell, grace_seconds)
                for variables, place in zip(assigned, places, strict=True)
            ]
            group = WorkerGroup(workers_to_start, stream, network)
            watcher.change = None
            failure = group.wait(watcher)
            # A preempted worker's peers save at the same step and exit by themselves.
            group.stop(grace_seconds, terminate=not (failure and failure.preempted))
            if received_signals:
                name = signal.Signals(received_signals[0]).name
                if PREEMPTED_EXIT_CODE in group.returncodes:
                    # Workers saved on the forwarded SIGTERM: tell a cluster manager so.
                    messages.write(
                        f"launch: received {name}; workers saved a checkpoint and stopped "
                        f"(code {PREEMPTED_EXIT_CODE}: restart to resume)\n"
                    )
                    return PREEMPTED_EXIT_CODE
                messages.write(f"launch: received {name}; stopped all workers\n")
                return 128 + received_signals[0]
            if all(code == 0 for code in group.returncodes):
                return 0
            if watcher.change is not None:
                change = watcher.change
                messages.write(f"launch: {change.describe()}; restarting the group\n")
                continue
            messages.write(f"launch: {failure.describe()}; stopped the other workers\n")
            failed = [] if failure.preempted else [slots[failure.rank]]
            stop_status = restart_after(failed, failure.exit_status)
            if stop_status is not None:
                return stop_status
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
        shutil.rmtree(scratch_root, ignore_errors=True)
        for host in sorted(remote_hosts):
            shell.remove_directory(host, scratch_root)
        if network is not None:
            network.close()


def worker_process(
    command: Sequence[str],
    variables: dict[str, str],
    place: WorkerPlace,
    shell: RemoteShell | None,
    grace_seconds: float,
) -> WorkerProcess:
    """How to start one worker: here with `variables` over this environment, or on its
    host through the remote shell, carrying `variables` (and `FORWARDED_VARIABLES`) on its
    command line. TMPDIR among them: the guard makes the scratch directory there, so a
    serving worker posts its settings where the chief looks (`cluster_agreement`)."""
    if place.remote_host is None or shell is None:
        return WorkerProcess(tuple(command), {**os.environ, **variables})
    forwarded = {name: os.environ[name] for name in FORWARDED_VARIABLES if name in os.environ}
    line = remote_command_line(command, {**forwarded, **variables}, os.getcwd(), grace_seconds)
    return WorkerProcess(tuple(shell.argv(place.remote_host, line)), dict(os.environ), remote=True)


def _starting_slots(
    workers: WorkerRange,
    list_slots: Callable[[], list[str]] | None,
    slots_from: str | None,
    other_hosts: bool = False,
) -> list[str]:
    """The slots a launch starts on: listed, the SLURM allocation's, or slot0 ... slotMAX-1.

    Raises:
        ValueError: two sources of slots, or an allocation this launcher cannot start.
    """
    if slots_from is None and list_slots is None and other_hosts:
        raise ValueError(
            "--remote_shell starts each slot's worker on the slot's host: name the hosts "
            "with --hosts_file, --discovery_command or --slots_from=slurm"
        )
    if slots_from is None:
        return list_slots() if list_slots else [f"slot{i}" for i in range(workers.maximum)]
    if slots_from not in SLOT_ORIGINS:
        raise ValueError(
            f"slots_from must be one of {', '.join(SLOT_ORIGINS)}. Received: {slots_from!r}"
        )
    if list_slots is not None:
        raise ValueError(
            "Give the slot list as --slots_from=slurm, a file or a discovery command, not two."
        )
    slots = allocation_slots()
    elsewhere = [host for host in dict.fromkeys(map(host_of, slots)) if not is_this_machine(host)]
    if elsewhere and not other_hosts:
        raise ValueError(
            f"the SLURM allocation names hosts other than this one ({', '.join(elsewhere)}), "
            "and without --remote_shell the launcher starts every worker here: pass "
            f"--remote_shell='srun --nodes=1 --ntasks=1 --overlap -w {HOST_PLACEHOLDER} sh -c', "
            "or ask for one node (sbatch -N1 --ntasks-per-node=N)"
        )
    if len(slots) < workers.minimum:
        raise ValueError(
            f"the SLURM allocation gives {len(slots)} slot(s) ({', '.join(slots)}), fewer than "
            f"--num_workers={workers} needs: ask for one task per worker (sbatch -N1 "
            f"--ntasks-per-node={workers.maximum})"
        )
    return slots


def _private_network(
    isolation: str, shell: RemoteShell | None
) -> tuple[PrivateNetwork | None, str]:
    """The launch's private network, or None and why the workers will be exposed."""
    if shell is not None:
        return None, "workers on other hosts (--remote_shell) cannot share a private network"
    if isolation == "none":
        return None, f"isolation is none (--isolation or {ISOLATION_VARIABLE})"
    try:
        return PrivateNetwork(), ""
    except IsolationUnavailable as error:
        return None, f"no private network ({error})"


def _exposure_warning(exposed_because: str, places: Sequence[WorkerPlace]) -> str:
    addresses = ", ".join(place.address for place in places)
    if any(place.remote_host for place in places):
        return (
            f"launch: {exposed_because}: the workers' unauthenticated TensorFlow ports "
            f"({addresses}) listen on every interface of their hosts; admit only the job's "
            "hosts to them (a firewall, or a network only the job reaches)\n"
        )
    ports = ", ".join(place.address.rpartition(":")[2] for place in places)
    return (
        f"launch: {exposed_because}: the workers' unauthenticated TensorFlow ports {ports} "
        "listen on every interface; close them with a firewall, or run where unprivileged "
        "user namespaces are allowed (--isolation=namespace refuses instead)\n"
    )
