"""Every script under scripts/ runs its main path at its smallest size and prints or writes
what it promises: JSON that parses, with sane keys and values, and valid PNG pictures.

`train.py`, `launch.py` and `plan_pipeline.py` have files of their own, and `plan.py`
measures, saves, validates and prints JSON as docs/guide/hybrid_and_planner.md shows it, in
test_documented_commands.py (MAIN_PATH_TESTS); this file runs the benchmarks, and the
documented benchmark commands run here, in these runs (RUNS): benchmark_parallel.py's
takes its `mesh3d` section too, as BUILD.md and docs/design/tensor_parallel_traffic.md
show it, rather than starting TensorFlow in a process of its own for it.
"""

import glob
import json
import math
import os

import pytest
from script_runner import REPO_ROOT, run_script

# Where each script's main path runs; test_every_script_has_a_test_of_its_main_path holds it.
MAIN_PATH_TESTS = {
    "train.py": "test_train_script.py",
    "launch.py": "test_launcher.py",
    "plan_pipeline.py": "test_plan_pipeline_script.py",
    "plan.py": "test_documented_commands.py",
    "benchmark_dp.py": "test_every_script_runs.py",
    "benchmark_parallel.py": "test_every_script_runs.py",
    "benchmark_pipeline.py": "test_every_script_runs.py",
    "benchmark_startup.py": "test_every_script_runs.py",
    "benchmark_across_hosts.py": "test_every_script_runs.py",
    "benchmark_cpu_allocator.py": "test_every_script_runs.py",
    "benchmark_zero.py": "test_every_script_runs.py",
    "benchmark_cluster_planner.py": "test_every_script_runs.py",
}

# The smallest run of each benchmark; test_documented_commands.py shrinks the documented
# commands with the same flags (the last value of a flag wins).
SMALLEST = {
    "benchmark_dp.py": (
        "--virtual_devices=2",
        "--steps=2",
        "--epochs_per_round=2",
        "--rounds=1",
        "--features=8",
        "--width=8",
        "--batch_size=8",
    ),
    "benchmark_parallel.py": (
        "--d_models=8",
        "--sequence_length=4",
        "--rows=8",
        "--steps=1",
        "--rounds=1",
        "--llama_ways=1,2",
        "--llama_hidden_dim=8",
        "--llama_batch_size=2",
        "--meshes=data=2,pipe=2,tensor=2",
        "--mesh3d_layers=2",
        "--mesh3d_global_batch=8",
        "--mesh3d_steps=1",
        "--mesh3d_epochs=2",
        "--reduce_ways=2",
        "--reduce_shapes=2x4x8",
        "--reduce_blocks=1",
    ),
    # Schedules of one chunk, with a split backward, and of two chunks with overlapped pairs.
    "benchmark_pipeline.py": (
        "--schedules=1f1b,zb_h1,dualpipev",
        "--num_devices=2",
        "--microbatches=4",
        "--forward_ms=1",
        "--batch_size=8",
        "--steps=1",
        "--repeats=2",
        "--timeline_microbatches=4",
        "--memory_microbatches=2",
        "--real_num_layers=1",
        "--real_d_model=8",
        "--real_sequence_length=4",
        "--real_batch_size=4",
        "--real_microbatches=2",
    ),
    "benchmark_startup.py": (
        "--layers=1",
        "--microbatches=2",
        "--num_devices=2",
        "--batch_size=4",
        "--steady_steps=1",
    ),
    # The hybrid mesh alone (the pipeline layout runs the same code), one host and 2 x 2.
    "benchmark_across_hosts.py": (
        "--layouts=hybrid",
        "--num_layers=1",
        "--d_model=8",
        "--sequence_length=4",
        "--batch_size=8",
        "--microbatches=2",
        "--steps=1",
    ),
    # One small run, one process under each allocator.
    "benchmark_cpu_allocator.py": (
        "--run=--strategy=one_device --model=mlp --dataset=digits --batch_size=8",
        "--rounds=1",
        "--epochs=2",
        "--steps_per_epoch=2",
    ),
    # Stage 0 (MultiWorkerMirroredStrategy) and 3 over 2 workers, a narrow MLP.
    "benchmark_zero.py": (
        "--workers=2",
        "--stages=0,3",
        "--width=32",
        "--layers=1",
        "--steps=2",
        "--epochs=2",
        "--overlap_devices=2",
    ),
    # The smallest and the fitted row of Megatron-LM's Table 1 (no TensorFlow, seconds).
    "benchmark_cluster_planner.py": ("--rows=1,7",),
    # Its smallest measuring (one Transformer block, narrow) and --validate runs.
    "plan.py": (
        "--model_option=num_layers=1",
        "--model_option=d_model=16",
        "--global_batch=8",
        "--measure_rounds=1",
        "--validate_repeats=1",
        "--validate_steps=2",
        "--validate_epochs=2",
        # The machine's cost terms are measured and cached by tests/test_planner_accuracy.py;
        # here they would take minutes and write to the user's cache directory.
        "--machine_costs=none",
    ),
}


