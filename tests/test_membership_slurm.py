"""SLURM allocations as worker slots (`--slots_from=slurm`): node lists expand as SLURM
writes them, each task is a slot, and an allocation the launcher cannot start is refused
in one line."""

import io
import os
import socket
import stat
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from script_runner import LAUNCH, worker_program

from tfmulti.platform.launching import launcher
from tfmulti.platform.launching.slurm_nodes import (
    allocation_slots,
    expand_nodelist,
    expand_tasks_per_node,
    host_of,
    hostnames,
    is_this_machine,
)

WORKER = worker_program("elastic_worker")


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[0-2]", ["n0", "n1", "n2"]),
        ("n[5]", ["n5"]),
        ("n[3-3]", ["n3"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        (
            "n[1-2].cluster.org,gpu.cluster.org",
            ["n1.cluster.org", "n2.cluster.org", "gpu.cluster.org"],
        ),
        ("a, b ,c", ["a", "b", "c"]),
        ("n[2,1],n[1-3]", ["n2", "n1", "n3"]),
        ("gpu5,cpu[1-2]", ["gpu5", "cpu1", "cpu2"]),
    ],
)
def test_a_node_list_expands_as_scontrol_show_hostnames_does(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "nodelist, problem",
    [
        ("n[1-", "unbalanced brackets"),
        ("n1-2]", "unbalanced brackets"),
        ("n]1[", "unbalanced brackets"),
        ("n[[1]]", "unbalanced brackets"),
        ("n[a-b]", "'a-b' in brackets"),
        ("n[1-2-3]", "'1-2-3' in brackets"),
        ("n[]", "'' in brackets"),
        ("n[1,]", "'' in brackets"),
        ("n[3-1]", "backward range '3-1'"),
        ("a,,b", "an empty name"),
        ("a,", "an empty name"),
        ("", "an empty name"),
    ],
)
def test_a_malformed_node_list_names_the_problem_and_what_was_received(nodelist, problem):
    with pytest.raises(ValueError, match="SLURM node list") as raised:
        expand_nodelist(nodelist)
    assert problem in str(raised.value)
    assert str(raised.value).endswith(f"Received: SLURM_JOB_NODELIST={nodelist}")


def _compressed(prefix: str, width: int, numbers: list[int]) -> str:
    """`numbers` written as SLURM writes them: runs of consecutive numbers as ranges."""
    runs, numbers = [], sorted(set(numbers))
    for number in numbers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    ranges = [
        str(low).zfill(width)
        if low == high
        else f"{str(low).zfill(width)}-{str(high).zfill(width)}"
        for low, high in runs
    ]
    return f"{prefix}[{','.join(ranges)}]"


@st.composite
def node_groups(draw):
    prefix = draw(st.sampled_from(["node", "gpu", "n-", "r1n", "x"]))
    width = draw(st.integers(1, 4))
    numbers = draw(st.lists(st.integers(0, 10**width - 1), min_size=1, max_size=30))
    return prefix, width, numbers


