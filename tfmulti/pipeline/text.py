"""Schedules as text: a step-by-device grid to read, and a compact form to write by hand.

Pure Python. The compact form round-trips:

    # comments and blank lines are ignored
    name: 1f1b
    microbatches: 2
    stage_devices: 0 1
    device 0: F0.0 F0.1 B0.0 B0.1
    device 1: F1.0 B1.0 F1.1 B1.1

Actions are written `<kind><stage>.<micro-batch>`, kinds F, B, I, W. An overlapped
forward-and-backward pair (DualPipeV, `Schedule.overlapped_pairs`) is one token, as the
schedule CSV writes it (`tfmulti.pipeline.schedule_files`): `(F0.3;B3.1)OVERLAP_F_B`.
`name` defaults to "custom", `microbatches` to the largest micro-batch index + 1, and
`stage_devices` to stage s on device s.
"""

from __future__ import annotations

import re

from tfmulti.pipeline.actions import Action, Schedule
from tfmulti.pipeline.dependencies import run_in_order
from tfmulti.pipeline.schedule_files import OVERLAPPED_PAIR, overlapped_pair_name

_ACTION_PATTERN = re.compile(r"^([FBIW])(\d+)\.(\d+)$")
_DEVICE_PATTERN = re.compile(r"^device\s+(\d+)\s*:(.*)$")
_IDLE = "."


def schedule_to_text(schedule: Schedule) -> str:
    """The compact text form of `schedule` (see the module docstring).

    Example:
        >>> from tfmulti.pipeline import build_schedule
        >>> print(schedule_to_text(build_schedule("gpipe", 2, 1)))
        name: gpipe
        microbatches: 1
        stage_devices: 0 1
        device 0: F0.0 B0.0
        device 1: F1.0 B1.0
    """
    lines = [
        f"name: {schedule.name}",
        f"microbatches: {schedule.num_microbatches}",
        "stage_devices: " + " ".join(str(d) for d in schedule.stage_devices),
    ]
    for device, actions in enumerate(schedule.device_actions):
        tokens = [str(action) for action in actions]
        for index in reversed(schedule.pair_starts(device)):
            tokens[index : index + 2] = [overlapped_pair_name(tokens[index], tokens[index + 1])]
        lines.append(f"device {device}: " + " ".join(tokens))
    return "\n".join(lines)


def schedule_from_text(text: str) -> Schedule:
    """Parses the compact text form (see the module docstring) into a `Schedule`.

    The result is not validated; call `validate_schedule` on it.

    Args:
        text: the schedule text.

    Raises:
        ValueError: naming the line that cannot be read.

    Example:
        >>> schedule = schedule_from_text("device 0: F0.0 (F0.1;B0.0)OVERLAP_F_B B0.1")
        >>> [str(a) for a in schedule.device_actions[0]], schedule.overlapped_pairs
        (['F0.0', 'F0.1', 'B0.0', 'B0.1'], ((1,),))
    """
    fields: dict[str, str] = {}
    device_actions: dict[int, tuple[Action, ...]] = {}
    device_pairs: dict[int, tuple[int, ...]] = {}
    for line_number, raw_line in enumerate(text.splitlines(), start=1):
        line = raw_line.split("#", 1)[0].strip()
        if not line:
            continue
        device_match = _DEVICE_PATTERN.match(line)
        if device_match:
            device = int(device_match.group(1))
            if device in device_actions:
                raise ValueError(f"Line {line_number}: device {device} is listed twice.")
            device_actions[device], device_pairs[device] = _parse_device_tokens(
                device_match.group(2).split(), line_number
            )
            continue
        key, separator, value = line.partition(":")
        key = key.strip()
        if not separator or key not in ("name", "microbatches", "stage_devices"):
            raise ValueError(
                f"Line {line_number}: expected 'name:', 'microbatches:', 'stage_devices:' or "
                f"'device <n>:'. Received: {raw_line.strip()!r}"
            )
        fields[key] = value.strip()
    if sorted(device_actions) != list(range(len(device_actions))) or not device_actions:
        raise ValueError(
            "Devices must be listed as 'device 0:', 'device 1:', ... without gaps. "
            f"Received devices: {sorted(device_actions)}"
        )
    devices = sorted(device_actions)
    actions = [a for device in devices for a in device_actions[device]]
    pairs = tuple(device_pairs[d] for d in devices)
    return Schedule(
        name=fields.get("name", "custom"),
        num_microbatches=_parse_microbatches(fields, actions),
        stage_devices=_parse_stage_devices(fields, actions),
        device_actions=tuple(device_actions[d] for d in devices),
        overlapped_pairs=pairs if any(pairs) else (),
    )


