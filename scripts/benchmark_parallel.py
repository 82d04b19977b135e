"""Benchmark: a tensor-parallel MLP over logical devices against the same MLP on one device.

For each d_model (hidden width 4x) and rows (batch x sequence length): training-step
time of `ParallelMLP` split over `--tensor_parallel` logical CPU devices and of the unsplit
`FeedForward` on one device, in alternating rounds (ABBA) so load from other processes
hits both alike; examples/sec and their ratio. Also the bytes the split layer moves per
step, measured in its traced graph and counted analytically. Logical CPU devices share
the machine's cores, so a gain shows only where both devices' matmuls overlap.

Prints a JSON list of records; `--out` writes it.

Example:
    python scripts/benchmark_parallel.py --d_models=1024,2048 --rows=2048 --out=/tmp/tp.json
"""

import json
import statistics
import time

from absl import flags

from tfmulti.flags.console_flags import define_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.tf_startup import start_tensorflow

define_console_flags()
flags.DEFINE_list("d_models", ["1024", "2048"], "Model widths; the MLP's hidden width is 4x.")
flags.DEFINE_list("rows", ["2048"], "Rows per step (batch x sequence length).")
flags.DEFINE_integer("sequence_length", 128, "Tokens per example.", lower_bound=1)
flags.DEFINE_integer("tensor_parallel", 2, "Devices the MLP is split over.", lower_bound=2)
flags.DEFINE_integer("steps", 3, "Timed steps per round and layout.", lower_bound=1)
flags.DEFINE_integer("rounds", 2, "ABBA rounds (each times both layouts twice).", lower_bound=1)
flags.DEFINE_string("out", None, "Write the JSON records to this file.")
flags.register_validator(
    "rows",
    lambda values: all(int(v) % FLAGS.sequence_length == 0 for v in values),
    "each value must be a multiple of --sequence_length",
)
FLAGS = flags.FLAGS


def _training_step(layer, home_device):
    """A traced SGD step of `layer` on a squared-output loss; optimizer state on each
    variable's device."""
    import keras
    import tensorflow as tf

    from tfmulti.pipeline.runtime.optimizer_placement import place_optimizer_on_variable_devices

    optimizer = keras.optimizers.SGD(learning_rate=1e-3)
    place_optimizer_on_variable_devices(optimizer)

    @tf.function
    def step(inputs):
        with tf.device(home_device):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(layer(inputs)))
            gradients = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(gradients, layer.trainable_variables)
            return loss

    return step


def _step_seconds(step, inputs) -> list[float]:
    seconds = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step(inputs).numpy()
        seconds.append(time.perf_counter() - start)
    return seconds


def mlp_record(d_model: int, rows: int) -> dict:
    """Times one-device and tensor-parallel training steps of one MLP shape."""
    import numpy as np
    import tensorflow as tf

    from models.transformer import FeedForward
    from tfmulti.parallel import ParallelMLP, measure_communication, resolve_shard_devices

    devices = resolve_shard_devices(FLAGS.tensor_parallel)
    batch_size = rows // FLAGS.sequence_length
    input_shape = (batch_size, FLAGS.sequence_length, d_model)
    with tf.device(devices[0]):
        inputs = tf.constant(np.random.default_rng(0).normal(size=input_shape), tf.float32)
        unsplit = FeedForward(d_model, 4 * d_model, seed=0)
        unsplit.build(input_shape)
    split = ParallelMLP(d_model, 4 * d_model, devices)
    split.build(input_shape)
    split.set_unsplit_weights(unsplit.get_weights())
    steps = {
        "one_device": _training_step(unsplit, devices[0]),
        "tensor_parallel": _training_step(split, devices[0]),
    }
    for step in steps.values():
        step(inputs).numpy()  # trace and warm up
    seconds = {name: [] for name in steps}
    for _ in range(FLAGS.rounds):
        for name in ("one_device", "tensor_parallel", "tensor_parallel", "one_device"):
            seconds[name] += _step_seconds(steps[name], inputs)
    step_ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
    examples_per_sec = {name: 1000 * batch_size / ms for name, ms in step_ms.items()}
    measured = measure_communication(split, tf.TensorSpec(input_shape, tf.float32))
    analytic = split.communication_bytes(input_shape)
    return {
        "benchmark": "parallel_mlp",
        "d_model": d_model,
        "mlp_dim": 4 * d_model,
        "rows": rows,
        "batch_size": batch_size,
        "sequence_length": FLAGS.sequence_length,
        "tensor_parallel": FLAGS.tensor_parallel,
        "step_ms": step_ms,
        "examples_per_sec": examples_per_sec,
        "speedup": examples_per_sec["tensor_parallel"] / examples_per_sec["one_device"],
        "communication_bytes_per_step": {
            "measured": {"forward": measured.forward, "backward": measured.backward},
            "analytic": {"forward": analytic.forward, "backward": analytic.backward},
            "equal": measured == analytic,
        },
    }


def main(argv):
    del argv
    start_tensorflow(FLAGS.tf_log_level)
    from tfmulti.devices import configure_logical_devices

    configure_logical_devices(FLAGS.tensor_parallel, device_type="CPU")
    records = []
    for d_model in (int(value) for value in FLAGS.d_models):
        for rows in (int(value) for value in FLAGS.rows):
            records.append(mlp_record(d_model, rows))
            print(json.dumps(records[-1]), flush=True)
    print(json.dumps(records, indent=1))
    if FLAGS.out:
        with open(FLAGS.out, "w") as out_file:
            json.dump(records, out_file, indent=1)


if __name__ == "__main__":
    run_script(main, user_errors=(ValueError,))
