"""Every shell command that README.md, BUILD.md and docs/**/*.md show runs, at its smallest size.

Commands come from fenced ```bash blocks, and from untagged blocks that hold only commands
(docs/guide/pipeline_schedules.md). Each block runs in a fresh directory, its commands in order
(a later one may read what an earlier one wrote), with these rewrites:
- `python`, `.venv/bin/python` and `tfmulti-*` are this environment's; `scripts/` is the
  checkout's; a `VAR=value` prefix goes into the environment;
- output paths (--out, --plot, --model_dir, --save_costs, --costs, ...) keep only their
  file name, so everything lands in the fresh directory;
- sizes shrink: every flag of SHRINK_TRAIN (train.py, also under launch.py) or of the
  script's `SMALLEST` in test_every_script_runs.py replaces the documented value, or is
  added; `--validate` trains one layout; plan.py with `--hardware` measures nothing and
  runs as documented (its cluster plan takes seconds);
- `my_project.models:small_cnn` and `my_project.data:load` are a small module written into
  the directory, as the documents describe it.
Then each run must exit 0 without a traceback and leave what it promises: a completed
metrics.json, JSON that parses, valid PNGs.

A command that does not run is in EXCLUDED, with the reason. One that would repeat another
run once shrunk is in SAME_RUN (another documented command), RUN_BY_SCRIPT_TESTS (a test
of test_every_script_runs.py, which checks its output in detail) or RUN_BY_TRAIN_TESTS (a
`train.py` test that compares the run with one device), and a test holds that the other run
has every flag of the shrunk command, sizes aside.
"""

import glob
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from script_runner import REPO_ROOT, read_metrics, script_environment, warm_when_possible
from test_every_script_runs import RUNS, SMALLEST, assert_valid_png, json_values
from test_train_script_hybrid import (
    MESH_3D_LAUNCH,
    MESH_3D_RUN,
    ONE_HOST_RUN,
    TWO_WORKERS_LAUNCH,
    TWO_WORKERS_RUN,
)
from test_train_script_parallel import TWO_WAY_TENSOR_PARALLEL_RUN

