"""Standard pipeline schedules, built as data.

Pure Python. Each function returns a `Schedule`: per device, the ordered actions. `p` is the
number of devices (pipeline depth), `m` the number of micro-batches, `v` the number of model
chunks per device (the model then has p·v stages).
"""

from __future__ import annotations

import collections

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Schedule,
)

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv")
# Schedules that place several chunks (stages) on each device.
CHUNKED_SCHEDULES = ("interleaved_1f1b", "zbv")


def build_schedule(
    name: str, num_devices: int, num_microbatches: int, chunks: int | None = None
) -> Schedule:
    """Builds the schedule called `name`.

    Args:
        name: one of `SCHEDULE_NAMES`.
        num_devices: pipeline depth p (devices).
        num_microbatches: micro-batches per step m.
        chunks: model chunks per device v: for "interleaved_1f1b" any v >= 2 (default 2),
            for "zbv" only 2 (or None). Other schedules accept only None or 1.

    Returns:
        The `Schedule`.

    Example:
        >>> build_schedule("1f1b", 2, 3).device_actions[1]
        (F1.0, B1.0, F1.1, B1.1, F1.2, B1.2)
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown schedule. Expected one of {SCHEDULE_NAMES}. Received: {name!r}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_devices, num_microbatches, 2 if chunks is None else chunks)
    if name == "zbv":
        if chunks not in (None, 2):
            raise ValueError(
                "zbv places exactly two chunks on each device (a V), so chunks must be 2. "
                f"Received: chunks={chunks}"
            )
        return zbv(num_devices, num_microbatches)
    if chunks not in (None, 1):
        raise ValueError(
            f"Schedule {name!r} places one stage per device, so chunks must be 1; "
            f"use 'interleaved_1f1b' or 'zbv' for chunks > 1. Received: chunks={chunks}"
        )
    builders = {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "zb_h1": zb_h1,
        "zb_h2": zb_h2,
    }
    return builders[name](num_devices, num_microbatches)


def gpipe(num_devices: int, num_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every forward, then every backward.

    Bubble (p-1)/(m+p-1); every stage holds all m micro-batches' activations.
    """
    _check_sizes(num_devices, num_microbatches)
    orders = [
        [Action(FORWARD, device, mb) for mb in range(num_microbatches)]
        + [Action(BACKWARD, device, mb) for mb in range(num_microbatches)]
        for device in range(num_devices)
    ]
    return _flat_schedule("gpipe", num_microbatches, orders)


