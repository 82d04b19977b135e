"""Choosing and checking the devices a tensor-parallel layer splits its weights over."""

from __future__ import annotations

from collections.abc import Sequence

from tfmulti.platform.runtime.devices import device_key, first_logical_devices, logical_device_names


def resolve_shard_devices(
    num_shards: int | None = None, devices: Sequence[str] | None = None
) -> list[str]:
    """Returns the devices a layer split `num_shards` ways uses, checked to exist.

    Args:
        num_shards: how many ways to split (K); None means `len(devices)`.
        devices: device names; None means the first `num_shards` logical devices.

    Example:
        >>> [name.split("/")[-1] for name in resolve_shard_devices(2)]
        ['device:CPU:0', 'device:CPU:1']
    """
    available = logical_device_names()
    if devices is None:
        if num_shards is None or num_shards < 1:
            raise ValueError(f"Give devices, or num_shards >= 1. Received: num_shards={num_shards}")
        return first_logical_devices(num_shards, f"Splitting {num_shards} ways")
    if isinstance(devices, str):
        devices = [name for name in devices.split(",") if name]
    devices = list(devices)
    if not devices or (num_shards is not None and len(devices) != num_shards):
        raise ValueError(
            f"Give one device per shard ({num_shards if num_shards else '>= 1'}). "
            f"Received: devices={devices}, num_shards={num_shards}"
        )
    known = {device_key(name) for name in available}
    unknown = [name for name in devices if device_key(name) not in known]
    if unknown:
        raise ValueError(
            f"Unknown devices {unknown}; this host has {available}. Received: devices={devices}"
        )
    if len({device_key(name) for name in devices}) != len(devices):
        raise ValueError(f"Each shard needs its own device. Received: devices={devices}")
    return devices


def check_divisible(name: str, value: int, num_shards: int) -> None:
    """Raises ValueError unless `value` (the size called `name`) splits into `num_shards`."""
    if value % num_shards:
        raise ValueError(
            f"{name} must be divisible by the number of devices ({num_shards}) to split it "
            f"evenly; use a multiple of {num_shards} or fewer devices. "
            f"Received: {name}={value}, devices={num_shards}"
        )
