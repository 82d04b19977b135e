"""Layouts as a text table and as JSON, with the command that trains each: `scripts/train.py`,
started by `scripts/launch.py` over several hosts; and how their predictions measured."""

from __future__ import annotations

from collections.abc import Sequence

from tfmulti.planner.accuracy import Accuracy, accuracy
from tfmulti.planner.costs import ModelCosts
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_flags import command_line, launch_flags, train_flags
from tfmulti.planner.validation import Measurement
from tfmulti.text_table import format_table

_COLUMNS = ("#", "mesh", "schedule", "m", "v", "split", "step ms", "bubble", "peak MiB/dev")
# Over several hosts: the hosts a layout runs on and the mesh axis across them.
_HOST_COLUMN = "hosts"


def format_bytes_mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f}"


def format_step_ms(layout: Layout) -> str:
    """The predicted step time in ms, with its uncertainty when known: '52.10 ± 4.20'."""
    text = f"{1000 * layout.step_time:.2f}"
    if layout.uncertainty:
        text += f" ± {1000 * layout.uncertainty:.2f}"
    return text


def layout_row(rank: int, layout: Layout) -> tuple[str, ...]:
    """One table row: rank, mesh, schedule, m, v, split, step ms, bubble, peak MiB."""
    return (
        str(rank),
        f"{layout.mesh.data}x{layout.mesh.pipe}x{layout.mesh.tensor}"
        + (f" zero{layout.zero}" if layout.zero else ""),
        layout.schedule or "-",
        str(layout.num_microbatches),
        str(layout.chunks),
        ",".join(str(b) for b in layout.boundaries) or "-",
        format_step_ms(layout),
        f"{layout.bubble_fraction:.3f}",
        format_bytes_mib(layout.peak_memory),
    )


def hosts_cell(layout: Layout) -> str:
    """'2 pipe': the hosts a layout runs on and the axis across them; '1' on one host."""
    if layout.hosts == 1:
        return "1"
    return f"{layout.hosts} {layout.cross_host_axis}"


def layout_command(layout: Layout, costs: ModelCosts, global_batch: int) -> str:
    """The shell command that trains `layout`."""
    return command_line(train_flags(layout, costs, global_batch), launch_flags(layout))


def format_layouts(layouts: Sequence[Layout], costs: ModelCosts, global_batch: int) -> str:
    """The table of `layouts` (mesh is data x pipe x tensor; over several hosts, a column
    of the hosts each uses and the axis across them), then each one's command."""
    rows = [layout_row(rank, layout) for rank, layout in enumerate(layouts, 1)]
    columns = _COLUMNS
    if any(layout.hosts > 1 for layout in layouts):
        rows = [(*row, hosts_cell(layout)) for row, layout in zip(rows, layouts, strict=True)]
        columns = (*columns, _HOST_COLUMN)
    table = format_table(rows, columns)
    commands = [
        f"{rank}: {layout_command(layout, costs, global_batch)}"
        for rank, layout in enumerate(layouts, 1)
    ]
    return "\n".join([table, "", *commands])


def layout_json(layout: Layout, costs: ModelCosts, global_batch: int) -> dict:
    """A layout's fields, predictions (seconds, bytes) and train.py flags as a JSON object."""
    return {
        "mesh": {"data": layout.mesh.data, "pipe": layout.mesh.pipe, "tensor": layout.mesh.tensor},
        "schedule": layout.schedule,
        "microbatches": layout.num_microbatches,
        "chunks": layout.chunks,
        "boundaries": list(layout.boundaries),
        "step_time": layout.step_time,
        "uncertainty": layout.uncertainty,
        "pipeline_time": layout.pipeline_time,
        "allreduce_time": layout.allreduce_time,
        "overhead_time": layout.overhead_time,
        "bubble_fraction": layout.bubble_fraction,
        "peak_memory_bytes": layout.peak_memory,
        "zero": layout.zero,
        "hosts": layout.hosts,
        "cross_host_axis": layout.cross_host_axis,
        "train_flags": train_flags(layout, costs, global_batch),
        "launch_flags": launch_flags(layout),
        "command": layout_command(layout, costs, global_batch),
    }


def validation_accuracy(
    measurements: Sequence[Measurement], machine_drift: float | None = None
) -> Accuracy | None:
    """MAPE, Kendall tau, best gap and the runs' own repeat error over the layouts that
    ran (with the anchor's `machine_drift`, the MAPE on its fastest run too), or None if
    none did."""
    ran = [m for m in measurements if m.measured_step_time is not None]
    if not ran:
        return None
    return accuracy(
        [m.layout.step_time for m in ran],
        [m.measured_step_time for m in ran],
        [m.run_step_times for m in ran],
        machine_drift,
    )


def _run_spread(run_step_times: Sequence[float]) -> str:
    """How much slower a layout's slowest run was than its fastest: '+12%', or '-'."""
    if len(run_step_times) < 2:
        return "-"
    return f"+{100 * (max(run_step_times) / min(run_step_times) - 1):.0f}%"


def format_validation(
    measurements: Sequence[Measurement], machine_drift: float | None = None
) -> str:
    """Predicted against measured step time per layout, failures, then the three figures
    (and the anchor's drift since planning, when re-timed)."""
    rows = []
    for rank, measurement in enumerate(measurements, 1):
        predicted = layout_row(rank, measurement.layout)
        measured = measurement.measured_step_time
        rows.append(
            (
                *predicted[:7],
                f"{1000 * measured:.2f}" if measured is not None else "failed",
                f"{measured / measurement.layout.step_time:.2f}" if measured else "-",
                _run_spread(measurement.run_step_times),
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
        "slowest run",
    )
    if any(m.layout.hosts > 1 for m in measurements):
        rows = [(*row, hosts_cell(m.layout)) for row, m in zip(rows, measurements, strict=True)]
        columns = (*columns, "hosts")
    failures = [
        f"{rank}: {m.error}" for rank, m in enumerate(measurements, 1) if m.error is not None
    ]
    figures = validation_accuracy(measurements, machine_drift)
    summary = [f"\n{figures.summary()}"] if figures else []
    return "\n".join([format_table(rows, columns), *failures, *summary])
