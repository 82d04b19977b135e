r"""Plan how to train a model on N devices: mesh, schedule, micro-batches and stage split.

Measures the model's blocks on this machine (or reads --costs), searches every
data x pipe x tensor mesh, schedule, micro-batch count and stage split by simulation, and
prints the best layouts with their predicted step time, bubble and peak memory per
device, and the `scripts/train.py` flags that run each.

Examples:
  tfmulti-plan --model=transformer --model_option=num_layers=6 --devices=8
  tfmulti-plan --devices=4 --memory_per_device=2MiB --save_costs=/tmp/costs.json
  tfmulti-plan --costs=/tmp/costs.json --devices=8 --json
  tfmulti-plan --devices=2 --allow_fewer_devices --validate=4   # run them, compare

Cost model (see docs/planner.md): block times are affine in the micro-batch size; the
framework's own per-step costs (a step's fixed cost, each replica's dispatch, the pipeline
executor's cost per action and loop round), the all-reduce's latency and bandwidth and
how much the devices overlap are measured once per machine by small benchmarks and kept
in --cost_cache (--machine_costs=none: devices independent, links of --bandwidth bytes/s);
a tensor-split block computes 1/K of its per-example work plus two output all-reduces per
pass; memory is parameter state (--bytes_per_param per parameter) plus the block outputs
kept for the backward. Each predicted time carries the ± its measurements' spread gives.
"""

import json
import os
import re
import sys
import tempfile

from absl import flags

from tfmulti.flags.console_flags import define_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.flags.training_flags import define_data_flags, parse_model_option
from tfmulti.planner import Hardware, load_costs, save_costs, search_layouts
from tfmulti.planner.accuracy import accuracy
from tfmulti.planner.report import (
    format_layouts,
    layout_json,
    layout_row,
)
from tfmulti.planner.train_flags import train_flags
from tfmulti.planner.validation import (
    accepts_flags,
    distinct_layouts,
    measure_layouts,
)
from tfmulti.text_table import format_table
from tfmulti.user_code import is_function_reference

FLAGS = flags.FLAGS
_BYTE_UNITS = {
    **{"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9},
    **{"KIB": 2**10, "MIB": 2**20, "GIB": 2**30},
}
_BYTES = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*$")

define_data_flags()
define_console_flags()
FLAGS.set_default("model", "transformer")
FLAGS.set_default("dataset", "tokens")
flags.DEFINE_integer("devices", 8, "Devices to lay the model out on.", lower_bound=1)
flags.DEFINE_bool("allow_fewer_devices", False, "Also consider meshes over a divisor of --devices.")
flags.DEFINE_integer("global_batch", 64, "Examples per step over all replicas.", lower_bound=1)
flags.DEFINE_string(
    "memory_per_device", None, "Largest bytes a device may hold, e.g. 16GiB, 512MiB, 1e9."
)
flags.register_validator(
    "memory_per_device",
    lambda text: text is None or _parse_bytes(text) is not None,
    message="--memory_per_device must be a number of bytes with an optional unit "
    "(B, KB, MB, GB, KiB, MiB, GiB), e.g. 16GiB",
)
flags.DEFINE_float(
    "bandwidth",
    10e9,
    "Bytes per second between two devices (all-reduce, transfers).",
    lower_bound=1.0,
)
flags.DEFINE_float(
    "bytes_per_param",
    16.0,
    "Bytes of parameter state per parameter: 16 = float32 weight, gradient, Adam m and v.",
    lower_bound=0.0,
)
flags.DEFINE_bool(
    "shared_compute",
    False,
    "The devices share one processor (logical devices from --virtual_devices): their work "
    "does not overlap.",
)
flags.DEFINE_string("costs", None, "Read block costs from this JSON cost file; no measuring.")
flags.DEFINE_enum(
    "machine_costs",
    "measure",
    ["measure", "none"],
    "measure: the framework's per-step costs, the all-reduce and the devices' overlap, "
    "measured once per machine and kept in --cost_cache; none: leave them out (devices "
    "independent, links of --bandwidth).",
)
flags.DEFINE_string(
    "cost_cache",
    os.path.join(os.path.expanduser("~"), ".cache", "tfmulti", "planner_costs.json"),
    "JSON file keeping the machine's measured costs between plans.",
)
flags.DEFINE_bool("remeasure_machine", False, "Measure the machine's costs again.")
flags.DEFINE_string("save_costs", None, "Write the measured block costs to this JSON file.")
flags.DEFINE_list(
    "measure_batch_sizes",
    None,
    "Two batch sizes to time the blocks at (default: global_batch / 8 and global_batch).",
)
flags.DEFINE_integer("measure_rounds", 3, "Timing rounds per block; the fastest counts.", 1)
flags.DEFINE_integer("top", 5, "Layouts to print.", lower_bound=1)
flags.DEFINE_integer("max_microbatches", 32, "Largest micro-batch count tried.", lower_bound=1)
flags.DEFINE_integer("max_chunks", 4, "Largest chunk count for interleaved_1f1b.", lower_bound=2)
flags.DEFINE_bool("json", False, "Print a JSON object instead of the table.")
flags.DEFINE_integer(
    "validate",
    0,
    "Also train the best N layouts of different (mesh, schedule) with scripts/train.py "
    "and print predicted against measured step time.",
    lower_bound=0,
)
flags.DEFINE_integer("validate_repeats", 2, "Runs of each layout; the fastest counts.", 1)
flags.DEFINE_integer("validate_steps", 20, "Training steps per epoch in --validate.", 1)
flags.DEFINE_integer(
    "validate_epochs", 3, "Epochs per --validate run; all after the first are timed.", 2
)
flags.DEFINE_string("validate_dir", None, "Where --validate runs write (default: a temp dir).")


def _parse_bytes(text: str) -> float | None:
    match = _BYTES.match(text)
    if not match or match.group(2).upper() not in _BYTE_UNITS:
        return None
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]