@given(st.lists(node_groups(), min_size=1, max_size=4, unique_by=lambda group: group[0]))
def test_every_compressed_node_list_expands_to_its_hosts_in_order(groups):
    nodelist = ",".join(_compressed(*group) for group in groups)
    expected = [
        f"{prefix}{str(number).zfill(width)}"
        for prefix, width, numbers in groups
        for number in sorted(set(numbers))
    ]
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("1", [1]), ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]), ("8(x1)", [8])],
)
def test_tasks_per_node_expand_their_repeat_counts(text, expected):
    assert expand_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", ["", "0", "x", "2(x)", "2(3)", "2(x3", "-1", "1,,2"])
def test_malformed_tasks_per_node_name_what_was_received(text):
    with pytest.raises(ValueError) as raised:
        expand_tasks_per_node(text)
    assert str(raised.value).endswith(f"Received: SLURM_TASKS_PER_NODE={text}")


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"SLURM_JOB_NODELIST": "n[1-2]"}, ["n1", "n2"]),
        ({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "3"}, ["n1:0", "n1:1", "n1:2"]),
        (
            {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2,1(x2)"},
            ["n1:0", "n1:1", "n2", "n3"],
        ),
        (
            {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2"},
            ["n1:0", "n1:1", "n2:0", "n2:1"],
        ),
        (
            # SLURM_TASKS_PER_NODE gives each node's count, so it wins.
            {
                "SLURM_JOB_NODELIST": "n[1-2]",
                "SLURM_TASKS_PER_NODE": "1,2",
                "SLURM_NTASKS_PER_NODE": "2",
            },
            ["n1", "n2:0", "n2:1"],
        ),
    ],
)
def test_each_task_of_the_allocation_is_a_slot(environ, expected, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no scontrol: the parser
    assert allocation_slots(environ) == expected
    assert [host_of(slot) for slot in expected] == [slot.split(":")[0] for slot in expected]


def test_task_counts_that_do_not_match_the_nodes_are_refused():
    with pytest.raises(ValueError, match="gives 2 task counts for the 3 nodes"):
        allocation_slots({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "1,1"})


def test_no_allocation_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="run the launcher inside sbatch or salloc"):
        allocation_slots({})


def _fake_scontrol(directory, script: str) -> None:
    path = directory / "scontrol"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_scontrol_expands_the_node_list_where_it_runs(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, 'test "$1 $2" = "show hostnames" && printf "x1\\nx2\\n"')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hostnames("anything[1-2]") == ["x1", "x2"]


@pytest.mark.parametrize("script", ["exit 1", "true", "exec sleep 30"])
def test_a_failing_scontrol_falls_back_to_the_parser(tmp_path, monkeypatch, script):
    _fake_scontrol(tmp_path, script)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("tfmulti.platform.launching.slurm_nodes._SCONTROL_TIMEOUT", 0.5)
    assert hostnames("n[1-2]") == ["n1", "n2"]


def test_this_machine_is_known_by_its_host_name_its_slurm_name_and_localhost():
    name = socket.gethostname()
    environ = {"SLURMD_NODENAME": "node07"}
    for host in (name, name.split(".")[0], f"{name.split('.')[0]}.example.org", "localhost"):
        assert is_this_machine(host, environ), host
    assert is_this_machine("node07", environ)
    assert not is_this_machine("node07", {})
    assert not is_this_machine("surely-not-this-host-42", environ)


def _launch_in_allocation(monkeypatch, num_workers, command=("true",), **options):
    slurm = {name: value for name, value in options.items() if name.startswith("SLURM")}
    for name in [name for name in os.environ if name.startswith("SLURM")]:
        monkeypatch.delenv(name)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    messages = io.StringIO()
    status = launcher.launch(
        list(command),
        num_workers,
        slots_from="slurm",
        messages=messages,
        stream=io.StringIO(),
        **{name: value for name, value in options.items() if name not in slurm},
    )
    return status, messages.getvalue()


def test_with_a_remote_shell_each_task_of_a_multi_node_allocation_runs_on_its_node(
    monkeypatch, tmp_path
):
    """node07 is this machine; node08's two tasks start through the (stand-in) remote
    shell, which runs them here and logs the host it was asked for."""
    run_dir, hosts_log = tmp_path / "run", tmp_path / "hosts_log"
    run_dir.mkdir()
    monkeypatch.setenv("STAND_IN_HOSTS_LOG", str(hosts_log))
    worker = [sys.executable, worker_program("elastic_worker"), "--run_dir", str(run_dir)]
    status, messages = _launch_in_allocation(
        monkeypatch,
        3,
        command=worker,
        remote_shell=f"{sys.executable} {worker_program('stand_in_remote_shell')}",
        isolation="none",
        SLURM_JOB_NODELIST="node[07-08]",
        SLURM_TASKS_PER_NODE="1,2",
        SLURMD_NODENAME="node07",
    )
    assert status == 0, messages
    assert sorted(os.listdir(run_dir)) == ["0-node07", "0-node08:0", "0-node08:1"]
    # Once to find ports, once for each of node08's workers, once to remove the scratch.
    assert hosts_log.read_text().splitlines() == ["node08"] * 4


