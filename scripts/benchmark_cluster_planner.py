"""Benchmark: the cluster planner against Megatron-LM's published thousand-GPU runs.

For each row of Megatron-LM's Table 1 (SC'21; `tfmulti.planner.published_runs`), plans the
GPT on the row's A100 GPUs from the hardware file alone (`--hardware`, no measuring): the
published (tensor, pipeline) layout's predicted model TFLOP/s per GPU against the
published figure, its memory per GPU, and its gap to the planner's predicted best layout
(within 5%: among the best). Prints one JSON object with the rows, the MAPE and the count
of rows that hold; `--out` writes it, `--plot` draws published against predicted.

Example:
    python scripts/benchmark_cluster_planner.py --out=/tmp/cluster.json --plot=/tmp/cluster.png
    python scripts/benchmark_cluster_planner.py --rows=1,7   # the 1.7B and 145.6B rows
"""

import json
import os
import sys

from absl import flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from tfmulti.flags.parsing import run_script  # noqa: E402
from tfmulti.planner.hardware_files import hardware_presets, load_hardware  # noqa: E402
from tfmulti.planner.published_runs import MEGATRON_TABLE_1, compare_published  # noqa: E402

flags.DEFINE_enum("hardware", "a100_80gb", hardware_presets(), "The cluster's hardware preset.")
flags.DEFINE_list(
    "rows", [], f"Rows of Table 1 to compare, 1-{len(MEGATRON_TABLE_1)} (default: all)."
)
flags.register_validator(
    "rows",
    lambda rows: all(row.isdigit() and 1 <= int(row) <= len(MEGATRON_TABLE_1) for row in rows),
    message=f"--rows takes row numbers 1-{len(MEGATRON_TABLE_1)}, e.g. --rows=1,7",
)
flags.DEFINE_string("out", None, "Also write the JSON result to this file.")
flags.DEFINE_string("plot", None, "Draw published against predicted TFLOP/s per GPU to this PNG.")
FLAGS = flags.FLAGS


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{row['billions']:g}B\nt{row['tensor']} p{row['pipe']}" for row in rows]
    positions = range(len(rows))
    figure, (tflops_axis, gap_axis) = plt.subplots(1, 2, figsize=(14, 4.5))
    tflops_axis.plot(
        positions, [row["published_tflops_per_gpu"] for row in rows], "o-", label="published"
    )
    tflops_axis.plot(
        positions, [row["predicted_tflops_per_gpu"] for row in rows], "s--", label="predicted"
    )
    tflops_axis.set(
        ylabel="model TFLOP/s per GPU",
        title=f"Megatron-LM Table 1 on {result['hardware']}: MAPE {100 * result['mape']:.1f}%",
    )
    gap_axis.bar(positions, [100 * row["gap_to_best"] for row in rows])
    gap_axis.axhline(5, color="red", linestyle=":", label="5%")
    gap_axis.set(ylabel="published layout's step over the best's (%)", title="Gap to best")
    for axis in (tflops_axis, gap_axis):
        axis.set_xticks(list(positions), labels, fontsize=7)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv):
    del argv
    runs = [MEGATRON_TABLE_1[int(row) - 1] for row in FLAGS.rows] or list(MEGATRON_TABLE_1)
    hardware = load_hardware(FLAGS.hardware)
    result = {"hardware": FLAGS.hardware, **compare_published(hardware, runs)}
    text = json.dumps(result, indent=1)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as file:
            file.write(text + "\n")
    if FLAGS.plot:
        _plot(result, FLAGS.plot)


if __name__ == "__main__":
    run_script(main, (ValueError,))
