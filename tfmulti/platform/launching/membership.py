"""Which worker slots an elastic launch runs on, and when that changes.

A slot is a place a worker runs: a line of `--hosts_file` or of what
`--discovery_command` prints, a task of the SLURM allocation (`--slots_from=slurm`,
`slurm_nodes.py`), or for a plain local launch `slot0` ... `slot{MAX-1}`.
The launcher asks `Membership` after every failure and every new listing; a change stops
the group on the preemption path (or finds it stopped by the failure) and restarts it on
the new slots, which resume from the last step checkpoint. No TensorFlow is imported here.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable

from tfmulti.platform.mesh import MeshError, parse_mesh, resolve_data_axis

# Set on every launched worker: JSON {"slots", "left", "joined"} of its group.
MEMBERSHIP_VARIABLE = "TFMULTI_MEMBERSHIP"
# Set on every launched worker: the name of its slot.
SLOT_VARIABLE = "TFMULTI_SLOT"
_REREAD_SECONDS = 0.5
_DISCOVERY_TIMEOUT = 30.0


@dataclasses.dataclass(frozen=True)
class WorkerRange:
    """How many workers a launch may run on: `--num_workers=MIN:MAX`, or N for N:N.

    Example:
        >>> WorkerRange.parse("2:3")
        WorkerRange(minimum=2, maximum=3)
    """

    minimum: int
    maximum: int

    @classmethod
    def parse(cls, text: str) -> WorkerRange:
        low, colon, high = str(text).partition(":")
        try:
            minimum, maximum = int(low), int(high if colon else low)
        except ValueError:
            minimum = maximum = 0
        if not 1 <= minimum <= maximum:
            raise ValueError(
                "--num_workers must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2:3. "
                f"Received: --num_workers={text}"
            )
        return cls(minimum, maximum)

    def __str__(self) -> str:
        if self.minimum == self.maximum:
            return str(self.minimum)
        return f"{self.minimum}:{self.maximum}"


def read_slots(hosts_file: str) -> list[str]:
    """The slots `hosts_file` lists, one a line (blank lines and `#` comments skipped);
    none while the file is missing."""
    try:
        with open(hosts_file) as handle:
            return _slot_lines(handle.read())
    except FileNotFoundError:
        return []


def discovered_slots(command: str, timeout_seconds: float = _DISCOVERY_TIMEOUT) -> list[str]:
    """The slots a discovery command prints, one a line, as Horovod's host-discovery
    script: `command` runs in a shell; a failure, a time-out or no output lists none
    (the membership then stays as it is)."""
    try:
        result = subprocess.run(
            command,
            shell=True,
            capture_output=True,
            text=True,
            timeout=timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return []
    return _slot_lines(result.stdout) if result.returncode == 0 else []


def slot_source(
    hosts_file: str | None = None, discovery_command: str | None = None
) -> Callable[[], list[str]] | None:
    """What lists the slots while an elastic job runs: `hosts_file`, re-read, or
    `discovery_command`, run again; None when neither is given."""
    if hosts_file and discovery_command:
        raise ValueError(
            "Give the slot list as a file or as a discovery command, not both. Received: "
            f"hosts_file={hosts_file!r}, discovery_command={discovery_command!r}"
        )
    if hosts_file:
        return lambda: read_slots(hosts_file)
    if discovery_command:
        return lambda: discovered_slots(discovery_command)
    return None


def _slot_lines(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return list(dict.fromkeys(line for line in lines if line))


@dataclasses.dataclass(frozen=True)
class DataReplicas:
    """The data replicas a group of workers splits the global batch over.

    Each device of a worker is a replica, except under a hybrid mesh
    (`--strategy=hybrid --mesh=data=D,pipe=P[,tensor=K]`), where a replica spans P x K
    devices: there are D replicas, or with `data=auto` as many as the workers' devices hold;
    and under `--strategy=pipeline` or `model_parallel`, whose one model spans every
    worker's devices: one replica, which any batch splits.

    Args:
        devices_per_worker: each worker's devices (`--devices_per_worker`); None when not
            given: then each worker counts one replica, and a mesh is not checked.
        mesh: the hybrid mesh as `--mesh` gives it; None for other strategies.
        cross_host_axis: the mesh axis laid across the workers, "pipe" (the training's
            default) or "data".
        one_replica: the strategy spreads one model over all the workers' devices.

    Example:
        >>> DataReplicas(devices_per_worker=2, mesh="data=auto,pipe=2").count(3)
        3
    """

    devices_per_worker: int | None = None
    mesh: str | None = None
    cross_host_axis: str = "pipe"
    one_replica: bool = False

    def count(self, num_workers: int) -> int | None:
        """The data replicas of `num_workers` workers: 0 when their devices cannot hold
        the mesh, None when unknown (no devices per worker, or a mesh the training refuses
        by itself)."""
        if self.one_replica:
            return 1
        if self.mesh is None:
            return num_workers * (self.devices_per_worker or 1)
        if self.devices_per_worker is None or self.devices_per_replica is None:
            return None
        devices = num_workers * self.devices_per_worker
        try:
            mesh = parse_mesh(resolve_data_axis(self.mesh, devices))
            if self.cross_host_axis == "data":
                mesh.check_fits(self.devices_per_worker, num_workers)
            elif mesh.num_devices != devices:
                return 0
        except MeshError:
            return 0
        return mesh.data

    @property
    def devices_per_replica(self) -> int | None:
        """pipe x tensor of the mesh (1 without one; None for a malformed mesh)."""
        if self.mesh is None:
            return 1
        try:
            return parse_mesh(resolve_data_axis(self.mesh, None)).devices_per_replica
        except MeshError:
            return None

    def mesh_fix(self) -> str:
        """What makes the workers hold the mesh, where `count` gives 0."""
        per_replica = self.devices_per_replica
        if self.cross_host_axis == "data" and self.devices_per_worker % per_replica:
            return (
                f"give each worker a multiple of pipe x tensor = {per_replica} devices "
                "(--devices_per_worker)"
            )
        if "data=auto" not in self.mesh.replace(" ", ""):
            return "give the mesh data=auto, so that it follows the workers"
        return f"give the workers together a multiple of pipe x tensor = {per_replica} devices"

    def describe(self, num_workers: int) -> str:
        if self.mesh is None:
            return f"{num_workers} workers x {self.devices_per_worker or 1} replicas"
        return f"{num_workers} workers x {self.devices_per_worker} devices"


@dataclasses.dataclass(frozen=True)
class Change:
    """A new set of slots, and who left or joined to make it."""

    slots: tuple[str, ...]
    left: tuple[str, ...] = ()
    joined: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [f"{', '.join(self.left)} left"] if self.left else []
        parts += [f"{', '.join(self.joined)} joined"] if self.joined else []
        return "; ".join(parts + [f"{len(self.slots)} workers ({', '.join(self.slots)})"])


class Membership:
    """The slots a launch runs on, within `WorkerRange`, as failures and the list change.

    Args:
        workers: the allowed worker counts.
        slots: the slots offered at the start (the first `workers.maximum` are used).
        max_failures_per_slot: a slot whose worker fails more often than this is
            dropped (None: never); it returns only after leaving the list and coming back.
        global_batch_size: the training's global batch; a size whose data replicas
            (`replicas`) do not split it evenly is refused (the slots stay as they are).
        replicas: how many data replicas each worker count trains with.

    Example:
        >>> membership = Membership(WorkerRange(2, 3), ["a", "b", "c"], max_failures_per_slot=1)
        >>> membership.record_failure("c"), membership.record_failure("c")
        (None, Change(slots=('a', 'b'), left=('c',), joined=()))
    """

    def __init__(
        self,
        workers: WorkerRange,
        slots: list[str],
        max_failures_per_slot: int | None = None,
        global_batch_size: int | None = None,
        replicas: DataReplicas | None = None,
    ):
        self.workers = workers
        self.max_failures_per_slot = max_failures_per_slot
        self.global_batch_size = global_batch_size
        self.replicas = replicas or DataReplicas()
        self.slots = tuple(slots[: workers.maximum])
        self.failures: dict[str, int] = {}
        self.dropped: set[str] = set()
        self.refused: tuple[str, ...] | None = None

    def fits(self, num_workers: int) -> bool:
        return self.misfit(num_workers) is None

    def misfit(self, num_workers: int) -> tuple[str, str] | None:
        """Why `num_workers` workers cannot train the global batch, and what would fix it;
        None when they can (or when that is not known)."""
        replicas = self.replicas.count(num_workers)
        workers = self.replicas.describe(num_workers)
        mesh = self.replicas.mesh
        if replicas == 0:
            return f"{workers} cannot hold --mesh={mesh}", self.replicas.mesh_fix()
        batch = self.global_batch_size
        if replicas is None or batch is None or batch % replicas == 0:
            return None
        held = "" if mesh is None else f" hold {replicas} data replicas of --mesh={mesh}, which"
        larger = (batch // replicas + 1) * replicas
        return (
            f"{workers}{held} do not split --batch_size={batch} evenly",
            f"give --batch_size a multiple of {replicas}, e.g. {larger}",
        )

    def settle(self) -> str | None:
        """Narrows the starting slots to the largest count of at least MIN whose replicas
        split the global batch; returns the one line saying so (None: they stay)."""
        if len(self.slots) < self.workers.minimum or self.fits(len(self.slots)):
            return None
        fitting = self._largest_fitting(self.slots)
        if fitting is None:
            return None
        problem, _ = self.misfit(len(self.slots))
        # The same listing offered again is then refused without a second line.
        self.refused, self.slots = self.slots, fitting
        return f"{problem}; starting {len(fitting)} workers"

    def record_failure(self, slot: str) -> Change | None:
        """Counts a failure of `slot`'s worker; returns the change when it drops the slot."""
        self.failures[slot] = self.failures.get(slot, 0) + 1
        if self.max_failures_per_slot is None or self.failures[slot] <= self.max_failures_per_slot:
            return None
        self.dropped.add(slot)
        remaining = tuple(s for s in self.slots if s != slot)
        return self._apply(self._largest_fitting(remaining) or remaining)

    def offer(self, listed: list[str]) -> Change | str | None:
        """Takes a fresh read of the slot list; returns the change it makes, a one-line
        refusal (said once per listing), or None when nothing changes. An empty read
        is taken for a file caught mid-write, and ignored."""
        if not listed:
            return None
        self.dropped &= set(listed)
        # Slots already running keep their ranks (and the chief stays); new ones follow.
        usable = [s for s in listed if s not in self.dropped]
        kept = [s for s in self.slots if s in usable]
        wanted = tuple((kept + [s for s in usable if s not in kept])[: self.workers.maximum])
        if set(wanted) == set(self.slots):
            return None
        fitting = self._largest_fitting(wanted)
        if fitting is not None and set(fitting) == set(self.slots):
            if self.refused == wanted:
                return None
            self.refused = wanted
            return f"{self.misfit(len(wanted))[0]}; keeping {len(self.slots)} workers"
        return self._apply(fitting or wanted)

    def _largest_fitting(self, slots: tuple[str, ...]) -> tuple[str, ...] | None:
        """The first n of `slots` for the largest n >= MIN that splits the global batch."""
        for count in range(len(slots), self.workers.minimum - 1, -1):
            if self.fits(count):
                return slots[:count]
        return None

    def _apply(self, slots: tuple[str, ...]) -> Change:
        change = Change(
            slots,
            left=tuple(s for s in self.slots if s not in slots),
            joined=tuple(s for s in slots if s not in self.slots),
        )
        self.slots = slots
        return change

    def shortfall(self) -> str | None:
        """Why the slots cannot run the job (too few, or they split the batch unevenly)."""
        if len(self.slots) < self.workers.minimum:
            return (
                f"{len(self.slots)} worker slot(s) left ({', '.join(self.slots) or 'none'}), "
                f"fewer than --num_workers={self.workers} needs"
            )
        misfit = self.misfit(len(self.slots))
        return "; ".join(misfit) if misfit else None


