"""Keras 3 compat fixes: when they load, what they change, whether upstream still needs them."""

import json
import os
import subprocess
import sys

import keras
import pytest

import tfmulti.compat
from tests.workers.local_cluster import REPO_ROOT, assert_all_workers_succeeded, run_local_cluster
from tfmulti.compat import fixes, keras_lazy_modules, keras_multi_worker, worker_paths

# What the unpatched Keras function does under a real 2-worker strategy today.
UPSTREAM_FAILURES = {
    "symbolic_build_from_one_replica": "PerReplica",
    "reduce_metrics_across_replicas_only": "Invalid reduction dimension 0",
    "steps_per_execution_in_a_plain_loop": "You must feed a value for placeholder",
}


def run_python(code, all_lines=False):
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    return lines if all_lines else lines[-1]


def test_importing_tfmulti_compat_loads_neither_tensorflow_nor_keras():
    loaded = run_python(
        "import sys, tfmulti, tfmulti.compat; tfmulti.compat.install_when_keras_loads(); "
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    )
    assert loaded == "[]"


# Each import order runs in a fresh interpreter, once for the tests reading its output:
# keras-first's reports what upstream Keras loads before any fix; the order where
# TensorFlow imports Keras later is a training process's, whose wrappers and plots load
# only once read.
IMPORT_ORDERS = {
    "hook-before-keras": (
        "import tfmulti.compat; tfmulti.compat.install_when_keras_loads(); import keras"
    ),
    "keras-first": (
        "import sys, keras\n"
        "print('upstream', 'sklearn' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n"
        "import tfmulti.compat; tfmulti.compat.install_when_keras_loads()"
    ),
    "tensorflow-imports-keras-later": (
        "import tfmulti.compat; tfmulti.compat.install_when_keras_loads(); import tensorflow\n"
        # A training process: digits, an autograph-converted function (autograph reads every
        # loaded module's __file__), then a user reaching for the wrappers and the plots.
        "import sys, tfmulti, tensorflow as tf, keras\n"
        "from tfmulti.data.digits import load_digits\n"
        "load_digits()\n"
        "tf.function(lambda x: x + 1)(tf.constant(1))\n"
        "before = 'sklearn' in sys.modules, 'matplotlib' in sys.modules\n"
        "from keras.wrappers import SKLearnClassifier\n"
        "from keras.visualization import plot_image_gallery\n"
        "import keras.src.visualization as internal\n"
        "print('wrappers', before, SKLearnClassifier.__name__, plot_image_gallery.__name__,\n"
        "      internal.plot_image_gallery.__name__, 'sklearn' in sys.modules,\n"
        "      'matplotlib.pyplot' in sys.modules)"
    ),
}


@pytest.fixture(scope="module")
def import_order_output():
    """`import_order_output(order)`: the lines IMPORT_ORDERS[order] printed, its last the
    active fixes and whether the trainer's reduce_per_replica is wrapped."""
    outputs = {}

    def output(order):
        if order not in outputs:
            outputs[order] = run_python(
                f"{IMPORT_ORDERS[order]}\nimport keras, tfmulti.compat\n"
                "from keras.src.backend.tensorflow import trainer\n"
                "print(tfmulti.compat.active_fixes(), "
                "hasattr(trainer.reduce_per_replica, '__wrapped__'))",
                all_lines=True,
            )
        return outputs[order]

    return output


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_fixes_are_active_whichever_import_comes_first(import_order_output, order):
    assert import_order_output(order)[-1] == (
        "['symbolic_build_from_one_replica', 'reduce_metrics_across_replicas_only', "
        "'steps_per_execution_in_a_plain_loop', 'non_chief_callbacks_write_to_scratch', "
        "'merge_repeated_sparse_gradient_rows', "
        "'mean_aggregated_layer_state_under_strategies', "
        "'traceback_entries_without_a_line', "
        "'build_ahead_of_the_first_trace_without_a_strategy'] True"
    )


def test_keras_executes_its_wrappers_and_visualization_only_when_a_program_reads_them(
    import_order_output,
):
    lines = import_order_output("tensorflow-imports-keras-later")
    assert [line for line in lines if line.startswith("wrappers ")] == [
        "wrappers (False, False) SKLearnClassifier plot_image_gallery "
        "keras.src.visualization.plot_image_gallery True True"
    ]


def test_upstream_keras_still_imports_scikit_learn_and_matplotlib_when_it_loads(
    import_order_output,
):
    lines = import_order_output("keras-first")
    assert [line for line in lines if line.startswith("upstream ")] == ["upstream True True"], (
        "Keras no longer imports scikit-learn or matplotlib eagerly: drop that module from "
        "tfmulti/compat/keras_lazy_modules.py's LAZY_MODULES"
    )


