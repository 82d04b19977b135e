"""The layout planner: its choice against exhaustive search, memory caps, cost files, flags."""

import itertools
import json

import pytest
from script_runner import last_line, run_script

from tfmulti.pipeline import SCHEDULE_NAMES, CostModel, StageCost, build_schedule, simulate
from tfmulti.pipeline.schedules import SCHEDULE_CHUNKS
from tfmulti.planner import (
    AffineTime,
    BlockCost,
    Hardware,
    ModelCosts,
    blocks_at,
    load_costs,
    meshes,
    ring_allreduce_seconds,
    save_costs,
    score_layout,
    scoring,
    search_layouts,
)
from tfmulti.planner.machine import MachineCosts
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_flags import train_flags
from tfmulti.planner.validation import distinct_layouts
from tfmulti.platform.mesh import HybridMesh, parse_mesh

GLOBAL_BATCH = 16
HARDWARE = Hardware(bandwidth=2e8)


def _chunk_counts(schedule, max_chunks):
    fewest, most = SCHEDULE_CHUNKS.get(schedule, (1, 1))
    return range(fewest, min(most or max_chunks, max_chunks) + 1)


def _costs(num_blocks=8, tensor_sizes=(1, 2), num_layers=None):
    """Uneven synthetic costs: a cheap embedding, heavier middle blocks, a costly head."""
    blocks = []
    for index in range(num_blocks):
        middle = 0 < index < num_blocks - 1
        scale = 1 + (index % 3) if middle else (0.5 if index == 0 else 2.5)
        blocks.append(
            BlockCost(
                name=f"block_{index}",
                params=1000 * (index + 1),
                forward_seconds=AffineTime(2e-4, 1e-4 * scale),
                backward_seconds=AffineTime(3e-4, 2e-4 * scale),
                activation_bytes_per_example=8192,
                tensor_allreduces=2 if middle else 0,
            )
        )
    options = {"num_layers": num_layers if num_layers is not None else num_blocks - 2}
    return ModelCosts("transformer", options, "tokens", None, tuple(blocks), tensor_sizes)


