"""Plan a pipeline schedule: print its step grid and costs, draw its timeline, compare.

Examples:
  python scripts/plan_pipeline.py --schedule=1f1b --stages=4 --microbatches=8 --out=/tmp/plan
  python scripts/plan_pipeline.py --schedule=interleaved_1f1b --chunks=2 --costs=1,2,1
  python scripts/plan_pipeline.py --compare --stages=4 --microbatches=8 --json
  python scripts/plan_pipeline.py --schedule=zbv --stages=4 --write_csv=/tmp/zbv.csv
  python scripts/plan_pipeline.py --schedule_file=/tmp/zbv.csv

--stages is the pipeline depth p (devices). With --chunks=v the model has p·v stages, v on
each device (zbv: always 2, in a V). Costs are per device-stage (one p-th of the model);
chunked schedules split each into v equal chunks.

--schedule_file reads a .csv in PyTorch's compute_only format (one row per device, actions
like 0F0,1I0,1W0) or any other file in tfmulti's compact text form; --write_csv writes the
planned schedule as such a CSV, which scripts/train.py --schedule=FILE.csv runs.

--costs is either "F,B,W" (or "F,B", W = B/2), uniform over stages, or a JSON file:
  {"forward": 1, "backward": 2, "weight_grad": 1, "activation_bytes": 1, "transfer": 0}
or, per stage (p entries, or p·v entries for the chunked stages themselves):
  {"stages": [{"forward": 1, "backward": 2, "weight_grad": 1, "activation_bytes": 1},
              ...], "transfer": 0}
"--transfer" overrides the file's "transfer".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

from absl import app, flags

from tfmulti.flags.parsing import parse_flags_or_exit
from tfmulti.pipeline import (
    SCHEDULE_NAMES,
    CostModel,
    StageCost,
    build_schedule,
    read_schedule_csv,
    schedule_from_text,
    schedule_grid,
    simulate,
    validate_schedule,
    write_schedule_csv,
)
from tfmulti.pipeline.schedules import CHUNKED_SCHEDULES

FLAGS = flags.FLAGS

flags.DEFINE_enum("schedule", "1f1b", SCHEDULE_NAMES, "Schedule to plan.")
flags.DEFINE_string(
    "schedule_file",
    None,
    "A custom schedule: a PyTorch compute_only .csv, or the compact text form; replaces "
    "--schedule.",
)
flags.DEFINE_string(
    "write_csv", None, "Write the planned schedule to this file as PyTorch's compute_only CSV."
)
flags.DEFINE_integer("stages", 4, "Pipeline depth p: number of devices.", lower_bound=1)
flags.DEFINE_integer("microbatches", 8, "Micro-batches per step m.", lower_bound=1)
flags.DEFINE_integer(
    "chunks",
    None,
    "Model chunks per device v, for interleaved_1f1b (default 2) and zbv (2 only); the "
    "model has p·v stages.",
    lower_bound=1,
)
flags.DEFINE_string("costs", "1,2,1", "'F,B,W', 'F,B' or a JSON file (see --help).")
flags.DEFINE_float("transfer", None, "Time to send a tensor between devices.", lower_bound=0)
flags.DEFINE_string("out", None, "Directory for the timeline PNG and Chrome trace JSON.")
flags.DEFINE_bool("compare", False, "Plan every schedule for the same p, m and costs.")
flags.DEFINE_bool("json", False, "Print one JSON object per schedule instead of text.")


def _costs_are_readable(value: str) -> bool:
    return os.path.isfile(value) or _parse_numbers(value) is not None


flags.register_validator(
    "costs",
    _costs_are_readable,
    message="must be 'F,B,W' or 'F,B' with non-negative numbers and W <= B, or an existing "
    "JSON file, e.g. --costs=1,2,1",
)


@flags.multi_flags_validator(
    ["schedule", "chunks", "compare", "schedule_file"],
    message=f"--chunks applies only to --schedule={'|'.join(CHUNKED_SCHEDULES)} (or --compare); "
    "drop it",
)
def _chunks_only_when_chunked(values):
    chunked = values["schedule"] in CHUNKED_SCHEDULES or values["compare"]
    return values["chunks"] in (None, 1) or chunked or values["schedule_file"] is not None


@flags.multi_flags_validator(
    ["write_csv", "compare"],
    message="--write_csv writes one schedule; drop --compare or --write_csv",
)
def _one_schedule_to_write(values):
    return not (values["write_csv"] and values["compare"])


@flags.multi_flags_validator(
    ["schedule", "stages", "microbatches", "compare"],
    message="--microbatches must be a multiple of --stages for --schedule=interleaved_1f1b, "
    "e.g. --stages=4 --microbatches=8",
)
def _interleaved_microbatches(values):
    if values["schedule"] != "interleaved_1f1b" or values["compare"]:
        return True
    return values["stages"] < 1 or values["microbatches"] % values["stages"] == 0


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What to plan, built from flags."""

    schedules: tuple[str, ...]
    schedule_file: str | None
    num_devices: int
    num_microbatches: int
    chunks: int | None
    costs: str
    transfer: float | None
    out_dir: str | None
    as_json: bool
    write_csv: str | None = None


