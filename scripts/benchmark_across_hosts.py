"""Benchmark: the same pipeline on one host and with its stages on two launched workers.

For each of `--layouts`, a `--num_stages` pipeline (`pipeline`) and a `--mesh` hybrid model
with its pipe axis across the workers (`hybrid`), of the reference Transformer (tokens of
length `--sequence_length`, vocabulary 64): once in one process with `--num_workers` x
`--devices_per_worker` logical CPU devices, once over `scripts/launch.py
--num_workers --devices_per_worker`, where the chief connects to the cluster and drives
every stage (`tfmulti/platform/runtime/connected_cluster.py`). Each run is a fresh process (or
group), and reports:
- start-up: wall seconds from starting the process (or the launcher) to the end of the
  first training step, and the chief's CPU seconds to it;
- the median wall seconds of `--steps` further steps;
- bytes crossing hosts per step: the analytic figure, activations and their gradients at
  each stage boundary between workers (rows x the boundary tensor's elements x 4 bytes x
  2, over all micro-batches and replicas, the boundary's shape read from the blocks' real
  output), plus the labels the chief feeds to the last stage; and the measured figure,
  the bytes of every TCP connection between the workers' gRPC ports over the timed steps
  (the kernel's per-socket counters as `ss -ti` shows them), divided by the steps.
Then the ratios across hosts / one host. As `scripts/train.py` runs them, steps roll into
the runtime's loop over rounds on one host and trace every action across hosts, where a
loop's state would cross hosts every round; `--norolled` unrolls the one-host runs too,
`--rolled_across_hosts` rolls the runs across hosts.

Prints JSON records, one per run, then the comparisons; `--out` writes them all, `--plot`
draws step time, start-up and bytes per step.

Example:
    python scripts/benchmark_across_hosts.py --out=/tmp/across.json --plot=/tmp/across.png
    python scripts/benchmark_across_hosts.py --rolled_across_hosts --layouts=hybrid --steps=20
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from absl import flags  # noqa: E402

from tfmulti.flags.parsing import run_script  # noqa: E402

VOCAB = 64
LAYOUTS = ("pipeline", "hybrid")
PLACES = ("one_host", "across_hosts")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

flags.DEFINE_list("layouts", list(LAYOUTS), "Which of pipeline and hybrid to measure.")
flags.DEFINE_integer("num_stages", 4, "Stages of the pipeline layout.", lower_bound=2)
flags.DEFINE_string("mesh", "data=2,pipe=2", "Mesh of the hybrid layout (pipe across hosts).")
flags.DEFINE_integer("num_workers", 2, "Launched workers (hosts).", lower_bound=2)
flags.DEFINE_integer("devices_per_worker", 2, "Logical CPU devices per worker.", lower_bound=1)
flags.DEFINE_integer("num_layers", 4, "Transformer layers.", lower_bound=1)
flags.DEFINE_integer("d_model", 64, "Transformer width (features at a stage boundary).")
flags.DEFINE_integer("sequence_length", 32, "Tokens per row.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Rows per training step.", lower_bound=1)
flags.DEFINE_integer("microbatches", 4, "Micro-batches per step (per replica).", lower_bound=1)
flags.DEFINE_enum("schedule", "1f1b", ("gpipe", "1f1b", "zb_h1"), "Pipeline schedule.")
flags.DEFINE_boolean(
    "rolled",
    True,
    "On one host, let the pipeline runtime roll each step's steady state into a loop "
    "over rounds, as train.py does (--norolled: trace every action).",
)
flags.DEFINE_boolean(
    "rolled_across_hosts",
    False,
    "Across hosts, roll the step too; train.py does not (a loop's state would cross hosts "
    "every round).",
)
flags.DEFINE_integer("steps", 10, "Timed steps after the first.", lower_bound=1)
flags.DEFINE_string("only", None, "Measure one run LAYOUT:PLACE in this process (internal).")
flags.DEFINE_string("out", None, "Write the JSON records to this file.")
flags.DEFINE_string("plot", None, "Draw step time, start-up and bytes per step into this PNG.")
FLAGS = flags.FLAGS


def _blocks():
    from tfmulti.models import build_blocks

    return build_blocks(
        "transformer",
        (FLAGS.sequence_length,),
        VOCAB,
        seed=0,
        num_layers=FLAGS.num_layers,
        num_heads=2,
        d_model=FLAGS.d_model,
    )


def _stage_devices(layout: str, cluster) -> tuple[list[list[str]], int]:
    """Per replica, the device of each stage; and the stages each worker holds."""
    from tfmulti.platform.mesh import parse_mesh
    from tfmulti.platform.runtime.connected_cluster import devices_across_workers, pipe_major_groups
    from tfmulti.platform.runtime.devices import logical_device_names

    if layout == "pipeline":
        count, purpose = FLAGS.num_stages, f"--num_stages={FLAGS.num_stages}"
        devices = (
            devices_across_workers(cluster, count, purpose)
            if cluster
            else logical_device_names("CPU")[:count]
        )
        return [devices], FLAGS.num_stages // FLAGS.num_workers
    mesh = parse_mesh(FLAGS.mesh)
    devices = (
        devices_across_workers(cluster, mesh.num_devices, f"--mesh={mesh}")
        if cluster
        else logical_device_names("CPU")[: mesh.num_devices]
    )
    groups = pipe_major_groups(devices, mesh)
    return [[group[0] for group in replica] for replica in groups], mesh.pipe // FLAGS.num_workers


def _build(layout: str, replica_devices: list[list[str]], rolled: bool):
    from tfmulti.hybrid import HybridPipelineModel
    from tfmulti.pipeline.runtime import PipelineModel, partition_blocks, stages_from_blocks

    num_stages = len(replica_devices[0])

    def make_stages():
        blocks = _blocks()
        return stages_from_blocks(blocks, partition_blocks(blocks, num_stages).boundaries)

    def make_pipeline(devices: list[str]) -> PipelineModel:
        return PipelineModel(
            make_stages(), devices, FLAGS.microbatches, FLAGS.schedule, rolled=rolled
        )

    if layout == "pipeline":
        return make_pipeline(replica_devices[0])
    return HybridPipelineModel(
        None, replica_devices, FLAGS.microbatches, FLAGS.schedule, make_pipeline=make_pipeline
    )


def _boundary_elements(num_stages: int, x) -> list[int]:
    """Elements per row of each stage's output (stages 0 .. num_stages - 2), read from the
    blocks' real outputs on a few rows."""
    from tfmulti.pipeline.runtime import partition_blocks, stages_from_blocks

    blocks = _blocks()
    stages = stages_from_blocks(blocks, partition_blocks(blocks, num_stages).boundaries)
    elements, value = [], x[:2]
    for stage in stages[:-1]:
        value = stage(value)
        elements.append(int(value.shape[1:].num_elements()))
    return elements


