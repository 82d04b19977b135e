"""How long ago this process started, as the kernel counts it (Linux), for time-to-first-step."""

from __future__ import annotations

import os


def process_age_seconds() -> float | None:
    """Seconds since this process started, from `/proc` (start time in clock ticks after
    boot against the uptime); None where `/proc` does not say (not Linux).

    Example:
        >>> 0 < process_age_seconds() < 3600
        True
    """
    try:
        with open("/proc/self/stat") as stat_file:
            # Fields after the command name (which may hold spaces) start at field 3.
            fields = stat_file.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime_file:
            uptime = float(uptime_file.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started, 0.0)
