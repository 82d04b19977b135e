"""Benchmark: scripts/train.py's step with TensorFlow's default CPU allocator and with BFC.

tfmulti asks for TensorFlow's BFC CPU allocator (`tfmulti.platform.runtime.cpu_allocator`); this
measures what that choice is worth on this machine. Each run (a `--run` of train.py flags)
trains in fresh processes, once with `TF_CPU_ALLOCATOR_USE_BFC=false` and once with
`true`, in alternating rounds so machine noise hits both alike; a process's step is the
median of its logged steps after the first epoch, and each setting's fastest process counts.

Prints one JSON object: per run, its flags, each process's step in ms under each
allocator (`default_ms`, `bfc_ms`) and `bfc_over_default`, the ratio of the fastest.

Example:
    python scripts/benchmark_cpu_allocator.py --rounds=2
"""

import json
import os
import statistics
import sys
import tempfile

from absl import flags

from tfmulti.flags.parsing import run_script
from tfmulti.planner.validation import TRAIN_SCRIPT, run_timed_training, training_run_flags
from tfmulti.platform.runtime.cpu_allocator import CPU_ALLOCATOR_ENV

_MODEL = (
    "--model=transformer --dataset=tokens --model_option=num_layers=4 --model_option=d_model=64"
)
_DEFAULT_RUNS = [
    f"--strategy=one_device --batch_size=16 {_MODEL}",
    f"--strategy=one_device --batch_size=32 {_MODEL}",
    f"--strategy=mirrored --virtual_devices=2 --batch_size=32 {_MODEL}",
    "--strategy=pipeline --virtual_devices=2 --num_stages=2 --microbatches=2 "
    f"--batch_size=32 {_MODEL}",
]
ALLOCATORS = {"default_ms": "false", "bfc_ms": "true"}

flags.DEFINE_multi_string("run", _DEFAULT_RUNS, "The train.py flags of one run (repeatable).")
flags.DEFINE_integer("rounds", 2, "Processes per run and allocator.", lower_bound=1)
flags.DEFINE_integer("epochs", 3, "Epochs per process; the first is not timed.", lower_bound=2)
flags.DEFINE_integer("steps_per_epoch", 10, "Training steps per epoch.", lower_bound=2)
FLAGS = flags.FLAGS


def step_ms(run_flags: list[str], use_bfc: str, model_dir: str) -> float:
    """The median logged step (ms) of one train.py process with the allocator chosen."""
    command = [
        sys.executable,
        TRAIN_SCRIPT,
        *run_flags,
        *training_run_flags(FLAGS.epochs, FLAGS.steps_per_epoch, model_dir),
    ]
    steps, error = run_timed_training(
        command, model_dir, 900, FLAGS.steps_per_epoch, {CPU_ALLOCATOR_ENV: use_bfc}
    )
    if error is not None:
        raise SystemExit(f"train.py {' '.join(run_flags)} failed: {error}")
    return round(statistics.median(steps) * 1000, 2)


def main(argv):
    del argv
    runs = [{"flags": text.split(), **{name: [] for name in ALLOCATORS}} for text in FLAGS.run]
    with tempfile.TemporaryDirectory(prefix="allocator_bench_") as work_dir:
        for round_index in range(FLAGS.rounds):
            for index, run in enumerate(runs):
                for name, use_bfc in ALLOCATORS.items():
                    model_dir = os.path.join(work_dir, f"{index}_{name}_{round_index}")
                    run[name].append(step_ms(run["flags"], use_bfc, model_dir))
    for run in runs:
        run["bfc_over_default"] = round(min(run["bfc_ms"]) / min(run["default_ms"]), 3)
    print(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    run_script(main, (ValueError,), runs_children=True)
