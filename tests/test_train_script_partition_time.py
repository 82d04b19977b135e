"""`scripts/train.py --partition=time`: each stage's measured seconds in the split summary,
and the block timings kept in `--model_dir` so a resumed run does not time again (a fresh
run given the file does with `--remeasure_partition`), for reference models and the user's
own."""

import json
import os
import shutil
import textwrap
from types import SimpleNamespace

import pytest
from script_runner import run_script

ARGS = (
    "--virtual_devices=2",
    "--strategy=pipeline",
    "--num_stages=2",
    "--microbatches=2",
    "--partition=time",
    "--model=transformer",
    "--model_option=num_layers=2",
    "--dataset=tokens",
    "--batch_size=16",
    "--steps_per_epoch=1",
    "--validation_steps=1",
)
COST_FILE = "partition_costs.json"


def _read(model_dir, name):
    with open(os.path.join(model_dir, name)) as handle:
        return json.load(handle)


def _stage_seconds(split):
    return [stage["seconds"] for stage in split["stages"]]


def _with_kept_costs(model_dir, directory) -> str:
    """`directory`, made and given `model_dir`'s kept block timings: a fresh run's
    `--model_dir` that holds the file."""
    os.makedirs(directory)
    shutil.copy(os.path.join(model_dir, COST_FILE), directory)
    return str(directory)


