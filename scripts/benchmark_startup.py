"""Benchmark: how long a pipeline takes to its first finished training step.

For the reference Transformer (tokens of length 32, vocabulary 64, batch 64) at each of
`--layers`, one device and a `--num_devices`-stage pipeline (`--schedule`, 1F1B) at each of
`--microbatches` (uniform partition), plus a hybrid `data=D,pipe=2` model for each D of
`--hybrid_data` at the first and the largest m that gives each replica's micro-batches a
row:
seconds to trace the training step, seconds to its first finished run (graph
optimisation and set-up included) and to a second run, the process's CPU seconds, and the
size of the traced step (nodes in the step's graph, and with its functions); then the CPU
seconds to trace, optimise and run one evaluation step, which `fit` with validation data
pays before its first epoch ends, and that step's size. Each
configuration runs in a fresh process, so nothing is shared between them.

Prints JSON records; `--out` writes them, `--plot` draws start-up time against m (and,
with several `--hybrid_data`, the hybrid models' against D).

Example:
    python scripts/benchmark_startup.py --out=/tmp/startup.json --plot=/tmp/startup.png
    python scripts/benchmark_startup.py --num_devices=2 --microbatches=4 \
        --hybrid_data=1,2,4,8 --out=/tmp/hybrid.json --plot=/tmp/hybrid.png
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402

from tfmulti.flags.parsing import run_script  # noqa: E402

SEQUENCE, VOCAB = 32, 64

flags.DEFINE_list("layers", ["6", "12"], "Transformer layers of each model measured.")
flags.DEFINE_list("microbatches", ["4", "8", "16", "32", "64"], "Pipeline micro-batch counts m.")
flags.DEFINE_integer("num_devices", 4, "Pipeline stages p (one per device).", lower_bound=2)
flags.DEFINE_enum(
    "schedule", "1f1b", ("1f1b", "gpipe", "zb_h1"), "Schedule of the pipeline and hybrid runs."
)
flags.DEFINE_integer("batch_size", 64, "Rows per training step.", lower_bound=1)
flags.DEFINE_boolean("hybrid", True, "Also measure data=D,pipe=2 hybrid models.")
flags.DEFINE_list("hybrid_data", ["2"], "Data replicas D of each hybrid model measured.")
flags.DEFINE_integer(
    "steady_steps", 5, "Further runs whose median step time is reported.", lower_bound=1
)
flags.DEFINE_string("only", None, "Measure one configuration KIND:LAYERS:M:D in this process.")
flags.DEFINE_string("out", None, "Write the JSON records to this file.")
flags.DEFINE_string("plot", None, "Draw start-up CPU seconds against m into this PNG.")
FLAGS = flags.FLAGS


def _build(kind: str, layers: int, microbatches: int, data_replicas: int):
    from tfmulti.hybrid import HybridPipelineModel
    from tfmulti.models import build_blocks, build_model
    from tfmulti.pipeline.runtime import PipelineModel, partition_blocks, stages_from_blocks
    from tfmulti.platform.runtime.devices import logical_device_names

    options = dict(num_layers=layers)
    if kind == "one_device":
        return build_model("transformer", (SEQUENCE,), VOCAB, seed=0, **options)
    devices = logical_device_names("CPU")

    def make_stages(num_stages):
        blocks = build_blocks("transformer", (SEQUENCE,), VOCAB, seed=0, **options)
        return stages_from_blocks(blocks, partition_blocks(blocks, num_stages).boundaries)

    if kind == "pipeline":
        p = FLAGS.num_devices
        return PipelineModel(make_stages(p), devices[:p], microbatches, FLAGS.schedule)
    replica_devices = [devices[2 * replica : 2 * replica + 2] for replica in range(data_replicas)]
    return HybridPipelineModel(
        lambda: make_stages(2), replica_devices, microbatches, FLAGS.schedule
    )


def measure(kind: str, layers: int, microbatches: int, data_replicas: int) -> dict:
    """Times tracing and the first two runs of one training step of one configuration."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(FLAGS.batch_size, SEQUENCE + 1)).astype("int32")
    data = (tf.constant(tokens[:, :-1]), tf.constant(tokens[:, 1:]))
    model = _build(kind, layers, microbatches, data_replicas)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model(data[0][:2])
    order = getattr(model, "optimizer_variable_order", None)
    model.optimizer.build(order() if order else model.trainable_variables)
    step = tf.function(model.train_step, autograph=False)
    wall, cpu = time.perf_counter(), time.process_time()
    concrete = step.get_concrete_function(data)
    trace_s = time.perf_counter() - wall
    concrete(data)
    first_step_s, first_step_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    again = time.perf_counter()
    concrete(data)
    second_step_s = time.perf_counter() - again
    steady = []
    for _ in range(FLAGS.steady_steps):
        start = time.perf_counter()
        concrete(data)
        steady.append(time.perf_counter() - start)
    graph = step.get_concrete_function(data).graph.as_graph_def()
    # What `fit` with validation data pays next: trace, optimise and run one test step.
    evaluate = tf.function(model.test_step, autograph=False)
    cpu = time.process_time()
    concrete_evaluate = evaluate.get_concrete_function(data)
    evaluation_graph = concrete_evaluate.graph.as_graph_def()
    concrete_evaluate(data)
    first_evaluation_cpu_s = time.process_time() - cpu
    return {
        "benchmark": "startup",
        "kind": kind,
        "schedule": None if kind == "one_device" else FLAGS.schedule,
        "layers": layers,
        "microbatches": microbatches,
        "data": data_replicas if kind == "hybrid" else None,
        "trace_s": trace_s,
        "first_step_s": first_step_s,
        "first_step_cpu_s": first_step_cpu_s,
        "second_step_s": second_step_s,
        "steady_step_s": float(np.median(steady)),
        "step_nodes": len(graph.node),
        "rolled": any(
            node.op in ("While", "StatelessWhile")
            for node in [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
        ),
        "total_nodes": _total_nodes(graph),
        "first_evaluation_cpu_s": first_evaluation_cpu_s,
        "evaluation_total_nodes": _total_nodes(evaluation_graph),
    }


def _total_nodes(graph_def) -> int:
    """Nodes of a graph and of every function in its library."""
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def _configurations() -> list[tuple[str, int, int, int]]:
    counts = [int(value) for value in FLAGS.microbatches]
    configurations = []
    for layers in (int(value) for value in FLAGS.layers):
        configurations.append(("one_device", layers, 1, 1))
        configurations += [("pipeline", layers, m, 1) for m in counts]
        for data in (int(value) for value in FLAGS.hybrid_data) if FLAGS.hybrid else ():
            # Each replica takes 1/D of the batch: at least one row per micro-batch.
            fitting = [m for m in counts if m <= FLAGS.batch_size // data]
            if fitting:
                chosen = sorted({fitting[0], fitting[-1]})
                configurations += [("hybrid", layers, m, data) for m in chosen]
    return configurations


def _run_fresh(kind: str, layers: int, microbatches: int, data: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__)]
    command += [f"--only={kind}:{layers}:{microbatches}:{data}"]
    command += [f"--num_devices={FLAGS.num_devices}", f"--batch_size={FLAGS.batch_size}"]
    command += [f"--steady_steps={FLAGS.steady_steps}"]
    command += [f"--schedule={FLAGS.schedule}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{kind} layers={layers} m={microbatches} data={data} failed:\n{result.stderr}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def plot(records: list[dict], path: str) -> None:
    """Start-up CPU seconds against m, one line per model depth, one device as a level.

    CPU seconds, since wall time on a shared machine mostly measures the other jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hybrid = [r for r in records if r["kind"] == "hybrid"]
    by_data = len({r["data"] for r in hybrid}) > 1
    figure, axes = plt.subplots(
        2 if by_data else 1, 1, figsize=(10, 8 if by_data else 4.5), squeeze=False
    )
    axis = axes[0][0]
    for index, layers in enumerate(sorted({r["layers"] for r in records})):
        color = f"C{index}"
        pipeline = sorted(
            (r for r in records if r["layers"] == layers and r["kind"] == "pipeline"),
            key=lambda r: r["microbatches"],
        )
        axis.plot(
            [r["microbatches"] for r in pipeline],
            [r["first_step_cpu_s"] for r in pipeline],
            "o-",
            color=color,
            label=f"{FLAGS.schedule} pipeline p={FLAGS.num_devices}, {layers} layers",
        )
        axis.plot(
            [r["microbatches"] for r in pipeline],
            [r["first_step_cpu_s"] + r.get("first_evaluation_cpu_s", 0.0) for r in pipeline],
            "s:",
            color=color,
            label=f"the same, with the first evaluation step, {layers} layers",
        )
        for r in records:
            if r["layers"] == layers and r["kind"] == "one_device":
                axis.axhline(
                    r["first_step_cpu_s"],
                    color=color,
                    ls="--",
                    label=f"one device, {layers} layers",
                )
                if "first_evaluation_cpu_s" in r:
                    axis.axhline(
                        r["first_step_cpu_s"] + r["first_evaluation_cpu_s"],
                        color=color,
                        ls="-.",
                        label=f"one device with its first evaluation step, {layers} layers",
                    )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("micro-batches m")
    axis.set_ylabel("CPU seconds to the first finished step(s)")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.set_title("Start-up: trace, optimise and run one training step")
    if by_data:
        _plot_hybrid(axes[1][0], hybrid)
    figure.tight_layout()
    figure.savefig(path)


def _plot_hybrid(axis, hybrid: list[dict]) -> None:
    """Hybrid start-up CPU seconds against the data replicas D, one line per depth and m."""
    for layers, m in sorted({(r["layers"], r["microbatches"]) for r in hybrid}):
        line = sorted(
            (r for r in hybrid if r["layers"] == layers and r["microbatches"] == m),
            key=lambda r: r["data"],
        )
        axis.plot(
            [r["data"] for r in line],
            [r["first_step_cpu_s"] for r in line],
            "o-",
            label=f"hybrid data=D,pipe=2, m={m}, {layers} layers",
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("data replicas D")
    axis.set_ylabel("CPU seconds to the first finished step")
    axis.set_ylim(bottom=0)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def main(argv):
    del argv
    from tfmulti.platform.runtime.devices import configure_logical_devices
    from tfmulti.platform.runtime.tf_startup import start_tensorflow

    if FLAGS.only:
        kind, layers, microbatches, data = FLAGS.only.split(":")
        start_tensorflow(2)
        configure_logical_devices(max(FLAGS.num_devices, 2 * int(data)), device_type="CPU")
        print(json.dumps(measure(kind, int(layers), int(microbatches), int(data))), flush=True)
        return
    records = []
    for configuration in _configurations():
        records.append(_run_fresh(*configuration))
        print(json.dumps(records[-1]), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as out_file:
            json.dump(records, out_file, indent=1)
    if FLAGS.plot:
        plot(records, FLAGS.plot)


if __name__ == "__main__":
    run_script(main, (ValueError,), runs_children=True)
