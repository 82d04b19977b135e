"""Layouts as a text table and as JSON, with the `scripts/train.py` command of each."""

from __future__ import annotations

from collections.abc import Sequence

from tfmulti.planner.costs import ModelCosts
from tfmulti.planner.scoring import Layout
from tfmulti.planner.train_flags import command_line, train_flags
from tfmulti.text_table import format_table

_COLUMNS = ("#", "mesh", "schedule", "m", "v", "split", "step ms", "bubble", "peak MiB/dev")


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
        f"{layout.mesh.data}x{layout.mesh.pipe}x{layout.mesh.tensor}",
        layout.schedule or "-",
        str(layout.num_microbatches),
        str(layout.chunks),
        ",".join(str(b) for b in layout.boundaries) or "-",
        format_step_ms(layout),
        f"{layout.bubble_fraction:.3f}",
        format_bytes_mib(layout.peak_memory),
    )


def format_layouts(layouts: Sequence[Layout], costs: ModelCosts, global_batch: int) -> str:
    """The table of `layouts` (mesh is data x pipe x tensor), then each one's command."""
    rows = [layout_row(rank, layout) for rank, layout in enumerate(layouts, 1)]
    table = format_table(rows, _COLUMNS)
    commands = [
        f"{rank}: {command_line(train_flags(layout, costs, global_batch))}"
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
        "train_flags": train_flags(layout, costs, global_batch),
    }