def _parse_numbers(value: str) -> tuple[float, ...] | None:
    try:
        numbers = tuple(float(token) for token in value.split(","))
    except ValueError:
        return None
    if len(numbers) not in (2, 3) or min(numbers) < 0:
        return None
    if len(numbers) == 3 and numbers[2] > numbers[1]:
        return None
    return numbers


def load_costs(spec: str, transfer: float | None) -> tuple[tuple[StageCost, ...], float]:
    """Per device-stage costs (uniform ones as a 1-tuple) and the transfer time."""
    numbers = _parse_numbers(spec)
    if numbers is not None:
        return (StageCost(*numbers),), transfer or 0.0
    with open(spec) as costs_file:
        document = json.load(costs_file)
    stage_fields = ("forward", "backward", "weight_grad", "activation_bytes")
    if "stages" in document:
        stages = tuple(
            StageCost(**{k: entry[k] for k in stage_fields if k in entry})
            for entry in document["stages"]
        )
    else:
        stages = (StageCost(**{k: document[k] for k in stage_fields if k in document}),)
    return stages, document.get("transfer", 0.0) if transfer is None else transfer


def cost_model_for(schedule, stages: tuple[StageCost, ...], transfer: float) -> CostModel:
    """Fits device-stage costs to `schedule`'s stages, splitting them into its chunks."""
    if len(stages) == 1:
        stages = stages * schedule.num_devices
    if len(stages) == schedule.num_stages:
        return CostModel(stages, transfer)
    if len(stages) == schedule.num_devices:
        return CostModel(stages, transfer).split_into_chunks(schedule.chunks)
    raise ValueError(
        f"--costs lists {len(stages)} stages; give {schedule.num_devices} (one per device) "
        f"or {schedule.num_stages} (one per chunked stage)"
    )


def plan_schedules(config: PlanConfig, stages, transfer):
    """Yields (schedule name, simulation result or the reason it was skipped)."""
    if config.schedule_file:
        schedule = read_schedule_file(config.schedule_file)
        yield schedule.name, simulate(schedule, cost_model_for(schedule, stages, transfer))
        return
    for name in config.schedules:
        try:
            chunks = config.chunks if name in CHUNKED_SCHEDULES else None
            schedule = build_schedule(name, config.num_devices, config.num_microbatches, chunks)
        except ValueError as error:
            if len(config.schedules) == 1:
                raise
            yield name, f"skipped: {error}"
            continue
        yield name, simulate(schedule, cost_model_for(schedule, stages, transfer))


def read_schedule_file(path: str):
    """The validated schedule in `path`: a PyTorch compute_only .csv, else compact text."""
    if path.endswith(".csv"):
        return read_schedule_csv(path)
    with open(path) as schedule_file:
        schedule = schedule_from_text(schedule_file.read())
    validate_schedule(schedule)
    return schedule


def result_summary(result) -> dict:
    """The JSON-ready numbers of one simulation."""
    schedule = result.schedule
    return {
        "schedule": schedule.name,
        "stages": schedule.num_devices,
        "microbatches": schedule.num_microbatches,
        "chunks": schedule.chunks,
        "makespan": result.makespan,
        "bubble_fraction": round(result.bubble_fraction, 6),
        "overlapped_bubble_fraction": round(result.overlapped_bubble_fraction, 6),
        "peak_activations": [peak / schedule.chunks for peak in result.peak_activations],
        "peak_activation_bytes": list(result.peak_activation_bytes),
        "utilisation": [round(u, 6) for u in result.utilisation],
    }