class SlotListWatcher:
    """Lists the slots again while a group runs; `is_set()` turns True on a change.

    It stands in for the launcher's stop event in `WorkerGroup.wait`: the wait ends on
    a signal (`should_stop`) or on a change of membership, kept in `change`.

    Args:
        membership: the launch's `Membership`, which judges each read.
        list_slots: lists the slots (`slot_source`; None: membership changes only by
            failures).
        should_stop: the launcher's stop event.
        say: writes one launcher message line.
    """

    def __init__(
        self,
        membership: Membership,
        list_slots: Callable[[], list[str]] | None,
        should_stop,
        say,
    ):
        self.membership = membership
        self.list_slots = list_slots
        self.should_stop = should_stop
        self.say = say
        self.change: Change | None = None
        self._next_read = time.monotonic() + _REREAD_SECONDS

    def is_set(self) -> bool:
        if self.should_stop.is_set() or self.change is not None:
            return True
        if self.list_slots is None or time.monotonic() < self._next_read:
            return False
        self._next_read = time.monotonic() + _REREAD_SECONDS
        offered = self.membership.offer(self.list_slots())
        if isinstance(offered, str):
            self.say(offered)
        elif offered is not None:
            self.change = offered
        return self.change is not None

    def wait_for_enough(self, timeout_seconds: float) -> Change | None:
        """Waits up to `timeout_seconds` for the list to offer enough slots again."""
        deadline = time.monotonic() + timeout_seconds
        while self.list_slots and time.monotonic() < deadline and not self.should_stop.is_set():
            offered = self.membership.offer(self.list_slots())
            if isinstance(offered, Change) and self.membership.shortfall() is None:
                return offered
            time.sleep(_REREAD_SECONDS)
        return None
