"""`scripts/train.py --strategy=keras_model_parallel --layout_map=module:function` trains the
model sharded by the user's keras.distribution layout map exactly as on one device."""

import pytest
from script_runner import (
    TWO_EPOCHS,
    USER_CODE_ENV,
    assert_same_training,
    last_line,
    read_metrics,
    run_script,
)


@pytest.mark.parametrize(
    "mesh_args, expected_log",
    [
        (["--virtual_devices=2"], "6 weights sharded over 2 devices, batch split over 1 rows"),
        (
            ["--virtual_devices=4", "--mesh=data=2,tensor=2"],
            "6 weights sharded over 4 devices, batch split over 2 rows",
        ),
    ],
    ids=["model-axis", "batch-by-model-mesh"],
)
def test_keras_model_parallel_script_trains_like_one_device(
    tmp_path, one_device_metrics, mesh_args, expected_log
):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        "--strategy=keras_model_parallel",
        "--layout_map=user_layouts:mlp_layout_map",
        *mesh_args,
        f"--model_dir={model_dir}",
        env=USER_CODE_ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"keras.distribution: {expected_log}" in result.stderr
    assert_same_training(read_metrics(model_dir), one_device_metrics)


@pytest.mark.parametrize(
    "args, code, expected",
    [
        (["--strategy=keras_model_parallel"], 2, "needs --layout_map=package.module:function"),
        (["--strategy=mirrored", "--layout_map=user_layouts:mlp_layout_map"], 2, "goes only"),
        (
            ["--strategy=keras_model_parallel", "--layout_map=user_layouts:not_a_layout_map"],
            1,
            "Received: dict from --layout_map=user_layouts:not_a_layout_map",
        ),
        (
            [
                "--strategy=keras_model_parallel",
                "--layout_map=user_layouts:mlp_layout_map",
                "--mesh=data=2,pipe=2",
            ],
            1,
            "for pipelines use --strategy=hybrid. Received: --mesh=data=2,pipe=2",
        ),
        (
            [
                "--strategy=keras_model_parallel",
                "--layout_map=user_layouts:mlp_layout_map",
                "--mesh=data=2,tensor=2",
            ],
            1,
            "--mesh=data=2,tensor=2 needs 4 devices but only 2 exist",
        ),
    ],
    ids=["missing", "without-strategy", "returns-a-dict", "mesh-with-pipe", "mesh-too-big"],
)
def test_bad_layout_map_exits_with_one_line(tmp_path, args, code, expected):
    model_dir = str(tmp_path / "run")
    result = run_script(
        "train.py",
        *TWO_EPOCHS,
        *args,
        "--virtual_devices=2",
        f"--model_dir={model_dir}",
        env=USER_CODE_ENV,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert expected in last_line(result.stderr)
    assert "Traceback" not in result.stderr
