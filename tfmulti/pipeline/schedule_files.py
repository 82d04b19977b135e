"""Schedules written elsewhere: PyTorch's action CSV, and plain per-device action lists.

Pure Python. PyTorch's `torch.distributed.pipelining` writes a schedule in its
`compute_only` format (`_PipelineScheduleRuntime._dump_csv`, read back by `_load_csv`) as
one CSV row per rank, each cell an action `<stage><F|B|I|W><micro-batch>`: `0F0` is the
forward of stage 0 on micro-batch 0, `1I0` and `1W0` the input- and weight-gradient halves
of stage 1's backward, `2B1` a full backward. Empty cells are idle steps. Which device
runs a stage follows from the row its actions are in, so chunks may be placed in any
order (interleaved, V, ...). An overlapped forward-and-backward pair (DualPipeV) is one
cell, as PyTorch writes it: `(0F3;3B1)OVERLAP_F_B`. The sends and receives of PyTorch's
`compute_comms` format are not needed here: the executor moves tensors between stages
itself.

    0F0,0F1,1F0,0F2,...
    ,1F0,...
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Sequence

from tfmulti.pipeline.actions import Action, Schedule
from tfmulti.pipeline.validate import ScheduleError, validate_schedule

_PYTORCH_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
_TFMULTI_ACTION = re.compile(r"^([FBIW])(\d+)\.(\d+)$")
# An overlapped pair's cell, its two actions in either notation; the text form uses it too.
OVERLAPPED_PAIR = re.compile(r"^\(([^;()]+);([^;()]+)\)OVERLAP_F_B$")
# Actions as `Action.__str__` writes them inside validator messages (F0.3).
_ACTION_IN_MESSAGE = re.compile(r"\b([FBIW])(\d+)\.(\d+)\b")


def overlapped_pair_name(forward: str, backward: str) -> str:
    """An overlapped F&B pair written as one cell, as PyTorch writes it.

    Example:
        >>> overlapped_pair_name("0F3", "3B1")
        '(0F3;3B1)OVERLAP_F_B'
    """
    return f"({forward};{backward})OVERLAP_F_B"


def pytorch_action_name(action: Action) -> str:
    """`action` as PyTorch writes it: `<stage><kind><micro-batch>`.

    Example:
        >>> pytorch_action_name(Action("I", 1, 0))
        '1I0'
    """
    return f"{action.stage}{action.kind}{action.microbatch}"


def parse_action(token: str) -> Action:
    """An action written as PyTorch does (`1I0`) or as tfmulti does (`I1.0`).

    Example:
        >>> parse_action("2B1") == parse_action("B2.1") == Action("B", 2, 1)
        True
    """
    text = token.strip()
    pytorch = _PYTORCH_ACTION.match(text)
    if pytorch:
        return Action(pytorch.group(2), int(pytorch.group(1)), int(pytorch.group(3)))
    ours = _TFMULTI_ACTION.match(text)
    if ours:
        return Action(ours.group(1), int(ours.group(2)), int(ours.group(3)))
    raise ValueError(
        "Cannot read action; write <stage><F|B|I|W><micro-batch> as PyTorch does (e.g. 1I0) "
        f"or <kind><stage>.<micro-batch> (e.g. I1.0). Received: {token!r}"
    )


def schedule_from_lists(
    device_actions: Sequence[Sequence[Action | str]],
    name: str = "custom",
    num_microbatches: int | None = None,
) -> Schedule:
    """A `Schedule` from one list of actions per device, each stage on the device that runs it.

    The result is not validated; call `validate_schedule` on it.

    Args:
        device_actions: per device, its actions in order, as `Action`s or strings (`0F0` or
            `F0.0`, or an overlapped pair `(0F3;3B1)OVERLAP_F_B`); empty strings and None
            are idle steps and are skipped.
        name: the schedule's name.
        num_microbatches: micro-batches per step; defaults to the largest index + 1.

    Raises:
        ScheduleError: an action cannot be read, a stage's actions are on two devices, or
            a stage below the largest has no actions.

    Example:
        >>> schedule = schedule_from_lists([["0F0", "1F0", "1B0", "0B0"]])
        >>> schedule.stage_devices, schedule.num_microbatches
        ((0, 0), 1)
    """
    if not device_actions:
        raise ScheduleError("A schedule needs at least one device's actions. Received: none")
    rows, pairs = [], []
    stage_device: dict[int, tuple[int, Action]] = {}
    for device, row in enumerate(device_actions):
        actions, pair_starts = [], []
        for token in row:
            if token is None or (isinstance(token, str) and not token.strip()):
                continue
            pair = OVERLAPPED_PAIR.match(token.strip()) if isinstance(token, str) else None
            if pair:
                pair_starts.append(len(actions))
            for part in pair.groups() if pair else (token,):
                try:
                    action = part if isinstance(part, Action) else parse_action(part)
                except ValueError as error:
                    raise ScheduleError(f"Device {device}: {error}") from None
                first = stage_device.setdefault(action.stage, (device, action))
                if first[0] != device:
                    raise ScheduleError(
                        f"Action {pytorch_action_name(action)} is on device {device}, but "
                        f"stage {action.stage} already runs on device {first[0]} "
                        f"({pytorch_action_name(first[1])}); each stage runs on one device."
                    )
                actions.append(action)
        rows.append(tuple(actions))
        pairs.append(tuple(pair_starts))
    if not stage_device:
        raise ScheduleError("The schedule has no actions.")
    missing = [s for s in range(max(stage_device) + 1) if s not in stage_device]
    if missing:
        raise ScheduleError(
            f"Stage {missing[0]} has no actions, but stages up to {max(stage_device)} do; "
            "stages are numbered 0, 1, ... without gaps."
        )
    microbatches = max(a.microbatch for row in rows for a in row) + 1
    return Schedule(
        name=name,
        num_microbatches=microbatches if num_microbatches is None else num_microbatches,
        stage_devices=tuple(stage_device[s][0] for s in range(len(stage_device))),
        device_actions=tuple(rows),
        overlapped_pairs=tuple(pairs) if any(pairs) else (),
    )


def schedule_from_csv(text: str, name: str = "custom") -> Schedule:
    """Reads PyTorch's `compute_only` CSV (see the module docstring); not validated.

    Example:
        >>> schedule = schedule_from_csv("0F0,0B0\\n,1F0,1B0\\n")
        >>> schedule.stage_devices, [str(a) for a in schedule.device_actions[1]]
        ((0, 1), ['F1.0', 'B1.0'])
    """
    rows = [row for row in csv.reader(io.StringIO(text)) if any(cell.strip() for cell in row)]
    return schedule_from_lists(rows, name=name)


def schedule_to_csv(schedule: Schedule) -> str:
    """`schedule` as PyTorch's `compute_only` CSV: one row per device, no idle cells.

    Example:
        >>> from tfmulti.pipeline import build_schedule
        >>> print(schedule_to_csv(build_schedule("1f1b", 2, 2)), end="")
        0F0,0F1,0B0,0B1
        1F0,1B0,1F1,1B1
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for device, actions in enumerate(schedule.device_actions):
        cells = [pytorch_action_name(action) for action in actions]
        for index in reversed(schedule.pair_starts(device)):
            cells[index : index + 2] = [overlapped_pair_name(cells[index], cells[index + 1])]
        writer.writerow(cells)
    return out.getvalue()


def write_schedule_csv(schedule: Schedule, path: str) -> None:
    """Writes `schedule` to `path` as PyTorch's `compute_only` CSV."""
    with open(path, "w", newline="") as csv_file:
        csv_file.write(schedule_to_csv(schedule))


def read_schedule_csv(path: str, name: str | None = None) -> Schedule:
    """The validated schedule in PyTorch's `compute_only` CSV at `path`.

    Args:
        path: the CSV file.
        name: the schedule's name; defaults to the file name without its extension.

    Raises:
        FileNotFoundError: there is no such file.
        ScheduleError: in one line naming the file and the first bad action, in PyTorch's
            notation.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No schedule file at {path!r}; pass an existing .csv file.")
    with open(path, newline="") as csv_file:
        text = csv_file.read()
    if name is None:
        name = os.path.splitext(os.path.basename(path))[0]
    try:
        schedule = schedule_from_csv(text, name=name)
        validate_schedule(schedule)
    except ScheduleError as error:
        message = _ACTION_IN_MESSAGE.sub(r"\2\1\3", str(error)).replace("\n", " ")
        raise ScheduleError(f"Schedule file {path}: {message}") from None
    return schedule
