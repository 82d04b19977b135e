r"""Plan how to train a model on N devices: mesh, schedule, micro-batches and stage split.

Measures the model's blocks on this machine (or reads --costs), searches every
data x pipe x tensor mesh, schedule, micro-batch count and stage split by simulation, and
prints the best layouts with their predicted step time, bubble and peak memory per
device, and the `scripts/train.py` flags that run each.

Examples:
  tfmulti-plan --model=transformer --model_option=num_layers=6 --devices=8
  tfmulti-plan --hosts=2 --devices_per_host=4 --inter_host_gbps=25   # prints launch commands
  tfmulti-plan --devices=4 --memory_per_device=2MiB --save_costs=/tmp/costs.json
  tfmulti-plan --costs=/tmp/costs.json --devices=8 --json
  tfmulti-plan --devices=2 --allow_fewer_devices --validate=4   # run them, compare
  tfmulti-plan --hardware=a100_80gb --devices=1024 --global_batch=1536 \
    --model_shape=gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200   # no measuring

Cost model (see docs/planner.md): block times are affine in the micro-batch size; the
framework's own per-step costs (a step's fixed cost, each replica's dispatch, the pipeline
executor's cost per action and loop round), the all-reduce's latency and bandwidth and
how much the devices overlap are measured once per machine by small benchmarks and kept
in --cost_cache (--machine_costs=none: devices independent, links of --bandwidth bytes/s);
a tensor-split block computes 1/K of its per-example work plus two output all-reduces per
pass; memory is parameter state (--bytes_per_param per parameter) plus the block outputs
kept for the backward. Each predicted time carries the ± its measurements' spread gives.
Over --hosts hosts, one mesh axis (data or pipe) crosses them and each layout is scored
for each axis that can; what crosses pays --inter_host_gbps and --inter_host_latency_us.

With --hardware and --model_shape (docs/planner_cluster.md), nothing is measured: block
costs come from the shape's FLOPs and bytes on the hardware file's peak, memory and links,
scored by the same simulation, for clusters of thousands of devices.
"""

import dataclasses
import json
import os
import re
import sys
import tempfile

from absl import flags

