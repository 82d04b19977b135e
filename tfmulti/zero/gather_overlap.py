"""How much of ZeRO stage 3's weight gathering a profile shows hidden behind compute.

Each gather's ops run under the name scope `zero_gather` (before a layer's call) or
`zero_regather` (before its backward), which the trace's op names carry. Compute is the
matrix products (`MatMul`, convolutions and their fused forms). A gather overlaps compute
for as long as some compute op runs at the same time on another thread: the executor issued
the next layer's gather while the current layer computed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tfmulti.platform.runtime.trace_events import TraceEvent

# Name scopes of stage 3's gathers (`gather_on_read`), which a profile's op names carry.
FORWARD_GATHER = "zero_gather"
BACKWARD_GATHER = "zero_regather"
COMPUTE_TYPES = ("MatMul", "Conv2D", "Conv")


# A scope's second use in one graph is named "<scope>_1", and so on.
_GATHER_SCOPE = re.compile(rf"^(?:{FORWARD_GATHER}|{BACKWARD_GATHER})(?:_\d+)?$")


def is_gather(event: TraceEvent) -> bool:
    return any(_GATHER_SCOPE.match(part) for part in event.op_name.split("/"))


def is_regather(event: TraceEvent) -> bool:
    """A gather for a layer's backward (stage 3 gathers each layer's weights again)."""
    return any(
        _GATHER_SCOPE.match(part) and part.startswith(BACKWARD_GATHER)
        for part in event.op_name.split("/")
    )


def is_compute(event: TraceEvent) -> bool:
    return not is_gather(event) and any(kind in event.op_type for kind in COMPUTE_TYPES)


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(
    first: Sequence[tuple[float, float]], second: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    found, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        start = max(first[i][0], second[j][0])
        end = min(first[i][1], second[j][1])
        if start < end:
            found.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return found


def gather_overlap(ops: Sequence[TraceEvent], span: tuple[float, float] | None = None) -> dict:
    """Seconds of gathering and of compute among `ops` (within `span`, if given), and the
    share of gathering during which compute ran on another thread.

    Returns:
        {"gather_ops", "regather_ops" (of them, for the backward), "gather_op_seconds"
        (summed over the gathers' ops), "compute_seconds" (the compute ops' union in time),
        "overlapped_op_seconds" (of the gathers' op time, what ran beside compute),
        "overlap_fraction"}.
    """
    if span is not None:
        ops = [op for op in ops if op.start >= span[0] and op.end <= span[1]]
    gathers = [op for op in ops if is_gather(op)]
    computes = [op for op in ops if is_compute(op)]
    gathering = sum(op.end - op.start for op in gathers)
    # Compute on threads other than each gather's, merged once per thread.
    elsewhere = {
        thread: _union([(op.start, op.end) for op in computes if op.thread != thread])
        for thread in {op.thread for op in gathers}
    }
    overlapped = sum(
        _length(_intersection([(gather.start, gather.end)], elsewhere[gather.thread]))
        for gather in gathers
    )
    return {
        "gather_ops": len(gathers),
        "regather_ops": sum(1 for op in gathers if is_regather(op)),
        "gather_op_seconds": gathering,
        "compute_seconds": _length(_union([(op.start, op.end) for op in computes])),
        "overlapped_op_seconds": overlapped,
        "overlap_fraction": overlapped / gathering if gathering else 0.0,
    }