DOCUMENTS = (
    "README.md",
    "BUILD.md",
    *sorted(
        str(path.relative_to(REPO_ROOT)) for path in pathlib.Path(REPO_ROOT, "docs").rglob("*.md")
    ),
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
COMMAND_START = ("make ", "python", ".venv/bin/", "tfmulti-", "PYTHONPATH=")

EXCLUDED = {
    "make demo": "trains at full size (minutes); differs from BUILD.md's pipeline command, "
    "which runs here, only in --schedule (test_make_demo_is_the_documented_pipeline_command)",
    "make test": "runs ruff and this whole suite, this test included",
    "make test-profile": "runs this whole suite, this test included, to time it",
    "make format": "rewrites the checkout's files",
    "python3 -m venv .venv": "creates the environment these tests run in",
    '.venv/bin/pip install -e ".[dev]"': "installs the environment these tests run in "
    "(network, minutes)",
    '.venv/bin/pip install -e ".[gpu,dev]"': "installs CUDA wheels (network; no GPU here)",
    ".venv/bin/tensorboard --logdir runs/demo/logs": "a server that runs until stopped",
    '.venv/bin/pip install -e ".[ray]"': "installs the environment these tests run in "
    "(`.[dev]` holds the ray extra)",
    ".venv/bin/python train_on_ray.py": "starts a Ray cluster, which the tests run only inside "
    "a loopback-only network namespace: tests/test_ray.py runs the script (docs/guide/ray.md's "
    "Python blocks) there",
    "kubectl apply -f rayjob.yaml": "needs a Kubernetes cluster with KubeRay; "
    "tests/test_ray.py checks the manifest",
    ".venv/bin/python scripts/plan.py --model=transformer --model_option=num_layers=6 "
    "--devices=8 [--memory_per_device=2GiB] [--global_batch=64] [--costs=FILE | "
    "--save_costs=FILE] [--json]": "a synopsis ([optional] parts), not a command; "
    "docs/guide/hybrid_and_planner.md's commands run each form",
}
# A command whose shrunk run equals an earlier one's: it runs once, as the earlier one.
SAME_RUN = {
    "python scripts/plan.py --model_option=num_layers=4 --model_option=d_model=128 "
    "--devices=2 --allow_fewer_devices --validate=4": (
        "python scripts/plan.py --devices=2 --allow_fewer_devices --validate=4"
    ),
}

RUN_BY_SCRIPT_TESTS = {
    ".venv/bin/python scripts/benchmark_dp.py --virtual_devices=2": "benchmark_dp",
    ".venv/bin/python scripts/benchmark_cpu_allocator.py --rounds=2": "benchmark_cpu_allocator",
    ".venv/bin/python scripts/benchmark_pipeline.py --out=docs/benchmarks/pipeline.json": (
        "benchmark_pipeline"
    ),
    ".venv/bin/python scripts/benchmark_startup.py --out=/tmp/startup.json "
    "--plot=/tmp/startup.png": "benchmark_startup",
    ".venv/bin/python scripts/benchmark_parallel.py --out=/tmp/tp.json": "benchmark_parallel",
    ".venv/bin/python scripts/benchmark_parallel.py --sections=keras_llama "
    "--llama_ways=1,2,4,2x4": "benchmark_parallel",
    ".venv/bin/python scripts/benchmark_parallel.py --sections=mesh3d": "benchmark_parallel",
    "python scripts/benchmark_cluster_planner.py --out=docs/benchmarks/cluster_planner.json "
    "--plot=docs/benchmarks/cluster_planner.png": "benchmark_cluster_planner",
    ".venv/bin/python scripts/benchmark_zero.py --workers=2,4 --out=docs/benchmarks/zero.json "
    "--plot=docs/benchmarks/zero.png": "benchmark_zero",
    ".venv/bin/python scripts/benchmark_parallel.py --sections=mesh3d "
    "--meshes=data=2,pipe=2,tensor=2 --meshes=data=1,pipe=2,tensor=4 --out=/tmp/mesh3d.json": (
        "benchmark_parallel"
    ),
}

# A documented train.py command that a test runs already, with the flags it runs (launch.py's
# and train.py's): the test, not this file, runs it.
RUN_BY_TRAIN_TESTS = {
    ".venv/bin/python scripts/train.py --strategy=hybrid --mesh=data=2,pipe=2 "
    "--virtual_devices=4 --microbatches=4 --schedule=zb_h1 --model_dir=runs/hybrid": (
        "test_train_script_hybrid.py::test_hybrid_script_on_one_host_trains_like_one_device",
        ONE_HOST_RUN,
    ),
    ".venv/bin/python scripts/launch.py --num_workers=2 --devices_per_worker=2 -- "
    ".venv/bin/python scripts/train.py --strategy=hybrid --mesh=data=2,pipe=2 "
    "--microbatches=4 --model_dir=runs/hybrid2": (
        "test_train_script_hybrid.py::"
        "test_hybrid_script_across_two_workers_trains_like_one_device_with_chief_only_outputs",
        (*TWO_WORKERS_LAUNCH, *TWO_WORKERS_RUN),
    ),
    ".venv/bin/python scripts/launch.py --num_workers=2 --devices_per_worker=4 -- "
    ".venv/bin/python scripts/train.py --strategy=hybrid --mesh=data=2,pipe=2,tensor=2 "
    "--model=transformer --dataset=tokens --microbatches=2 --model_dir=runs/hybrid3d": (
        "test_train_script_hybrid.py::"
        "test_data_pipe_tensor_mesh_across_two_workers_trains_like_one_device",
        (*MESH_3D_LAUNCH, *MESH_3D_RUN),
    ),
    ".venv/bin/python scripts/train.py --strategy=model_parallel --tensor_parallel=2 "
    "--virtual_devices=2 --num_stages=1 --model=transformer --dataset=tokens "
    "--model_dir=runs/tp": (
        "test_train_script_parallel.py::test_tensor_parallel_transformer_script_trains_like_unsplit",
        TWO_WAY_TENSOR_PARALLEL_RUN,
    ),
}

PATH_FLAGS = ("out", "plot", "model_dir", "save_costs", "costs", "validate_dir")
SHRINK_TRAIN = ("--epochs=1", "--steps_per_epoch=2", "--validation_steps=1")
SHRINK_ANY = {"--model_option=num_layers": "2", "--validate": "1"}
MY_PROJECT = {
    "my_project/__init__.py": "",
    "my_project/models.py": """import keras


def small_cnn(width=32):
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(width, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(width, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))
""",
    "my_project/data.py": """import numpy as np


def load():
    x = np.random.default_rng(0).normal(size=(1024, 8, 8, 1)).astype("float32")
    return x, np.arange(1024) % 10
""",
}


def _blocks() -> list[tuple[str, list[str]]]:
    """(document: first command, [command, ...]) of every fenced block of commands, in order.

    A block is named by its document and the start of its first command, not by its line,
    so a test's id does not change when text above the block moves.
    """
    blocks = []
    for document in DOCUMENTS:
        with open(os.path.join(REPO_ROOT, document)) as handle:
            text = handle.read()
        for fence in FENCE.finditer(text):
            joined = fence.group(2).replace("\\\n", " ")
            lines = [line.split(" #")[0].strip() for line in joined.splitlines()]
            commands = [" ".join(line.split()) for line in lines if line and line[0] != "#"]
            is_shell = fence.group(1) == "bash" or (
                fence.group(1) == ""
                and commands
                and all(c.startswith(COMMAND_START) for c in commands)
            )
            if is_shell:
                blocks.append((f"{document}: {commands[0][:60]}", commands))
    return blocks


BLOCKS = _blocks()


def _key(argument: str) -> str:
    """What a later flag of the same key replaces: --model_option=NAME, else --flag."""
    name, _, value = argument.partition("=")
    if name == "--model_option":
        return f"{name}={value.partition('=')[0]}"
    return name


def _replace(arguments: list[str], new: list[str], only_present: bool = False) -> list[str]:
    present = {_key(argument) for argument in arguments}
    new = [argument for argument in new if not only_present or _key(argument) in present]
    replaced = {_key(argument) for argument in new}
    return [a for a in arguments if _key(a) not in replaced] + new


def _shrink_arguments(script: str, arguments: list[str]) -> list[str]:
    shrunk = []
    for argument in arguments:
        name, equals, value = argument.partition("=")
        if equals and name.lstrip("-") in PATH_FLAGS:
            argument = f"{name}={os.path.basename(value.rstrip('/'))}"
        shrunk.append(argument)
    any_size = [f"{key}={value}" for key, value in SHRINK_ANY.items()]
    shrunk = _replace(shrunk, any_size, only_present=True)
    if script == "train.py" and "--help" not in shrunk:
        steps = [int(a.split(",")[-1]) for a in shrunk if a.startswith(("--profile_", "--trace_"))]
        epochs, _, validation = SHRINK_TRAIN
        shrunk = _replace(shrunk, [epochs, f"--steps_per_epoch={max([2, *steps])}", validation])
    elif script in SMALLEST and not (
        script == "plan.py" and any(a.startswith("--hardware=") for a in shrunk)
    ):
        shrunk = _replace(shrunk, list(SMALLEST[script]))
    return shrunk


def _program(word: str) -> tuple[list[str], str | None]:
    """(argv start, script name) of a documented program word."""
    if word in ("python", "python3", ".venv/bin/python"):
        return [sys.executable], None
    if word.startswith("tfmulti-"):
        script = word.removeprefix("tfmulti-") + ".py"
        return [os.path.join(os.path.dirname(sys.executable), word)], script
    raise ValueError(f"No rule runs the documented program {word!r}")


def shrink(command: str) -> tuple[dict, list[str]]:
    """(environment additions, argv) of the smallest run of a documented command."""
    words = shlex.split(command)
    environment = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        name, _, value = words.pop(0).partition("=")
        environment[name] = value
    argv = []
    # launch.py's worker command follows `--`; each part is a program and its arguments.
    parts = [words]
    if "--" in words:
        split = words.index("--")
        parts = [words[:split], words[split + 1 :]]
    for index, part in enumerate(parts):
        start, script = _program(part[0])
        arguments = part[1:]
        if start == [sys.executable]:
            script = os.path.basename(arguments[0])
            start, arguments = [*start, os.path.join(REPO_ROOT, arguments[0])], arguments[1:]
        argv += [*start, *_shrink_arguments(script, arguments)]
        if index + 1 < len(parts):
            argv.append("--")
    return environment, argv


def _flag_value(argv: list[str], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    return values[-1] if values else None


def _check_outputs(argv: list[str], stdout: str, directory: str) -> None:
    """Asserts a run left what its flags promise."""
    scripts = [
        os.path.basename(a) if a.endswith(".py") else os.path.basename(a)[len("tfmulti-") :] + ".py"
        for a in argv
        if a.endswith(".py") or os.path.basename(a).startswith("tfmulti-")
    ]
    if "--help" in argv:
        assert "flags:" in stdout
        return
    if scripts[-1] == "train.py":
        metrics = read_metrics(os.path.join(directory, _flag_value(argv, "model_dir")))
        assert metrics["status"] == "completed" and len(metrics["epochs"]) == 1
    if _flag_value(argv, "trace_steps"):
        pictures = glob.glob(f"{directory}/**/step*.png", recursive=True)
        assert pictures, "--trace_steps drew no timeline"
        for picture in pictures:
            assert_valid_png(picture)
    if _flag_value(argv, "profile_steps"):
        assert glob.glob(f"{directory}/**/*.xplane.pb", recursive=True), "no profile written"
    if "--json" in argv or scripts[-1].startswith("benchmark_"):
        assert json_values(stdout)
    for name in ("out", "save_costs"):
        path = _flag_value(argv, name)
        if path and path.endswith(".json"):
            assert json_values(open(os.path.join(directory, path)).read())
        elif path:
            pictures = glob.glob(os.path.join(directory, path, "*.png"))
            assert pictures, f"--{name}={path} holds no picture"
            for picture in pictures:
                assert_valid_png(picture)
    if _flag_value(argv, "plot"):
        assert_valid_png(os.path.join(directory, _flag_value(argv, "plot")))


def _runs(commands: list[str]) -> list[str]:
    elsewhere = {**EXCLUDED, **SAME_RUN, **RUN_BY_SCRIPT_TESTS, **RUN_BY_TRAIN_TESTS}
    return [c for c in commands if c not in elsewhere]


def documented_scripts() -> set[str]:
    """Scripts that a documented command runs here (benchmarks: in a script test)."""
    return {
        os.path.basename(argument)
        for _, commands in BLOCKS
        for command in _runs(commands)
        for argument in shrink(command)[1]
        if argument.endswith(".py")
    }


def _without_outputs(arguments) -> set[str]:
    return {a for a in arguments if a.partition("=")[0].lstrip("-") not in PATH_FLAGS}


@pytest.mark.parametrize(
    "where, commands",
    [block for block in BLOCKS if _runs(block[1])],
    ids=[where for where, commands in BLOCKS if _runs(commands)],
)
def test_documented_commands_run_at_their_smallest_size(where, commands, tmp_path):
    for path, text in MY_PROJECT.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    for command in _runs(commands):
        additions, argv = shrink(command)
        env = {**script_environment(), **additions}
        result = subprocess.run(
            warm_when_possible(argv, env),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{where}: {shlex.join(argv)}\n{output[-3000:]}"
        assert "Traceback" not in output, f"{where}: {shlex.join(argv)}\n{output[-3000:]}"
        _check_outputs(argv, result.stdout, str(tmp_path))


def test_every_exclusion_and_same_run_names_a_documented_command():
    documented = {command for _, commands in BLOCKS for command in commands}

    assert set(EXCLUDED) <= documented
    assert set(SAME_RUN) | set(SAME_RUN.values()) | set(RUN_BY_SCRIPT_TESTS) <= documented
    assert set(RUN_BY_TRAIN_TESTS) <= documented
    assert not set(SAME_RUN.values()) & {*EXCLUDED, *SAME_RUN, *RUN_BY_SCRIPT_TESTS}


@pytest.mark.parametrize("command", sorted(SAME_RUN))
def test_a_same_run_command_shrinks_to_the_command_that_runs(command):
    assert _without_outputs(shrink(command)[1]) == _without_outputs(shrink(SAME_RUN[command])[1])


@pytest.mark.parametrize("command", sorted(RUN_BY_SCRIPT_TESTS))
def test_a_benchmark_command_is_part_of_its_script_tests_run(command):
    script, *arguments = RUNS[RUN_BY_SCRIPT_TESTS[command]]
    _, (_, path, *documented) = shrink(command)

    assert os.path.basename(path) == script
    assert _without_outputs(documented) <= set(arguments)


@pytest.mark.parametrize("command", sorted(RUN_BY_TRAIN_TESTS))
def test_a_train_command_is_the_run_of_its_test(command):
    test, tested_flags = RUN_BY_TRAIN_TESTS[command]
    test_file, _, test_name = test.partition("::")
    sizes = {_key(flag) for flag in (*SHRINK_TRAIN, *(f"{k}=" for k in SHRINK_ANY))}
    documented = {
        flag
        for flag in _without_outputs(shrink(command)[1])
        if flag.startswith("--") and flag != "--" and _key(flag) not in sizes
    }

    with open(os.path.join(REPO_ROOT, "tests", test_file)) as handle:
        assert f"def {test_name}(" in handle.read()
    assert documented <= set(tested_flags), f"{test} does not run {documented - set(tested_flags)}"


def test_make_demo_is_the_documented_pipeline_command():
    with open(os.path.join(REPO_ROOT, "Makefile")) as handle:
        recipe = handle.read().split("\ndemo:", 1)[1].replace("\\\n", " ")
    demo = next(line for line in recipe.splitlines() if "scripts/train.py" in line)
    demo = demo.replace("$(BIN)/python", "python").replace("$(DEMO_DIR)", "runs/demo")
    documented = next(
        c for _, commands in BLOCKS for c in commands if "--schedule=zb_h1 --partition=time" in c
    )

    difference = set(shrink(demo)[1]) ^ set(shrink(documented)[1])
    # 64 is train.py's default --batch_size.
    assert difference == {
        *("--schedule=1f1b", "--schedule=zb_h1", "--model_dir=demo", "--model_dir=pp"),
        "--batch_size=64",
    }
