"""Benchmark: does the pipeline executor run what the schedules promise?

1. fidelity: stages whose forward, input-gradient and weight-gradient each hold their device
   for a known time (a sleep inside the graph, proportional to the micro-batch's rows), so
   the machine's two cores do not limit the overlap. For each schedule at p devices and
   m micro-batches: measured step time against the simulator's makespan, and speedup over
   `model_parallel` against the ideal m·p/(m+p-1). Gains, measured and predicted: ZB-H1
   over 1F1B; ZB-V over ZB-H1 and 1F1B; interleaved zero bubble over interleaved 1F1B;
   DualPipeV over ZB-V (the executor runs each overlapped pair's forward beside its
   backward, so a pair of holds takes about its backward's time; the simulator takes a
   pair's cost from a measured pair of holds).
   A schedule that cannot run at some m (DualPipeV needs m >= 2p) is skipped there. A
   hold costs more than its sleep (TensorFlow's numpy_function dispatch, ~0.9 ms here,
   whatever the executor does), so each record also simulates the schedule
   with every hold at its cost measured alone in a one-device chain: that ratio is the
   executor's own overhead.
2. real_compute: the Transformer reference model over 2 logical CPU devices, examples/sec
   for one device, model_parallel and a 1F1B pipeline.
3. memory: peak stashed activations per stage, GPipe and 1F1B, as the executor measured
   them, against the formulas (m, and p-s).

Prints a JSON list of records; `--out` writes it, `--plot` draws the fidelity results and
puts measured-beside-planned timelines next to the plot.

Example:
    python scripts/benchmark_pipeline.py --out=/tmp/pipeline.json --plot=/tmp/pipeline.png
"""

import dataclasses
import functools
import json
import os
import statistics
import time

from absl import flags

from tfmulti.flags.console_flags import define_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.pipeline.schedules import SCHEDULE_NAMES
from tfmulti.platform.runtime.tf_startup import start_tensorflow

BENCHMARKS = ("fidelity", "real_compute", "memory")
# (schedule, baseline): the gains the fidelity benchmark predicts and measures.
GAINS = (
    ("zb_h1", "1f1b"),
    ("zbv", "zb_h1"),
    ("zbv", "1f1b"),
    ("interleaved_zb", "interleaved_1f1b"),
    ("dualpipev", "zbv"),
)

define_console_flags()
flags.DEFINE_list("benchmarks", list(BENCHMARKS), f"Which of {BENCHMARKS} to run.")
flags.DEFINE_list("schedules", list(SCHEDULE_NAMES), "Schedules for the fidelity benchmark.")
flags.DEFINE_list("microbatches", ["4", "8", "16"], "Micro-batch counts for fidelity.")
flags.DEFINE_integer("num_devices", 4, "Pipeline devices p for fidelity and memory.", lower_bound=2)
flags.DEFINE_float("forward_ms", 40.0, "Forward hold of one stage on the whole batch (ms).")
flags.DEFINE_integer("batch_size", 16, "Rows per step in fidelity and memory.", lower_bound=1)
flags.DEFINE_integer("steps", 5, "Timed steps per configuration (median).", lower_bound=1)
flags.DEFINE_integer(
    "repeats",
    1,
    "Fidelity: times each schedule's step and its hold cost are measured, in turn; the "
    "record is the run with the median measured/simulated-at-hold-cost ratio.",
    lower_bound=1,
)
flags.DEFINE_integer("real_batch_size", 64, "Batch size of the real-compute benchmark.")
flags.DEFINE_integer("real_microbatches", 4, "Micro-batches of the real-compute pipeline.")
flags.DEFINE_integer("real_num_layers", 4, "Transformer blocks of the real-compute model.", 1)
flags.DEFINE_integer("real_d_model", 256, "Width of the real-compute Transformer (4 heads).", 4)
flags.DEFINE_integer("real_sequence_length", 64, "Tokens per example in real_compute.", 1)
flags.DEFINE_integer("memory_microbatches", 8, "Micro-batches m of the memory benchmark.", 1)
flags.DEFINE_integer(
    "timeline_microbatches", 8, "With --plot: draw the fidelity timelines at this m.", 1
)
flags.DEFINE_string("out", None, "Write the JSON records to this file.")
flags.DEFINE_string("plot", None, "Draw the fidelity results into this PNG.")
flags.register_validator(
    "benchmarks", lambda names: set(names) <= set(BENCHMARKS), f"must be among {BENCHMARKS}"
)
flags.register_validator(
    "real_d_model", lambda width: width % 4 == 0, "must be a multiple of 4 (4 attention heads)"
)
flags.register_validator(
    "schedules", lambda names: set(names) <= set(SCHEDULE_NAMES), f"must be among {SCHEDULE_NAMES}"
)
flags.register_multi_flags_validator(
    ["microbatches", "batch_size"],
    lambda values: all(values["batch_size"] % int(m) == 0 for m in values["microbatches"]),
    "--batch_size must be a multiple of every --microbatches count: each micro-batch holds "
    "its devices for its rows' time, and the simulator assumes equal micro-batches (e.g. "
    "--microbatches=8,16,32 --batch_size=64)",
)
FLAGS = flags.FLAGS


