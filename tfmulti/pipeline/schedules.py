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

SCHEDULE_NAMES = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_h2",
    "zbv",
    "interleaved_zb",
    "dualpipev",
)
# Schedules that place several chunks (stages) on each device.
CHUNKED_SCHEDULES = ("interleaved_1f1b", "zbv", "interleaved_zb", "dualpipev")
# Chunks per device each chunked schedule takes: the fewest, and the most (None: any).
SCHEDULE_CHUNKS = {
    "interleaved_1f1b": (2, None),
    "interleaved_zb": (2, None),
    "zbv": (2, 2),
    "dualpipev": (2, 2),
}


def chunks_fit_schedule(name: str, chunks: int) -> bool:
    """Whether `name` (a built-in schedule) can place `chunks` chunks on each device.

    Example:
        >>> chunks_fit_schedule("zbv", 2), chunks_fit_schedule("zbv", 3)
        (True, False)
    """
    low, high = SCHEDULE_CHUNKS.get(name, (1, 1))
    return low <= chunks and (high is None or chunks <= high)


def build_schedule(
    name: str, num_devices: int, num_microbatches: int, chunks: int | None = None
) -> Schedule:
    """Builds the schedule called `name`.

    Args:
        name: one of `SCHEDULE_NAMES`.
        num_devices: pipeline depth p (devices).
        num_microbatches: micro-batches per step m.
        chunks: model chunks per device v: for "interleaved_1f1b" and "interleaved_zb"
            any v >= 2 (default 2), for "zbv" and "dualpipev" only 2 (or None). Other
            schedules accept only None or 1.

    Returns:
        The `Schedule`.

    Example:
        >>> [str(action) for action in build_schedule("1f1b", 2, 3).device_actions[1]]
        ['F1.0', 'B1.0', 'F1.1', 'B1.1', 'F1.2', 'B1.2']
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"Unknown schedule. Expected one of {SCHEDULE_NAMES}. Received: {name!r}")
    low, high = SCHEDULE_CHUNKS.get(name, (1, 1))
    if chunks is None:
        chunks = low
    if not chunks_fit_schedule(name, chunks):
        others = f"chunked schedules: {', '.join(CHUNKED_SCHEDULES)}"
        rule = f"needs chunks >= {low} ({others})"
        if high is not None:
            rule = f"places {low} chunk(s) on each device ({others}), so chunks must be {low}"
        raise ValueError(f"Schedule {name!r} {rule}. Received: chunks={chunks}")
    builders = {
        "gpipe": gpipe,
        "1f1b": one_f_one_b,
        "zb_h1": zb_h1,
        "zb_h2": zb_h2,
        "zbv": zbv,
        "dualpipev": dualpipev,
    }
    if name in builders:
        return builders[name](num_devices, num_microbatches)
    chunked = {"interleaved_1f1b": interleaved_1f1b, "interleaved_zb": interleaved_zb}
    return chunked[name](num_devices, num_microbatches, chunks)


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
    _check_sizes(num_devices, num_microbatches)
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
    return Schedule("interleaved_zb", m, stage_devices, _freeze(orders))


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

    tfmulti's executor runs a pair as its forward, then its backward (no overlap), so
    there F&B = F + B and the bubble is twice ZB-V's at F = I = W; the simulator takes a
    measured pair time from `CostModel.pair_times`.

    Example:
        >>> schedule = dualpipev(2, 4)
        >>> schedule.stage_devices, schedule.overlapped_pairs[0][:2]
        ((0, 1, 1, 0), (7, 9))
    """
    _check_sizes(num_devices, num_microbatches)
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
        "dualpipev", num_microbatches, stage_devices, _freeze(orders), overlapped_pairs=tuple(pairs)
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
