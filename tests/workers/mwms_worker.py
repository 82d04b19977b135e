"""One worker of a multi-worker Keras run, driven by tests through TF_CONFIG.

Usage: python mwms_worker.py --mode=train|upstream_probe --devices=K --out=DIR --model_dir=DIR
Writes DIR/worker<rank>.json with what the test checks.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmulti.compat  # noqa: E402

tfmulti.compat.install_when_keras_loads()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmulti.compat import keras_multi_worker, tf_profiler, worker_paths  # noqa: E402
from tfmulti.platform.runtime import cluster as cluster_lib  # noqa: E402
from tfmulti.platform.runtime import input_sharding  # noqa: E402
from tfmulti.run.profiling import ProfileSteps  # noqa: E402

GLOBAL_BATCH = 16
NUM_EXAMPLES = 64


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")).astype("float32")
    return x, y


def make_model(steps_per_execution=1):
    """A small dense model with weights set from a fixed seed, identical everywhere."""
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
    )
    rng = np.random.default_rng(1)
    model.set_weights(
        [rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.weights]
    )
    model.compile(
        keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return model


def sharded_dataset(with_labels=True):
    x, y = make_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y) if with_labels else x)
    return input_sharding.apply_shard_policy(dataset.batch(GLOBAL_BATCH), "data")


def train(strategy, cluster, model_dir, epochs, steps_per_execution=1):
    with strategy.scope():
        model = make_model(steps_per_execution)
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(model_dir, "ckpt-{epoch}.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.BackupAndRestore(
            os.path.join(model_dir, "backup"), delete_checkpoint=False
        ),
        keras.callbacks.TensorBoard(os.path.join(model_dir, "logs")),
    ]
    if tf_profiler.host_profiler_is_safe(True, cluster.is_chief):
        callbacks.append(
            ProfileSteps(
                os.path.join(model_dir, "logs"), (2, 3), host_name=f"worker{cluster.task_index}"
            )
        )
    history = model.fit(sharded_dataset(), epochs=epochs, verbose=0, callbacks=callbacks)
    evaluation = model.evaluate(sharded_dataset(), verbose=0)
    predictions = model.predict(sharded_dataset(with_labels=False), verbose=0)
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "loss": history.history["loss"],
        "evaluation": evaluation,
        "predictions": predictions.tolist(),
        "trace_path": getattr(callbacks[-1], "trace_path", None),
        "scratch_dir": worker_paths.scratch_dir() if not cluster.is_chief else None,
        "active_fixes": tfmulti.compat.active_fixes(),
    }


def fit_without(strategy, fix_name, model_dir):
    """Runs one epoch with fix `fix_name` undone; returns the error text, or None if it ran."""
    fix = next(fix for fix in keras_multi_worker.FIXES if fix.name == fix_name)
    patched = getattr(fix.owner, fix.attribute)
    setattr(fix.owner, fix.attribute, keras_multi_worker.original_function(fix_name))
    saved_paths = []
    try:
        with strategy.scope():
            # That fix only acts on several steps per execution.
            model = make_model(2 if fix_name == "steps_per_execution_in_a_plain_loop" else 1)
        model.save_weights = lambda filepath, **kwargs: saved_paths.append(filepath)
        probe_path = os.path.join(model_dir, "probe.weights.h5")
        callback = keras.callbacks.ModelCheckpoint(probe_path, save_weights_only=True)
        model.fit(sharded_dataset(), epochs=1, verbose=0, callbacks=[callback])
        return {"error": None, "saved_paths": saved_paths, "user_path": probe_path}
    except Exception as error:  # the probe reports any failure of the unpatched path
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    finally:
        setattr(fix.owner, fix.attribute, patched)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["train", "upstream_probe"], default="train")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model_dir", required=True)
    args = parser.parse_args()

    cluster = cluster_lib.resolve_cluster()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices
    )
    strategy = cluster_lib.build_multi_worker_strategy(
        cluster, communication="ring", timeout_seconds=120, connect_timeout_seconds=150
    )
    if args.mode == "train":
        result = train(strategy, cluster, args.model_dir, args.epochs, args.steps_per_execution)
    else:
        result = {
            name: fit_without(strategy, name, args.model_dir)
            for name in keras_multi_worker.FIX_SET.active_names()
        }
    result["num_replicas"] = strategy.num_replicas_in_sync
    with open(os.path.join(args.out, f"worker{cluster.task_index}.json"), "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