def _exhaustive_step_times(costs, num_devices, hardware):
    """Every layout's (step time, peak memory), simulated here without the planner."""
    outcomes = {}
    for data, pipe, tensor in itertools.product(range(1, num_devices + 1), repeat=3):
        if data * pipe * tensor != num_devices or tensor not in costs.tensor_parallel_sizes:
            continue
        per_replica = GLOBAL_BATCH // data
        microbatch_counts = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
        shapes = [(None, 1, 1)]
        if pipe > 1:
            shapes = [
                (schedule, m, chunks)
                for schedule in SCHEDULE_NAMES
                for chunks in (_chunk_counts(schedule, max_chunks=4) if tensor == 1 else (1,))
                for m in microbatch_counts
            ]
        for schedule, m, chunks in shapes:
            try:
                plan = build_schedule(schedule or "gpipe", pipe, m, chunks)
            except ValueError:
                continue
            blocks = blocks_at(costs, per_replica / m, tensor, hardware)
            for cuts in itertools.combinations(range(1, len(blocks)), pipe * chunks - 1):
                edges = (0, *cuts, len(blocks))
                stages = [blocks[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
                stage_costs = tuple(
                    StageCost(
                        sum(b.forward_time for b in s),
                        sum(b.backward_time for b in s),
                        activation_bytes=sum(b.activation_bytes for b in s),
                    )
                    for s in stages
                )
                transfer = stages[0][-1].activation_bytes / hardware.bandwidth if pipe > 1 else 0
                result = simulate(plan, CostModel(stage_costs, transfer))
                params = [0.0] * pipe
                held = [0.0] * pipe
                for stage, device in zip(stages, plan.stage_devices, strict=True):
                    params[device] += sum(b.params for b in stage)
                    held[device] += sum(b.param_bytes for b in stage)
                allreduce = 2 * (data - 1) / data * 4 * max(params) / hardware.bandwidth
                memory = max(h + a for h, a in zip(held, result.peak_activation_bytes, strict=True))
                key = (HybridMesh(data, pipe, tensor), schedule, m, chunks, cuts)
                outcomes[key] = (result.makespan + allreduce, memory)
                if data == 1 or pipe > 1 or tensor > 1:
                    continue
                # ZeRO: of the 16 bytes a float32 Adam parameter holds, 4 of weights and 4
                # of gradients; stage 1 shares the other 8 over the devices, stage 2 the
                # gradients too, stage 3 everything, sends the weights a third time and
                # runs each forward twice.
                per_param = hardware.bytes_per_param
                live = result.peak_activation_bytes[0]
                for zero, shared in ((1, per_param - 8), (2, per_param - 4), (3, per_param)):
                    state = params[0] * ((per_param - shared) + shared / data)
                    time = result.makespan + allreduce
                    if zero == 3:
                        time += m * stage_costs[0].forward + allreduce / 2
                    outcomes[(*key, zero)] = (time, state + live)
    return outcomes


def test_top_layout_is_the_fastest_of_an_exhaustive_enumeration():
    costs = _costs()
    outcomes = _exhaustive_step_times(costs, 4, HARDWARE)
    best_time = min(time for time, _ in outcomes.values())
    top = search_layouts(costs, 4, GLOBAL_BATCH, HARDWARE, max_microbatches=GLOBAL_BATCH)[0]
    assert top.step_time == pytest.approx(best_time, rel=1e-9)
    # One host: the key's first five fields (its last two name hosts and the axis across).
    assert outcomes[top.key[:5]][0] == pytest.approx(top.step_time, rel=1e-9)


def _fitting_layouts(costs, cap: float) -> list:
    """The planner's layouts on 4 devices under a memory cap; asserts each fits it."""
    layouts = search_layouts(
        costs,
        4,
        GLOBAL_BATCH,
        Hardware(bandwidth=HARDWARE.bandwidth, memory_per_device=cap),
        max_microbatches=GLOBAL_BATCH,
    )
    assert layouts and all(layout.peak_memory <= cap for layout in layouts)
    return layouts


def test_top_layout_under_a_memory_cap_is_the_fastest_that_fits():
    costs = _costs()
    outcomes = _exhaustive_step_times(costs, 4, HARDWARE)
    unconstrained = min(outcomes.values())
    cap = 0.8 * unconstrained[1]
    fitting = [time for time, memory in outcomes.values() if memory <= cap]
    layouts = _fitting_layouts(costs, cap)
    assert layouts[0].step_time == pytest.approx(min(fitting), rel=1e-9)
    assert layouts[0].step_time > unconstrained[0]


def test_planner_proposes_zero_when_only_sharded_state_fits():
    costs = _costs(tensor_sizes=(1,))
    plain = search_layouts(costs, 4, GLOBAL_BATCH, HARDWARE, max_microbatches=GLOBAL_BATCH)
    data_parallel = next(x for x in plain if x.mesh == HybridMesh(data=4) and not x.zero)
    zero3 = next(x for x in plain if x.mesh == HybridMesh(data=4) and x.zero == 3)
    cap = (data_parallel.peak_memory + zero3.peak_memory) / 2
    layouts = _fitting_layouts(costs, cap)
    data_only = [layout for layout in layouts if layout.mesh == HybridMesh(data=4)]
    assert data_only and all(layout.zero > 0 for layout in data_only)
    assert "--zero=" in " ".join(train_flags(data_only[0], costs, GLOBAL_BATCH))


def test_memory_cap_below_every_layout_leaves_none():
    hardware = Hardware(memory_per_device=1.0)
    assert search_layouts(_costs(), 4, GLOBAL_BATCH, hardware) == []


def test_step_time_is_pipeline_makespan_plus_ring_allreduce_of_the_gradients():
    costs = _costs(num_blocks=4, tensor_sizes=(1,))
    blocks = blocks_at(costs, 4, 1, HARDWARE)
    layout = score_layout(blocks, HybridMesh(data=2, pipe=2), "1f1b", 2, 1, (2,), HARDWARE)
    gradient_bytes = 4 * max(
        blocks[0].params + blocks[1].params, blocks[2].params + blocks[3].params
    )
    assert layout.allreduce_time == pytest.approx(
        ring_allreduce_seconds(gradient_bytes, 2, HARDWARE.bandwidth)
    )
    assert ring_allreduce_seconds(1000, 4, 1000) == pytest.approx(1.5)
    assert layout.step_time == pytest.approx(layout.pipeline_time + layout.allreduce_time)


def test_tensor_split_divides_per_example_time_and_params_and_adds_allreduces():
    block = _costs().blocks[1]
    whole, split = (
        blocks_at(ModelCosts("m", {}, "d", None, (block,)), 8, k, HARDWARE)[0] for k in (1, 2)
    )
    allreduce = ring_allreduce_seconds(8 * 8192, 2, HARDWARE.bandwidth)
    assert split.forward_time == pytest.approx(2e-4 + 8 * 1e-4 * 2 / 2 + 2 * allreduce)
    assert whole.forward_time == pytest.approx(2e-4 + 8 * 1e-4 * 2)
    assert split.param_bytes == pytest.approx(whole.param_bytes / 2)


def test_tensor_meshes_appear_for_supported_sizes_alone_and_mixed_without_chunks():
    assert all(mesh.tensor == 1 for mesh in meshes(4, (1,)))
    assert {mesh.tensor for mesh in meshes(2, (1, 2))} == {1, 2}
    mixed = {str(mesh) for mesh in meshes(8, (1, 2, 4), allow_fewer_devices=True)}
    assert {"data=2,pipe=2,tensor=2", "data=1,pipe=2,tensor=4", "data=2,pipe=1,tensor=4"} <= mixed
    layouts = search_layouts(_costs(tensor_sizes=(1,)), 4, GLOBAL_BATCH, HARDWARE)
    assert all(layout.mesh.tensor == 1 for layout in layouts)
    layouts = search_layouts(_costs(tensor_sizes=(1, 2)), 8, GLOBAL_BATCH, HARDWARE)
    three_d = [layout for layout in layouts if layout.mesh == HybridMesh(2, 2, 2)]
    assert three_d and all(layout.chunks == 1 for layout in three_d)


def test_fewer_devices_are_considered_only_when_allowed():
    assert {mesh.num_devices for mesh in meshes(4)} == {4}
    assert {mesh.num_devices for mesh in meshes(4, allow_fewer_devices=True)} == {1, 2, 4}


def test_cost_file_round_trips(tmp_path):
    path = str(tmp_path / "costs.json")
    save_costs(_costs(), path)
    assert load_costs(path) == _costs()


def test_cost_file_with_a_missing_field_names_it(tmp_path):
    data = _costs().to_json()
    del data["blocks"][0]["forward_seconds"]
    with pytest.raises(ValueError, match="forward_seconds"):
        ModelCosts.from_json(data)


def test_affine_fit_passes_through_both_measurements():
    fitted = AffineTime.fit([8, 64], [0.002, 0.009])
    assert fitted.at(8) == pytest.approx(0.002)
    assert fitted.at(64) == pytest.approx(0.009)


def _layouts_by_strategy(costs, num_devices):
    """The best layout of each mesh kind among `num_devices` or fewer."""
    layouts = search_layouts(costs, num_devices, GLOBAL_BATCH, HARDWARE, allow_fewer_devices=True)
    return {train_flags(layout, costs, GLOBAL_BATCH)[0]: layout for layout in reversed(layouts)}


@pytest.mark.parametrize(
    "strategy",
    [
        "--strategy=one_device",
        "--strategy=mirrored",
        "--strategy=pipeline",
        "--strategy=hybrid",
        "--strategy=model_parallel",
    ],
)
def test_printed_flags_parse_with_train_py(strategy):
    costs = _costs(num_blocks=6)
    layout = _layouts_by_strategy(costs, 4)[strategy]
    result = run_script("train.py", *train_flags(layout, costs, GLOBAL_BATCH), "--only_check_args")
    assert result.returncode == 0, result.stderr


def test_interleaved_flags_parse_with_train_py():
    costs = _costs(num_blocks=6)
    layouts = search_layouts(costs, 2, GLOBAL_BATCH, HARDWARE)
    interleaved = next(layout for layout in layouts if layout.chunks > 1)
    flags = train_flags(interleaved, costs, GLOBAL_BATCH)
    assert f"--chunks={interleaved.chunks}" in flags
    result = run_script("train.py", *flags, "--only_check_args")
    assert result.returncode == 0, result.stderr


def _runs(layout):
    if layout.schedule is None:
        return None
    schedule = build_schedule(
        layout.schedule, layout.mesh.pipe, layout.num_microbatches, layout.chunks
    )
    return schedule.stage_devices, schedule.device_actions


def test_distinct_layouts_differ_in_mesh_or_in_what_their_devices_run():
    layouts = distinct_layouts(search_layouts(_costs(), 4, GLOBAL_BATCH, HARDWARE), 4)
    kinds = {(layout.mesh, layout.chunks, _runs(layout)) for layout in layouts}
    assert len(kinds) == len(layouts) == 4


def test_schedules_that_run_the_same_actions_are_one_kind():
    # At one micro-batch ZB-H1 and ZB-H2 (and GPipe and 1F1B) build the same actions.
    mesh = parse_mesh("pipe=2")
    same = [
        Layout(mesh, name, 1, 1, (1,), 1.0 + index, 1.0, 0.0, 0.0, 0.0)
        for index, name in enumerate(("zb_h1", "zb_h2", "gpipe", "1f1b"))
    ]
    assert [layout.schedule for layout in distinct_layouts(same, 4)] == ["zb_h1", "gpipe"]


def test_plan_script_prints_json_layouts_from_a_cost_file(tmp_path):
    path = str(tmp_path / "costs.json")
    save_costs(_costs(), path)
    result = run_script(
        "plan.py",
        f"--costs={path}",
        "--devices=4",
        f"--global_batch={GLOBAL_BATCH}",
        "--machine_costs=none",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert len(output["layouts"]) == 5
    times = [layout["step_time"] for layout in output["layouts"]]
    assert times == sorted(times)
    assert output["layouts"][0]["train_flags"][0].startswith("--strategy=")


def test_plan_script_table_lists_layouts_and_train_commands(tmp_path):
    path = str(tmp_path / "costs.json")
    save_costs(_costs(), path)
    result = run_script(
        "plan.py", f"--costs={path}", "--devices=2", "--top=3", "--machine_costs=none"
    )
    assert result.returncode == 0, result.stderr
    assert "step ms" in result.stdout
    assert result.stdout.count("python scripts/train.py") == 3


@pytest.mark.parametrize(
    "flag, name",
    [("--memory_per_device=lots", "memory_per_device"), ("--devices=0", "devices")],
)
def test_plan_script_bad_flag_is_one_line_naming_it(flag, name):
    result = run_script("plan.py", flag, "--costs=/nonexistent.json")
    assert result.returncode == 2
    assert name in last_line(result.stderr)
    assert "Traceback" not in result.stderr


def test_plan_script_with_no_fitting_layout_says_what_to_change(tmp_path):
    path = str(tmp_path / "costs.json")
    save_costs(_costs(), path)
    result = run_script(
        "plan.py",
        f"--costs={path}",
        "--devices=2",
        "--memory_per_device=1",
        "--machine_costs=none",
    )
    assert result.returncode == 1
    assert "--memory_per_device" in last_line(result.stderr)


def test_top_pipeline_layout_flags_train_with_train_py(tmp_path):
    costs = _costs(num_blocks=4, tensor_sizes=(1,))
    layouts = search_layouts(costs, 2, GLOBAL_BATCH, HARDWARE)
    top_pipeline = next(layout for layout in layouts if layout.mesh == HybridMesh(pipe=2))
    flags = train_flags(top_pipeline, costs, GLOBAL_BATCH)
    assert flags[0] == "--strategy=pipeline"
    result = run_script(
        "train.py",
        *flags,
        "--epochs=1",
        "--steps_per_epoch=2",
        "--validation_steps=1",
        f"--model_dir={tmp_path}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "metrics.json") as file:
        record = json.load(file)
    assert record["status"] == "completed"
    assert record["run"]["schedule"] == top_pipeline.schedule


def test_shared_compute_makes_a_step_at_least_every_devices_work_added_up():
    costs = _costs(num_blocks=4, tensor_sizes=(1,))
    blocks = blocks_at(costs, 8, 1, HARDWARE)
    whole_batch_work = sum(b.forward_time + b.backward_time for b in blocks)
    shared = Hardware(bandwidth=HARDWARE.bandwidth, shared_compute=True)
    mirrored = score_layout(blocks, HybridMesh(data=2), None, 1, 1, (), shared)
    pipelined = score_layout(blocks, HybridMesh(pipe=2), "1f1b", 4, 1, (2,), shared)
    assert mirrored.pipeline_time == pytest.approx(2 * whole_batch_work)
    assert pipelined.pipeline_time == pytest.approx(4 * whole_batch_work)
    independent = score_layout(blocks, HybridMesh(pipe=2), "1f1b", 4, 1, (2,), HARDWARE)
    assert independent.pipeline_time < pipelined.pipeline_time


def test_a_data_by_tensor_hybrid_runs_the_micro_batches_it_was_scored_at():
    """train.py runs such a mesh's replicas as one-stage pipelines of --microbatches
    (default 4); the printed command must run the layout's own count, which is 1."""
    costs = _costs(num_blocks=6)
    layouts = search_layouts(costs, 4, GLOBAL_BATCH, HARDWARE)
    data_by_tensor = next(layout for layout in layouts if layout.mesh == HybridMesh(2, 1, 2))
    flags = train_flags(data_by_tensor, costs, GLOBAL_BATCH)
    assert "--strategy=hybrid" in flags
    assert [flag for flag in flags if flag.startswith("--microbatches")] == [
        f"--microbatches={data_by_tensor.num_microbatches}"
    ]
    result = run_script("train.py", *flags, "--only_check_args")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("mesh", "runs_executor"),
    [
        (HybridMesh(2, 1, 2), True),
        (HybridMesh(1, 2, 1), True),
        (HybridMesh(4, 1, 1), False),
        (HybridMesh(1, 1, 4), False),
    ],
)
def test_the_executors_cost_is_added_where_train_py_runs_the_executor(mesh, runs_executor):
    """Executor costs (fixed, per action) land on pipelines and on every hybrid mesh, a
    data x tensor one included; mirrored and tensor-only runs pay none."""
    blocks = blocks_at(_costs(num_blocks=4), 4, mesh.tensor, HARDWARE)
    boundaries = (2,) if mesh.pipe == 2 else ()
    schedule = "gpipe" if mesh.pipe > 1 else None

    def overhead(**terms):
        hardware = Hardware(bandwidth=HARDWARE.bandwidth, machine=MachineCosts(**terms))
        return score_layout(blocks, mesh, schedule, 1, 1, boundaries, hardware).overhead_time

    executor_cost = overhead(pipeline_fixed=0.01, per_action=0.001) - overhead()
    dispatching_replicas = mesh.data
    actions = 2 * mesh.pipe
    expected = 0.01 + dispatching_replicas * 0.001 * actions if runs_executor else 0.0
    assert executor_cost == pytest.approx(expected)


@pytest.mark.parametrize(
    "mesh, hosts, strategy",
    [
        ("data=1", 1, "one_device"),
        ("data=4", 1, "mirrored"),
        ("data=4", 2, "multi_worker"),
        ("pipe=4", 1, "pipeline"),
        ("pipe=4", 2, "pipeline"),
        ("tensor=4", 1, "model_parallel"),
        ("tensor=4", 2, "hybrid"),
        ("data=2,tensor=2", 1, "hybrid"),
        ("data=2,pipe=2", 2, "hybrid"),
    ],
)
def test_one_function_chooses_train_pys_strategy_for_the_command_and_the_costs(
    mesh, hosts, strategy
):
    from tfmulti.planner.scoring import runs_pipeline_executor
    from tfmulti.planner.train_strategy import train_strategy

    parsed = parse_mesh(mesh)
    assert train_strategy(parsed, hosts) == strategy
    # The cost model charges the executor exactly where the command runs it.
    assert runs_pipeline_executor(parsed, hosts) == (strategy in ("pipeline", "hybrid"))


def test_a_search_rolls_each_schedule_once_however_many_splits_it_scores(monkeypatch):
    rolled = []
    roll = scoring.loop_schedule
    monkeypatch.setattr(scoring, "loop_schedule", lambda plan: rolled.append(plan) or roll(plan))
    scoring.executed_actions.cache_clear()
    machine = MachineCosts(per_action=1e-5, per_round=1e-5)
    # Six blocks on four devices: each pipeline schedule scores ten splits.
    layouts = search_layouts(_costs(num_blocks=6), 4, GLOBAL_BATCH, Hardware(machine=machine))
    assert any(layout.mesh.pipe > 1 for layout in layouts)
    assert rolled and len(rolled) == len(set(rolled))
