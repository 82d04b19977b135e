"""Which device each unit of a model goes to: from an explicit map, a file, or the balancer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence

from tfmulti.pipeline.balance import Block, balance
from tfmulti.pipeline.stages.stage_devices import resolve_devices
from tfmulti.placement.units import GraphUnit

BALANCE_POLICIES = ("params", "time", "memory")
# With this many micro-batches per device the balancer's simulated step time is set by the
# slowest device, so "time" minimises the largest per-device load.
_MICROBATCHES_PER_DEVICE = 4
_NAMES_SHOWN = 8


def assign_from_map(
    units: Sequence[GraphUnit], device_map: Mapping[str, int | str], devices: Sequence[str]
) -> list[int]:
    """Returns each unit's device index under an explicit `device_map`.

    A key is a unit name or a regular expression matched against whole names; an exact
    name wins over patterns, and patterns are tried in the map's order. A value is an
    index into `devices` or a device name. A unit without weights that no key matches
    runs with its first producer (or, when it reads only model inputs, its first consumer)
    so that it adds no transfer; a unit with weights that no key matches is an error.

    Args:
        units: `graph_units(model)`.
        device_map: {"layer name or regex": device index or name}.
        devices: the resolved devices indices refer to.

    Raises:
        ValueError: a key matches no unit or is not a valid regex, a value is not a device
            of `devices`, or a unit with weights is left without a device.

    Example:
        >>> assign_from_map(units, {"embedding": 0, "block_.*": 1, "head": "/cpu:1"}, devices)
    """
    indices = {key: _device_index(key, value, devices) for key, value in device_map.items()}
    patterns = {key: _compile(key) for key in device_map}
    names = [unit.name for unit in units]
    for key, pattern in patterns.items():
        if key not in names and not any(pattern.fullmatch(name) for name in names):
            raise ValueError(
                f"Device map key {key!r} matches no layer. Use a layer name or a regex over "
                f"the model's layers: {_shown(names)}"
            )
    chosen: dict[str, int] = {}
    for unit in units:
        if unit.name in indices:
            chosen[unit.name] = indices[unit.name]
            continue
        for key, pattern in patterns.items():
            if pattern.fullmatch(unit.name):
                chosen[unit.name] = indices[key]
                break
    unplaced = [unit.name for unit in units if unit.name not in chosen and unit.has_weights]
    if unplaced:
        raise ValueError(
            f"Layers with weights need a device, and the map places none of {_shown(unplaced)}. "
            'Add them to the map, or a catch-all such as {".*": 0} as its last key.'
        )
    _follow_neighbours(units, chosen)
    return [chosen[unit.name] for unit in units]


def assign_balanced(blocks: Sequence[Block], num_devices: int, policy: str) -> list[int]:
    """Returns each unit's device index, splitting `blocks` into contiguous runs per device.

    "params" minimises the largest per-device parameter count, "time" the largest
    per-device forward+backward time, "memory" the largest per-device state bytes plus
    activation bytes; with fewer units than devices, some devices stay empty.

    Example:
        >>> assign_balanced([Block(params=10), Block(params=10), Block(params=20)], 2, "params")
        [0, 0, 1]
    """
    if policy not in BALANCE_POLICIES:
        raise ValueError(
            f"balance must be one of {list(BALANCE_POLICIES)}. Received: balance={policy!r}"
        )
    num_stages = min(num_devices, len(blocks))
    if policy == "memory":
        # The balancer's "params" policy is an exact min-max over `Block.params`; handing it
        # each unit's memory makes it minimise the largest per-device memory instead.
        blocks = [Block(params=int(memory_bytes(block)), name=block.name) for block in blocks]
    partition = balance(
        blocks,
        num_stages,
        _MICROBATCHES_PER_DEVICE * num_stages,
        "time" if policy == "time" else "params",
    )
    return [
        stage
        for stage, (start, end) in enumerate(partition.stage_ranges)
        for _ in range(start, end)
    ]


def memory_bytes(block: Block) -> float:
    """A unit's memory in the "memory" policy: its state bytes plus its output bytes."""
    return block.param_bytes + block.activation_bytes


def resolve_device_list(devices: Sequence[str | int] | None, available: Sequence[str]) -> list[str]:
    """Returns full device names for `devices` (names, or indices into `available`).

    Example:
        >>> resolve_device_list([0, "/cpu:3"], logical_device_names())
    """
    if devices is None:
        return resolve_devices(available)
    if not devices:
        raise ValueError("devices must name at least one device. Received: devices=[]")
    names = [_indexed(device, available, "devices") for device in devices]
    return resolve_devices(names)


def read_placement_file(path: str) -> dict[str, int | str]:
    """Reads a JSON placement file: an object {"layer name or regex": device index or name}.

    Example file:
        {"embedding": 0, "transformer_block_[01]": 1, ".*": 2}
    """
    if not os.path.isfile(path):
        raise ValueError(
            "placement must be 'auto', 'params', 'time', 'memory' or a JSON file. "
            f"Received: {path!r}, which is not a file"
        )
    with open(path, encoding="utf-8") as file:
        try:
            device_map = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"Placement file {path!r} is not valid JSON: {error}") from None
    if not isinstance(device_map, dict) or not all(
        isinstance(v, (int, str)) and not isinstance(v, bool) for v in device_map.values()
    ):
        raise ValueError(
            f'Placement file {path!r} must hold one object like {{"layer or regex": 0}}. '
            f"Received: {device_map!r}"
        )
    return device_map


def _device_index(key, value, devices) -> int:
    name = _indexed(value, devices, f"device map entry {key!r}")
    full_name = resolve_devices([name])[0]
    if full_name not in devices:
        raise ValueError(
            f"Device map entry {key!r} names device {value!r}, which is not among the placement "
            f"devices {list(devices)}; use one of them or its index."
        )
    return list(devices).index(full_name)


def _indexed(value, devices, what) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} must be a device index or name. Received: {value!r}")
    if isinstance(value, int):
        if not 0 <= value < len(devices):
            raise ValueError(
                f"{what} has device index {value}, out of range for {len(devices)} devices; "
                f"use 0..{len(devices) - 1} or make more logical devices."
            )
        return devices[value]
    return value


def _compile(key):
    try:
        return re.compile(key)
    except re.error as error:
        raise ValueError(
            f"Device map key {key!r} is neither a layer name nor a valid regex ({error})."
        ) from None


def _follow_neighbours(units, chosen):
    """Gives each unplaced weightless unit its first producer's device, else a consumer's."""
    for unit in units:
        if unit.name not in chosen:
            placed = [chosen[name] for name in unit.producers if name in chosen]
            if placed:
                chosen[unit.name] = placed[0]
    for unit in reversed(units):
        for producer in unit.producers:
            if producer not in chosen and unit.name in chosen:
                chosen[producer] = chosen[unit.name]
    for unit in units:
        chosen.setdefault(unit.name, 0)


def _shown(names):
    listed = ", ".join(repr(name) for name in names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return f"[{listed}{f', ... {more} more' if more > 0 else ''}]"