# What each benchmark test runs; test_documented_commands.py finds the documented
# benchmark commands among them.
RUNS = {
    "benchmark_dp": ("benchmark_dp.py", *SMALLEST["benchmark_dp.py"]),
    "benchmark_parallel": (
        "benchmark_parallel.py",
        "--sections=mlp",
        "--sections=keras_llama",
        "--sections=mesh3d",
        "--sections=tensor_reduce",
        *SMALLEST["benchmark_parallel.py"],
    ),
    "benchmark_pipeline": ("benchmark_pipeline.py", *SMALLEST["benchmark_pipeline.py"]),
    "benchmark_startup": ("benchmark_startup.py", *SMALLEST["benchmark_startup.py"]),
    "benchmark_across_hosts": (
        "benchmark_across_hosts.py",
        *SMALLEST["benchmark_across_hosts.py"],
    ),
    "benchmark_cpu_allocator": (
        "benchmark_cpu_allocator.py",
        *SMALLEST["benchmark_cpu_allocator.py"],
    ),
    "benchmark_zero": ("benchmark_zero.py", *SMALLEST["benchmark_zero.py"]),
    "benchmark_cluster_planner": (
        "benchmark_cluster_planner.py",
        *SMALLEST["benchmark_cluster_planner.py"],
    ),
}


def json_values(text: str) -> list:
    """Every JSON value printed in `text`, in order (JSON lines, then an indented list)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)


def assert_valid_png(path) -> None:
    """Asserts `path` is a PNG that decodes, with a picture in it."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width > 100 and image.height > 100
        image.load()


def _ran(result) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout


def _finite_positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_every_script_has_a_test_of_its_main_path():
    scripts = {os.path.basename(path) for path in glob.glob(f"{REPO_ROOT}/scripts/*.py")}

    assert scripts == set(MAIN_PATH_TESTS)
    from test_documented_commands import documented_scripts

    for script, test_file in MAIN_PATH_TESTS.items():
        with open(os.path.join(REPO_ROOT, "tests", test_file)) as handle:
            named = script in handle.read()
        if test_file == "test_documented_commands.py":
            named = script in documented_scripts()
        assert named, f"{test_file} never runs {script}"


def test_benchmark_dp_prints_its_overhead_ratio_and_writes_it(tmp_path):
    out = tmp_path / "dp.json"
    stdout = _ran(run_script(*RUNS["benchmark_dp"], f"--out={out}"))

    result = json.loads(stdout)
    assert json.loads(out.read_text()) == result
    # A warm-up round and one timed round of 2 epochs of 2 steps, on each path.
    assert result["steps_trained_each"] == 2 * 2 * 2
    assert _finite_positive(
        result["overhead_ratio"],
        result["handwritten_steps_per_sec"],
        result["tfmulti_steps_per_sec"],
        result["wall_clock_ratio"],
    )
    assert result["overhead_ratio"] == pytest.approx(
        result["handwritten_steps_per_sec"] / result["tfmulti_steps_per_sec"]
    )
    for key in ("epoch_end_seconds", "before_first_step_seconds", "round_seconds"):
        assert set(result[key]) == {"tfmulti", "handwritten"}


