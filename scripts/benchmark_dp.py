"""Benchmark: tfmulti's data-parallel path against hand-written Keras 3 + MirroredStrategy.

Both runs use the same devices, model, input pipeline and global batch in one
process, so the ratio isolates what tfmulti adds: its strategy factory and the
callbacks every tfmulti run carries (throughput, NaN guard, backup, checkpoints,
metrics.json, TensorBoard).
Rounds alternate between the two (ABBA order) so machine noise hits both alike; each round
is one `fit` call of `--epochs_per_round` epochs, after a warm-up round.

Prints one JSON object:
- `handwritten_steps_per_sec`, `tfmulti_steps_per_sec`: training throughput
  inside epochs (first step's start to last step's end, median over epochs),
  per-step callback work included;
- `overhead_ratio`: tfmulti step time / hand-written step time;
- `epoch_end_seconds`: median time from an epoch's last step to the next
  epoch's first (validation-free here; tfmulti writes its checkpoint, backup
  and metrics.json then);
- `before_first_step_seconds`: median time from `fit`'s callbacks starting to the first step;
- `round_seconds`, `wall_clock_ratio`: each round's (one `fit` call's) time, and the ratio
  of the two paths' median rounds, everything included.

Example:
    python scripts/benchmark_dp.py --virtual_devices=2 --steps=100 --rounds=4
"""

from tfmulti.platform.runtime.tf_startup import start_tensorflow

# Imported below at module level (the timer subclasses a Keras callback), so TensorFlow
# starts before flags are read: TF_CPP_MIN_LOG_LEVEL, not a flag, brings its notices back.
start_tensorflow()

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402

from tfmulti.flags.parsing import run_script  # noqa: E402

flags.DEFINE_integer("virtual_devices", 2, "Logical devices to split the CPU into.", lower_bound=1)
flags.DEFINE_integer("batch_size", 256, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("features", 1024, "Input features of the synthetic data.", lower_bound=1)
flags.DEFINE_integer("width", 1024, "Units of each of the MLP's 3 hidden layers.", lower_bound=1)
flags.DEFINE_integer("steps", 100, "Steps per epoch.", lower_bound=2)
flags.DEFINE_integer("epochs_per_round", 3, "Epochs per fit call.", lower_bound=2)
flags.DEFINE_integer("rounds", 6, "Alternating rounds per path.", lower_bound=1)
flags.DEFINE_string("out", None, "Also write the JSON result to this file.")
FLAGS = flags.FLAGS


def _synthetic_source():
    from tfmulti import data as data_lib

    return data_lib.load_source(
        "synthetic", num_examples=8192, input_shape=(FLAGS.features,), num_classes=10
    )


def _build_model(strategy):
    from tfmulti.models.registry import build_model

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model("mlp", (FLAGS.features,), 10, seed=0, hidden_units=(FLAGS.width,) * 3)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        )
    return model


def _training_stream(source):
    from tfmulti import data as data_lib

    # Each round reads the same finite stream, so its input threads end with the round.
    return data_lib.make_datasets_from_source(
        source,
        FLAGS.batch_size,
        seed=0,
        steps_per_epoch=FLAGS.steps,
        total_steps=FLAGS.steps * FLAGS.epochs_per_round,
    ).train