@pytest.fixture(scope="module")
def first_run(shared_dir):
    """One epoch of the reference Transformer timed into a fresh `--model_dir` (`model_dir`,
    read-only: copy it to run on) and its log (`stderr`), which every test here that reads a
    first run's timings shares.

    The directory starts with a damaged `partition_costs.json` (a truncated write): such a
    file must cost one warning line and nothing else, so this run times every block as a
    run without the file does, and also serves the damaged-cache test."""

    def fill(directory: str) -> None:
        model_dir = os.path.join(directory, "run")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, COST_FILE), "w") as handle:
            handle.write("{truncated")
        result = run_script("train.py", *ARGS, "--epochs=1", f"--model_dir={model_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        with open(os.path.join(directory, "stderr.txt"), "w") as handle:
            handle.write(result.stderr)

    directory = shared_dir("partition_time_first_run", fill)
    with open(os.path.join(directory, "stderr.txt")) as handle:
        stderr = handle.read()
    return SimpleNamespace(model_dir=os.path.join(directory, "run"), stderr=stderr)


def test_split_summary_shows_each_stages_measured_seconds_and_share(first_run):
    metrics = _read(first_run.model_dir, "metrics.json")
    split = metrics["run"]["split"]
    assert split["stage_cost"] == "measured seconds"
    assert sum(stage["params"] for stage in split["stages"]) == metrics["run"]["parameters"]
    # Reference: the cache holds one entry per distinct block (embedding, the two
    # identical layers, head); the stages hold embedding + 2 x layer + head.
    entries = _read(first_run.model_dir, COST_FILE)["blocks"]
    assert len(entries) == 3
    per_block = {
        entry["block"].split()[0]: entry["forward_seconds"] + entry["backward_seconds"]
        for entry in entries.values()
    }
    expected_total = sum(per_block.values()) + per_block["TransformerBlock"]
    assert sum(_stage_seconds(split)) == pytest.approx(expected_total, rel=1e-9)
    shares = [stage["seconds_share"] for stage in split["stages"]]
    assert sum(shares) == pytest.approx(1.0)
    assert "F+B ms" in first_run.stderr
    for stage in split["stages"]:
        assert f"{stage['seconds'] * 1e3:.2f}" in first_run.stderr
        assert f"{stage['seconds_share']:.1%}" in first_run.stderr
    assert f"predicted bubble (stage cost = measured seconds): {split['predicted_bubble']:.1%}" in (
        first_run.stderr
    )
    assert "3 timed, 1 same as another block" in first_run.stderr


def test_a_resumed_run_reads_the_kept_timings_even_with_remeasure_partition(first_run, tmp_path):
    """`--remeasure_partition` turns nothing on in a resumed run (the cache is read as
    without it), so one resumed run checks both: no block is timed again, the stages keep
    their seconds, and the flag is reported as ignored."""
    model_dir = str(tmp_path / "run")
    shutil.copytree(first_run.model_dir, model_dir)

    resumed = run_script(
        "train.py",
        *ARGS,
        "--epochs=2",
        "--resume",
        "--remeasure_partition",
        f"--model_dir={model_dir}",
    )

    # The resumed run's checkpoint holds the old cut, which new timings could move.
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--remeasure_partition is ignored with --resume" in resumed.stderr
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr
    split = _read(first_run.model_dir, "metrics.json")["run"]["split"]
    resumed_split = _read(model_dir, "metrics.json")["run"]["split"]
    assert _stage_seconds(resumed_split) == _stage_seconds(split)


def test_remeasure_partition_times_a_fresh_run_given_the_kept_timings(first_run, tmp_path):
    fresh_dir = _with_kept_costs(first_run.model_dir, tmp_path / "fresh")

    remeasured = run_script(
        "train.py", *ARGS, "--epochs=1", "--remeasure_partition", f"--model_dir={fresh_dir}"
    )

    assert remeasured.returncode == 0, remeasured.stderr[-3000:]
    assert "3 timed, 1 same as another block" in remeasured.stderr
    assert "used the cached costs" not in remeasured.stderr


def test_another_model_option_times_its_changed_blocks_again(first_run, tmp_path):
    second_dir = _with_kept_costs(first_run.model_dir, tmp_path / "second")

    changed = run_script(
        "train.py", *ARGS, "--model_option=mlp_dim=96", "--epochs=1", f"--model_dir={second_dir}"
    )

    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "1 timed, 1 same as another block, 2 cached" in changed.stderr, changed.stderr[-3000:]


def test_a_damaged_cost_cache_costs_one_warning_line_and_the_run_goes_on(first_run):
    assert first_run.stderr.count("damaged block cost cache") == 1
    assert "Traceback" not in first_run.stderr
    assert len(_read(first_run.model_dir, COST_FILE)["blocks"]) == 3


USER_MODULE = textwrap.dedent(
    """
    import keras


    def repeated_mlp(depth=4):
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Flatten()(inputs)
        for index in range(depth):
            x = keras.layers.Dense(16, activation="relu", name=f"hidden_{index}")(x)
        return keras.Model(inputs, keras.layers.Dense(10, name="head")(x))
    """
)
USER_ARGS = (
    "--virtual_devices=2",
    "--strategy=pipeline",
    "--num_stages=2",
    "--microbatches=2",
    "--partition=time",
    "--model=user_models:repeated_mlp",
    "--dataset=digits",
    "--batch_size=16",
    "--steps_per_epoch=1",
    "--validation_steps=1",
)


def _user_module_env(tmp_path) -> dict:
    """Writes `USER_MODULE` as `tmp_path/user_models.py`; the environment that imports it."""
    (tmp_path / "user_models.py").write_text(USER_MODULE)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_a_user_models_call_timings_are_kept_in_model_dir_for_the_next_run(tmp_path):
    """No fresh `--remeasure_partition` run here: the flag reaches a user's model through the
    same kept cache as a reference model's, which
    test_remeasure_partition_times_a_fresh_run_given_the_kept_timings runs, and
    tests/test_partition_costs_from_model.py remeasures a user model's calls."""
    env = _user_module_env(tmp_path)
    model_dir = str(tmp_path / "run")

    first = run_script("train.py", *USER_ARGS, "--epochs=1", f"--model_dir={model_dir}", env=env)

    assert first.returncode == 0, first.stderr[-3000:]
    # Flatten, hidden_0 (64 inputs), hidden_1 for the three equal layers, head.
    assert "4 timed, 2 same as another block" in first.stderr, first.stderr[-3000:]
    assert len(_read(model_dir, COST_FILE)["blocks"]) == 4

    resumed = run_script(
        "train.py", *USER_ARGS, "--epochs=2", "--resume", f"--model_dir={model_dir}", env=env
    )

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr


def test_layer_placement_of_a_user_model_reuses_the_kept_timings(tmp_path):
    env = _user_module_env(tmp_path)
    model_dir = str(tmp_path / "run")
    pipeline_only = ("--strategy", "--microbatches", "--partition")
    placed_args = [arg for arg in USER_ARGS if not arg.startswith(pipeline_only)]
    placed_args += ["--strategy=model_parallel", "--placement=time"]

    first = run_script("train.py", *placed_args, "--epochs=1", f"--model_dir={model_dir}", env=env)
    resumed = run_script(
        "train.py", *placed_args, "--epochs=2", "--resume", f"--model_dir={model_dir}", env=env
    )

    assert first.returncode == 0, first.stderr[-3000:]
    assert "timed" in first.stderr and "same as another block" in first.stderr
    assert os.path.exists(os.path.join(model_dir, COST_FILE))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr
