"""The launcher's private network: local workers listen where no other machine reaches them.

Sockets are inspected through /proc (this process's namespace and each worker's); no
traffic is sent to any non-loopback address. Where Linux refuses a private network,
running the launcher under `unshare --user` (no id mapping, so no nested user
namespace) takes it away for real.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from script_runner import (
    REPO_ROOT,
    TWO_EPOCHS,
    assert_same_training,
    child_pids,
    read_metrics,
    script_environment,
    start_launched_training,
)

from tfmulti.platform.launching.network_isolation import (
    IsolationUnavailable,
    PrivateNetwork,
    has_only_loopback,
)
from tfmulti.platform.launching.worker_places import free_ports

LAUNCH = os.path.join(REPO_ROOT, "scripts", "launch.py")
LISTENING_WORKER = os.path.join(REPO_ROOT, "tests", "workers", "listening_worker.py")
LAUNCHER_WORKER = os.path.join(REPO_ROOT, "tests", "workers", "launcher_worker.py")
_TCP_LISTEN = "0A"


def private_network_available() -> bool:
    try:
        PrivateNetwork().close()
    except IsolationUnavailable:
        return False
    return True


def listening_ports(pid: int | str) -> set[int]:
    """TCP ports in LISTEN state in the network namespace of process `pid` ("self": ours)."""
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as file:
            for row in file.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == _TCP_LISTEN:
                    ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def interfaces(pid: int | str) -> set[str]:
    with open(f"/proc/{pid}/net/dev") as file:
        return {row.split(":")[0].strip() for row in file.read().splitlines()[2:]}


def without_private_network() -> list[str]:
    """A command prefix under which the launcher cannot make a private network."""
    if not private_network_available():
        return []
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux `unshare` to take the private network away")
    return ["unshare", "--user"]


def wait_for_worker_files(pid_dir, count: int, launcher: subprocess.Popen) -> list[str]:
    deadline = time.monotonic() + 120
    while len(os.listdir(pid_dir)) < count:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    time.sleep(0.05)  # a file seen may not be written yet
    return [(pid_dir / name).read_text() for name in sorted(os.listdir(pid_dir))]


def test_launched_workers_listen_only_inside_a_loopback_only_private_network(tmp_path):
    if not private_network_available():
        pytest.skip("this kernel refuses unprivileged user namespaces")
    pid_dir, release = tmp_path / "pids", tmp_path / "release"
    pid_dir.mkdir()
    command = [sys.executable, LAUNCH, "--num_workers=2", "--", sys.executable, LISTENING_WORKER]
    launcher = subprocess.Popen(
        [*command, "--pid_dir", str(pid_dir), "--release_file", str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        workers = [
            tuple(map(int, text.split())) for text in wait_for_worker_files(pid_dir, 2, launcher)
        ]
        host_listening = listening_ports("self")
        for pid, port in workers:
            assert port in listening_ports(pid), "the worker listens, in its own namespace"
            assert port not in host_listening
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            assert interfaces(pid) == {"lo"}
    finally:
        release.touch()
        stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stderr
    # Worker-to-worker traffic still flows, over loopback.
    assert "[worker 0] worker 0 reached all 2 workers" in stdout
    assert "[worker 1] worker 1 reached all 2 workers" in stdout
    assert "launch:" not in stderr


def test_isolated_multi_worker_training_opens_no_host_port_and_trains_like_one_device(
    tmp_path, one_device_metrics
):
    if not private_network_available():
        pytest.skip("this kernel refuses unprivileged user namespaces")
    model_dir = str(tmp_path / "run")
    launcher = start_launched_training(
        ("--num_workers=2", "--devices_per_worker=2"),
        (*TWO_EPOCHS, "--strategy=multi_worker", f"--model_dir={model_dir}"),
    )
    try:
        servers = _wait_for_tensorflow_servers(launcher.pid, count=2)
        host_listening = listening_ports("self")
        assert servers and not servers & host_listening, (servers, host_listening)
    finally:
        output, _ = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, output[-3000:]
    assert "listen on" not in output  # no exposure warning from the chief
    assert_same_training(read_metrics(model_dir), one_device_metrics)


def _wait_for_tensorflow_servers(launcher_pid: int, count: int) -> set[int]:
    """The ports the launcher's workers listen on (in their namespace), once all do."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ports = set()
        for pid in child_pids(launcher_pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as file:
                    environ = dict(
                        item.split(b"=", 1) for item in file.read().split(b"\0") if b"=" in item
                    )
                if b"TF_CONFIG" not in environ:
                    continue  # the namespace holder
                config = json.loads(environ[b"TF_CONFIG"])
                own = int(config["cluster"]["worker"][config["task"]["index"]].rpartition(":")[2])
                if own in listening_ports(pid):
                    ports.add(own)
            except (FileNotFoundError, ProcessLookupError):
                pass
        if len(ports) == count:
            return ports
        time.sleep(0.1)
    return set()


def _run_launcher(prefix: list[str], isolation: str | None, pid_dir) -> subprocess.CompletedProcess:
    environment = dict(script_environment())
    environment.pop("TFMULTI_ISOLATION", None)
    if isolation is not None:
        environment["TFMULTI_ISOLATION"] = isolation
    command = [sys.executable, LAUNCH, "--num_workers=2", "--", sys.executable, LAUNCHER_WORKER]
    return subprocess.run(
        [*prefix, *command, "--pid_dir", str(pid_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )


@pytest.mark.parametrize("isolation", [None, "auto"])
def test_without_a_private_network_the_launch_warns_in_one_line_naming_the_ports(
    tmp_path, isolation
):
    result = _run_launcher(without_private_network(), isolation, tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("launch:")]
    assert len(warnings) == 1, result.stderr
    assert "no private network" in warnings[0] and "firewall" in warnings[0]
    ports = warnings[0].split("TensorFlow ports ")[1].split(" listen")[0].split(", ")
    assert len(ports) == 2 and all(port.isdigit() for port in ports), warnings[0]
    assert result.stdout.count("done") == 2


def test_isolation_none_warns_even_where_a_private_network_is_possible(tmp_path):
    result = _run_launcher([], "none", tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("launch:")]
    assert len(warnings) == 1 and "isolation is none" in warnings[0], result.stderr


def test_isolation_namespace_refuses_in_one_line_without_a_private_network(tmp_path):
    result = _run_launcher(without_private_network(), "namespace", tmp_path)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "refusing" in result.stderr and "no private network" in result.stderr
    assert "Traceback" not in result.stderr
    assert not os.listdir(tmp_path), "no worker was started"


def test_an_unknown_isolation_is_one_line_naming_the_choices(tmp_path):
    result = _run_launcher([], "firewall", tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "launch: TFMULTI_ISOLATION must be one of auto, namespace, none. Received: 'firewall'"
    )


_CHIEF_OF_ONE_WORKER = """
import sys
from tfmulti.platform.runtime.cluster import build_multi_worker_strategy, resolve_cluster
build_multi_worker_strategy(resolve_cluster([sys.argv[1]], task_index=0))
"""


def test_the_chief_of_an_explicit_cluster_logs_once_what_it_exposes():
    if has_only_loopback():
        pytest.skip("this test process itself runs where no other machine reaches it")

    address = f"127.0.0.1:{free_ports(1)[0]}"
    result = subprocess.run(
        [sys.executable, "-c", _CHIEF_OF_ONE_WORKER, address],
        capture_output=True,
        text=True,
        timeout=120,
        env=script_environment(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    notices = [line for line in result.stderr.splitlines() if "no authentication" in line]
    assert len(notices) == 1, result.stderr[-3000:]
    assert f"1 workers (cluster from flags) listen on {address}" in notices[0]
    assert "trusted network" in notices[0]


def test_the_isolation_flag_overrides_the_environment(tmp_path):
    environment = dict(script_environment(), TFMULTI_ISOLATION="auto")
    command = [sys.executable, LAUNCH, "--num_workers=2", "--isolation=none", "--"]
    result = subprocess.run(
        [*command, sys.executable, LAUNCHER_WORKER, "--pid_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("launch:")]
    assert len(warnings) == 1 and "isolation is none" in warnings[0], result.stderr
