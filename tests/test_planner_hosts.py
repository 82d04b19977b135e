"""The planner over several hosts: which mesh axis crosses them, what crossing costs, and
the launch commands it prints.

A model whose gradients are large next to its activations should cross a slow inter-host
link with its pipeline axis (only stage-boundary activations cross) rather than its data
axis (every gradient crosses); when the link between hosts is as fast as inside one, the
axis makes no difference or data wins. The printed command of a 2-host x 2-device plan is
run through `scripts/launch.py`.
"""

import json
import shlex
import subprocess
import sys

import pytest
from script_runner import (
    REPO_ROOT,
    one_line_error,
    parse_each,
    read_metrics,
    run_script,
    script_environment,
    worker_program,
)

from tfmulti.planner import (
    AffineTime,
    BlockCost,
    Hardware,
    ModelCosts,
    blocks_at,
    cross_host_axes,
    save_costs,
    score_layout,
    search_layouts,
)
from tfmulti.planner.hosts import inter_host_ring_seconds
from tfmulti.planner.train_flags import launch_flags, train_flags
from tfmulti.planner.validation import (
    LAUNCH_SCRIPT,
    TRAIN_SCRIPT,
    chief_lines,
    distinct_layouts,
    training_command,
)
from tfmulti.platform.mesh import HybridMesh

GLOBAL_BATCH = 16
INTRA_HOST = 10e9
# The reference Transformer these costs stand for: embedding, two blocks, head.
TINY_TRANSFORMER = {"num_layers": 2, "num_heads": 2, "d_model": 16}


def _costs(params: int, activation_bytes: float) -> ModelCosts:
    """Four blocks of `params` parameters and `activation_bytes` per example each."""
    block = BlockCost(
        "block", params, AffineTime(1e-4, 2e-5), AffineTime(2e-4, 4e-5), activation_bytes
    )
    return ModelCosts("transformer", TINY_TRANSFORMER, "tokens", None, (block,) * 4)


# Gradients of 4 MB a block against 256 bytes of activations an example.
GRADIENT_HEAVY = _costs(params=1_000_000, activation_bytes=256)
# Gradients of 4 KB a block against 1 MB of activations an example.
ACTIVATION_HEAVY = _costs(params=1_000, activation_bytes=1e6)


def _hardware(inter_host_bandwidth: float, inter_host_latency: float = 1e-4) -> Hardware:
    return Hardware(
        bandwidth=INTRA_HOST,
        inter_host_bandwidth=inter_host_bandwidth,
        inter_host_latency=inter_host_latency,
    )


def _best_by_axis(layouts, mesh: HybridMesh) -> dict:
    """The fastest layout of `mesh` for each axis across hosts."""
    best = {}
    for layout in layouts:
        if layout.mesh == mesh and layout.cross_host_axis not in best:
            best[layout.cross_host_axis] = layout
    return best


def test_a_slow_link_makes_the_pipe_axis_cross_hosts_when_gradients_outweigh_activations():
    layouts = search_layouts(GRADIENT_HEAVY, 4, GLOBAL_BATCH, _hardware(1e9), hosts=2)
    assert layouts[0].cross_host_axis == "pipe"
    best = _best_by_axis(layouts, HybridMesh(data=2, pipe=2))
    assert best["pipe"].step_time < best["data"].step_time
    # What the data axis pays: each device's gradients summed over the two hosts.
    assert best["data"].allreduce_time > 10 * best["pipe"].allreduce_time


def test_a_slow_link_makes_the_data_axis_cross_hosts_when_activations_outweigh_gradients():
    layouts = search_layouts(ACTIVATION_HEAVY, 4, GLOBAL_BATCH, _hardware(1e9), hosts=2)
    best = _best_by_axis(layouts, HybridMesh(data=2, pipe=2))
    assert best["data"].step_time < best["pipe"].step_time


@pytest.mark.parametrize("latency", [0.0, 1e-4])
def test_a_link_as_fast_as_inside_a_host_makes_the_axis_indifferent_or_data(latency):
    fast = _hardware(INTRA_HOST, inter_host_latency=latency)
    layouts = search_layouts(GRADIENT_HEAVY, 4, GLOBAL_BATCH, fast, hosts=2)
    both = {layout.mesh for layout in layouts if len(cross_host_axes(layout.mesh, 2)) == 2}
    assert both
    for mesh in both:
        best = _best_by_axis(layouts, mesh)
        assert best["data"].step_time <= best["pipe"].step_time * (1 + 1e-9)
    if latency:
        return
    # Without latency, crossing with the pipe axis costs nothing over one host.
    one_host = {
        layout.key[:5]: layout.step_time
        for layout in search_layouts(GRADIENT_HEAVY, 4, GLOBAL_BATCH, fast)
    }
    for layout in layouts:
        if layout.cross_host_axis == "pipe":
            assert layout.step_time == pytest.approx(one_host[layout.key[:5]], rel=1e-9)