def analytic_bytes(
    rows: int, boundary_elements: list[int], stages_per_worker: int, label_elements: int
) -> dict:
    """Bytes crossing hosts per step by the stage boundaries between workers.

    Every row of the step crosses each such boundary once forwards (its activation) and
    once backwards (that activation's gradient), float32; the chief, which holds the
    input, also feeds the labels to the last stage's worker.

    Example:
        >>> analytic_bytes(64, [2048, 2048, 2048], 2, 32)
        {'boundary_bytes_per_step': 1048576, 'label_bytes_per_step': 8192}
    """
    crossing = [
        elements
        for stage, elements in enumerate(boundary_elements)
        if (stage + 1) % stages_per_worker == 0
    ]
    return {
        "boundary_bytes_per_step": rows * sum(crossing) * 4 * 2,
        "label_bytes_per_step": rows * label_elements * 4,
    }


def wire_bytes(ports: list[int]) -> int:
    """Bytes sent both ways so far on the established TCP connections to `ports`, counted
    once per connection (on its client side)."""
    filters = " or ".join(f"dport = :{port}" for port in ports)
    listing = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( {filters} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sent = sum(int(value) for value in re.findall(r"bytes_acked:(\d+)", listing))
    received = sum(int(value) for value in re.findall(r"bytes_received:(\d+)", listing))
    return sent + received


def measure(layout: str, place: str) -> dict:
    """Runs one layout's first and `--steps` further training steps; serves, and returns
    None, on a worker other than the chief."""
    import keras
    import numpy as np
    import tensorflow as tf

    cluster = _connect() if place == "across_hosts" else None
    if cluster is False:
        return None
    replica_devices, stages_per_worker = _stage_devices(layout, cluster)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(FLAGS.batch_size, FLAGS.sequence_length + 1))
    data = (tf.constant(tokens[:, :-1], tf.int32), tf.constant(tokens[:, 1:], tf.int32))
    rolled = FLAGS.rolled_across_hosts if cluster else FLAGS.rolled
    model = _build(layout, replica_devices, rolled)
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model(data[0][:2])
    order = getattr(model, "optimizer_variable_order", None)
    model.optimizer.build(order() if order else model.trainable_variables)
    step = tf.function(model.train_step, autograph=False)
    concrete = step.get_concrete_function(data)
    concrete(data)
    first_step_unix, first_step_cpu_s = time.time(), time.process_time()
    ports = [int(a.rpartition(":")[2]) for a in cluster.worker_addresses] if cluster else []
    before = wire_bytes(ports) if cluster else 0
    times = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        concrete(data)
        times.append(time.perf_counter() - start)
    measured = (wire_bytes(ports) - before) / FLAGS.steps if cluster else 0.0
    boundary = _boundary_elements(len(replica_devices[0]), data[0])
    analytic = analytic_bytes(FLAGS.batch_size, boundary, stages_per_worker, FLAGS.sequence_length)
    return {
        "benchmark": "across_hosts",
        "layout": layout,
        "place": place,
        "stages": FLAGS.num_stages if layout == "pipeline" else None,
        "mesh": FLAGS.mesh if layout == "hybrid" else None,
        "rolled": rolled,
        "replica_devices": replica_devices,
        "first_step_unix": first_step_unix,
        "first_step_cpu_s": first_step_cpu_s,
        "steady_step_s": float(np.median(times)),
        "boundary_elements_per_row": boundary,
        "analytic_bytes_per_step": (
            analytic["boundary_bytes_per_step"] + analytic["label_bytes_per_step"] if cluster else 0
        ),
        **({key: value if cluster else 0 for key, value in analytic.items()}),
        "measured_bytes_per_step": measured,
    }