from tfmulti.cli.plan_cluster import ClusterPlanConfig, plan_cluster
from tfmulti.flags.console_flags import define_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.flags.training_flags import define_data_flags, parse_model_option
from tfmulti.planner import Hardware, load_costs, save_costs, search_layouts
from tfmulti.planner.hardware_files import hardware_presets
from tfmulti.planner.overlap_anchor import anchored_overlap
from tfmulti.planner.report import (
    format_layouts,
    format_validation,
    layout_json,
    validation_accuracy,
)
from tfmulti.planner.search import model_hardware
from tfmulti.planner.train_flags import train_flags
from tfmulti.planner.validation import (
    ONE_DEVICE,
    accepts_flags,
    anchor_steps,
    distinct_layouts,
    measure_layouts,
)
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
DEFAULT_DEVICES = 8
flags.DEFINE_integer(
    "devices",
    None,
    f"Devices of one host to lay the model out on (default {DEFAULT_DEVICES}); over several "
    "hosts give --hosts and --devices_per_host.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "hosts",
    1,
    "Hosts to lay the model out over, each a worker of scripts/launch.py; needs "
    "--devices_per_host when above 1.",
    lower_bound=1,
)
flags.DEFINE_integer(
    "devices_per_host", None, "Devices on each host (--hosts x this = all devices).", 1
)
flags.DEFINE_float(
    "inter_host_gbps",
    10.0,
    "Bandwidth between two hosts in gigabits per second, as network links are rated "
    "(10: 10 Gb Ethernet); stage transfers and gradient sums that cross hosts use it.",
)
flags.register_validator(
    "inter_host_gbps",
    lambda value: value > 0,
    message="--inter_host_gbps must be > 0 gigabits per second, e.g. 10",
)
flags.DEFINE_float(
    "inter_host_latency_us",
    100.0,
    "Microseconds each message between hosts waits beyond its bytes (100: TensorFlow's "
    "gRPC runtime over a LAN).",
    lower_bound=0.0,
)
flags.DEFINE_bool(
    "allow_fewer_devices",
    False,
    "Also consider meshes over a divisor of the devices (over several hosts: on whole hosts "
    "or inside one).",
)
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
    "Bytes per second between two devices of one host (all-reduce, transfers).",
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
flags.DEFINE_integer(
    "anchor_repeats",
    None,
    "Runs of scripts/train.py's one-device step at each --measure_batch_sizes, timed as "
    "--validate times a layout (--validate_epochs, --validate_steps), counted as the "
    "expected fastest of --validate_repeats of them (the statistic its layouts are checked "
    "by): the model takes its cost per example, and what its fixed part exceeds the "
    "blocks' is the script's own cost, paid once a step (default: twice --validate_repeats; "
    "0: keep the blocks as timed in plan.py, whose cost per example can be off by half).",
    lower_bound=0,
)
flags.DEFINE_bool(
    "anchor_data_parallel",
    True,
    "With the anchor: also time scripts/train.py's data-parallel step on all --devices "
    "(one host) at --global_batch in the anchor's rounds, and score the layouts without a "
    "pipe axis on the model's overlap curve scaled to match it.",
)
flags.DEFINE_integer("top", 5, "Layouts to print.", lower_bound=1)
flags.DEFINE_integer("max_microbatches", 32, "Largest micro-batch count tried.", lower_bound=1)
flags.DEFINE_integer("max_chunks", 4, "Largest chunk count for interleaved_1f1b.", lower_bound=2)
flags.DEFINE_bool("json", False, "Print a JSON object instead of the table.")
flags.DEFINE_integer(
    "validate",
    0,
    "Also train N layouts with scripts/train.py (the best of each mesh first, then the "
    "next best of other kinds) and print predicted against measured step time.",
    lower_bound=0,
)
flags.DEFINE_integer(
    "validate_repeats",
    2,
    "Runs of each layout, in rounds; the fastest run's median step counts.",
    1,
)
flags.DEFINE_integer("validate_steps", 20, "Training steps per epoch in --validate.", 1)
flags.DEFINE_integer(
    "validate_epochs", 3, "Epochs per --validate run; all after the first are timed.", 2
)
flags.DEFINE_bool(
    "validate_anchor",
    True,
    "With --validate on an anchored model: also run the one-device anchor at --global_batch "
    "in each round, report how much faster or slower it ran than when the model was "
    "anchored, and the MAPE with the model anchored on its fastest run of all.",
)
flags.DEFINE_string("validate_dir", None, "Where --validate runs write (default: a temp dir).")
flags.DEFINE_multi_string(
    "launch_option",
    [],
    "With --hosts above 1: a scripts/launch.py flag added to every printed command and "
    "--validate run, to start the workers on real hosts, e.g. "
    "--launch_option=--hosts_file=hosts.txt --launch_option=--remote_shell='ssh -o BatchMode=yes'.",
)
flags.register_multi_flags_validator(
    ["launch_option", "hosts"],
    lambda values: not values["launch_option"] or values["hosts"] > 1,
    "--launch_option starts the workers of a layout over several hosts; give --hosts and "
    "--devices_per_host too, or drop it",
)
flags.DEFINE_string(
    "hardware",
    None,
    "Plan for a cluster instead of measuring this machine: a preset "
    f"({', '.join(hardware_presets())}) or a hardware JSON file (tfmulti.planner."
    "hardware_files); needs --model_shape.",
)
flags.DEFINE_string(
    "model_shape",
    None,
    "With --hardware, the model: gpt:layers=L,hidden=H,heads=A,seq=S,vocab=V[,microbatch=b] "
    "or layers:FILE.json (tfmulti.planner.model_shapes).",
)
flags.DEFINE_string(
    "layout",
    None,
    "With --hardware, score only this mesh, e.g. data=24,pipe=8,tensor=8.",
)
flags.DEFINE_enum(
    "recompute",
    "full",
    ["full", "none", "search"],
    "With --hardware: full activation recomputation (Megatron-LM's), none, or search both.",
)
flags.register_multi_flags_validator(
    ["hardware", "model_shape"],
    lambda values: (values["hardware"] is None) == (values["model_shape"] is None),
    "--hardware and --model_shape plan a cluster together: give both, or neither to measure "
    "a model on this machine",
)
flags.register_validator(
    "hardware",
    lambda value: value is None or value.endswith(".json") or value in hardware_presets(),
    message=f"--hardware must be one of {hardware_presets()} or a path to a .json hardware file",
)
flags.register_multi_flags_validator(
    ["layout", "hardware"],
    lambda values: values["layout"] is None or values["hardware"] is not None,
    "--layout restricts a cluster plan: give --hardware and --model_shape too",
)
flags.register_multi_flags_validator(
    ["hardware", "hosts"],
    lambda values: values["hardware"] is None or values["hosts"] == 1,
    "--hardware lays --devices over the nodes its file describes; drop --hosts",
)
# What the planner itself gives the launcher for each layout.
_PLANNED_LAUNCH_FLAGS = ("--num_workers", "--devices_per_worker")


