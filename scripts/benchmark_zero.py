"""Benchmark: bytes each device holds and step time under ZeRO stages 0-3, against the formulas.

For each worker count in `--workers` and each stage in `--stages`, one job of
`scripts/launch.py --num_workers=N --devices_per_worker=1` runs `scripts/train.py
--strategy=multi_worker --zero=S` on the reference MLP (`--width` units in each of
`--layers` hidden layers, digits' 64 features in, batch `--batch_size`: its state of
weights and Adam's moments dominates its activations). One device per worker process,
so TensorFlow's BFC allocator peak (`TF_CPU_ALLOCATOR_USE_BFC=true`) belongs to that
device alone. From each run's `metrics.json`:
- the bytes of weights and of optimizer state on every device (the `memory` section),
  beside the ZeRO formulas (`tfmulti.zero.zero_state_bytes`, with the padded parameter
  count the run records under `run.sharding`);
- the largest allocator peak over the workers;
- the median step time of the epochs after the first, and its ratio to stage 0 at the
  same N (stage 0 is MultiWorkerMirroredStrategy's collective all-reduce; stages 1-3 are
  driven by the chief over gRPC, `tfmulti/zero/`).

With `--overlap_devices=N` (default 4), one more run traces stage 3 on one host
(`--strategy=mirrored --virtual_devices=N --zero=3 --profile_steps`, every device in one
process, so one profile holds them all) and reads from the trace how much of the weight
gathering ran while a layer computed on another thread (`tfmulti.zero.gather_overlap`):
the next layer's gather issued during the current layer's compute.

Prints one JSON object; `--out` writes it, `--plot` draws bytes per device against N
beside the formulas, and step time per stage; `--timeline` draws one traced stage-3 step,
gathers beside compute, thread by thread.

Example:
    python scripts/benchmark_zero.py --workers=2,4 --out=/tmp/zero.json --plot=/tmp/zero.png
    python scripts/benchmark_zero.py --workers=2 --stages=0,3 --width=32 --layers=1 --steps=2 \
        --overlap_devices=2 --timeline=/tmp/zero_timeline.png
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tfmulti.flags.parsing import run_script  # noqa: E402
from tfmulti.platform.runtime.trace_events import host_events, newest_trace, op_events, step_spans  # noqa: E402
from tfmulti.zero.formulas import zero_state_bytes  # noqa: E402
from tfmulti.zero.gather_overlap import gather_overlap, is_compute, is_gather  # noqa: E402

flags.DEFINE_list("workers", ["2", "4"], "Worker counts N (one device each).")
flags.DEFINE_list("stages", ["0", "1", "2", "3"], "ZeRO stages to run.")
flags.DEFINE_integer("width", 1024, "Units of each hidden layer.", lower_bound=1)
flags.DEFINE_integer("layers", 8, "Hidden layers.", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "Global batch.", lower_bound=1)
flags.DEFINE_integer("steps", 5, "Steps per epoch.", lower_bound=1)
flags.DEFINE_integer("epochs", 2, "Epochs; the first one's steps are not timed.", lower_bound=2)
flags.DEFINE_string("out", None, "Also write the JSON result to this file.")
flags.DEFINE_string("plot", None, "Draw bytes per device and step time to this PNG.")
flags.DEFINE_integer(
    "overlap_devices",
    4,
    "Devices of the traced stage-3 run on one host; 0 skips it.",
    lower_bound=0,
)
flags.DEFINE_string("timeline", None, "Draw one traced stage-3 step to this PNG.")
FLAGS = flags.FLAGS


def _train_flags(stage: int, model_dir: str) -> list[str]:
    hidden = tuple([FLAGS.width] * FLAGS.layers)
    return [
        sys.executable,
        os.path.join(REPO_ROOT, "scripts", "train.py"),
        f"--zero={stage}",
        "--model=mlp",
        f"--model_option=hidden_units={list(hidden)!r}".replace(" ", ""),
        "--dataset=digits",
        "--optimizer=adam",
        f"--batch_size={FLAGS.batch_size}",
        f"--steps_per_epoch={FLAGS.steps}",
        f"--epochs={FLAGS.epochs}",
        "--validation_steps=1",
        "--log_steps=0",
        f"--model_dir={model_dir}",
    ]


def _execute(command: list[str], what: str, model_dir: str) -> dict:
    environment = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=REPO_ROOT, env=environment, check=False
    )
    if result.returncode != 0:
        last = [line for line in result.stderr.splitlines() if line.strip()][-1:]
        raise ValueError(f"{what} failed: {' '.join(last)}")
    with open(os.path.join(model_dir, "metrics.json")) as handle:
        return json.load(handle)


def _run(num_workers: int, stage: int, model_dir: str) -> dict:
    launch = [
        sys.executable,
        os.path.join(REPO_ROOT, "scripts", "launch.py"),
        f"--num_workers={num_workers}",
        "--devices_per_worker=1",
        "--",
    ]
    command = launch + _train_flags(stage, model_dir) + ["--strategy=multi_worker"]
    return _execute(command, f"N={num_workers} stage {stage}", model_dir)


def _traced_stage3(num_devices: int, model_dir: str) -> tuple[dict, list]:
    """The overlap of gathers and compute in each traced step of a stage-3 run on one host
    (the steps of the last epoch but its first), and the ops of the middle traced step."""
    first = FLAGS.steps * (FLAGS.epochs - 1) + 2
    last = FLAGS.steps * FLAGS.epochs
    if first > last:
        raise ValueError("--steps must be at least 2 to trace a stage-3 step after the first.")
    command = _train_flags(3, model_dir) + [
        "--strategy=mirrored",
        f"--virtual_devices={num_devices}",
        f"--profile_steps={first},{last}",
    ]
    _execute(command, f"stage 3 traced on {num_devices} devices", model_dir)
    events = host_events(newest_trace(os.path.join(model_dir, "logs", "train")))
    ops, steps = op_events(events), step_spans(events)
    per_step = [gather_overlap(ops, span) for span in steps]
    middle = steps[len(steps) // 2]
    summary = {
        "devices": num_devices,
        "traced_steps": len(steps),
        "gather_ops_per_step": per_step[0]["gather_ops"],
        "regather_ops_per_step": per_step[0]["regather_ops"],
        "overlap_fraction_median": statistics.median(s["overlap_fraction"] for s in per_step),
        "overlap_fraction": [s["overlap_fraction"] for s in per_step],
        "gather_op_ms_median": 1e3 * statistics.median(s["gather_op_seconds"] for s in per_step),
        "compute_ms_median": 1e3 * statistics.median(s["compute_seconds"] for s in per_step),
    }
    return summary, [op for op in ops if middle[0] <= op.start and op.end <= middle[1]]


def _summary(num_workers: int, stage: int, record: dict) -> dict:
    memory = record["memory"]
    params = record["run"].get("sharding", {}).get("parameters_with_padding")
    params = params or record["run"]["parameters"]
    formula = zero_state_bytes(stage, params, num_workers)
    weights = [entry["weights"] for entry in memory.values()]
    optimizer = [entry["optimizer"] for entry in memory.values()]
    peaks = [entry["peak"] for entry in memory.values() if entry["peak"]]
    return {
        "workers": num_workers,
        "stage": stage,
        "parameters": params,
        "devices": len(memory),
        "weights_bytes_max": max(weights),
        "optimizer_bytes_max": max(optimizer),
        "formula_weights_bytes": formula.weights,
        "formula_optimizer_bytes": formula.optimizer,
        "formula_state_bytes": formula.total,
        "held_over_formula": (max(weights) + max(optimizer))
        / (formula.weights + formula.optimizer),
        "peak_bytes_max": max(peaks) if peaks else None,
        "peak_bytes": [entry["peak"] for entry in memory.values()],
        "step_time_ms": statistics.median(e["step_time_ms"] for e in record["epochs"][1:]),
    }


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stage"] for r in results})
    workers = sorted({r["workers"] for r in results})
    figure, (held_axis, peak_axis, time_axis) = plt.subplots(1, 3, figsize=(15, 4.5))
    for stage in stages:
        rows = [r for r in results if r["stage"] == stage]
        line = held_axis.plot(
            [r["workers"] for r in rows],
            [(r["weights_bytes_max"] + r["optimizer_bytes_max"]) / 2**20 for r in rows],
            "o-",
            label=f"stage {stage} measured",
        )[0]
        held_axis.plot(
            [r["workers"] for r in rows],
            [(r["formula_weights_bytes"] + r["formula_optimizer_bytes"]) / 2**20 for r in rows],
            "x--",
            color=line.get_color(),
            label=f"stage {stage} formula",
        )
        peak_axis.plot(
            [r["workers"] for r in rows],
            [(r["peak_bytes_max"] or 0) / 2**20 for r in rows],
            "o-",
            label=f"stage {stage}",
        )
    held_axis.set(
        xlabel="devices N", ylabel="MiB per device", title="weights + optimizer state held"
    )
    peak_axis.set(xlabel="devices N", ylabel="MiB", title="allocator peak (largest worker)")
    for axis in (held_axis, peak_axis):
        axis.set_xticks(workers)
        axis.legend(fontsize=7)
    width = 0.8 / len(stages)
    for index, stage in enumerate(stages):
        rows = [r for r in results if r["stage"] == stage]
        time_axis.bar(
            [workers.index(r["workers"]) + index * width for r in rows],
            [r["step_time_ms"] for r in rows],
            width,
            label=f"stage {stage}",
        )
    time_axis.set_xticks([i + width * (len(stages) - 1) / 2 for i in range(len(workers))])
    time_axis.set_xticklabels([f"N={n}" for n in workers])
    time_axis.set(ylabel="ms", title="median step time")
    time_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _plot_timeline(ops: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({op.thread for op in ops})
    origin = min(op.start for op in ops)
    figure, axis = plt.subplots(figsize=(14, 1.2 + 0.8 * len(threads)))
    kinds = (
        ("gather (zero_gather, zero_regather)", is_gather, "tab:orange"),
        ("compute (MatMul)", is_compute, "tab:blue"),
        ("other ops", lambda op: not is_gather(op) and not is_compute(op), "lightgrey"),
    )
    for label, belongs, color in kinds:
        for lane, thread in enumerate(threads):
            bars = [
                (1e3 * (op.start - origin), 1e3 * (op.end - op.start))
                for op in ops
                if op.thread == thread and belongs(op)
            ]
            axis.broken_barh(
                bars, (lane - 0.35, 0.7), color=color, label=label if lane == 0 else None
            )
    axis.set_yticks(range(len(threads)))
    axis.set_yticklabels([f"executor thread {index}" for index in range(len(threads))])
    axis.set(xlabel="ms from the step's first op", title="ZeRO stage 3, one traced step")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv):
    del argv
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for num_workers in (int(n) for n in FLAGS.workers):
            for stage in (int(s) for s in FLAGS.stages):
                model_dir = os.path.join(scratch, f"n{num_workers}_zero{stage}")
                results.append(_summary(num_workers, stage, _run(num_workers, stage, model_dir)))
    for result in results:
        zero = [r for r in results if r["workers"] == result["workers"] and r["stage"] == 0]
        result["step_time_vs_stage0"] = (
            result["step_time_ms"] / zero[0]["step_time_ms"] if zero else None
        )
    output = {"model": {"width": FLAGS.width, "layers": FLAGS.layers}, "runs": results}
    if FLAGS.overlap_devices:
        with tempfile.TemporaryDirectory() as scratch:
            output["stage3_overlap"], traced_ops = _traced_stage3(FLAGS.overlap_devices, scratch)
        if FLAGS.timeline:
            _plot_timeline(traced_ops, FLAGS.timeline)
    text = json.dumps(output, indent=2)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as handle:
            handle.write(text + "\n")
    if FLAGS.plot:
        _plot(results, FLAGS.plot)


if __name__ == "__main__":
    run_script(main, (ValueError,))