def _connect():
    """The cluster after connecting to it on the chief; False on a serving worker."""
    from tfmulti.flags.agreed_flags import agreed_flags
    from tfmulti.platform.runtime.cluster import resolve_cluster
    from tfmulti.platform.runtime.connected_cluster import connect_to_workers, serve_chief

    cluster = resolve_cluster()
    if not cluster.is_chief:
        serve_chief(cluster, settings=agreed_flags())
        return False
    connect_to_workers(cluster, settings=agreed_flags())
    return cluster


def _own_flags() -> list[str]:
    names = (
        "num_stages",
        "mesh",
        "num_workers",
        "devices_per_worker",
        "num_layers",
        "d_model",
        "sequence_length",
        "batch_size",
        "microbatches",
        "schedule",
        "steps",
        "rolled",
        "rolled_across_hosts",
    )
    return [f"--{name}={FLAGS[name].value}" for name in names]


def _run_fresh(layout: str, place: str) -> dict:
    """Runs `--only=layout:place` in a fresh process (one host) or launched group."""
    command = [sys.executable, os.path.abspath(__file__), f"--only={layout}:{place}"]
    command += _own_flags()
    if place == "across_hosts":
        command = [
            sys.executable,
            os.path.join(REPO_ROOT, "scripts", "launch.py"),
            f"--num_workers={FLAGS.num_workers}",
            f"--devices_per_worker={FLAGS.devices_per_worker}",
            "--",
            *command,
        ]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{layout} {place} failed:\n{result.stdout[-3000:]}{result.stderr}")
    lines = [line.split("] ", 1)[-1] for line in result.stdout.splitlines()]
    record = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    record["startup_s"] = record.pop("first_step_unix") - started
    return record