def _not_planned(options: list[str]) -> bool:
    for option in options:
        name = option.partition("=")[0]
        if name in _PLANNED_LAUNCH_FLAGS or not name.startswith("--") or name == "--":
            raise flags.ValidationError(
                "--launch_option takes a scripts/launch.py flag other than --num_workers and "
                "--devices_per_worker (the planner sets those from --hosts and "
                f"--devices_per_host), e.g. --launch_option=--hosts_file=hosts.txt. "
                f"Received: --launch_option={option}"
            )
    return True


flags.register_validator("launch_option", _not_planned)


def _device_counts_agree(values: dict) -> bool:
    """--devices for one host, or --hosts x --devices_per_host; refuses a contradiction."""
    devices, hosts, per_host = values["devices"], values["hosts"], values["devices_per_host"]
    if hosts > 1 and per_host is None:
        raise flags.ValidationError(
            f"--hosts={hosts} needs --devices_per_host (devices on each host), e.g. "
            f"--hosts={hosts} --devices_per_host=4. Received: --devices_per_host unset"
        )
    if devices is not None and per_host is not None and devices != hosts * per_host:
        raise flags.ValidationError(
            f"--devices={devices} contradicts --hosts={hosts} x --devices_per_host={per_host} "
            f"= {hosts * per_host} devices; give --devices for one host, or --hosts and "
            "--devices_per_host"
        )
    return True


flags.register_multi_flags_validator(["devices", "hosts", "devices_per_host"], _device_counts_agree)


def _devices_per_host() -> int:
    return FLAGS.devices_per_host or FLAGS.devices or DEFAULT_DEVICES


def _total_devices() -> int:
    return FLAGS.hosts * _devices_per_host()


def _parse_bytes(text: str) -> float | None:
    match = _BYTES.match(text)
    if not match or match.group(2).upper() not in _BYTE_UNITS:
        return None
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]


def _start_tensorflow() -> None:
    """Starts TensorFlow with one host's logical devices (two at least, for the benchmarks)."""
    from tfmulti.platform.runtime.tf_startup import start_tensorflow

    start_tensorflow(FLAGS.tf_log_level)
    from tfmulti.platform.runtime.devices import configure_logical_devices

    configure_logical_devices(max(_devices_per_host(), 2))


def _machine_costs():
    if FLAGS.machine_costs == "none":
        return None
    _start_tensorflow()
    from tfmulti.costing.cost_cache import CostCache
    from tfmulti.planner.machine_benchmarks import machine_costs

    return machine_costs(_plan_devices(), CostCache(FLAGS.cost_cache), FLAGS.remeasure_machine)


def _plan_devices() -> list[str]:
    """The logical devices of one host the benchmarks run on (two at least)."""
    from tfmulti.platform.runtime.devices import logical_device_names

    return logical_device_names()[: max(_devices_per_host(), 2)]


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
        devices=_plan_devices() if machine is not None else (),
    )
    if is_function_reference(FLAGS.model):
        costs = measure_user_model_costs(FLAGS.model, FLAGS.dataset, **common)
    else:
        costs = measure_model_costs(
            FLAGS.model, FLAGS.dataset, rounds=FLAGS.measure_rounds, **common
        )
    if machine is not None and _anchor_repeats():
        costs = _anchored(costs, machine)
    if FLAGS.save_costs:
        save_costs(costs, FLAGS.save_costs)
    return costs


def _anchor_repeats() -> int:
    """Runs of each anchor step: --anchor_repeats, else twice --validate_repeats (their
    expected fastest of --validate_repeats counts, steadier than the fastest of as many)."""
    if FLAGS.anchor_repeats is None:
        return 2 * FLAGS.validate_repeats
    return FLAGS.anchor_repeats