def test_benchmark_parallel_records_mlp_llama_mesh3d_and_tensor_reduce(tmp_path):
    out = tmp_path / "parallel.json"
    # Its mesh3d section trains in a process of its own: longer than run_script's default.
    stdout = _ran(run_script(*RUNS["benchmark_parallel"], f"--out={out}", timeout=900))

    *lines, records = json_values(stdout)
    assert lines == records == json.loads(out.read_text())
    kinds = [record["benchmark"] for record in records]
    assert kinds == [
        "parallel_mlp",
        *["keras_model_parallel_llama"] * 2,
        "mesh3d",
        "tensor_reduce",
    ]
    mlp, llama_one, llama_two, mesh3d, reduce = records
    assert mlp["communication_bytes_per_step"]["equal"]
    assert _finite_positive(mlp["speedup"], *mlp["step_ms"].values())
    assert len(llama_one["variable_bytes_per_device"]) == 1
    assert len(llama_two["variable_bytes_per_device"]) == 2
    # Sharded over two devices, no device holds the whole model.
    assert llama_two["max_variable_bytes_on_a_device"] < llama_one["max_variable_bytes_on_a_device"]
    # The planner's best layout of the mesh, trained by scripts/train.py.
    assert mesh3d["mesh"] == "data=2,pipe=2,tensor=2" and mesh3d["error"] is None
    assert _finite_positive(mesh3d["predicted_step_seconds"], mesh3d["measured_step_seconds"])
    assert _finite_positive(*mesh3d["split_blocks_bytes_per_step"].values())
    assert _finite_positive(*mesh3d["embedding_bytes_per_step"].values())
    assert set(reduce["collective_over_ring"]) == {"blocks", "all_reduce"}
    assert _finite_positive(*reduce["step_ms"].values())


def test_benchmark_pipeline_refuses_micro_batches_that_do_not_split_the_batch():
    # With 16 rows, 32 micro-batches would hold 1 row each (16 of them empty) and measure
    # twice what the simulator's equal micro-batches take.
    result = run_script("benchmark_pipeline.py", "--microbatches=8,32", "--batch_size=16")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--batch_size must be a multiple of every --microbatches count" in result.stderr


def test_benchmark_pipeline_records_fidelity_memory_and_compute_and_draws_them(tmp_path):
    out, plot = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    stdout = _ran(run_script(*RUNS["benchmark_pipeline"], f"--out={out}", f"--plot={plot}"))

    records = json_values(stdout)[-1]
    assert records == json.loads(out.read_text())
    fidelity = [r for r in records if r["benchmark"] == "fidelity" and "measured_s" in r]
    schedules = ["1f1b", "zb_h1", "dualpipev"]
    assert [r["schedule"] for r in fidelity] == schedules
    for record in fidelity:
        assert _finite_positive(record["measured_s"], record["simulated_s"], record["speedup"])
        runs = record["measured_over_simulated_at_hold_cost_runs"]
        assert len(runs) == 2 and record["measured_over_simulated_at_hold_cost"] in runs
    assert [r["schedule"] for r in records if r["schedule"] == "zb_h1_vs_1f1b"]
    memory = [r for r in records if r["benchmark"] == "memory"]
    assert [(r["schedule"], r["stage"]) for r in memory] == [
        ("gpipe", 0),
        ("gpipe", 1),
        ("1f1b", 0),
        ("1f1b", 1),
    ]
    assert all(r["measured_peak_stashed"] == r["formula_peak_stashed"] for r in memory)
    compute = [r for r in records if r["benchmark"] == "real_compute"]
    assert [r["schedule"] for r in compute] == ["one_device", "model_parallel", "1f1b"]
    assert _finite_positive(*(r["examples_per_s"] for r in compute))
    assert_valid_png(plot)
    for schedule in schedules:
        assert_valid_png(tmp_path / "pipeline_timelines" / f"timeline_{schedule}_m4.png")


def test_benchmark_startup_records_each_kind_in_a_fresh_process_and_draws_them(tmp_path):
    out, plot = tmp_path / "startup.json", tmp_path / "startup.png"
    stdout = _ran(run_script(*RUNS["benchmark_startup"], f"--out={out}", f"--plot={plot}"))

    records = json_values(stdout)
    assert records == json.loads(out.read_text())
    assert [(r["kind"], r["microbatches"]) for r in records] == [
        ("one_device", 1),
        ("pipeline", 2),
        ("hybrid", 2),
    ]
    for record in records:
        assert record["first_step_s"] >= record["trace_s"] > 0
        assert record["total_nodes"] >= record["step_nodes"] > 0
        assert _finite_positive(record["first_evaluation_cpu_s"], record["steady_step_s"])
    assert_valid_png(plot)


