"""What a TensorFlow profiler trace (`*.xplane.pb`) says ran on the host: each op with its
start, end and thread, and the steps `ProfileSteps` marked."""

from __future__ import annotations

import dataclasses
import glob
import os

_PICOSECONDS = 1e-12


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One event of a trace: `name` (an op's is "full/op/name:OpType"), when, and where.

    `start` and `end` are seconds from the trace's first event.
    """

    name: str
    start: float
    end: float
    thread: str

    @property
    def op_name(self) -> str:
        return self.name.rpartition(":")[0]

    @property
    def op_type(self) -> str:
        return self.name.rpartition(":")[2]


def newest_trace(log_dir: str) -> str:
    """The newest `*.xplane.pb` under `log_dir/plugins/profile/`.

    Raises:
        FileNotFoundError: when there is none.
    """
    traces = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    if not traces:
        raise FileNotFoundError(
            f"No profiler trace under {log_dir}/plugins/profile/; run with --profile_steps."
        )
    return max(traces, key=os.path.getmtime)


def host_events(path: str) -> list[TraceEvent]:
    """Every event of the host plane of trace `path`, in order of start."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as handle:
        space.ParseFromString(handle.read())
    (host,) = [plane for plane in space.planes if plane.name == "/host:CPU"]
    raw = []
    for line in host.lines:
        for event in line.events:
            start = line.timestamp_ns * 1e-9 + event.offset_ps * _PICOSECONDS
            name = host.event_metadata[event.metadata_id].name
            raw.append((start, start + event.duration_ps * _PICOSECONDS, name, line.name))
    origin = min((start for start, *_ in raw), default=0.0)
    return [
        TraceEvent(name, start - origin, end - origin, thread)
        for start, end, name, thread in sorted(raw)
    ]


def op_events(events: list[TraceEvent]) -> list[TraceEvent]:
    """The ops TensorFlow's executor ran (its compute threads' "name:OpType" events)."""
    return [
        event
        for event in events
        if event.thread.startswith("tf_Compute") and ":" in event.name and "::" not in event.name
    ]


def step_spans(events: list[TraceEvent], name: str = "train") -> list[tuple[float, float]]:
    """(start, end) of each step marked `name` (`ProfileSteps`'s "train"), in order."""
    return [(event.start, event.end) for event in events if event.name == name]