def _anchored(costs, machine):
    """`costs` anchored on scripts/train.py's one-device steps (`anchored_to_steps`) and,
    with --anchor_data_parallel, its data-parallel step on all devices of one host
    (`overlap_anchor`), run and counted as --validate runs and counts a layout."""
    from tfmulti.planner.measure import anchored_to_steps

    with tempfile.TemporaryDirectory(prefix="plan_anchor_") as work_dir:
        seconds, data_parallel_step = anchor_steps(
            costs,
            costs.measured_batch_sizes,
            work_dir,
            data_parallel=_data_parallel_anchor(),
            epochs=FLAGS.validate_epochs,
            steps_per_epoch=FLAGS.validate_steps,
            repeats=_anchor_repeats(),
            counted_runs=FLAGS.validate_repeats,
        )
    variables = sum(block.variables for block in costs.blocks)
    anchored = anchored_to_steps(costs, seconds, machine.step_seconds(variables))
    return dataclasses.replace(anchored, data_parallel_step=data_parallel_step)


def _data_parallel_anchor() -> tuple[int, int] | None:
    """(devices, global batch) of the data-parallel anchor, or None: not asked for, one
    device, several hosts, or a global batch the devices do not divide."""
    devices = _total_devices()
    wanted = FLAGS.anchor_data_parallel and FLAGS.hosts == 1 and devices >= 2
    if not wanted or FLAGS.global_batch % devices:
        return None
    return devices, FLAGS.global_batch


def _planned_anchor_step(costs) -> float | None:
    """The anchored one-device step at --global_batch that --validate re-times among its
    layouts, or None (--novalidate_anchor, a model not anchored, or anchored at other
    batch sizes)."""
    sizes = costs.measured_batch_sizes
    if not FLAGS.validate_anchor or FLAGS.global_batch not in sizes or not costs.anchor_steps:
        return None
    return costs.anchor_steps[sizes.index(FLAGS.global_batch)]


def _machine_drift(anchor_check: dict | None) -> float | None:
    """The one-device step re-timed among the layouts over the anchored one, or None."""
    if not anchor_check or anchor_check["measured_step_time"] is None:
        return None
    return anchor_check["measured_step_time"] / anchor_check["planned_step_time"]


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
    return sorted(chosen, key=lambda layout: layout.step_time)


def _devices_description() -> str:
    """'8 devices', or '2 hosts x 4 devices (10 Gbit/s, 100 us between hosts)'."""
    if FLAGS.hosts == 1:
        return f"{_total_devices()} devices"
    return (
        f"{FLAGS.hosts} hosts x {_devices_per_host()} devices ({FLAGS.inter_host_gbps:g} "
        f"Gbit/s, {FLAGS.inter_host_latency_us:g} us between hosts)"
    )


def _measured_costs():
    """(machine costs, model costs): read, or measured with the callbacks a training run
    adds to every step (so each predicted step includes them)."""
    if FLAGS.machine_costs == "none" and FLAGS.costs:
        return None, load_costs(FLAGS.costs)
    _start_tensorflow()
    from tfmulti.planner.machine_benchmarks import timed_with_callbacks
    from tfmulti.run.training import timing_callbacks

    with tempfile.TemporaryDirectory() as scratch:
        with timed_with_callbacks(lambda: timing_callbacks(scratch)):
            machine = _machine_costs()
            return machine, _model_costs(machine)