def test_benchmark_across_hosts_compares_one_host_with_two_workers_and_draws_it(tmp_path):
    out, plot = tmp_path / "across.json", tmp_path / "across.png"
    stdout = _ran(run_script(*RUNS["benchmark_across_hosts"], f"--out={out}", f"--plot={plot}"))

    records = json_values(stdout)
    assert records == json.loads(out.read_text())
    one_host, across_hosts, ratio = records
    assert [r["place"] for r in (one_host, across_hosts)] == ["one_host", "across_hosts"]
    assert one_host["measured_bytes_per_step"] == one_host["analytic_bytes_per_step"] == 0
    # Each replica's stage 0 on worker 0 and stage 1 on worker 1.
    assert [[device.split("/")[3] for device in r] for r in across_hosts["replica_devices"]] == [
        ["task:0", "task:1"],
        ["task:0", "task:1"],
    ]
    # Rows x (sequence x d_model) x 4 bytes x 2, and the int32 labels.
    assert across_hosts["boundary_bytes_per_step"] == 8 * 4 * 8 * 4 * 2
    assert across_hosts["label_bytes_per_step"] == 8 * 4 * 4
    assert across_hosts["measured_bytes_per_step"] >= across_hosts["analytic_bytes_per_step"]
    assert _finite_positive(
        ratio["step_time_ratio"], ratio["startup_ratio"], ratio["measured_over_analytic_bytes"]
    )
    assert_valid_png(plot)


def test_benchmark_cpu_allocator_times_each_run_under_both_allocators():
    result = json.loads(_ran(run_script(*RUNS["benchmark_cpu_allocator"])))

    (run,) = result["runs"]
    assert run["flags"] == [
        "--strategy=one_device",
        "--model=mlp",
        "--dataset=digits",
        "--batch_size=8",
    ]
    assert len(run["default_ms"]) == len(run["bfc_ms"]) == 1
    assert _finite_positive(*run["default_ms"], *run["bfc_ms"])
    assert run["bfc_over_default"] == pytest.approx(
        run["bfc_ms"][0] / run["default_ms"][0], abs=1e-3
    )


def test_benchmark_cpu_allocator_names_a_failing_run_in_one_line():
    result = run_script("benchmark_cpu_allocator.py", "--run=--strategy=no_such", "--rounds=1")

    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "--strategy=no_such" in result.stderr.strip().splitlines()[-1]


def test_benchmark_zero_measures_every_workers_bytes_against_the_formulas(tmp_path):
    out, plot, timeline = tmp_path / "zero.json", tmp_path / "zero.png", tmp_path / "line.png"
    stdout = _ran(
        run_script(
            *RUNS["benchmark_zero"], f"--out={out}", f"--plot={plot}", f"--timeline={timeline}"
        )
    )
    result = json.loads(stdout)
    assert json.loads(out.read_text()) == result
    assert_valid_png(plot)
    assert_valid_png(timeline)
    # The traced stage-3 step (the second epoch's second) read from the profiler's trace:
    # each of the MLP's 4 weights gathered on each of 2 devices for the forward, and
    # gathered again for the backward.
    overlap = result["stage3_overlap"]
    assert overlap["traced_steps"] == 1
    assert overlap["gather_ops_per_step"] >= 8 and overlap["regather_ops_per_step"] > 0
    assert 0.0 <= overlap["overlap_fraction_median"] <= 1.0
    runs = {run["stage"]: run for run in result["runs"]}
    assert sorted(runs) == [0, 3]
    for run in runs.values():
        # Both workers' devices, gathered on the chief, each with its allocator's peak.
        assert run["devices"] == 2
        assert run["held_over_formula"] == pytest.approx(1.0, rel=0.02)
        assert _finite_positive(run["peak_bytes_max"], run["step_time_ms"])
    # Stage 3 holds half of stage 0's weights and optimizer state on each of 2 devices.
    held = {s: r["weights_bytes_max"] + r["optimizer_bytes_max"] for s, r in runs.items()}
    assert held[3] == pytest.approx(held[0] / 2, rel=0.02)


def test_benchmark_cluster_planner_holds_published_rows_against_predictions(tmp_path):
    out, plot = tmp_path / "cluster.json", tmp_path / "cluster.png"
    stdout = _ran(run_script(*RUNS["benchmark_cluster_planner"], f"--out={out}", f"--plot={plot}"))

    result = json.loads(stdout)
    assert json.loads(out.read_text()) == result
    assert_valid_png(plot)
    assert [row["billions"] for row in result["rows"]] == [1.7, 145.6]
    for row in result["rows"]:
        assert row["published_layout_fits"] and row["published_among_best"]
        assert abs(row["error"]) <= 0.10
        assert _finite_positive(
            row["predicted_tflops_per_gpu"], row["published_layout_memory_per_gpu"]
        )
    # The fitted row matches by construction.
    assert result["rows"][1]["predicted_tflops_per_gpu"] == pytest.approx(148, abs=0.5)
    assert result["mape"] == pytest.approx(sum(abs(row["error"]) for row in result["rows"]) / 2)
