"""The chunked zero-bubble schedules: ZB-V and DualPipeV (two chunks per device in a V)
and interleaved zero-bubble (v chunks per device in turn), built as data. Pure Python.

Orders follow PyTorch's `ScheduleZBVZeroBubble`, `ScheduleDualPipeV` and
`ScheduleInterleavedZeroBubble`; `p` is the number of devices, `m` of micro-batches.
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
from tfmulti.pipeline.schedule_orders import check_sizes, frozen


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
    check_sizes(num_devices, num_microbatches)
    p = num_devices
    # The order is built for at least 2p-1 micro-batches, then actions on micro-batches
    # the step does not have are left out, as PyTorch does.
    planned = max(2 * p - 1, num_microbatches)
    orders = []
    for device in range(p):
        order = _zbv_device_order(device, p, planned)
        orders.append([a for a in order if a.microbatch < num_microbatches])
    stage_devices = tuple(range(p)) + tuple(reversed(range(p)))
    return Schedule("zbv", num_microbatches, stage_devices, frozen(orders))


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


def interleaved_zb(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved zero bubble (ZB1P on looped chunks): interleaved 1F1B with split backward.

    Stage i is on device i mod p, as in interleaved 1F1B. Micro-batches go through the
    chunks in rounds of m / max(1, m // p) (so m need not be a multiple of p, but must
    divide into the rounds); device d runs one fewer warm-up forward per device it is from
    the last, then F/I pairs, each W d I passes after its I, and the W passes it held back
    at the end. The order is PyTorch's `ScheduleInterleavedZeroBubble`. With m >= p each
    device idles (p-1)(F+B-2W) in one chunk's costs: ZB-H1's bubble divided by v, and a
    third of interleaved 1F1B's when F = I = W.

    Example:
        >>> [str(a) for a in interleaved_zb(2, 2).device_actions[1][:4]]
        ['F1.0', 'F1.1', 'F3.0', 'I3.0']
    """
    check_sizes(num_devices, num_microbatches)
    if chunks < 2:
        raise ValueError(
            "interleaved_zb needs chunks >= 2 (use 'zb_h1' for one stage per device). "
            f"Received: chunks={chunks}"
        )
    p, m, v = num_devices, num_microbatches, chunks
    rounds = max(1, m // p)
    if m % rounds:
        fits = [n for n in range(1, 2 * m) if n % max(1, n // p) == 0]
        lower = max(n for n in fits if n < m)
        upper = min(n for n in fits if n > m)
        raise ValueError(
            f"interleaved_zb sends micro-batches through the chunks in m // num_devices = "
            f"{rounds} equal rounds, so num_microbatches must divide into them (try {lower} "
            f"or {upper}). Received: num_microbatches={m}, num_devices={p}"
        )
    per_round = m // rounds
    orders = [_interleaved_zb_device_order(device, p, m, v, per_round) for device in range(p)]
    stage_devices = tuple(stage % p for stage in range(p * v))
    return Schedule("interleaved_zb", m, stage_devices, frozen(orders))


def _interleaved_zb_device_order(
    device: int, num_devices: int, num_microbatches: int, chunks: int, per_round: int
) -> list[Action]:
    total = num_microbatches * chunks
    warmup = min((chunks - 1) * per_round + num_devices - 1 - device, total)
    counts = collections.Counter()
    order = []

    def add(kind: str, chunk: int) -> None:
        stage = chunk * num_devices + device
        order.append(Action(kind, stage, counts[kind, stage]))
        counts[kind, stage] += 1

    def forward_chunk(index: int) -> int:
        return (index // per_round) % chunks

    def backward_chunk(index: int) -> int:
        return chunks - 1 - (index // per_round) % chunks

    for index in range(warmup):
        add(FORWARD, forward_chunk(index))
    for index in range(total):
        if index + warmup < total:
            add(FORWARD, forward_chunk(index + warmup))
        add(INPUT_GRAD, backward_chunk(index))
        if index >= device:
            add(WEIGHT_GRAD, backward_chunk(index - device))
    for index in range(max(total - device, 0), total):
        add(WEIGHT_GRAD, backward_chunk(index))
    return order


def dualpipev(num_devices: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek): two chunks per device in a V, with overlapped F&B pairs.

    Device d holds stages d and 2p-1-d, as in ZB-V. After a warm-up of forwards, each
    device alternates overlapped pairs: the forward of one chunk with the full backward
    of the other (`Schedule.overlapped_pairs`), so on hardware that overlaps them one
    pair's communication hides behind the other's compute. The cool-down splits part of
    the backwards into I and W to fill the drain. The order is PyTorch's
    `ScheduleDualPipeV`, after deepseek-ai/DualPipe. Needs m >= 2p. With F = I >= W per
    chunk, the busiest device idles (p-1)(F&B + B - 3W), F&B a pair's time: DualPipe's
    bubble on 2p devices.

    tfmulti's executor starts a pair's two halves together (neither waits for the other),
    so F&B is what the device's overlap of them costs: F + B where they share one
    saturated device (the bubble then twice ZB-V's at F = I = W), less where they overlap;
    the simulator takes a measured pair time from `CostModel.pair_times`.

    Example:
        >>> schedule = dualpipev(2, 4)
        >>> schedule.stage_devices, schedule.overlapped_pairs[0][:2]
        ((0, 1, 1, 0), (7, 9))
    """
    check_sizes(num_devices, num_microbatches)
    if num_microbatches < 2 * num_devices:
        raise ValueError(
            "dualpipev needs at least as many micro-batches as stages (2 x num_devices), "
            f"so num_microbatches >= {2 * num_devices}. Received: "
            f"num_microbatches={num_microbatches}, num_devices={num_devices}"
        )
    orders, pairs = [], []
    for device in range(num_devices):
        order, starts = _dualpipev_device_order(device, num_devices, num_microbatches)
        orders.append(order)
        pairs.append(tuple(starts))
    stage_devices = tuple(range(num_devices)) + tuple(reversed(range(num_devices)))
    return Schedule(
        "dualpipev", num_microbatches, stage_devices, frozen(orders), overlapped_pairs=tuple(pairs)
    )


def _dualpipev_device_order(
    device: int, num_devices: int, num_microbatches: int
) -> tuple[list[Action], list[int]]:
    """DualPipeV's order on `device`, and the positions where its overlapped pairs start."""
    p = num_devices
    first, second = device, 2 * p - 1 - device
    forwards = collections.Counter()
    backwards = collections.Counter()
    held_weight_grads = collections.deque()
    order, pair_starts = [], []

    def forward(stage: int) -> None:
        order.append(Action(FORWARD, stage, forwards[stage]))
        forwards[stage] += 1

    def backward(stage: int, split: bool = False) -> None:
        action = Action(INPUT_GRAD if split else BACKWARD, stage, backwards[stage])
        order.append(action)
        backwards[stage] += 1
        if split:
            held_weight_grads.append(Action(WEIGHT_GRAD, stage, action.microbatch))

    def release_weight_grad() -> None:
        if held_weight_grads:
            order.append(held_weight_grads.popleft())

    def pair(forward_stage: int, backward_stage: int) -> None:
        pair_starts.append(len(order))
        forward(forward_stage)
        backward(backward_stage)

    for _ in range(2 * (p - 1 - device)):
        forward(first)
    for _ in range(device + 1):
        forward(first)
        forward(second)
    for _ in range(p - 1 - device):
        backward(second, split=True)
        release_weight_grad()
        forward(second)
    for index in range(num_microbatches - 2 * p + device + 1):
        if index == 0 and device == p - 1:
            # As DualPipe does: the turn of the V runs unpaired, so its bubble is shorter.
            forward(first)
            backward(second)
        else:
            pair(first, second)
        pair(second, first)
    for _ in range(p - 1 - device):
        backward(second)
        pair(second, first)
    # The cool-down splits the second half of its backwards, so W passes fill the drain.
    half = (device + 1) // 2
    for index in range(device + 1):
        backward(second, split=index > half or (index == half and device % 2 == 1))
        backward(first, split=index >= half)
    for _ in range(p - 1 - device):
        release_weight_grad()
        backward(first, split=True)
    while held_weight_grads:
        release_weight_grad()
    return order, pair_starts
