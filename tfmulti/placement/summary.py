"""What went where: the placement's per-layer table and per-device predicted loads."""

from __future__ import annotations

import dataclasses

from tfmulti.platform.runtime.devices import short_device_name

_KIB = 1024.0


@dataclasses.dataclass(frozen=True)
class LayerPlacement:
    """One unit of a placed model.

    Args:
        name: the layer's (or operation's) name.
        kind: its class name.
        device: the device it runs on and keeps its variables on.
        params: trainable parameter count.
        time: measured forward+backward seconds on the sample batch, or None if not timed.
        memory: state bytes plus output bytes on the sample batch, or None if not measured.
    """

    name: str
    kind: str
    device: str
    params: int
    time: float | None
    memory: float | None


@dataclasses.dataclass(frozen=True)
class DeviceLoad:
    """The predicted load of one device: its layers' summed costs."""

    device: str
    num_layers: int
    params: int
    time: float | None
    memory: float | None


@dataclasses.dataclass(frozen=True)
class PlacementSummary:
    """A model's placement: each layer's device and cost, and the edges that cross devices.

    Args:
        layers: per unit, in topological order.
        devices: the devices placed on, in index order.
        policy: "explicit" or the balance policy.
        cross_device_edges: (producer, consumer) unit pairs on different devices; each one
            moves a tensor forward and its gradient back per step.

    Example:
        >>> print(placed.placement_summary)
    """

    layers: tuple[LayerPlacement, ...]
    devices: tuple[str, ...]
    policy: str
    cross_device_edges: tuple[tuple[str, str], ...]

    def device_of(self, name: str) -> str:
        """Returns the device of the unit called `name`."""
        for layer in self.layers:
            if layer.name == name:
                return layer.device
        raise ValueError(
            f"No layer {name!r} in this placement; layers: {[x.name for x in self.layers]}"
        )

    def device_loads(self) -> list[DeviceLoad]:
        """Per device, in index order, the summed cost of the layers placed there."""
        loads = []
        for device in self.devices:
            here = [layer for layer in self.layers if layer.device == device]
            loads.append(
                DeviceLoad(
                    device,
                    len(here),
                    sum(layer.params for layer in here),
                    _total([layer.time for layer in here]),
                    _total([layer.memory for layer in here]),
                )
            )
        return loads

    def __str__(self) -> str:
        name_width = max([len("layer"), *(len(layer.name) for layer in self.layers)])
        kind_width = max([len("kind"), *(len(layer.kind) for layer in self.layers)])
        device_width = max(len("device"), *(len(short_device_name(d)) for d in self.devices))
        lines = [
            f"Placement by {self.policy} over {len(self.devices)} devices",
            f"{'layer':<{name_width}}  {'kind':<{kind_width}}  {'device':<{device_width}}  "
            f"{'params':>10}  {'time ms':>9}  {'memory KiB':>10}",
        ]
        for layer in self.layers:
            lines.append(
                f"{layer.name:<{name_width}}  {layer.kind:<{kind_width}}  "
                f"{short_device_name(layer.device):<{device_width}}  {layer.params:>10}  "
                f"{_milliseconds(layer.time):>9}  {_kibibytes(layer.memory):>10}"
            )
        lines.append(
            f"{'device':<{device_width}}  {'layers':>6}  {'params':>10}  {'time ms':>9}  "
            f"{'memory KiB':>10}"
        )
        for load in self.device_loads():
            lines.append(
                f"{short_device_name(load.device):<{device_width}}  {load.num_layers:>6}  "
                f"{load.params:>10}  {_milliseconds(load.time):>9}  {_kibibytes(load.memory):>10}"
            )
        crossings = ", ".join(f"{a} -> {b}" for a, b in self.cross_device_edges) or "none"
        lines.append(f"cross-device edges ({len(self.cross_device_edges)}): {crossings}")
        return "\n".join(lines)


def _total(values):
    return None if any(value is None for value in values) else float(sum(values))


def _milliseconds(seconds):
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _kibibytes(size):
    return "-" if size is None else f"{size / _KIB:.1f}"
