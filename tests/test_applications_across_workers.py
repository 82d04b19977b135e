"""`keras.applications` models from a user's module train across workers as on one host.

A representative pair of the model families tried by hand (docs/guide/multi_worker.md,
"Model families across workers"): ConvNeXtTiny, whose grouped convolutions Keras runs on
CPU as XLA-compiled functions, pipelined over 2 launched workers of one device each, and
MobileNetV3Small (BatchNorm, hard-swish, squeeze-and-excitation) in a hybrid
`data=2,pipe=2` mesh over 2 workers of 2 devices. Each run's reference shares its
micro-batches: one device for ConvNeXt (LayerNorm: two micro-batches sum to the batch),
the same hybrid mesh on 4 logical devices of one process for MobileNet (each replica's
BatchNorm sees its own rows by design).

Tolerance: as `assert_same_run` (the same gradients summed in another order: losses rel
1e-5, weights rtol 1e-5, atol 1e-6), but for the weights of ConvNeXt's two micro-batches
atol 1e-5: over its 28M weights Adam, which
divides by the root of each weight's squared gradients, moves a few whose gradients are
near zero by up to 2e-6 more or less than one device does (3 of 294912 in one kernel).
Across workers the runs equal the same layout on one host to the last bit.
"""

import numpy as np
import pytest
from script_runner import (
    USER_CODE_ENV,
    launch_training,
    model_weights,
    read_metrics,
    run_script,
)

# One epoch of 2 steps (the second step starts from weights the first changed) and one
# validation batch: the models' size, not the run's length, is the point here.
COMMON = (
    "--dataset=user_applications:images_32",
    "--batch_size=16",
    "--epochs=1",
    "--steps_per_epoch=2",
    "--validation_steps=1",
    "--log_steps=0",
)
HYBRID = ("--strategy=hybrid", "--mesh=data=2,pipe=2", "--microbatches=1")
# name: (model, (workers, devices per worker), flags across workers, reference flags,
# weights' atol).
CASES = {
    "convnext_tiny-pipeline-2x1": (
        "convnext_tiny",
        (2, 1),
        ("--strategy=pipeline", "--num_stages=2", "--microbatches=2"),
        ("--strategy=one_device",),
        1e-5,
    ),
    "mobilenet_v3_small-hybrid-2x2": (
        "mobilenet_v3_small",
        (2, 2),
        HYBRID,
        (*HYBRID, "--virtual_devices=4"),
        1e-6,
    ),
}


def reference_dir(shared_dir, case: str) -> str:
    """The one-host run `case` compares with, once per session."""
    model, _, _, flags, _ = CASES[case]

    def fill(model_dir: str) -> None:
        result = run_script(
            "train.py",
            *COMMON,
            f"--model=user_applications:{model}",
            *flags,
            f"--model_dir={model_dir}",
            env=USER_CODE_ENV,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    return shared_dir(f"applications-{case}-one_host", fill)


@pytest.mark.parametrize("case", CASES)
def test_an_application_across_workers_trains_like_on_one_host(
    tmp_path, monkeypatch, shared_dir, case
):
    model, (num_workers, devices_per_worker), flags, _, weights_atol = CASES[case]
    monkeypatch.setenv("PYTHONPATH", USER_CODE_ENV["PYTHONPATH"])
    model_dir = str(tmp_path / "run")
    returncode, output = launch_training(
        *COMMON,
        f"--model=user_applications:{model}",
        *flags,
        f"--model_dir={model_dir}",
        num_workers=num_workers,
        devices_per_worker=devices_per_worker,
        timeout=400,
    )
    assert returncode == 0, output[-3000:]
    reference = reference_dir(shared_dir, case)
    metrics, expected = read_metrics(model_dir), read_metrics(reference)
    assert metrics["status"] == "completed"
    for epoch, reference_epoch in zip(metrics["epochs"], expected["epochs"], strict=True):
        assert epoch["loss"] == pytest.approx(reference_epoch["loss"], rel=1e-5)
    for weight, reference_weight in zip(
        model_weights(model_dir), model_weights(reference), strict=True
    ):
        np.testing.assert_allclose(weight, reference_weight, rtol=1e-5, atol=weights_atol)
