"""A SLURM job's allocation as worker slots (`scripts/launch.py --slots_from=slurm`).

SLURM writes the allocation compressed: `SLURM_JOB_NODELIST=node[01-03,07],gpu5` names
node01, node02, node03, node07 and gpu5, and `SLURM_TASKS_PER_NODE=2(x3),1` gives the
first three 2 tasks and the last 1, in the node list's order. Each task is a slot, named
`host` when its host has one task and `host:i` (i = 0, 1, ...) when it has more. The
launcher starts workers on its own machine only, so an allocation naming another host is
refused. No TensorFlow is imported here.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping

NODELIST_VARIABLE = "SLURM_JOB_NODELIST"
TASKS_PER_NODE_VARIABLE = "SLURM_TASKS_PER_NODE"
NTASKS_PER_NODE_VARIABLE = "SLURM_NTASKS_PER_NODE"
# The node's name in SLURM, which may differ from its host name.
NODENAME_VARIABLE = "SLURMD_NODENAME"
_SCONTROL_TIMEOUT = 10.0
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASK_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_nodelist(text: str) -> list[str]:
    """The host names of a SLURM node list, in order, each once.

    Brackets hold numbers and ranges joined by commas; a range keeps the zero padding of
    its first number; several brackets in one name expand as nested loops, the first
    outermost (as `scontrol show hostnames` does).

    Raises:
        ValueError: unbalanced brackets, an empty name or range, a range that is not
            numbers, or one that runs backwards.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts = [
        host
        for name in _split_outside_brackets(text, str(text))
        for host in _expand_name(name, str(text))
    ]
    return list(dict.fromkeys(hosts))


def expand_tasks_per_node(text: str) -> list[int]:
    """The task count of each node from SLURM_TASKS_PER_NODE's form.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for part in str(text).split(","):
        match = _TASK_COUNT.match(part.strip())
        if match is None or int(match.group(1)) < 1:
            raise ValueError(
                f"{TASKS_PER_NODE_VARIABLE} must be counts like 2(x3),1. Received: "
                f"{TASKS_PER_NODE_VARIABLE}={text}"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def hostnames(nodelist: str) -> list[str]:
    """The hosts of `nodelist`: `scontrol show hostnames` where scontrol runs (it knows
    every form the site's SLURM writes), else `expand_nodelist`."""
    if shutil.which("scontrol"):
        try:
            listing = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=_SCONTROL_TIMEOUT,
                check=True,
            ).stdout.split()
        except (subprocess.SubprocessError, OSError):
            listing = []
        if listing:
            return list(dict.fromkeys(listing))
    return expand_nodelist(nodelist)


def allocation_slots(environ: Mapping[str, str] | None = None) -> list[str]:
    """The worker slots of the SLURM job this process runs in: one per task of each node.

    Tasks per node come from SLURM_TASKS_PER_NODE, else SLURM_NTASKS_PER_NODE, else 1.

    Raises:
        ValueError: no SLURM_JOB_NODELIST, a malformed variable, or task counts that do
            not match the node list.

    Example:
        >>> allocation_slots({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2,1"})
        ['n1:0', 'n1:1', 'n2']
    """
    environ = os.environ if environ is None else environ
    nodelist = environ.get(NODELIST_VARIABLE, "").strip()
    if not nodelist:
        raise ValueError(
            f"--slots_from=slurm reads the allocation from {NODELIST_VARIABLE}, which is "
            "not set: run the launcher inside sbatch or salloc, or give --hosts_file. "
            f"Received: {NODELIST_VARIABLE}={environ.get(NODELIST_VARIABLE, '(unset)')!r}"
        )
    hosts = hostnames(nodelist)
    if environ.get(TASKS_PER_NODE_VARIABLE):
        tasks = expand_tasks_per_node(environ[TASKS_PER_NODE_VARIABLE])
    else:
        per_node = environ.get(NTASKS_PER_NODE_VARIABLE, "1")
        tasks = expand_tasks_per_node(per_node) * len(hosts)
    if len(tasks) != len(hosts):
        raise ValueError(
            f"{TASKS_PER_NODE_VARIABLE} gives {len(tasks)} task counts for the "
            f"{len(hosts)} nodes of {NODELIST_VARIABLE}. Received: "
            f"{TASKS_PER_NODE_VARIABLE}={environ[TASKS_PER_NODE_VARIABLE]}, "
            f"{NODELIST_VARIABLE}={nodelist}"
        )
    return [
        host if count == 1 else f"{host}:{index}"
        for host, count in zip(hosts, tasks, strict=True)
        for index in range(count)
    ]


def host_of(slot: str) -> str:
    """The host a slot of `allocation_slots` is on."""
    return slot.rpartition(":")[0] or slot


def is_this_machine(host: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `host` names the machine this runs on: its host name (short or full),
    SLURMD_NODENAME, or localhost."""
    environ = os.environ if environ is None else environ
    names = {socket.gethostname(), socket.getfqdn(), "localhost", environ.get(NODENAME_VARIABLE)}
    names |= {name.split(".")[0] for name in names if name}
    return host in names or host.split(".")[0] in names


def _split_outside_brackets(text: str, whole: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for position, character in enumerate(text):
        depth += {"[": 1, "]": -1}.get(character, 0)
        if depth not in (0, 1):
            raise _malformed(whole, "has unbalanced brackets")
        if character == "," and depth == 0:
            names.append(text[start:position])
            start = position + 1
    if depth:
        raise _malformed(whole, "has unbalanced brackets")
    names.append(text[start:])
    if any(not name.strip() for name in names):
        raise _malformed(whole, "has an empty name")
    return [name.strip() for name in names]


def _expand_name(name: str, whole: str) -> list[str]:
    """One name of a node list: text with bracketed ranges, expanded."""
    pieces = re.split(r"\[([^\]]*)\]", name)
    # pieces alternate: literal text, bracket contents, literal text, ...
    choices = [
        [piece] if i % 2 == 0 else _expand_ranges(piece, whole) for i, piece in enumerate(pieces)
    ]
    return ["".join(parts) for parts in itertools.product(*choices)]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise _malformed(whole, f"has {part.strip()!r} in brackets, not N or N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _malformed(whole, f"has the backward range {part.strip()!r}")
        numbers += [str(number).zfill(len(low)) for number in range(int(low), int(high) + 1)]
    return numbers


def _malformed(whole: str, problem: str) -> ValueError:
    return ValueError(
        f"The SLURM node list {problem}; expected names like node[01-03,07],gpu5. "
        f"Received: {NODELIST_VARIABLE}={whole}"
    )