def _sleep_then_pass(seconds):
    """A numpy_function body that holds its thread for `seconds`, then returns its first input."""

    def sleep_then_pass(first, *unused):
        time.sleep(seconds)
        return first

    return sleep_then_pass


def _hold_stage_class():
    import keras
    import numpy as np
    import tensorflow as tf

    hold = _sleep_then_pass

    class HoldStage(keras.layers.Layer):
        """Holds its device for fixed seconds per row in F, I and W; output equals input."""

        def __init__(self, forward_s_per_row, input_grad_s_per_row, weight_grad_s_per_row):
            super().__init__()
            self.per_row = (forward_s_per_row, input_grad_s_per_row, weight_grad_s_per_row)

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(), initializer="ones")

        def call(self, inputs):
            rows = inputs.shape[0]
            forward_s, input_grad_s, weight_grad_s = (rows * s for s in self.per_row)

            @tf.custom_gradient
            def held(x, scale):
                y = tf.numpy_function(hold(forward_s), [x * scale], tf.float32, stateful=False)
                y.set_shape(x.shape)

                def gradient(dy):
                    dx = tf.numpy_function(
                        hold(input_grad_s), [dy * scale], tf.float32, stateful=False
                    )
                    # Reads dx so that a whole backward runs I then W, as on one stream.
                    dscale = tf.numpy_function(
                        hold(weight_grad_s),
                        [tf.reduce_sum(dy * x), dx],
                        tf.float32,
                        stateful=False,
                    )
                    return tf.reshape(dx, tf.shape(x)), tf.reshape(dscale, [])

                return y, gradient

            return held(inputs, tf.convert_to_tensor(self.scale))

    return HoldStage, np


def _hold_model(schedule, num_devices, num_microbatches, chunks, forward_s_per_row):
    import keras

    from tfmulti.pipeline.runtime import PipelineModel
    from tfmulti.platform.runtime.devices import logical_device_names

    hold_stage, _ = _hold_stage_class()
    per_chunk = forward_s_per_row / chunks
    stages = [hold_stage(per_chunk, per_chunk, per_chunk) for _ in range(num_devices * chunks)]
    devices = logical_device_names("CPU")[:num_devices]
    model = PipelineModel(stages, devices, num_microbatches, schedule)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def _hold_call_seconds(seconds, calls=20):
    """What one hold of `seconds` really costs in a graph: a chain of `calls` holds on one
    device, timed. The excess over `seconds` is TensorFlow's own numpy_function dispatch
    (and the sleep's overshoot), paid by every action whatever the executor does."""
    return _chain_seconds(lambda value, hold: hold(seconds, [value]), calls)


def _hold_pair_seconds(forward_s, input_grad_s, weight_grad_s, calls=20):
    """What an overlapped F&B pair of holds really costs: a chain of `calls` units, each a
    forward beside a backward (I, then W reading its result) that wait only for the unit
    before, as the executor runs DualPipeV's pairs."""

    def pair(value, hold):
        forward = hold(forward_s, [value])
        input_grad = hold(input_grad_s, [value])
        return forward + hold(weight_grad_s, [input_grad, value])

    return _chain_seconds(pair, calls)


