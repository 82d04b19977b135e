"""tfmulti runs TensorFlow with its BFC CPU allocator unless the user chose, because the
default allocator takes memory from the system afresh each step under a strategy; a
canary tells when TensorFlow's default no longer does."""

import os
import subprocess
import sys

import pytest

from tfmulti.platform.runtime.cpu_allocator import CPU_ALLOCATOR_ENV, prefer_bfc_cpu_allocator

# Trains a small Transformer under OneDeviceStrategy and prints the process's minor page
# faults per step after warm-up (the kernel's count, not a time). It starts TensorFlow as
# the scripts do (`start_tensorflow`) and first prints the allocator choice that leaves.
#
# Both runs ask for oneDNN's kernels: TensorFlow turns them on by itself only on CPUs with
# AVX-512 or newer, and without them a matmul is Eigen's contraction, whose packing
# buffers come from the C library, not from TensorFlow's allocator (~770 faults a step
# under BFC on an AVX2-only EPYC, against 5-15 with oneDNN). oneDNN's scratch memory
# comes from TensorFlow's allocator, so the two runs differ by the allocator alone.
FAULTS_PER_STEP = f"""
import os
import resource
from tfmulti.platform.runtime.tf_startup import start_tensorflow
start_tensorflow()
print(os.environ[{CPU_ALLOCATOR_ENV!r}])
import keras
import tensorflow as tf
from tfmulti.data import load_source
from tfmulti.models import registry
batch, steps = 16, 8
source = load_source("tokens", data_path=None, seed=0)
x, y = source.x_train[: batch * steps], source.y_train[: batch * steps]
with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    model = registry.build_model(
        "transformer", source.info.input_shape, source.info.num_classes, 0, num_layers=2
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (2 * steps))
"""


@pytest.fixture(scope="module")
def allocator_runs() -> dict:
    """{choice: (allocator choice printed, faults per step)} of `FAULTS_PER_STEP` with
    TensorFlow's default allocator chosen ("false") and with no choice made (None, so
    `start_tensorflow` chooses, as in the scripts)."""
    environment = {name: value for name, value in os.environ.items() if name != CPU_ALLOCATOR_ENV}
    environment.update(TF_ENABLE_ONEDNN_OPTS="1", TF_CPP_MIN_LOG_LEVEL="2")
    runs = {}
    for choice in ("false", None):
        result = subprocess.run(
            [sys.executable, "-c", FAULTS_PER_STEP],
            capture_output=True,
            text=True,
            env={**environment, CPU_ALLOCATOR_ENV: choice} if choice else environment,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        printed_choice, faults = result.stdout.split()[-2:]
        runs[choice] = (printed_choice, float(faults))
    return runs


def test_bfc_is_asked_for_when_the_user_did_not_choose(monkeypatch):
    monkeypatch.delenv(CPU_ALLOCATOR_ENV, raising=False)

    assert prefer_bfc_cpu_allocator() is True
    assert os.environ[CPU_ALLOCATOR_ENV] == "true"


@pytest.mark.parametrize("choice, expected", [("false", False), ("0", False), ("1", True)])
def test_the_users_choice_of_allocator_is_kept(monkeypatch, choice, expected):
    monkeypatch.setenv(CPU_ALLOCATOR_ENV, choice)

    assert prefer_bfc_cpu_allocator() is expected
    assert os.environ[CPU_ALLOCATOR_ENV] == choice


def test_scripts_start_tensorflow_with_the_bfc_allocator(allocator_runs):
    assert allocator_runs[None][0] == "true"
    assert allocator_runs["false"][0] == "false"


def test_tensorflows_default_cpu_allocator_still_takes_fresh_pages_every_step(allocator_runs):
    """Canary: when TensorFlow's default stops faulting, `cpu_allocator` can go."""
    default_faults = allocator_runs["false"][1]
    bfc_faults = allocator_runs[None][1]

    assert default_faults > 300, (
        f"TensorFlow's default CPU allocator took {default_faults:.0f} fresh pages a step: "
        "it may no longer need tfmulti.platform.runtime.cpu_allocator"
    )
    assert bfc_faults < default_faults / 10, (
        f"BFC took {bfc_faults:.0f} fresh pages a step against the default's "
        f"{default_faults:.0f}: something outside TensorFlow's allocator allocates per step"
    )