def one_f_one_b(num_devices: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): a few warm-up forwards, then one forward, one backward.

    Same bubble as GPipe, (p-1)/(m+p-1), but stage s holds at most p-s micro-batches.
    """
    _check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(num_devices - 1 - device, num_microbatches)
        order = [Action(FORWARD, device, mb) for mb in range(warmup)]
        for mb in range(num_microbatches):
            if mb + warmup < num_microbatches:
                order.append(Action(FORWARD, device, mb + warmup))
            order.append(Action(BACKWARD, device, mb))
        orders.append(order)
    return _flat_schedule("1f1b", num_microbatches, orders)


def interleaved_1f1b(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): v chunks per device, stage i on device i mod p.

    Micro-batches go through the chunks in groups of p, so m must be a multiple of p. The
    bubble shrinks to about (p-1)/(v·m+p-1), for v times more sends between devices.
    """
    _check_sizes(num_devices, num_microbatches)
    if chunks < 2:
        raise ValueError(
            "interleaved_1f1b needs chunks >= 2 (use '1f1b' for one stage per device). "
            f"Received: chunks={chunks}"
        )
    if num_microbatches % num_devices:
        lower = num_microbatches - num_microbatches % num_devices
        suggestion = f"{lower} or {lower + num_devices}" if lower else f"{num_devices}"
        raise ValueError(
            "interleaved_1f1b sends micro-batches through the chunks in groups of "
            "num_devices, so num_microbatches must be a multiple of num_devices "
            f"(try {suggestion}). Received: num_microbatches={num_microbatches}, "
            f"num_devices={num_devices}"
        )
    p, v = num_devices, chunks
    group = p * v
    total = num_microbatches * v

    def chunk_action(kind: str, device: int, index: int) -> Action:
        chunk = (index % group) // p
        if kind == BACKWARD:
            chunk = v - 1 - chunk
        microbatch = (index // group) * p + index % p
        return Action(kind, chunk * p + device, microbatch)

    orders = []
    for device in range(p):
        # Deep enough that the first backward of the last chunk finds its inputs ready.
        warmup = min(2 * (p - 1 - device) + (v - 1) * p, total)
        order = [chunk_action(FORWARD, device, k) for k in range(warmup)]
        for k in range(total):
            if k + warmup < total:
                order.append(chunk_action(FORWARD, device, k + warmup))
            order.append(chunk_action(BACKWARD, device, k))
        orders.append(order)
    stage_devices = tuple(stage % p for stage in range(p * v))
    return Schedule("interleaved_1f1b", num_microbatches, stage_devices, _freeze(orders))


def zb_h1(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, 1F1B memory): 1F1B with the backward split into I and W.

    Stage s runs its W passes s micro-batches late, filling the bubbles the faster I chain
    leaves, while keeping at most p activations live on any device. Bubble time
    (p-1)(F+I-W) against 1F1B's (p-1)(F+I+W).
    """
    _check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(num_devices - 1 - device, num_microbatches)
        orders.append(_split_backward_order(device, num_microbatches, warmup, w_delay=device))
    return _flat_schedule("zb_h1", num_microbatches, orders)


def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (zero bubble, about 2p-1 activations): more warm-up forwards, later W passes.

    The warm-up forwards fill the wait before the first I, and the tail W passes fill the
    cool-down, so each device works without idling from its first action to its last
    when F = I = W: the bubble is only the start stagger, which overlapping consecutive
    steps hides.
    """
    _check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(2 * (num_devices - 1 - device) + 1, num_microbatches)
        orders.append(
            _split_backward_order(
                device, num_microbatches, warmup, w_delay=2 * device, forward_last=True
            )
        )
    return _flat_schedule("zb_h2", num_microbatches, orders)


def zbv(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-V (zero bubble, V placement): two chunks per device, backward split into I and W.

    Device d holds stages d and 2p-1-d, so a micro-batch goes down the devices and back up,
    and the loss is computed on device 0, where it started. Each device's order is
    PyTorch's `ScheduleZBVZeroBubble`: warm-up forwards of its first chunk, then of both,
    then F/I/W triples of the second chunk, a steady state alternating F, I, W of each
    chunk, and a cool-down of I passes with the W passes left to fill the drain. With
    m >= 2p-1 and F = I = W, each device idles only before its first and after its last
    action, and at most 2p chunk activations (p full-device micro-batches, as 1F1B) are
    live on any device.

    Example:
        >>> zbv(2, 3).stage_devices
        (0, 1, 1, 0)
    """
    _check_sizes(num_devices, num_microbatches)
    p = num_devices
    # The order is built for at least 2p-1 micro-batches, then actions on micro-batches
    # the step does not have are left out, as PyTorch does.
    planned = max(2 * p - 1, num_microbatches)
    orders = []
    for device in range(p):
        order = _zbv_device_order(device, p, planned)
        orders.append([a for a in order if a.microbatch < num_microbatches])
    stage_devices = tuple(range(p)) + tuple(reversed(range(p)))
    return Schedule("zbv", num_microbatches, stage_devices, _freeze(orders))


def _zbv_device_order(device: int, num_devices: int, num_microbatches: int) -> list[Action]:
    """ZB-V's order on `device` for `num_microbatches` (>= 2p-1) micro-batches."""
    p = num_devices
    first, second = device, 2 * p - 1 - device
    counts = collections.Counter()
    order = []

    def add(kind: str, stage: int) -> None:
        order.append(Action(kind, stage, counts[kind, stage]))
        counts[kind, stage] += 1

    for _ in range(2 * (p - device) - 1):
        add(FORWARD, first)
    for _ in range(device):
        add(FORWARD, second)
        add(FORWARD, first)
    for _ in range(p - device):
        add(FORWARD, second)
        add(INPUT_GRAD, second)
        add(WEIGHT_GRAD, second)
    while counts[FORWARD, second] < counts[FORWARD, first] or (
        counts[FORWARD, first] < num_microbatches
    ):
        if counts[FORWARD, first] < num_microbatches:
            add(FORWARD, first)
        add(INPUT_GRAD, first)
        add(WEIGHT_GRAD, first)
        add(FORWARD, second)
        add(INPUT_GRAD, second)
        add(WEIGHT_GRAD, second)
    for _ in range(device):
        add(INPUT_GRAD, first)
        add(INPUT_GRAD, second)
    for _ in range(p - device):
        add(INPUT_GRAD, first)
        add(WEIGHT_GRAD, first)
    for stage in (second, first):
        while counts[WEIGHT_GRAD, stage] < counts[INPUT_GRAD, stage]:
            add(WEIGHT_GRAD, stage)
    return order


def _split_backward_order(
    stage: int, num_microbatches: int, warmup: int, w_delay: int, forward_last: bool = False
) -> list[Action]:
    """Warm-up forwards, then F/I pairs with each W run `w_delay` I passes after its I."""
    order = [Action(FORWARD, stage, mb) for mb in range(warmup)]
    pending = collections.deque()
    for mb in range(num_microbatches):
        forward = [Action(FORWARD, stage, mb + warmup)] if mb + warmup < num_microbatches else []
        if not forward_last:
            order.extend(forward)
        order.append(Action(INPUT_GRAD, stage, mb))
        pending.append(Action(WEIGHT_GRAD, stage, mb))
        if len(pending) > w_delay:
            order.append(pending.popleft())
        if forward_last:
            order.extend(forward)
    order.extend(pending)
    return order


def _check_sizes(num_devices: int, num_microbatches: int) -> None:
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1. Received: num_devices={num_devices}")
    if num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be >= 1. Received: num_microbatches={num_microbatches}"
        )


def _flat_schedule(name: str, num_microbatches: int, orders: list[list[Action]]) -> Schedule:
    return Schedule(name, num_microbatches, tuple(range(len(orders))), _freeze(orders))


def _freeze(orders: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(order) for order in orders)
