"""Logical devices: split one physical device into N before TensorFlow initialises.

This is how every multi-device path runs on a machine with one CPU or one GPU;
on a machine with enough real accelerators nothing is split.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.platform.runtime.cpu_allocator import prefer_bfc_cpu_allocator


class DeviceConfigurationError(ValueError):
    """Raised when logical devices cannot be set up as asked."""


def accelerator_type() -> str:
    """Returns "GPU" when TensorFlow sees a GPU, else "CPU"."""
    return "GPU" if tf.config.list_physical_devices("GPU") else "CPU"


def configure_logical_devices(
    num_devices: int,
    device_type: str | None = None,
    memory_limit_mb: int = 1024,
) -> None:
    """Makes `num_devices` logical devices of `device_type`, without starting TensorFlow.

    TensorFlow stays uninitialised, so a multi-worker strategy can still be
    built afterwards; `logical_device_names()` lists the devices (and starts it).
    The devices get TensorFlow's BFC CPU allocator unless the user chose one
    (`tfmulti.platform.runtime.cpu_allocator`).

    Args:
        num_devices: how many logical devices are wanted (>= 1).
        device_type: "CPU" or "GPU"; defaults to GPU when one is present.
        memory_limit_mb: memory of each logical GPU when one GPU is split
            (TensorFlow requires a limit for virtual GPUs; ignored for CPU).

    Raises:
        DeviceConfigurationError: TensorFlow was already initialised with a
            different device layout, or there is no device of that type.

    Example:
        >>> configure_logical_devices(4)  # before any other TensorFlow work
    """
    if num_devices < 1:
        raise DeviceConfigurationError(
            f"num_devices must be >= 1. Received: num_devices={num_devices}"
        )
    prefer_bfc_cpu_allocator()
    device_type = (device_type or accelerator_type()).upper()
    physical = tf.config.list_physical_devices(device_type)
    if not physical:
        raise DeviceConfigurationError(
            f"No physical {device_type} device is visible. Received: device_type={device_type!r}"
        )
    if device_type == "GPU" and len(physical) >= num_devices:
        return

    memory_limit = memory_limit_mb if device_type == "GPU" else None
    config = [
        tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit) for _ in range(num_devices)
    ]
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError as error:
        existing = tf.config.list_logical_devices(device_type)
        if len(existing) >= num_devices:
            return
        raise DeviceConfigurationError(
            f"TensorFlow is already initialised with {len(existing)} logical {device_type} "
            f"device(s), so {num_devices} cannot be made now. Configure logical devices "
            "before creating any tensor, model or strategy."
        ) from error


def logical_device_names(device_type: str | None = None) -> list[str]:
    """Returns the names of the logical devices of `device_type` (default: accelerator)."""
    device_type = (device_type or accelerator_type()).upper()
    return [device.name for device in tf.config.list_logical_devices(device_type)]


def first_logical_devices(count: int, purpose: str) -> list[str]:
    """The first `count` logical accelerator (or CPU) devices, or a ValueError naming the fix.

    Args:
        count: how many devices are needed.
        purpose: what needs them, for the message, e.g. "--num_stages=4".
    """
    available = logical_device_names()
    if count > len(available):
        raise ValueError(
            f"{purpose} needs {count} devices but only {len(available)} exist "
            f"({available}); ask for fewer or make more logical devices (--virtual_devices)."
        )
    return available[:count]


def on_another_worker(device: str) -> bool:
    """Whether `device` is another worker's, lent to this process (the chief of a connected
    cluster, `tfmulti.platform.runtime.connected_cluster`), rather than one of this process's own.

    TensorFlow lists this process's own devices first, then the other workers'.

    Example:
        >>> on_another_worker("/job:worker/replica:0/task:1/device:CPU:0")  # on the chief
        True
        >>> on_another_worker("/device:CPU:1")
        False
    """
    spec = tf.DeviceSpec.from_string(device)
    if spec.job is None:
        return False
    own = tf.DeviceSpec.from_string(tf.config.list_logical_devices()[0].name)
    return (spec.job, spec.task or 0) != (own.job, own.task or 0)


def device_key(device: str) -> tuple[str, int]:
    """(device type, index) of any spelling of a device name, e.g. ("CPU", 1) for
    "/job:worker/task:0/device:cpu:1"; job, replica and task are ignored."""
    spec = tf.DeviceSpec.from_string(device)
    return (spec.device_type or "").upper(), spec.device_index or 0


def canonical_device_name(device: str) -> str:
    """The one spelling TensorFlow gives `device`, job and task included when named."""
    return tf.DeviceSpec.from_string(device).to_string()


def full_device_name(device: str) -> str:
    """`device` with job, replica and task, a process's own device as `/job:localhost`."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job is None:
        spec = spec.replace(job="localhost", replica=0, task=0)
    return spec.replace(device_type=(spec.device_type or "").upper()).to_string()


def worker_device_name(device: str) -> str:
    """`/job:worker/replica:0/task:1/device:CPU:0` as `/job:worker/task:1/device:CPU:0`; a
    device of this process alone (no job, or job `localhost`) as `/device:CPU:0`."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job in (None, "localhost"):
        return short_device_name(device)
    return f"/job:{spec.job}/task:{spec.task or 0}{short_device_name(device)}"


def short_device_name(device: str) -> str:
    """`/job:worker/replica:0/task:0/device:CPU:1` as `/device:CPU:1`."""
    device_type, index = device_key(device)
    return f"/device:{device_type}:{index}"
