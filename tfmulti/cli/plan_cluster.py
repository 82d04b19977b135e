"""`tfmulti-plan --hardware=... --model_shape=...`: plan for a cluster without measuring.

Reads the hardware file and the model's shape, searches the layouts
(`tfmulti.planner.cluster_search`) and prints the best as a table or one JSON object. No
TensorFlow: every cost comes from the shape's FLOPs and bytes and the hardware's figures.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from tfmulti.planner.cluster_search import search_cluster_layouts
from tfmulti.planner.hardware_files import load_hardware
from tfmulti.planner.model_shapes import parse_model_shape
from tfmulti.platform.mesh import parse_mesh
from tfmulti.text_table import format_table

_COLUMNS = (
    "#",
    "data x pipe x tensor",
    "schedule",
    "b",
    "m",
    "step s",
    "TFLOP/s/dev",
    "GB/dev",
    "fits",
)


@dataclasses.dataclass(frozen=True)
class ClusterPlanConfig:
    """What a cluster plan asks for (plan.py's flags)."""

    hardware: str
    model_shape: str
    devices: int
    global_batch: int
    layout: str | None = None
    recompute: str = "full"
    max_chunks: int = 4
    top: int = 5
    json: bool = False


def plan_cluster(config: ClusterPlanConfig) -> dict:
    """Plans `config` and prints the result; returns the JSON object."""
    hardware = load_hardware(config.hardware)
    shape = parse_model_shape(config.model_shape)
    layout = parse_mesh(config.layout) if config.layout else None
    planned = search_cluster_layouts(
        shape,
        hardware,
        config.devices,
        config.global_batch,
        layout=layout,
        recompute=config.recompute,
        max_chunks=config.max_chunks,
    )
    if not planned:
        raise ValueError(
            f"No layout of {shape.name} runs on --devices={config.devices} at "
            f"--global_batch={config.global_batch}: data must divide the batch, pipe the "
            f"{shape.repeated_layers} layers and tensor the {hardware.devices_per_node} "
            "devices of a node; or every layout's parameter state exceeds "
            f"{hardware.memory_bytes / 1e9:g} GB a device. Received: --devices={config.devices}"
        )
    best = planned[: config.top] if layout is None else planned
    output = {
        "hardware": hardware.name,
        "model": shape.name,
        "parameters": shape.num_params,
        "devices": config.devices,
        "global_batch": config.global_batch,
        "layouts_scored": len(planned),
        "layouts": [item.to_json() for item in best],
    }
    if config.json:
        json.dump(output, sys.stdout, indent=1)
        print()
        return output
    print(
        f"{shape.name} ({shape.num_params / 1e9:.1f}B parameters) on {config.devices} x "
        f"{hardware.name}, global batch {config.global_batch}: best {len(best)} of "
        f"{len(planned)} scored layouts\n"
    )
    rows = [
        (
            str(rank),
            f"{item.layout.mesh.data} x {item.layout.mesh.pipe} x {item.layout.mesh.tensor}"
            + (f" zero{item.layout.zero}" if item.layout.zero else ""),
            (item.layout.schedule or "-")
            + (f" v={item.layout.chunks}" if item.layout.chunks > 1 else ""),
            str(item.microbatch_size),
            str(item.layout.num_microbatches),
            f"{item.layout.step_time:.3f}",
            f"{item.tflops_per_device:.1f}",
            f"{item.layout.peak_memory / 1e9:.1f}",
            "yes" if item.fits else "no",
        )
        for rank, item in enumerate(best, 1)
    ]
    print(format_table(rows, _COLUMNS))
    return output
