"""Allocator peaks of this process's devices, where a peak belongs to one device.

TensorFlow reports a CPU's peak only under its BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC`,
see `cpu_allocator`), and logical devices of one type share the process's allocator, so a
device's peak is given only when it is the only one of its type here.
"""

from __future__ import annotations

import tensorflow as tf

from tfmulti.platform.runtime.devices import full_device_name


def local_peaks(task: tuple[str, int] | None = None) -> dict[str, int | None]:
    """Each local logical device's allocator peak in bytes, None where devices share one.

    Args:
        task: this process's (job, task) once it drives other workers, whose devices are
            then listed too; None when every listed device is this process's.
    """
    peaks: dict[str, int | None] = {}
    for device_type in ("CPU", "GPU"):
        devices = [
            device
            for device in tf.config.list_logical_devices(device_type)
            if task is None or _task_of(device.name) == task
        ]
        for device in devices:
            name = full_device_name(device.name)
            peaks[name] = _peak(device.name) if len(devices) == 1 else None
    return peaks


def _peak(device: str) -> int | None:
    try:
        peak = tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, tf.errors.OpError):
        return None
    return int(peak) or None


def _task_of(device: str) -> tuple[str, int]:
    spec = tf.DeviceSpec.from_string(device)
    return spec.job, spec.task or 0