@pytest.mark.parametrize(
    "num_workers, slurm, line",
    [
        (
            2,
            {"SLURM_JOB_NODELIST": "node[07-09]", "SLURMD_NODENAME": "node07"},
            "launch: the SLURM allocation names hosts other than this one (node08, node09), and "
            "without --remote_shell the launcher starts every worker here: pass "
            "--remote_shell='srun --nodes=1 --ntasks=1 --overlap -w {host} sh -c', or ask for "
            "one node (sbatch -N1 --ntasks-per-node=N)",
        ),
        (
            "2:3",
            {"SLURM_JOB_NODELIST": "node07", "SLURMD_NODENAME": "node07"},
            "launch: the SLURM allocation gives 1 slot(s) (node07), fewer than "
            "--num_workers=2:3 needs: ask for one task per worker (sbatch -N1 "
            "--ntasks-per-node=3)",
        ),
        (
            2,
            {},
            "launch: --slots_from=slurm reads the allocation from SLURM_JOB_NODELIST, which is "
            "not set: run the launcher inside sbatch or salloc, or give --hosts_file. Received: "
            "SLURM_JOB_NODELIST='(unset)'",
        ),
    ],
    ids=["other hosts", "too few tasks", "no allocation"],
)
def test_an_allocation_the_launcher_cannot_start_is_refused_in_one_line(
    monkeypatch, num_workers, slurm, line
):
    monkeypatch.setenv("PATH", "")  # no scontrol: the parser
    status, messages = _launch_in_allocation(monkeypatch, num_workers, **slurm)
    assert status == 2
    assert messages.splitlines() == [line]


def _allocation_environment(**slurm) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    return {**environment, **slurm}


def test_a_launch_in_a_one_node_allocation_runs_a_worker_per_task_and_drops_a_failing_one(
    tmp_path,
):
    # A faked allocation of 2 tasks on this machine, named as SLURM names it.
    environment = _allocation_environment(
        SLURM_JOB_NODELIST="node[07]", SLURMD_NODENAME="node07", SLURM_TASKS_PER_NODE="2"
    )
    result = subprocess.run(
        [
            sys.executable,
            LAUNCH,
            "--num_workers=1:2",
            "--slots_from=slurm",
            "--max_restarts_per_worker=0",
            "--",
            sys.executable,
            WORKER,
            "--run_dir",
            str(tmp_path),
            "--fail_slots=node07:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["0-node07:0", "0-node07:1", "1-node07:0"]
    assert (
        "launch: node07:1 failed more than --max_restarts_per_worker=0 times; node07:1 left; "
        "1 workers (node07:0); restarting the group" in result.stderr
    )
    assert (
        (tmp_path / "0-node07:1")
        .read_text()
        .startswith('2 {"slots": ["node07:0", "node07:1"], "left": []')
    )


@pytest.mark.parametrize(
    "flags",
    [["--slots_from=slurm", "--hosts_file=slots"], ["--slots_from=slurm", "--discovery_command=x"]],
)
def test_two_sources_of_slots_are_refused_in_one_line(flags):
    result = subprocess.run(
        [sys.executable, LAUNCH, "--num_workers=2", *flags, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_allocation_environment(SLURM_JOB_NODELIST="localhost"),
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "launch.py: error: --slots_from gives the slot list, as --hosts_file and "
        "--discovery_command do; keep one."
    ]


def test_a_malformed_allocation_exits_in_one_line_without_a_traceback():
    result = subprocess.run(
        [sys.executable, LAUNCH, "--num_workers=2", "--slots_from=slurm", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_allocation_environment(SLURM_JOB_NODELIST="node[07"), "PATH": ""},
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launch: The SLURM node list has unbalanced brackets; expected names like "
        "node[01-03,07],gpu5. Received: SLURM_JOB_NODELIST=node[07"
    ]