def handwritten_run(source):
    """What a user writes with Keras 3 and tf.distribute alone (no callbacks)."""
    devices = [device.name for device in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(
        devices=devices[: FLAGS.virtual_devices],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    return _build_model(strategy), _training_stream(source), []


def tfmulti_run(source, model_dir):
    """The same run through tfmulti's strategy factory, data pipeline and callbacks."""
    from tfmulti.config import TrainConfig
    from tfmulti.platform.runtime.distribute_strategy import get_strategy
    from tfmulti.run.run_record import RunRecord
    from tfmulti.run.training import standard_callbacks

    config = TrainConfig.from_flat(
        strategy="mirrored",
        num_devices=FLAGS.virtual_devices,
        batch_size=FLAGS.batch_size,
        model_dir=model_dir,
        log_steps=FLAGS.steps,
    )
    strategy = get_strategy("mirrored", FLAGS.virtual_devices)
    record = RunRecord(model_dir, config.to_dict())
    callbacks, _ = standard_callbacks(config, model_dir, record, steps_per_epoch=FLAGS.steps)
    return _build_model(strategy), _training_stream(source), callbacks


class _EpochTimer(keras.callbacks.Callback):
    """Records each epoch's in-epoch time and the gaps between epochs."""

    # Its batch-end hook may run on Keras's callback thread, so it does not make
    # the step loop wait for each step (which would hide what other callbacks cost).
    async_safe = True

    def __init__(self):
        super().__init__()
        self.in_epoch, self.between_epochs, self.before_first_step = [], [], []
        self._last_end = None
        self._fit_start = None

    def on_train_begin(self, logs=None):
        self._fit_start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self._start = time.perf_counter()
            if self._fit_start is not None:
                self.before_first_step.append(self._start - self._fit_start)
                self._fit_start = None
            if self._last_end is not None:
                self.between_epochs.append(self._start - self._last_end)

    def on_train_batch_end(self, batch, logs=None):
        if batch == FLAGS.steps - 1:
            self._last_end = time.perf_counter()
            self.in_epoch.append((self._last_end - self._start) / FLAGS.steps)

    def on_train_end(self, logs=None):
        self._last_end = None


def _run_round(model, dataset, callbacks, timer, first_epoch: int) -> float:
    # Rounds continue the epoch count: BackupAndRestore resumes from the last saved epoch.
    # Without prefetching to devices: tearing down TF's multi-device prefetch
    # iterator after a `fit` hung twice in ~30 rounds here. Both paths get the same.
    distributed = model.distribute_strategy.experimental_distribute_dataset(
        dataset, tf.distribute.InputOptions(experimental_fetch_to_device=False)
    )
    start = time.perf_counter()
    model.fit(
        distributed,
        initial_epoch=first_epoch,
        epochs=first_epoch + FLAGS.epochs_per_round,
        steps_per_epoch=FLAGS.steps,
        callbacks=[*callbacks, timer],
        verbose=0,
    )
    return time.perf_counter() - start


def main(argv):
    del argv
    from tfmulti.platform.runtime.devices import configure_logical_devices

    configure_logical_devices(FLAGS.virtual_devices, device_type="CPU")
    source = _synthetic_source()
    with tempfile.TemporaryDirectory() as model_dir:
        runs = {"tfmulti": tfmulti_run(source, model_dir), "handwritten": handwritten_run(source)}
        warm_up = {name: _EpochTimer() for name in runs}
        for name, run in runs.items():
            _run_round(*run, warm_up[name], first_epoch=0)
        timers = {name: _EpochTimer() for name in runs}
        round_seconds = {name: [] for name in runs}
        for round_index in range(FLAGS.rounds):
            first_epoch = (round_index + 1) * FLAGS.epochs_per_round
            # Alternate which path goes first, so neither always follows the other.
            order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
            for name in order:
                round_seconds[name].append(_run_round(*runs[name], timers[name], first_epoch))
    steps_trained = {name: int(run[0].optimizer.iterations.numpy()) for name, run in runs.items()}
    if len(set(steps_trained.values())) != 1:
        raise RuntimeError(f"The two runs trained different step counts: {steps_trained}")
    step_time = {name: statistics.median(timer.in_epoch) for name, timer in timers.items()}
    result = {
        "devices": FLAGS.virtual_devices,
        "global_batch_size": FLAGS.batch_size,
        "model": f"mlp {FLAGS.features}-{FLAGS.width}x3-10",
        "steps_per_epoch": FLAGS.steps,
        "epochs_per_round": FLAGS.epochs_per_round,
        "rounds": FLAGS.rounds,
        "steps_trained_each": steps_trained["tfmulti"],
        "handwritten_steps_per_sec": 1.0 / step_time["handwritten"],
        "tfmulti_steps_per_sec": 1.0 / step_time["tfmulti"],
        "overhead_ratio": step_time["tfmulti"] / step_time["handwritten"],
        "epoch_end_seconds": {
            name: statistics.median(timer.between_epochs) for name, timer in timers.items()
        },
        "before_first_step_seconds": {
            name: statistics.median(timer.before_first_step) for name, timer in timers.items()
        },
        "round_seconds": round_seconds,
        # Medians: a round that stalls in TensorFlow's iterator teardown (seconds, seen on
        # both paths) must not decide the ratio.
        "wall_clock_ratio": statistics.median(round_seconds["tfmulti"])
        / statistics.median(round_seconds["handwritten"]),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    run_script(main, (ValueError,))
