"""A cluster described by a hardware file: nodes of GPUs, their peak, memory and links.

Pure Python. `scripts/plan.py --hardware` takes a preset shipped in
`tfmulti/planner/hardware/` (`a100_80gb`, `h100_80gb`) or the path of a JSON file of the
same fields:

    {"format": "tfmulti.planner.hardware/1", "name": "my cluster",
     "devices_per_node": 8, "peak_flops": 312e12, "memory_bytes": 80e9,
     "memory_bandwidth": 2.039e12, "intra_node_bandwidth": 300e9,
     "intra_node_latency": 5e-6, "inter_node_bandwidth": 25e9, "inter_node_latency": 10e-6}

Bandwidths are bytes per second each way per device (inter-node: each GPU's own adapter);
latencies are seconds per message. An optional `matmul_efficiency` replaces the fraction
of peak a large matrix multiplication reaches (`analytic_costs.LARGE_MATMUL_EFFICIENCY`).
"""

from __future__ import annotations

import dataclasses
import json
import os

HARDWARE_FILE_FORMAT = "tfmulti.planner.hardware/1"
PRESET_FOLDER = os.path.join(os.path.dirname(__file__), "hardware")
_POSITIVE_FIELDS = (
    "peak_flops",
    "memory_bytes",
    "memory_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
)
_LATENCY_FIELDS = ("intra_node_latency", "inter_node_latency")


@dataclasses.dataclass(frozen=True)
class ClusterHardware:
    """Nodes of identical devices joined by a network.

    Args:
        name: what the hardware is.
        devices_per_node: devices in one node (joined by `intra_node_bandwidth`).
        peak_flops: dense 16-bit FLOP/s of one device.
        memory_bytes: bytes one device holds.
        memory_bandwidth: bytes per second between a device and its memory.
        intra_node_bandwidth: bytes per second each way between two devices of a node.
        intra_node_latency: seconds a message inside a node waits beyond its bytes.
        inter_node_bandwidth: bytes per second each way from one device to another node.
        inter_node_latency: seconds a message between nodes waits beyond its bytes.
        matmul_efficiency: fraction of `peak_flops` a large matrix multiplication reaches,
            or None for `analytic_costs.LARGE_MATMUL_EFFICIENCY`.
        sources: where each figure comes from, by field.
    """

    name: str
    devices_per_node: int
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    matmul_efficiency: float | None = None
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        if (
            isinstance(self.devices_per_node, bool)
            or not isinstance(self.devices_per_node, int)
            or self.devices_per_node < 1
        ):
            raise ValueError(
                "Hardware field devices_per_node must be an integer >= 1. "
                f"Received: devices_per_node={self.devices_per_node!r}"
            )
        for field in _POSITIVE_FIELDS:
            _check_number(field, getattr(self, field), lambda value: value > 0, "> 0")
        for field in _LATENCY_FIELDS:
            _check_number(field, getattr(self, field), lambda value: value >= 0, ">= 0")
        if self.matmul_efficiency is not None:
            _check_number(
                "matmul_efficiency",
                self.matmul_efficiency,
                lambda value: 0 < value <= 1,
                "in (0, 1]",
            )


def _check_number(field: str, value, holds, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not holds(value):
        raise ValueError(
            f"Hardware field {field} must be a number {rule}. Received: {field}={value!r}"
        )


def hardware_presets() -> list[str]:
    """The names `--hardware` accepts besides a path.

    Example:
        >>> hardware_presets()
        ['a100_80gb', 'h100_80gb']
    """
    return sorted(
        name[: -len(".json")] for name in os.listdir(PRESET_FOLDER) if name.endswith(".json")
    )


def load_hardware(name_or_path: str) -> ClusterHardware:
    """The preset called `name_or_path`, or the hardware file at that path.

    Example:
        >>> load_hardware("a100_80gb").peak_flops
        312000000000000.0
    """
    path = name_or_path
    if not name_or_path.endswith(".json"):
        if name_or_path not in hardware_presets():
            raise ValueError(
                f"Unknown hardware preset. Expected one of {hardware_presets()} or a path to a "
                f".json hardware file. Received: --hardware={name_or_path}"
            )
        path = os.path.join(PRESET_FOLDER, f"{name_or_path}.json")
    try:
        with open(path) as file:
            data = json.load(file)
    except OSError as error:
        raise ValueError(f"Cannot read hardware file {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"Hardware file {path} is not JSON: {error}") from None
    return hardware_from_json(data)


def hardware_from_json(data: dict) -> ClusterHardware:
    """Reads a hardware file's JSON object; errors name the missing or bad field."""
    if not isinstance(data, dict) or data.get("format") != HARDWARE_FILE_FORMAT:
        received = data.get("format") if isinstance(data, dict) else data
        raise ValueError(
            f"A hardware file starts with format {HARDWARE_FILE_FORMAT!r}. "
            f"Received: format={received!r}"
        )
    fields = {field.name for field in dataclasses.fields(ClusterHardware)}
    unknown = sorted(set(data) - fields - {"format"})
    if unknown:
        raise ValueError(
            f"Unknown hardware field {unknown[0]}. Expected fields: {sorted(fields)}. "
            f"Received: {unknown[0]}={data[unknown[0]]!r}"
        )
    optional = {"matmul_efficiency", "sources", "name"}
    for field in sorted(fields - optional):
        if field not in data:
            raise ValueError(
                f"Hardware field {field} is missing. "
                f"Received fields: {sorted(set(data) - {'format'})}"
            )
    return ClusterHardware(
        name=str(data.get("name", "unnamed hardware")),
        **{field: data[field] for field in fields - {"name", "sources"} if field in data},
        sources=dict(data.get("sources", {})),
    )