def _chain_seconds(unit, calls):
    """Median seconds per `unit(value, hold)` in a traced chain of `calls` of them;
    `hold(seconds, inputs)` sleeps in the graph once `inputs` are ready."""
    import numpy as np
    import tensorflow as tf

    def hold(seconds, inputs):
        held = tf.numpy_function(
            _sleep_then_pass(seconds), [inputs[0] * 1.0, *inputs[1:]], tf.float32, stateful=False
        )
        held.set_shape(inputs[0].shape)
        return held

    @tf.function
    def chain(value):
        for _ in range(calls):
            value = unit(value, hold)
        return value

    value = tf.constant(np.ones((4, 8), "float32"))
    chain(value)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        chain(value)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _measured_and_simulated_at_hold_cost(model, x, y, hold_seconds):
    """One measured step time of `model`, then its simulated makespan with each hold (and
    each overlapped pair) at what it costs alone, timed right after; and that hold cost."""
    from tfmulti.pipeline.overlapped_pairs import pair_times
    from tfmulti.pipeline.simulate import CostModel, simulate

    measured = _median_step_seconds(model, x, y, FLAGS.steps)
    hold_cost = _hold_call_seconds(hold_seconds)
    schedule = model.schedule
    held_costs = CostModel.uniform(schedule.num_stages, hold_cost, 2 * hold_cost, hold_cost)
    if schedule.overlapped_pairs:
        pair_cost = _hold_pair_seconds(hold_seconds, hold_seconds, hold_seconds)
        held_costs = dataclasses.replace(
            held_costs, pair_times=pair_times(schedule, lambda *pair: pair_cost)
        )
    return measured, simulate(schedule, held_costs).makespan, hold_cost


def _median(values):
    """The middle value (the lower of the two middle ones for an even count)."""
    return sorted(values)[(len(values) - 1) // 2]


def _median_step_seconds(model, x, y, steps):
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _batch(rows, features=8):
    import numpy as np

    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(rows, features)).astype("float32"),
        np.zeros((rows, features), "float32"),
    )


def fidelity_records(timeline_dir):
    from tfmulti.pipeline.overlapped_pairs import pair_times
    from tfmulti.pipeline.runtime import write_timeline_report
    from tfmulti.pipeline.schedules import SCHEDULE_CHUNKS, build_schedule
    from tfmulti.pipeline.simulate import CostModel, simulate

    p, rows = FLAGS.num_devices, FLAGS.batch_size
    per_row = FLAGS.forward_ms / 1e3 / rows
    x, y = _batch(rows)
    baseline = _hold_model("model_parallel", p, 1, 1, per_row)
    model_parallel_s = _median_step_seconds(baseline, x, y, FLAGS.steps)
    records = []
    for m in (int(value) for value in FLAGS.microbatches):
        for schedule in FLAGS.schedules:
            chunks = SCHEDULE_CHUNKS.get(schedule, (1, 1))[0]
            try:
                build_schedule(schedule, p, m, chunks)
            except ValueError as error:
                print(json.dumps({"schedule": schedule, "microbatches": m, "skipped": str(error)}))
                continue
            model = _hold_model(schedule, p, m, chunks, per_row)
            forward = FLAGS.forward_ms / 1e3 / m
            costs = CostModel.uniform(p, forward, 2 * forward, forward).split_into_chunks(chunks)
            # An overlapped pair of holds takes its longer half: the backward, I then W.
            pair = functools.partial(lambda seconds, *halves: seconds, 2 * forward / chunks)
            costs = dataclasses.replace(costs, pair_times=pair_times(model.schedule, pair))
            simulated = simulate(model.schedule, costs).makespan
            runs = [
                _measured_and_simulated_at_hold_cost(model, x, y, forward / chunks)
                for _ in range(FLAGS.repeats)
            ]
            ratios = [measured / at_hold_cost for measured, at_hold_cost, _ in runs]
            # The run with the median ratio speaks for the record.
            measured, simulated_at_hold_cost, hold_cost = runs[ratios.index(_median(ratios))]
            ideal = m * p / (m + p - 1)
            records.append(
                {
                    "benchmark": "fidelity",
                    "schedule": schedule,
                    "stages": p * chunks,
                    "devices": p,
                    "microbatches": m,
                    "measured_s": measured,
                    "simulated_s": simulated,
                    "measured_over_simulated": measured / simulated,
                    "hold_call_overhead_ms": 1e3 * (hold_cost - forward / chunks),
                    "simulated_at_hold_cost_s": simulated_at_hold_cost,
                    "measured_over_simulated_at_hold_cost": measured / simulated_at_hold_cost,
                    "measured_over_simulated_at_hold_cost_runs": ratios,
                    "model_parallel_s": model_parallel_s,
                    "speedup": model_parallel_s / measured,
                    "ideal_speedup": ideal,
                    "speedup_fraction_of_ideal": model_parallel_s / measured / ideal,
                }
            )
            print(json.dumps(records[-1]), flush=True)
            if timeline_dir and m == FLAGS.timeline_microbatches:
                model.set_step_tracing(True)
                model.train_on_batch(x, y)
                write_timeline_report(
                    model.measured_actions(), model.schedule, timeline_dir, step=m
                )
                os.replace(
                    os.path.join(timeline_dir, f"step{m}.png"),
                    os.path.join(timeline_dir, f"timeline_{schedule}_m{m}.png"),
                )
    for m in sorted({r["microbatches"] for r in records}):
        by_schedule = {r["schedule"]: r for r in records if r["microbatches"] == m}
        for schedule, baseline in GAINS:
            if {schedule, baseline} <= set(by_schedule):
                new, old = by_schedule[schedule], by_schedule[baseline]
                records.append(
                    {
                        "benchmark": "fidelity",
                        "schedule": f"{schedule}_vs_{baseline}",
                        "stages": new["stages"],
                        "microbatches": m,
                        "measured_gain": old["measured_s"] / new["measured_s"] - 1,
                        "predicted_gain": old["simulated_s"] / new["simulated_s"] - 1,
                    }
                )
                print(json.dumps(records[-1]), flush=True)
    return records


