"""Benchmark: tfmulti's data-parallel path against hand-written Keras 3 + MirroredStrategy.

Both runs use the same devices, model, input pipeline and global batch in one
process, so the ratio isolates what tfmulti adds: its strategy factory and the
callbacks every tfmulti run carries (throughput, NaN guard, backup, checkpoints,
metrics.json, TensorBoard).
Rounds alternate between the two so machine noise hits both alike; each
round times one `fit` epoch after a warm-up, and the medians are compared.
Prints one JSON object with `handwritten_steps_per_sec`, `tfmulti_steps_per_sec`
and `overhead_ratio` (tfmulti step time / hand-written step time).

Example:
    python scripts/benchmark_dp.py --virtual_devices=2 --steps=40 --rounds=5
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402

from tfmulti.flags.parsing import run_script  # noqa: E402

flags.DEFINE_integer("virtual_devices", 2, "Logical devices to split the CPU into.", lower_bound=1)
flags.DEFINE_integer("batch_size", 256, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("features", 512, "Input features of the synthetic data.", lower_bound=1)
flags.DEFINE_integer("steps", 40, "Timed steps per round.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Alternating rounds per path.", lower_bound=1)
flags.DEFINE_string("out", None, "Also write the JSON result to this file.")
FLAGS = flags.FLAGS


def _synthetic_source():
    from tfmulti import data as data_lib

    return data_lib.load_source(
        "synthetic", num_examples=8192, input_shape=(FLAGS.features,), num_classes=10
    )


def _build_model(strategy):
    import keras

    from models.registry import build_model

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model("mlp", (FLAGS.features,), 10, seed=0)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        )
    return model


def _training_stream(source):
    from tfmulti import data as data_lib

    return data_lib.make_datasets_from_source(
        source, FLAGS.batch_size, seed=0, steps_per_epoch=FLAGS.steps
    ).train


def handwritten_run(source):
    """What a user writes with Keras 3 and tf.distribute alone (no callbacks)."""
    import tensorflow as tf

    devices = [device.name for device in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(
        devices=devices[: FLAGS.virtual_devices],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    return _build_model(strategy), _training_stream(source), []


def tfmulti_run(source, model_dir):
    """The same run through tfmulti's strategy factory, data pipeline and callbacks."""
    from tfmulti.config import TrainConfig
    from tfmulti.run_record import RunRecord
    from tfmulti.strategy import get_strategy
    from tfmulti.training import standard_callbacks

    config = TrainConfig(
        strategy="mirrored",
        num_devices=FLAGS.virtual_devices,
        batch_size=FLAGS.batch_size,
        model_dir=model_dir,
        log_steps=FLAGS.steps,
    )
    strategy = get_strategy("mirrored", FLAGS.virtual_devices)
    callbacks, _ = standard_callbacks(config, model_dir, RunRecord(model_dir, config.to_dict()))
    return _build_model(strategy), _training_stream(source), callbacks


def _time_epoch(model, dataset, callbacks, epoch: int) -> float:
    # Each round is the next epoch: BackupAndRestore resumes from the last one saved.
    start = time.perf_counter()
    model.fit(
        dataset,
        initial_epoch=epoch,
        epochs=epoch + 1,
        steps_per_epoch=FLAGS.steps,
        callbacks=callbacks,
        verbose=0,
    )
    return (time.perf_counter() - start) / FLAGS.steps


def main(argv):
    del argv
    from tfmulti.devices import configure_logical_devices

    configure_logical_devices(FLAGS.virtual_devices, device_type="CPU")
    source = _synthetic_source()
    with tempfile.TemporaryDirectory() as model_dir:
        runs = {"handwritten": handwritten_run(source), "tfmulti": tfmulti_run(source, model_dir)}
        for run in runs.values():
            _time_epoch(*run, epoch=0)
        step_times = {name: [] for name in runs}
        for round_index in range(1, FLAGS.rounds + 1):
            for name, run in runs.items():
                step_times[name].append(_time_epoch(*run, epoch=round_index))
    steps_trained = {name: int(run[0].optimizer.iterations) for name, run in runs.items()}
    if len(set(steps_trained.values())) != 1:
        raise RuntimeError(f"The two runs trained different step counts: {steps_trained}")
    medians = {name: statistics.median(times) for name, times in step_times.items()}
    result = {
        "devices": FLAGS.virtual_devices,
        "global_batch_size": FLAGS.batch_size,
        "steps_per_round": FLAGS.steps,
        "rounds": FLAGS.rounds,
        "steps_trained_each": steps_trained["tfmulti"],
        "handwritten_steps_per_sec": 1.0 / medians["handwritten"],
        "tfmulti_steps_per_sec": 1.0 / medians["tfmulti"],
        "overhead_ratio": medians["tfmulti"] / medians["handwritten"],
        "step_times_s": step_times,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    run_script(main, (ValueError,))
