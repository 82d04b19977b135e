"""`scripts/plan.py --model=module:function`: a user's functional model is planned by the
calls `PipelineModel.from_model` cuts between, and the printed commands run it.

The user's module is written by the test into a temporary directory on PYTHONPATH, as a
user's project would be. Its `data()` returns a `(train, validation)` pair of tf.data
datasets, a form train.py takes, from which the planner takes the examples it times on.
"""

import json
import os
import textwrap

import pytest
from script_runner import run_script

USER_MODULE = textwrap.dedent(
    """
    import keras
    import numpy as np
    import tensorflow as tf


    def build(width=32):
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(width, activation="relu", name="hidden_1")(x)
        x = keras.layers.Dense(width, activation="relu", name="hidden_2")(x)
        x = keras.layers.Dense(width, activation="relu", name="hidden_3")(x)
        return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(400, 8, 8, 1)).astype("float32")
        y = x.reshape(400, -1)[:, :10].argmax(1).astype("int64")
        return (
            tf.data.Dataset.from_tensor_slices((x[:360], y[:360])),
            tf.data.Dataset.from_tensor_slices((x[360:], y[360:])),
        )
    """
)
CALLS = ["flatten", "hidden_1", "hidden_2", "hidden_3", "logits"]


@pytest.fixture(scope="module")
def user_plan(tmp_path_factory):
    """plan.py's JSON for the user's model on 2 devices, the module's environment, its costs."""
    directory = tmp_path_factory.mktemp("user_planner")
    (directory / "user_planner.py").write_text(USER_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")])}
    costs = str(directory / "costs.json")
    result = run_script(
        "plan.py",
        "--model=user_planner:build",
        "--model_option=width=16",
        "--dataset=user_planner:data",
        "--devices=2",
        "--global_batch=16",
        "--machine_costs=none",
        "--measure_rounds=1",
        "--top=30",
        f"--save_costs={costs}",
        "--json",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(costs) as file:
        return json.loads(result.stdout), env, json.load(file)


def test_a_user_dataset_of_a_tf_data_pair_is_planned_on_like_arrays(user_plan):
    output, _, costs = user_plan
    assert costs["dataset"] == "user_planner:data"
    assert costs["measured_batch_sizes"] and output["layouts"]
    # The largest measured batch came whole from the training dataset: its blocks' times
    # grow with the batch, as they would on arrays.
    assert any(block["forward_seconds"]["per_example"] > 0 for block in costs["blocks"])


def test_user_model_is_costed_call_by_call_as_from_model_cuts_it(user_plan):
    _, _, costs = user_plan
    assert [block["name"] for block in costs["blocks"]] == CALLS
    assert costs["tensor_parallel_sizes"] == [1]
    hidden = costs["blocks"][1]
    assert hidden["params"] == 64 * 16 + 16 and hidden["variables"] == 2
    assert hidden["forward_seconds"]["per_example"] >= 0
    # Each call's split backward is measured on the executor's cut functions: the first
    # call (a Flatten of float inputs) has no weights, so its W computes nothing.
    flatten = costs["blocks"][0]
    assert flatten["weight_grad_share"] == 0.0 and flatten["input_grad_share"] >= 0.0
    assert hidden["input_grad_share"] >= 0.0 and hidden["weight_grad_share"] >= 0.0


def test_user_model_layouts_have_no_tensor_axis_and_cut_at_named_calls(user_plan):
    output, _, _ = user_plan
    meshes = {
        (lay["mesh"]["data"], lay["mesh"]["pipe"], lay["mesh"]["tensor"])
        for lay in output["layouts"]
    }
    assert meshes == {(2, 1, 1), (1, 2, 1)}
    for layout in output["layouts"]:
        if layout["mesh"]["pipe"] > 1:
            (partition,) = [f for f in layout["train_flags"] if f.startswith("--partition=")]
            names = partition.removeprefix("--partition=layers:").split(",")
            assert names == [CALLS[index] for index in layout["boundaries"]]


def test_printed_commands_for_a_user_model_parse_with_train_py(user_plan):
    output, env, _ = user_plan
    pipeline = next(lay for lay in output["layouts"] if lay["mesh"]["pipe"] > 1)
    for layout in (output["layouts"][0], pipeline):
        flags = layout["train_flags"]
        assert "--model=user_planner:build" in flags and "--model_option=width=16" in flags
        result = run_script("train.py", *flags, "--only_check_args", env=env)
        assert result.returncode == 0, result.stderr[-2000:]