def real_compute_records():
    import keras

    from tfmulti.models import build_blocks, build_model
    from tfmulti.pipeline.runtime import PipelineModel, stages_from_blocks
    from tfmulti.platform.runtime.devices import logical_device_names

    vocab, sequence = 512, FLAGS.real_sequence_length
    options = dict(num_layers=FLAGS.real_num_layers, num_heads=4, d_model=FLAGS.real_d_model)
    rng = __import__("numpy").random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(FLAGS.real_batch_size, sequence + 1)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    devices = logical_device_names("CPU")[:2]

    def pipeline(schedule, m):
        blocks = build_blocks("transformer", (sequence,), vocab, seed=0, **options)
        # Two stages of about equal blocks (3 | 3 at 4 layers).
        return PipelineModel(stages_from_blocks(blocks, [len(blocks) // 2]), devices, m, schedule)

    candidates = {
        "one_device": lambda: build_model("transformer", (sequence,), vocab, seed=0, **options),
        "model_parallel": lambda: pipeline("model_parallel", 1),
        "1f1b": lambda: pipeline("1f1b", FLAGS.real_microbatches),
    }
    records = []
    for name, make in candidates.items():
        model = make()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=False)
        seconds = _median_step_seconds(model, x, y, FLAGS.steps)
        records.append(
            {
                "benchmark": "real_compute",
                "schedule": name,
                "stages": 1 if name == "one_device" else 2,
                "microbatches": FLAGS.real_microbatches if name == "1f1b" else 1,
                "step_s": seconds,
                "examples_per_s": FLAGS.real_batch_size / seconds,
            }
        )
        print(json.dumps(records[-1]), flush=True)
    return records


def memory_records():
    from tfmulti.pipeline.runtime import peak_stashed_activations

    p, m = FLAGS.num_devices, FLAGS.memory_microbatches
    x, y = _batch(FLAGS.batch_size)
    records = []
    for schedule in ("gpipe", "1f1b"):
        model = _hold_model(schedule, p, m, 1, 1e-4)
        model.set_step_tracing(True)
        model.train_on_batch(x, y)
        peaks = peak_stashed_activations(model.measured_actions(), p)
        for stage, peak in enumerate(peaks):
            records.append(
                {
                    "benchmark": "memory",
                    "schedule": schedule,
                    "stages": p,
                    "microbatches": m,
                    "stage": stage,
                    "measured_peak_stashed": peak,
                    "formula_peak_stashed": m if schedule == "gpipe" else min(p - stage, m),
                }
            )
        print(json.dumps([r for r in records if r["schedule"] == schedule]), flush=True)
    return records


def plot(records, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fidelity = [r for r in records if r["benchmark"] == "fidelity" and "measured_s" in r]
    microbatches = sorted({r["microbatches"] for r in fidelity})
    schedules = [s for s in SCHEDULE_NAMES if any(r["schedule"] == s for r in fidelity)]
    figure = Figure(figsize=(17, 4.5))
    FigureCanvasAgg(figure)
    times_axis, ratio_axis, fidelity_axis = figure.subplots(1, 3)
    width = 0.8 / len(schedules)
    for index, schedule in enumerate(schedules):
        rows = {r["microbatches"]: r for r in fidelity if r["schedule"] == schedule}
        ran = [m for m in microbatches if m in rows]
        positions = [microbatches.index(m) + index * width for m in ran]
        measured = [rows[m]["measured_s"] for m in ran]
        simulated = [rows[m]["simulated_s"] for m in ran]
        bars = times_axis.bar(positions, measured, width, label=schedule)
        times_axis.scatter(positions, simulated, color="black", marker="_", s=200, zorder=3)
        for axis, key in (
            (ratio_axis, "speedup_fraction_of_ideal"),
            (fidelity_axis, "measured_over_simulated_at_hold_cost"),
        ):
            axis.plot(
                ran,
                [rows[m][key] for m in ran],
                marker="o",
                color=bars[0].get_facecolor(),
                label=schedule,
            )
    times_axis.set_xticks([k + 0.4 - width / 2 for k in range(len(microbatches))])
    times_axis.set_xticklabels([f"m={m}" for m in microbatches])
    times_axis.set_ylabel("step time (s)")
    times_axis.set_title(f"measured (bars) vs simulated (black), p={FLAGS.num_devices}")
    times_axis.legend(fontsize=8)
    ratio_axis.axhline(0.9, color="grey", linestyle="--", label="target 0.90")
    ratio_axis.set_xlabel("micro-batches m")
    ratio_axis.set_ylabel("speedup over model_parallel / (m·p/(m+p-1))")
    ratio_axis.set_title("speedup as a fraction of the ideal")
    ratio_axis.legend(fontsize=8)
    fidelity_axis.axhline(1.10, color="grey", linestyle="--", label="target 1.10")
    fidelity_axis.set_xscale("log", base=2)
    fidelity_axis.set_xlabel("micro-batches m")
    fidelity_axis.set_ylabel("measured / simulated with holds at their cost")
    fidelity_axis.set_title("the executor's own overhead")
    fidelity_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv):
    del argv
    start_tensorflow(FLAGS.tf_log_level)
    import tensorflow as tf

    from tfmulti.platform.runtime.devices import configure_logical_devices

    # A held device blocks one inter-op thread, and TensorFlow sizes that pool by cores (2
    # here): give every logical device threads of its own so holds overlap as on real ones.
    tf.config.threading.set_inter_op_parallelism_threads(4 * max(FLAGS.num_devices, 2))
    configure_logical_devices(max(FLAGS.num_devices, 2), device_type="CPU")
    timeline_dir = os.path.splitext(FLAGS.plot)[0] + "_timelines" if FLAGS.plot else None
    records = []
    if "fidelity" in FLAGS.benchmarks:
        records += fidelity_records(timeline_dir)
    if "memory" in FLAGS.benchmarks:
        records += memory_records()
    if "real_compute" in FLAGS.benchmarks:
        records += real_compute_records()
    print(json.dumps(records, indent=1))
    if FLAGS.out:
        with open(FLAGS.out, "w") as out_file:
            json.dump(records, out_file, indent=1)
    if FLAGS.plot and any(r["benchmark"] == "fidelity" for r in records):
        plot(records, FLAGS.plot)


if __name__ == "__main__":
    run_script(main, (ValueError,))