def _start_tensorflow() -> None:
    """Starts TensorFlow with --devices logical devices (two at least, for the benchmarks)."""
    from tfmulti.platform.tf_startup import start_tensorflow

    start_tensorflow(FLAGS.tf_log_level)
    from tfmulti.platform.devices import configure_logical_devices

    configure_logical_devices(max(FLAGS.devices, 2))


def _machine_costs():
    if FLAGS.machine_costs == "none":
        return None
    _start_tensorflow()
    from tfmulti.costing.cost_cache import CostCache
    from tfmulti.planner.machine_benchmarks import machine_costs
    from tfmulti.platform.devices import logical_device_names

    devices = logical_device_names()[: max(FLAGS.devices, 2)]
    return machine_costs(devices, CostCache(FLAGS.cost_cache), FLAGS.remeasure_machine)


def _model_costs(machine):
    if FLAGS.costs:
        return load_costs(FLAGS.costs)
    _start_tensorflow()
    from tfmulti.planner.measure import measure_model_costs, measure_user_model_costs

    sizes = FLAGS.measure_batch_sizes or [max(1, FLAGS.global_batch // 8), FLAGS.global_batch]
    common = dict(
        data_path=FLAGS.data_path,
        model_options=dict(parse_model_option(option) for option in FLAGS.model_option),
        batch_sizes=[int(size) for size in sizes],
        seed=FLAGS.seed,
        machine=machine,
    )
    if is_function_reference(FLAGS.model):
        costs = measure_user_model_costs(FLAGS.model, FLAGS.dataset, **common)
    else:
        costs = measure_model_costs(
            FLAGS.model, FLAGS.dataset, rounds=FLAGS.measure_rounds, **common
        )
    if FLAGS.save_costs:
        save_costs(costs, FLAGS.save_costs)
    return costs


def _layouts_to_validate(layouts, costs):
    """The best --validate layouts of different kinds that train.py runs, and the best
    one-device layout as the baseline when fewer devices are allowed. Each check starts
    train.py, so checking stops once both are found."""
    chosen, baseline = [], None
    for layout in distinct_layouts(layouts, len(layouts)):
        wanted = len(chosen) < FLAGS.validate or (baseline is None and layout.mesh.num_devices == 1)
        if not wanted:
            if baseline is not None or not FLAGS.allow_fewer_devices:
                break
            continue
        if not accepts_flags(train_flags(layout, costs, FLAGS.global_batch)):
            continue
        if len(chosen) < FLAGS.validate:
            chosen.append(layout)
        elif layout.mesh.num_devices == 1:
            baseline = layout
        if layout.mesh.num_devices == 1 and baseline is None:
            baseline = layout
    if baseline is not None and baseline not in chosen:
        chosen.append(baseline)
    return chosen


def _validation_accuracy(measurements):
    """MAPE, Kendall tau and best gap over the layouts that ran, or None if none did."""
    ran = [m for m in measurements if m.measured_step_time is not None]
    if not ran:
        return None
    return accuracy([m.layout.step_time for m in ran], [m.measured_step_time for m in ran])


def _validation_table(measurements) -> str:
    rows = []
    for rank, measurement in enumerate(measurements, 1):
        predicted = layout_row(rank, measurement.layout)
        measured = measurement.measured_step_time
        rows.append(
            (
                *predicted[:7],
                f"{1000 * measured:.2f}" if measured is not None else "failed",
                f"{measured / measurement.layout.step_time:.2f}" if measured else "-",
            )
        )
    columns = (
        "#",
        "mesh",
        "schedule",
        "m",
        "v",
        "split",
        "predicted ms",
        "measured ms",
        "measured/predicted",
    )
    failures = [
        f"{rank}: {m.error}" for rank, m in enumerate(measurements, 1) if m.error is not None
    ]
    figures = _validation_accuracy(measurements)
    summary = [f"\n{figures.summary()}"] if figures else []
    return "\n".join([format_table(rows, columns), *failures, *summary])


def _plan(argv: list[str]) -> None:
    del argv
    machine = _machine_costs()
    costs = _model_costs(machine)
    hardware = Hardware(
        bandwidth=FLAGS.bandwidth,
        bytes_per_param=FLAGS.bytes_per_param,
        shared_compute=FLAGS.shared_compute,
        memory_per_device=_parse_bytes(FLAGS.memory_per_device)
        if FLAGS.memory_per_device
        else None,
        machine=machine,
    )
    layouts = search_layouts(
        costs,
        FLAGS.devices,
        FLAGS.global_batch,
        hardware,
        allow_fewer_devices=FLAGS.allow_fewer_devices,
        max_microbatches=FLAGS.max_microbatches,
        max_chunks=FLAGS.max_chunks,
    )
    if not layouts:
        raise ValueError(
            f"No layout of {FLAGS.devices} devices fits memory_per_device="
            f"{FLAGS.memory_per_device} with global_batch={FLAGS.global_batch}; raise "
            "--memory_per_device or --devices, or lower --global_batch."
        )
    best = layouts[: FLAGS.top]
    measurements = []
    if FLAGS.validate:
        work_dir = FLAGS.validate_dir or tempfile.mkdtemp(prefix="plan_validate_")
        measurements = measure_layouts(
            _layouts_to_validate(layouts, costs),
            costs,
            FLAGS.global_batch,
            work_dir,
            epochs=FLAGS.validate_epochs,
            steps_per_epoch=FLAGS.validate_steps,
            repeats=FLAGS.validate_repeats,
        )
    if FLAGS.json:
        figures = _validation_accuracy(measurements)
        output = {
            "model": costs.model,
            "model_options": costs.model_options,
            "dataset": costs.dataset,
            "devices": FLAGS.devices,
            "global_batch": FLAGS.global_batch,
            "layouts_considered": len(layouts),
            "layouts": [layout_json(layout, costs, FLAGS.global_batch) for layout in best],
            "validation": [
                {
                    **layout_json(m.layout, costs, FLAGS.global_batch),
                    "measured_step_time": m.measured_step_time,
                    "measured_over_predicted": (
                        m.measured_step_time / m.layout.step_time if m.measured_step_time else None
                    ),
                    "error": m.error,
                }
                for m in measurements
            ],
            "machine_costs": hardware.machine.to_json() if hardware.machine else None,
        }
        if figures is not None:
            output.update(figures.to_json())
        json.dump(output, sys.stdout, indent=1)
        print()
        return
    print(
        f"{costs.model} on {FLAGS.devices} devices, global batch {FLAGS.global_batch}: "
        f"best {len(best)} of {len(layouts)} layouts (mesh = data x pipe x tensor)\n"
    )
    print(format_layouts(best, costs, FLAGS.global_batch))
    if measurements:
        print(
            "\nPredicted against measured step time "
            "(scripts/train.py, median step after the first epoch):\n"
        )
        print(_validation_table(measurements))


def main() -> None:
    """Plans from the command line's flags (the `tfmulti-plan` command)."""
    from tfmulti.errors import USER_ERRORS

    run_script(_plan, USER_ERRORS, usage=__doc__, module=__name__, title="planner")