def schedule_grid(schedule: Schedule) -> str:
    """A step-by-device grid: one row per time step, one column per device.

    Every action takes one step and inputs arrive at once, so "." marks a step where a
    device waits: the bubbles of the schedule under unit costs. An overlapped pair runs
    as the executor runs it, its forward then its backward, and its two steps read
    `(F0.3;` and `B3.1)`, the pair as the text form writes it.

    Example:
        >>> from tfmulti.pipeline import build_schedule
        >>> print(schedule_grid(build_schedule("gpipe", 2, 1)))
        step  dev0  dev1
           0  F0.0  .
           1  .     F1.0
           2  .     B1.0
           3  B0.0  .
    """
    records, _ = run_in_order(schedule, duration=lambda a: 1.0, transfer=lambda a, b: 0.0)
    num_steps = int(max((r.end for r in records), default=0))
    labels = {}
    for device, actions in enumerate(schedule.device_actions):
        for index in schedule.pair_starts(device):
            forward, backward = actions[index : index + 2]
            labels[device, forward], labels[device, backward] = f"({forward};", f"{backward})"
    cells = [[_IDLE] * schedule.num_devices for _ in range(num_steps)]
    for record in records:
        label = labels.get((record.device, record.action), str(record.action))
        cells[int(record.start)][record.device] = label
    width = max([4] + [len(cell) for row in cells for cell in row])
    step_width = max(4, len(str(num_steps)))
    header = "step".rjust(step_width) + "".join(
        "  " + f"dev{d}".ljust(width) for d in range(schedule.num_devices)
    )
    rows = [
        str(step).rjust(step_width) + "".join("  " + cell.ljust(width) for cell in row)
        for step, row in enumerate(cells)
    ]
    return "\n".join(line.rstrip() for line in [header] + rows)


def _parse_device_tokens(
    tokens: list[str], line_number: int
) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """A device line's actions, and the positions where its overlapped pairs start."""
    actions, pair_starts = [], []
    for token in tokens:
        pair = OVERLAPPED_PAIR.match(token)
        if pair:
            pair_starts.append(len(actions))
        for part in pair.groups() if pair else (token,):
            actions.append(_parse_action(part, line_number))
    return tuple(actions), tuple(pair_starts)


def _parse_action(token: str, line_number: int) -> Action:
    match = _ACTION_PATTERN.match(token)
    if not match:
        raise ValueError(
            f"Line {line_number}: cannot read action {token!r}; write <kind><stage>.<micro-batch>"
            " with kind F, B, I or W, e.g. F0.3, or an overlapped pair as"
            " (F0.3;B3.1)OVERLAP_F_B."
        )
    return Action(match.group(1), int(match.group(2)), int(match.group(3)))


def _parse_microbatches(fields: dict[str, str], actions: list[Action]) -> int:
    if "microbatches" not in fields:
        return max((a.microbatch for a in actions), default=-1) + 1
    try:
        return int(fields["microbatches"])
    except ValueError:
        raise ValueError(
            f"'microbatches:' must be an integer. Received: {fields['microbatches']!r}"
        ) from None


def _parse_stage_devices(fields: dict[str, str], actions: list[Action]) -> tuple[int, ...]:
    if "stage_devices" not in fields:
        return tuple(range(max((a.stage for a in actions), default=-1) + 1))
    try:
        return tuple(int(token) for token in fields["stage_devices"].replace(",", " ").split())
    except ValueError:
        raise ValueError(
            "'stage_devices:' must list one device index per stage, e.g. '0 1 2 3 0 1 2 3'. "
            f"Received: {fields['stage_devices']!r}"
        ) from None
