"""Pictures and traces of pipeline timelines, planned or measured.

Everything here reads generic timing records: objects with `device`, `action` (with
`kind`, `stage`, `microbatch`), `start` and `end`, such as `TimedAction` from the simulator
or the TensorFlow executor's measurements. Matplotlib is imported only when drawing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

KIND_COLORS = {"F": "#3b75af", "B": "#4f9a5a", "I": "#e1812c", "W": "#8c64b4"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
_DEVICE_ROW_INCHES = 0.55
_PANEL_EXTRA_INCHES = 1.3


@dataclasses.dataclass(frozen=True)
class TimelinePanel:
    """One timeline to draw: its records, title and stage placement.

    Args:
        records: timing records (device, action, start, end).
        title: shown above the panel.
        stage_devices: device of each stage; with several stages per device, later chunks
            are drawn in lighter shades. None draws every stage in full colour.
    """

    records: Sequence
    title: str = ""
    stage_devices: Sequence[int] | None = None


def timeline_title(result) -> str:
    """A one-line summary of a `SimulationResult` for a picture's title."""
    schedule = result.schedule
    parts = [f"{schedule.name}", f"p={schedule.num_devices}", f"m={schedule.num_microbatches}"]
    if schedule.chunks > 1:
        parts.append(f"v={schedule.chunks}")
    parts.append(f"makespan={result.makespan:g}")
    parts.append(f"bubble={result.bubble_fraction:.1%}")
    peaks = ", ".join(f"{peak / schedule.chunks:g}" for peak in result.peak_activations)
    return "  ".join(parts) + f"\npeak live activations per device (micro-batches): [{peaks}]"


def save_timeline_png(path: str, panels: Sequence[TimelinePanel]) -> None:
    """Draws one or more timelines one above the other into a PNG.

    One row per device (device 0 on top), one box per action coloured by kind (F, B, I, W)
    and labelled with its micro-batch; empty space is idle time (bubbles). Panels share
    the time axis, so a planned and a measured timeline line up for comparison.

    Args:
        path: PNG file to write.
        panels: the timelines to draw, top to bottom.

    Example:
        >>> from tfmulti.pipeline import build_schedule, simulate
        >>> result = simulate(build_schedule("1f1b", 4, 8))
        >>> save_timeline_png("/tmp/1f1b.png", [TimelinePanel(result.records, "1f1b")])
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("save_timeline_png needs at least one panel. Received: panels=[]")
    device_counts = [_num_devices(panel.records) for panel in panels]
    most_boxes = max(_most_actions_on_a_device(panel.records) for panel in panels)
    width = min(30.0, max(9.0, 0.32 * most_boxes))
    heights = [_DEVICE_ROW_INCHES * count + _PANEL_EXTRA_INCHES for count in device_counts]
    figure = Figure(figsize=(width, sum(heights) + 0.4))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, squeeze=False, sharex=True, height_ratios=heights)
    kinds_seen = set()
    for axis, panel, num_devices in zip(axes[:, 0], panels, device_counts, strict=True):
        kinds_seen |= _draw_panel(axis, panel, num_devices)
    handles = [
        Patch(color=KIND_COLORS[kind], label=f"{kind}: {KIND_NAMES[kind]}")
        for kind in KIND_COLORS
        if kind in kinds_seen
    ]
    if any(max(_chunk_of_stage(p.stage_devices).values(), default=0) for p in panels):
        light = _lighten(KIND_COLORS["F"], 0.45)
        handles.append(Patch(color=light, label="lighter shade: later chunk"))
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    axes[-1, 0].set_xlabel("time")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=110)


def _draw_panel(axis, panel: TimelinePanel, num_devices: int) -> set[str]:
    chunk_of_stage = _chunk_of_stage(panel.stage_devices)
    num_chunks = max(chunk_of_stage.values(), default=0) + 1
    shortest = min((r.end - r.start for r in panel.records if r.end > r.start), default=1.0)
    span = max((r.end for r in panel.records), default=1.0) - min(
        (r.start for r in panel.records), default=0.0
    )
    kinds = set()
    for record in panel.records:
        action = record.action
        kinds.add(action.kind)
        chunk = chunk_of_stage.get(action.stage, 0)
        color = _lighten(KIND_COLORS[action.kind], 0.45 * chunk / max(num_chunks - 1, 1))
        duration = record.end - record.start
        axis.broken_barh(
            [(record.start, duration)],
            (record.device - 0.4, 0.8),
            facecolors=color,
            edgecolors="white",
            linewidth=0.8,
        )
        # Label only boxes wide enough to hold text; tiny measured ops would be clutter.
        if duration >= 0.5 * shortest and duration / span > 0.006:
            axis.text(
                record.start + duration / 2,
                record.device,
                str(action.microbatch),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if chunk == 0 else "#1a1a1a",
                fontweight="bold",
            )
    axis.set_yticks(range(num_devices))
    axis.set_yticklabels([f"device {d}" for d in range(num_devices)])
    axis.set_ylim(num_devices - 0.5, -0.5)
    axis.set_title(panel.title, fontsize=10, loc="left")
    axis.grid(axis="x", color="#dddddd", linewidth=0.5)
    axis.set_axisbelow(True)
    return kinds


def write_chrome_trace(
    path: str, records: Sequence, microseconds_per_unit: float = 1000.0, name: str = "pipeline"
) -> None:
    """Writes timing records as Chrome trace JSON (opens in Perfetto or chrome://tracing).

    Each device is a process row; each action a complete ("X") event.

    Args:
        path: JSON file to write.
        records: timing records (device, action, start, end).
        microseconds_per_unit: trace microseconds per record time unit (1e6 for seconds).
        name: prefix of the process names.
    """
    events = []
    for device in sorted({r.device for r in records}):
        events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": device,
                "tid": 0,
                "args": {"name": f"{name} device {device}"},
            }
        )
    for record in records:
        action = record.action
        events.append(
            {
                "name": str(action),
                "cat": KIND_NAMES.get(action.kind, action.kind),
                "ph": "X",
                "ts": record.start * microseconds_per_unit,
                "dur": (record.end - record.start) * microseconds_per_unit,
                "pid": record.device,
                "tid": 0,
                "args": {"stage": action.stage, "microbatch": action.microbatch},
            }
        )
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as trace_file:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, trace_file)


def _num_devices(records) -> int:
    return max((r.device for r in records), default=0) + 1


def _most_actions_on_a_device(records) -> int:
    counts = {}
    for record in records:
        counts[record.device] = counts.get(record.device, 0) + 1
    return max(counts.values(), default=1)


def _chunk_of_stage(stage_devices) -> dict[int, int]:
    if stage_devices is None:
        return {}
    seen_on_device: dict[int, int] = {}
    chunks = {}
    for stage, device in enumerate(stage_devices):
        chunks[stage] = seen_on_device.get(device, 0)
        seen_on_device[device] = chunks[stage] + 1
    return chunks


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(channel + (1 - channel) * amount for channel in rgb)
