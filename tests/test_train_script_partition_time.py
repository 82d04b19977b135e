"""`scripts/train.py --partition=time`: each stage's measured seconds in the split summary,
and the block timings kept in `--model_dir` so a resumed run does not time again (a fresh
run given the file does with `--remeasure_partition`), for reference models and the user's
own."""

import json
import os
import shutil
import textwrap

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


def _read(model_dir, name):
    with open(os.path.join(model_dir, name)) as handle:
        return json.load(handle)


def _stage_seconds(split):
    return [stage["seconds"] for stage in split["stages"]]


def test_split_summary_shows_each_stages_measured_seconds_and_share(tmp_path):
    model_dir = str(tmp_path / "run")

    result = run_script("train.py", *ARGS, "--epochs=1", f"--model_dir={model_dir}")

    assert result.returncode == 0, result.stderr[-3000:]
    metrics = _read(model_dir, "metrics.json")
    split = metrics["run"]["split"]
    assert split["stage_cost"] == "measured seconds"
    assert sum(stage["params"] for stage in split["stages"]) == metrics["run"]["parameters"]
    # Reference: the cache holds one entry per distinct block (embedding, the two
    # identical layers, head); the stages hold embedding + 2 x layer + head.
    entries = _read(model_dir, "partition_costs.json")["blocks"]
    assert len(entries) == 3
    per_block = {
        entry["block"].split()[0]: entry["forward_seconds"] + entry["backward_seconds"]
        for entry in entries.values()
    }
    expected_total = sum(per_block.values()) + per_block["TransformerBlock"]
    assert sum(_stage_seconds(split)) == pytest.approx(expected_total, rel=1e-9)
    shares = [stage["seconds_share"] for stage in split["stages"]]
    assert sum(shares) == pytest.approx(1.0)
    assert "F+B ms" in result.stderr
    for stage in split["stages"]:
        assert f"{stage['seconds'] * 1e3:.2f}" in result.stderr
        assert f"{stage['seconds_share']:.1%}" in result.stderr
    assert f"predicted bubble (stage cost = measured seconds): {split['predicted_bubble']:.1%}" in (
        result.stderr
    )
    assert "3 timed, 1 same as another block" in result.stderr

    resumed = run_script("train.py", *ARGS, "--epochs=2", "--resume", f"--model_dir={model_dir}")

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr
    assert _stage_seconds(_read(model_dir, "metrics.json")["run"]["split"]) == _stage_seconds(split)

    remeasured = run_script(
        "train.py",
        *ARGS,
        "--epochs=3",
        "--resume",
        "--remeasure_partition",
        f"--model_dir={model_dir}",
    )

    # The resumed run's checkpoint holds the old cut, which new timings could move.
    assert remeasured.returncode == 0, remeasured.stderr[-3000:]
    assert "--remeasure_partition is ignored with --resume" in remeasured.stderr
    assert "used the cached costs" in remeasured.stderr
    assert " timed" not in remeasured.stderr

    fresh_dir = str(tmp_path / "fresh")
    os.makedirs(fresh_dir)
    shutil.copy(os.path.join(model_dir, "partition_costs.json"), fresh_dir)
    remeasured = run_script(
        "train.py", *ARGS, "--epochs=1", "--remeasure_partition", f"--model_dir={fresh_dir}"
    )

    assert remeasured.returncode == 0, remeasured.stderr[-3000:]
    assert "3 timed, 1 same as another block" in remeasured.stderr
    assert "used the cached costs" not in remeasured.stderr


def test_another_model_option_times_its_changed_blocks_again(tmp_path):
    first_dir, second_dir = str(tmp_path / "first"), str(tmp_path / "second")
    first = run_script("train.py", *ARGS, "--epochs=1", f"--model_dir={first_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    os.makedirs(second_dir)
    shutil.copy(os.path.join(first_dir, "partition_costs.json"), second_dir)

    changed = run_script(
        "train.py", *ARGS, "--model_option=mlp_dim=96", "--epochs=1", f"--model_dir={second_dir}"
    )

    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "1 timed, 1 same as another block, 2 cached" in changed.stderr, changed.stderr[-3000:]


def test_a_damaged_cost_cache_costs_one_warning_line_and_the_run_goes_on(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "partition_costs.json").write_text("{truncated")

    result = run_script("train.py", *ARGS, "--epochs=1", f"--model_dir={model_dir}")

    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("damaged block cost cache") == 1
    assert "Traceback" not in result.stderr
    assert len(_read(str(model_dir), "partition_costs.json")["blocks"]) == 3


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


def test_a_user_models_call_timings_are_kept_in_model_dir_for_the_next_run(tmp_path):
    (tmp_path / "user_models.py").write_text(USER_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    model_dir = str(tmp_path / "run")

    first = run_script("train.py", *USER_ARGS, "--epochs=1", f"--model_dir={model_dir}", env=env)

    assert first.returncode == 0, first.stderr[-3000:]
    # Flatten, hidden_0 (64 inputs), hidden_1 for the three equal layers, head.
    assert "4 timed, 2 same as another block" in first.stderr, first.stderr[-3000:]
    assert len(_read(model_dir, "partition_costs.json")["blocks"]) == 4

    resumed = run_script(
        "train.py", *USER_ARGS, "--epochs=2", "--resume", f"--model_dir={model_dir}", env=env
    )

    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr

    # A fresh run given the file: remeasuring may move the cut, which a resumed run's
    # step checkpoint (saved for the old cut) would not load into.
    remeasured_dir = tmp_path / "remeasured"
    remeasured_dir.mkdir()
    shutil.copy(os.path.join(model_dir, "partition_costs.json"), remeasured_dir)
    remeasured = run_script(
        "train.py",
        *USER_ARGS,
        "--epochs=1",
        "--remeasure_partition",
        f"--model_dir={remeasured_dir}",
        env=env,
    )

    assert remeasured.returncode == 0, remeasured.stderr[-3000:]
    assert "4 timed, 2 same as another block" in remeasured.stderr
    assert "used the cached costs" not in remeasured.stderr


def test_layer_placement_of_a_user_model_reuses_the_kept_timings(tmp_path):
    (tmp_path / "user_models.py").write_text(USER_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
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
    assert os.path.exists(os.path.join(model_dir, "partition_costs.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("used the cached costs") == 1, resumed.stderr[-3000:]
    assert " timed" not in resumed.stderr