def test_only_stage_boundaries_between_hosts_pay_the_inter_host_latency():
    latency = 1e-3
    blocks = blocks_at(GRADIENT_HEAVY, 4, 1, Hardware(bandwidth=INTRA_HOST))
    mesh = HybridMesh(pipe=4)
    one_host = score_layout(blocks, mesh, "1f1b", 1, 1, (1, 2, 3), Hardware(bandwidth=INTRA_HOST))
    across = score_layout(
        blocks,
        mesh,
        "1f1b",
        1,
        1,
        (1, 2, 3),
        _hardware(INTRA_HOST, inter_host_latency=latency),
        hosts=2,
        cross_host_axis="pipe",
    )
    # One micro-batch crosses from device 1 to 2 forward and back once: two messages.
    assert across.pipeline_time == pytest.approx(one_host.pipeline_time + 2 * latency)
    assert across.allreduce_time == one_host.allreduce_time == 0.0


def test_gradient_sums_over_hosts_pay_the_inter_host_ring():
    hardware = _hardware(1e9, inter_host_latency=1e-4)
    blocks = blocks_at(GRADIENT_HEAVY, 4, 1, hardware)
    device_gradient_bytes = 2 * 4 * 1_000_000  # two blocks a device, float32 gradients
    hybrid = HybridMesh(data=2, pipe=2)
    data_across = score_layout(
        blocks, hybrid, "1f1b", 2, 1, (2,), hardware, hosts=2, cross_host_axis="data"
    )
    pipe_across = score_layout(
        blocks, hybrid, "1f1b", 2, 1, (2,), hardware, hosts=2, cross_host_axis="pipe"
    )
    assert data_across.allreduce_time == pytest.approx(
        inter_host_ring_seconds(device_gradient_bytes, 2, hardware)
    )
    assert pipe_across.allreduce_time == pytest.approx(device_gradient_bytes / INTRA_HOST)
    # A data-only mesh runs MultiWorkerMirroredStrategy: one ring over all four replicas.
    multi_worker = score_layout(
        blocks, HybridMesh(data=4), None, 1, 1, (), hardware, hosts=2, cross_host_axis="data"
    )
    assert multi_worker.allreduce_time == pytest.approx(6 * 1e-4 + 2 * 3 / 4 * 4 * 4_000_000 / 1e9)


def test_tensor_groups_never_cross_hosts():
    assert cross_host_axes(HybridMesh(tensor=4), 2) == ()
    assert cross_host_axes(HybridMesh(data=2, tensor=2), 2) == ("data",)
    costs = ModelCosts(
        "transformer", TINY_TRANSFORMER, "tokens", None, GRADIENT_HEAVY.blocks, (1, 2, 4)
    )
    layouts = search_layouts(costs, 8, GLOBAL_BATCH, _hardware(1e9), hosts=2)
    assert {layout.mesh.tensor for layout in layouts} == {1, 2, 4}
    for layout in layouts:
        axis_size = getattr(layout.mesh, layout.cross_host_axis)
        assert axis_size % 2 == 0 and 4 % layout.mesh.tensor == 0
    with pytest.raises(ValueError, match="tensor groups stay inside a host"):
        score_layout(
            blocks_at(costs, 4, 4, Hardware()),
            HybridMesh(tensor=4, data=2),
            None,
            1,
            1,
            (),
            Hardware(),
            hosts=2,
            cross_host_axis="pipe",
        )


def test_fewer_devices_run_on_whole_hosts_or_inside_one():
    layouts = search_layouts(
        GRADIENT_HEAVY, 4, GLOBAL_BATCH, _hardware(1e9), hosts=2, allow_fewer_devices=True
    )
    placements = {(layout.mesh.num_devices, layout.hosts) for layout in layouts}
    assert placements == {(1, 1), (2, 1), (4, 2)}
    one_host = next(layout for layout in layouts if layout.hosts == 1 and layout.mesh.pipe == 2)
    assert launch_flags(one_host) == [] and one_host.cross_host_axis is None


LAYOUTS_OVER_HOSTS = [
    (HybridMesh(data=4), "data", ["--strategy=multi_worker"]),
    (HybridMesh(pipe=4), "pipe", ["--strategy=pipeline", "--num_stages=4"]),
    (
        HybridMesh(data=2, pipe=2),
        "pipe",
        ["--strategy=hybrid", "--mesh=data=2,pipe=2,tensor=1", "--cross_host_axis=pipe"],
    ),
]


def _layout_over_hosts(mesh: HybridMesh, axis: str):
    layouts = search_layouts(GRADIENT_HEAVY, 4, GLOBAL_BATCH, _hardware(1e9), hosts=2)
    return _best_by_axis(layouts, mesh)[axis]


@pytest.fixture(scope="module")
def parsed_layout_flags() -> list[tuple[int, str]]:
    """train.py's parser on the train flags of each of `LAYOUTS_OVER_HOSTS`."""
    return parse_each(
        "tfmulti.cli.train",
        [
            train_flags(_layout_over_hosts(mesh, axis), GRADIENT_HEAVY, GLOBAL_BATCH)
            for mesh, axis, _ in LAYOUTS_OVER_HOSTS
        ],
    )


@pytest.mark.parametrize("case", range(len(LAYOUTS_OVER_HOSTS)))
def test_a_layout_over_hosts_is_launched_one_worker_a_host_and_its_flags_parse(
    parsed_layout_flags, case
):
    mesh, axis, strategy = LAYOUTS_OVER_HOSTS[case]
    layout = _layout_over_hosts(mesh, axis)
    flags = train_flags(layout, GRADIENT_HEAVY, GLOBAL_BATCH)
    assert flags[: len(strategy)] == strategy
    assert not any(flag.startswith("--virtual_devices") for flag in flags)
    assert launch_flags(layout) == ["--num_workers=2", "--devices_per_worker=2"]
    code, stderr = parsed_layout_flags[case]
    assert code == 0, stderr[-2000:]


def test_validation_launches_a_layout_over_hosts_and_times_the_chiefs_steps():
    layouts = search_layouts(GRADIENT_HEAVY, 4, GLOBAL_BATCH, _hardware(1e9), hosts=2)
    best = _best_by_axis(layouts, HybridMesh(data=2, pipe=2))
    # The same mesh and schedule with another axis across the hosts is another kind.
    kinds = {(lay.mesh, lay.cross_host_axis) for lay in distinct_layouts(layouts, len(layouts))}
    assert {(HybridMesh(data=2, pipe=2), "data"), (HybridMesh(data=2, pipe=2), "pipe")} <= kinds
    command = training_command(best["pipe"], ["--epochs=2"])
    assert command == [
        sys.executable,
        LAUNCH_SCRIPT,
        "--num_workers=2",
        "--devices_per_worker=2",
        "--",
        sys.executable,
        TRAIN_SCRIPT,
        "--epochs=2",
    ]
    log = "[worker 0] x.py:1] step 3: 1.0 examples/sec, 5.0 ms/step\n[worker 1] step 3: 9 ms/step"
    assert chief_lines(log) == "[worker 0] x.py:1] step 3: 1.0 examples/sec, 5.0 ms/step"


CONTRADICTORY_HOST_FLAGS = [
    (["--hosts=2"], "--devices_per_host"),
    (["--hosts=2", "--devices_per_host=2", "--devices=8"], "contradicts"),
    (["--devices=4", "--devices_per_host=2"], "contradicts"),
    (["--inter_host_gbps=0", "--hosts=2", "--devices_per_host=2"], "inter_host_gbps"),
    (["--hosts=0", "--devices_per_host=2"], "hosts"),
    (["--launch_option=--hosts_file=h.txt"], "--launch_option"),
    (["--hosts=2", "--devices_per_host=2", "--launch_option=--num_workers=4"], "planner"),
]
_NO_COSTS = ("--costs=/nonexistent.json", "--machine_costs=none")


@pytest.fixture(scope="module")
def parsed_host_flags() -> list[tuple[int, str]]:
    """plan.py's parser on each of `CONTRADICTORY_HOST_FLAGS`."""
    return parse_each(
        "tfmulti.cli.plan", [[*flags, *_NO_COSTS] for flags, _ in CONTRADICTORY_HOST_FLAGS]
    )


@pytest.mark.parametrize("case", range(len(CONTRADICTORY_HOST_FLAGS)))
def test_contradictory_host_flags_are_refused_in_one_line(parsed_host_flags, case):
    named = CONTRADICTORY_HOST_FLAGS[case][1]
    code, stderr = parsed_host_flags[case]
    assert code == 2 and "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("plan.py: error: ") and named in lines[0]


def test_plan_script_prints_a_contradictory_host_flag_as_its_one_line():
    result = run_script("plan.py", *CONTRADICTORY_HOST_FLAGS[0][0], *_NO_COSTS)
    assert CONTRADICTORY_HOST_FLAGS[0][1] in one_line_error(result, 2)


def _flag(command: list[str], name: str) -> str:
    return next(word.split("=", 1)[1] for word in command if word.startswith(f"--{name}="))


# The table's commands start their workers on two stand-in remote hosts
# (tests/test_remote_workers.py); the JSON's on this machine.
STAND_IN_SHELL = f"{sys.executable} {worker_program('stand_in_remote_shell')}"


@pytest.fixture(scope="module")
def two_host_plan(tmp_path_factory) -> dict:
    """plan.py's JSON for the tiny Transformer on 2 hosts x 2 devices, and its table, whose
    commands start the workers on hosts 127.0.0.2 and 127.0.0.3 (`--launch_option`)."""
    directory = tmp_path_factory.mktemp("two_host_plan")
    hosts = directory / "hosts.txt"
    hosts.write_text("127.0.0.2\n127.0.0.3\n")
    path = str(directory / "costs.json")
    save_costs(GRADIENT_HEAVY, path)
    common = (
        f"--costs={path}",
        "--hosts=2",
        "--devices_per_host=2",
        "--inter_host_gbps=8",
        f"--global_batch={GLOBAL_BATCH}",
        "--machine_costs=none",
        "--top=100",
    )
    table = run_script(
        "plan.py",
        *common,
        f"--launch_option=--hosts_file={hosts}",
        f"--launch_option=--remote_shell={STAND_IN_SHELL}",
    )
    assert table.returncode == 0, table.stderr[-3000:]
    as_json = run_script("plan.py", *common, "--json")
    assert as_json.returncode == 0, as_json.stderr[-3000:]
    return {"table": table.stdout, "json": json.loads(as_json.stdout)}


def test_the_plan_names_the_hosts_and_the_axis_across_them(two_host_plan):
    output = two_host_plan["json"]
    assert (output["hosts"], output["devices_per_host"], output["devices"]) == (2, 2, 4)
    assert output["inter_host_bandwidth"] == pytest.approx(1e9)
    assert output["layouts"][0]["cross_host_axis"] == "pipe"
    for layout in output["layouts"]:
        assert layout["command"].startswith(
            "python scripts/launch.py --num_workers=2 --devices_per_worker=2 -- "
            "python scripts/train.py "
        )
    assert "hosts" in two_host_plan["table"].splitlines()[2]


def test_the_printed_launch_command_of_a_two_host_plan_trains(two_host_plan, tmp_path):
    printed = [
        shlex.split(line.split(": ", 1)[1])
        for line in two_host_plan["table"].splitlines()
        if "--cross_host_axis=pipe" in line
    ]
    assert printed, two_host_plan["table"]
    # The one that traces fewest actions: fewest micro-batches, no chunks.
    words = min(printed, key=lambda command: (_flag(command, "microbatches"), len(command)))
    argv = [sys.executable if word == "python" else word for word in words]
    model_dir, hosts_log = str(tmp_path / "run"), tmp_path / "hosts_log"
    run_flags = ["--epochs=1", "--steps_per_epoch=2", "--validation_steps=1", "--log_steps=0"]
    result = subprocess.run(
        [*argv, *run_flags, f"--model_dir={model_dir}"],
        cwd=REPO_ROOT,
        env={**script_environment(), "STAND_IN_HOSTS_LOG": str(hosts_log)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    metrics = read_metrics(model_dir)
    assert metrics["status"] == "completed"
    stage_devices = [stage["device"] for stage in metrics["run"]["split"]["stages"]]
    assert any("task:0" in device for device in stage_devices)
    assert any("task:1" in device for device in stage_devices)
    # Its workers ran on the two stand-in hosts (each asked for ports, to run its worker,
    # then to remove the launch's scratch directory).
    assert sorted(hosts_log.read_text().split()) == ["127.0.0.2"] * 3 + ["127.0.0.3"] * 3