def _plan(argv: list[str]) -> None:
    del argv
    if FLAGS.hardware:
        plan_cluster(
            ClusterPlanConfig(
                hardware=FLAGS.hardware,
                model_shape=FLAGS.model_shape,
                devices=_total_devices(),
                global_batch=FLAGS.global_batch,
                layout=FLAGS.layout,
                recompute=FLAGS.recompute,
                max_chunks=FLAGS.max_chunks,
                top=FLAGS.top,
                json=FLAGS.json,
            )
        )
        return
    machine, costs = _measured_costs()
    hardware = Hardware(
        bandwidth=FLAGS.bandwidth,
        bytes_per_param=FLAGS.bytes_per_param,
        shared_compute=FLAGS.shared_compute,
        memory_per_device=_parse_bytes(FLAGS.memory_per_device)
        if FLAGS.memory_per_device
        else None,
        machine=machine,
        inter_host_bandwidth=FLAGS.inter_host_gbps * 1e9 / 8,
        inter_host_latency=FLAGS.inter_host_latency_us * 1e-6,
    )
    layouts = search_layouts(
        costs,
        _total_devices(),
        FLAGS.global_batch,
        hardware,
        allow_fewer_devices=FLAGS.allow_fewer_devices,
        max_microbatches=FLAGS.max_microbatches,
        max_chunks=FLAGS.max_chunks,
        hosts=FLAGS.hosts,
    )
    launch_options = tuple(FLAGS.launch_option)
    layouts = [
        dataclasses.replace(layout, launch_options=launch_options) if layout.hosts > 1 else layout
        for layout in layouts
    ]
    if not layouts:
        raise ValueError(
            f"No layout of {_devices_description()} fits memory_per_device="
            f"{FLAGS.memory_per_device} with global_batch={FLAGS.global_batch}; raise "
            "--memory_per_device or --devices, or lower --global_batch."
        )
    best = layouts[: FLAGS.top]
    measurements, anchor_check = [], None
    if FLAGS.validate:
        work_dir = FLAGS.validate_dir or tempfile.mkdtemp(prefix="plan_validate_")
        planned_anchor = _planned_anchor_step(costs)
        to_check = _layouts_to_validate(layouts, costs)
        measurements = measure_layouts(
            to_check + ([ONE_DEVICE] if planned_anchor is not None else []),
            costs,
            FLAGS.global_batch,
            work_dir,
            epochs=FLAGS.validate_epochs,
            steps_per_epoch=FLAGS.validate_steps,
            repeats=FLAGS.validate_repeats,
        )
        if planned_anchor is not None:
            *measurements, retimed = measurements
            anchor_check = {
                "batch": FLAGS.global_batch,
                "planned_step_time": planned_anchor,
                "measured_step_time": retimed.measured_step_time,
                "measured_runs": list(retimed.run_step_times),
                "error": retimed.error,
            }
    drift = _machine_drift(anchor_check)
    if FLAGS.json:
        figures = validation_accuracy(measurements, drift)
        output = {
            "model": costs.model,
            "model_options": costs.model_options,
            "dataset": costs.dataset,
            "devices": _total_devices(),
            "hosts": FLAGS.hosts,
            "devices_per_host": _devices_per_host(),
            "inter_host_bandwidth": hardware.inter_host_bandwidth,
            "inter_host_latency": hardware.inter_host_latency,
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
                    "measured_runs": list(m.run_step_times),
                    "error": m.error,
                }
                for m in measurements
            ],
            "machine_costs": hardware.machine.to_json() if hardware.machine else None,
            "model_serial_fraction": costs.serial_fraction,
            "model_serial_fractions": list(costs.serial_fractions),
            "model_anchor_steps": list(costs.anchor_steps),
            "model_data_parallel_step": (
                dataclasses.asdict(costs.data_parallel_step) if costs.data_parallel_step else None
            ),
            "overlap_scale": anchored_overlap(costs, model_hardware(costs, hardware))[1],
            "anchor_check": anchor_check,
        }
        if figures is not None:
            output.update(figures.to_json())
        json.dump(output, sys.stdout, indent=1)
        print()
        return
    print(
        f"{costs.model} on {_devices_description()}, global batch {FLAGS.global_batch}: "
        f"best {len(best)} of {len(layouts)} layouts (mesh = data x pipe x tensor)\n"
    )
    print(format_layouts(best, costs, FLAGS.global_batch))
    if measurements:
        print(
            "\nPredicted against measured step time "
            "(scripts/train.py, median step after the first epoch):\n"
        )
        print(format_validation(measurements, drift))
        if anchor_check and anchor_check["error"]:
            print(f"The one-device anchor failed among the layouts: {anchor_check['error']}")


def main() -> None:
    """Plans from the command line's flags (the `tfmulti-plan` command)."""
    from tfmulti.errors import USER_ERRORS

    run_script(
        _plan, USER_ERRORS, usage=__doc__, module=__name__, title="planner", runs_children=True
    )