def compare(records: list[dict]) -> list[dict]:
    """Per layout, across hosts against one host: step-time and start-up ratios, and the
    measured bytes per step against the analytic figure."""
    comparisons = []
    for layout in dict.fromkeys(r["layout"] for r in records):
        one, across = (
            next(r for r in records if (r["layout"], r["place"]) == (layout, p)) for p in PLACES
        )
        comparisons.append(
            {
                "benchmark": "across_hosts_ratio",
                "layout": layout,
                "step_time_ratio": across["steady_step_s"] / one["steady_step_s"],
                "startup_ratio": across["startup_s"] / one["startup_s"],
                "startup_cpu_ratio": across["first_step_cpu_s"] / one["first_step_cpu_s"],
                "measured_over_analytic_bytes": (
                    across["measured_bytes_per_step"] / across["analytic_bytes_per_step"]
                ),
            }
        )
    return comparisons


def plot(records: list[dict], path: str) -> None:
    """Bars per layout: steady step time and start-up, one host against across hosts; and
    measured against analytic bytes crossing hosts per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["benchmark"] == "across_hosts"]
    layouts = list(dict.fromkeys(r["layout"] for r in runs))
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    for axis, key, label in (
        (axes[0], "steady_step_s", "seconds per step (median)"),
        (axes[1], "startup_s", "seconds to the first finished step"),
    ):
        for offset, place in enumerate(PLACES):
            values = [
                next(r[key] for r in runs if (r["layout"], r["place"]) == (layout, place))
                for layout in layouts
            ]
            axis.bar([i + 0.4 * offset for i in range(len(layouts))], values, 0.4, label=place)
        axis.set_xticks([i + 0.2 for i in range(len(layouts))], layouts)
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    across = [
        next(r for r in runs if (r["layout"], r["place"]) == (lay, PLACES[1])) for lay in layouts
    ]
    for offset, (key, label) in enumerate(
        (("analytic_bytes_per_step", "analytic"), ("measured_bytes_per_step", "measured (TCP)"))
    ):
        axes[2].bar(
            [i + 0.4 * offset for i in range(len(layouts))],
            [r[key] / 1e6 for r in across],
            0.4,
            label=label,
        )
    axes[2].set_xticks([i + 0.2 for i in range(len(layouts))], layouts)
    axes[2].set_ylabel("MB crossing hosts per step")
    axes[2].legend(fontsize=8)
    figure.suptitle(
        f"One host against {FLAGS.num_workers} workers x {FLAGS.devices_per_worker} devices, "
        f"steps {'rolled' if FLAGS.rolled else 'unrolled'} on one host, "
        f"{'rolled' if FLAGS.rolled_across_hosts else 'unrolled'} across hosts"
    )
    figure.tight_layout()
    figure.savefig(path)


def main(argv):
    del argv
    from tfmulti.platform.runtime.devices import configure_logical_devices
    from tfmulti.platform.runtime.tf_startup import start_tensorflow

    if FLAGS.only:
        layout, place = FLAGS.only.split(":")
        start_tensorflow(2)
        per_process = (
            FLAGS.devices_per_worker
            if place == "across_hosts"
            else FLAGS.num_workers * FLAGS.devices_per_worker
        )
        configure_logical_devices(per_process, device_type="CPU")
        record = measure(layout, place)
        if record is not None:
            print(json.dumps(record), flush=True)
        return
    unknown = sorted(set(FLAGS.layouts) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"--layouts takes {list(LAYOUTS)}. Received: {unknown}")
    records = []
    for layout in FLAGS.layouts:
        for place in PLACES:
            records.append(_run_fresh(layout, place))
            print(json.dumps(records[-1]), flush=True)
    records += compare(records)
    for comparison in records[-len(FLAGS.layouts) :]:
        print(json.dumps(comparison), flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as out_file:
            json.dump(records, out_file, indent=1)
    if FLAGS.plot:
        plot(records, FLAGS.plot)


if __name__ == "__main__":
    run_script(main, (ValueError,), runs_children=True)