@pytest.mark.parametrize(
    "version, applies", [((3, 8), False), ((3, 9), True), ((3, 15, 1), True), ((3, 16), False)]
)
def test_lazy_modules_apply_only_to_the_keras_versions_checked(version, applies):
    assert keras_lazy_modules.applies_to(version) == applies


def test_install_is_idempotent():
    first = tfmulti.compat.install()
    patched = keras_multi_worker.FIXES[0].owner._maybe_symbolic_build
    assert tfmulti.compat.install() == first
    assert keras_multi_worker.FIXES[0].owner._maybe_symbolic_build is patched


@pytest.mark.parametrize(
    "version, applies", [((2, 15), False), ((3, 0), True), ((3, 15, 1), True), ((3, 16), False)]
)
def test_fixes_apply_only_to_the_keras_versions_known_to_need_them(version, applies):
    assert all(fix.applies_to(version) == applies for fix in keras_multi_worker.FIXES)


def test_installed_keras_version_is_within_the_checked_range():
    version = fixes.keras_version()
    assert version < fixes.FIRST_UNCHECKED_KERAS, (
        f"Keras {keras.version()} is newer than any checked: run tests/test_compat.py's "
        "upstream test on it, then raise FIRST_UNCHECKED_KERAS or remove fixes"
    )


def test_non_chief_callbacks_write_to_scratch_and_resume_from_the_chief_backup(tmp_path):
    chief_backup = tmp_path / "model" / "backup"
    chief_backup.mkdir(parents=True)
    (chief_backup / "training_metadata.json").write_text('{"epoch": 3, "batch": 0}')
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "model" / "ckpt-{epoch}.keras")),
        keras.callbacks.TensorBoard(str(tmp_path / "model" / "logs")),
        keras.callbacks.BackupAndRestore(str(chief_backup)),
        keras.callbacks.EarlyStopping(),
        keras.callbacks.CSVLogger(str(tmp_path / "model" / "log.csv")),
    ]
    scratch = tmp_path / "scratch"
    worker_paths.redirect_to_scratch(callbacks, str(scratch))
    worker_paths.redirect_to_scratch(callbacks, str(tmp_path / "elsewhere"))  # no second move

    checkpoint, tensorboard, backup, _, csv_logger = callbacks
    assert checkpoint.filepath.startswith(str(scratch))
    assert checkpoint.filepath.endswith("ckpt-{epoch}.keras")
    assert tensorboard.log_dir.startswith(str(scratch))
    assert csv_logger.filename.startswith(str(scratch))
    assert csv_logger.filename.endswith("log.csv")
    for path in (backup.backup_dir, backup._weights_path, backup._training_metadata_path):
        assert path.startswith(str(scratch))
    with open(backup._training_metadata_path) as file:
        assert json.load(file)["epoch"] == 3


@pytest.fixture(scope="module")
def upstream_probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    flags = ["--mode=upstream_probe", f"--out={out}", f"--model_dir={out}"]
    assert_all_workers_succeeded(run_local_cluster("mwms_worker.py", flags, timeout_seconds=240))
    return [json.loads((out / f"worker{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("fix_name", sorted(UPSTREAM_FAILURES))
def test_upstream_keras_still_fails_without_fix(upstream_probe, fix_name):
    for probe in upstream_probe:
        error = probe[fix_name]["error"]
        assert error is not None, f"upstream fixed {fix_name}: remove the fix"
        assert UPSTREAM_FAILURES[fix_name] in error, (
            f"unpatched {fix_name} now fails differently; recheck the fix: {error[:500]}"
        )


def test_upstream_keras_callbacks_still_write_to_user_paths_on_non_chief(upstream_probe):
    probe = upstream_probe[1]["non_chief_callbacks_write_to_scratch"]
    assert probe["error"] is None, probe["error"]
    assert probe["saved_paths"] == [probe["user_path"]], (
        "upstream fixed non_chief_callbacks_write_to_scratch: remove the fix"
    )


def test_upstream_keras_still_cannot_fit_with_xla_under_a_mirrored_strategy():
    # scripts/train.py refuses --jit_compile with mirrored and multi_worker for this reason
    # (keras-team/keras#19005); when this test fails, upstream fits: lift the refusal.
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:2])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, y = np.ones((16, 4), "float32"), np.ones((16, 3), "float32")
    with pytest.raises(Exception, match="Trying to access resource .* located in device"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_upstream_keras_still_builds_a_model_without_a_strategy_in_its_first_trace():
    # Fails once Keras builds such a model before tracing: then remove keras_build_ahead.
    import keras
    import numpy as np

    from tfmulti.compat import keras_build_ahead, keras_internals

    original = keras_build_ahead.FIX_SET.original(keras_build_ahead.FIXES[0].name)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    original(model, data_batch=(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), None))
    assert not keras_internals.compiled_metrics(model).built
    assert not model.optimizer.built