def print_single(result) -> None:
    summary = result_summary(result)
    print(schedule_grid(result.schedule))
    print()
    print(
        f"{summary['schedule']}: p={summary['stages']} m={summary['microbatches']} "
        f"v={summary['chunks']}  makespan={result.makespan:g}  "
        f"bubble={result.bubble_fraction:.4f}  "
        f"overlapped-steps bubble={result.overlapped_bubble_fraction:.4f}"
    )
    print(f"{'device':>6}  {'busy':>8}  {'util':>6}  {'peak act (mb)':>13}  {'peak bytes':>10}")
    for device, busy in enumerate(result.busy_time):
        print(
            f"{device:>6}  {busy:>8g}  {result.utilisation[device]:>6.3f}  "
            f"{summary['peak_activations'][device]:>13g}  "
            f"{result.peak_activation_bytes[device]:>10g}"
        )


def print_comparison(planned) -> None:
    print(
        f"{'schedule':<17} {'v':>2} {'makespan':>9} {'bubble':>7} {'overlap':>7} "
        f"{'max peak':>8}  peak activations per device (micro-batches)"
    )
    for name, outcome in planned:
        if isinstance(outcome, str):
            print(f"{name:<17} {outcome}")
            continue
        summary = result_summary(outcome)
        peaks = summary["peak_activations"]
        print(
            f"{name:<17} {summary['chunks']:>2} {outcome.makespan:>9g} "
            f"{outcome.bubble_fraction:>7.4f} {outcome.overlapped_bubble_fraction:>7.4f} "
            f"{max(peaks):>8g}  {' '.join(f'{p:g}' for p in peaks)}"
        )


def write_pictures(out_dir: str, result) -> None:
    from tfmulti.pipeline.timeline import (
        TimelinePanel,
        save_timeline_png,
        timeline_title,
        write_chrome_trace,
    )

    os.makedirs(out_dir, exist_ok=True)
    schedule = result.schedule
    stem = os.path.join(
        out_dir,
        f"{schedule.name}_p{schedule.num_devices}_m{schedule.num_microbatches}_v{schedule.chunks}",
    )
    panel = TimelinePanel(result.records, timeline_title(result), schedule.stage_devices)
    save_timeline_png(stem + ".png", [panel])
    write_chrome_trace(stem + ".trace.json", result.records, name=schedule.name)


def config_from_flags() -> PlanConfig:
    return PlanConfig(
        schedules=SCHEDULE_NAMES if FLAGS.compare else (FLAGS.schedule,),
        schedule_file=FLAGS.schedule_file,
        num_devices=FLAGS.stages,
        num_microbatches=FLAGS.microbatches,
        chunks=FLAGS.chunks,
        costs=FLAGS.costs,
        transfer=FLAGS.transfer,
        out_dir=FLAGS.out,
        as_json=FLAGS.json,
        write_csv=FLAGS.write_csv,
    )


def run(config: PlanConfig) -> None:
    stages, transfer = load_costs(config.costs, config.transfer)
    planned = list(plan_schedules(config, stages, transfer))
    results = [outcome for _, outcome in planned if not isinstance(outcome, str)]
    if config.as_json:
        for result in results:
            print(json.dumps(result_summary(result)))
    elif len(planned) == 1:
        print_single(results[0])
    else:
        print_comparison(planned)
    if config.out_dir:
        for result in results:
            write_pictures(config.out_dir, result)
    if config.write_csv:
        write_schedule_csv(results[0].schedule, config.write_csv)
        print(f"Schedule written to {config.write_csv}")


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; all options are --flags (see --help)")
    try:
        run(config_from_flags())
    except (ValueError, OSError, KeyError, TypeError) as error:
        _fail(str(error).replace("\n", " "))


def _fail(message: str) -> None:
    print(f"plan_pipeline.py: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=functools.partial(parse_flags_or_exit, usage=__doc__, title="plan"))
