"""Standard pipeline schedules, built as data.

Pure Python. Each function returns a `Schedule`: per device, the ordered actions. `p` is the
number of devices (pipeline depth), `m` the number of micro-batches, `v` the number of model
chunks per device (the model then has p·v stages).
"""

from __future__ import annotations

from tfmulti.pipeline.actions import (
    BACKWARD,
    FORWARD,
    Action,
    Schedule,
)
from tfmulti.pipeline.chunked_zero_bubble import dualpipev, interleaved_zb, zbv
from tfmulti.pipeline.schedule_orders import (
    check_sizes,
    flat_schedule,
    frozen,
    split_backward_order,
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
    check_sizes(num_devices, num_microbatches)
    orders = [
        [Action(FORWARD, device, mb) for mb in range(num_microbatches)]
        + [Action(BACKWARD, device, mb) for mb in range(num_microbatches)]
        for device in range(num_devices)
    ]
    return flat_schedule("gpipe", num_microbatches, orders)


def one_f_one_b(num_devices: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): a few warm-up forwards, then one forward, one backward.

    Same bubble as GPipe, (p-1)/(m+p-1), but stage s holds at most p-s micro-batches.
    """
    check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(num_devices - 1 - device, num_microbatches)
        order = [Action(FORWARD, device, mb) for mb in range(warmup)]
        for mb in range(num_microbatches):
            if mb + warmup < num_microbatches:
                order.append(Action(FORWARD, device, mb + warmup))
            order.append(Action(BACKWARD, device, mb))
        orders.append(order)
    return flat_schedule("1f1b", num_microbatches, orders)


def interleaved_1f1b(num_devices: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): v chunks per device, stage i on device i mod p.

    Micro-batches go through the chunks in groups of p, so m must be a multiple of p. The
    bubble shrinks to about (p-1)/(v·m+p-1), for v times more sends between devices.
    """
    check_sizes(num_devices, num_microbatches)
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
    return Schedule("interleaved_1f1b", num_microbatches, stage_devices, frozen(orders))


def zb_h1(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero bubble, 1F1B memory): 1F1B with the backward split into I and W.

    Stage s runs its W passes s micro-batches late, filling the bubbles the faster I chain
    leaves, while keeping at most p activations live on any device. Bubble time
    (p-1)(F+I-W) against 1F1B's (p-1)(F+I+W).
    """
    check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(num_devices - 1 - device, num_microbatches)
        orders.append(split_backward_order(device, num_microbatches, warmup, w_delay=device))
    return flat_schedule("zb_h1", num_microbatches, orders)


def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H2 (zero bubble, about 2p-1 activations): more warm-up forwards, later W passes.

    The warm-up forwards fill the wait before the first I, and the tail W passes fill the
    cool-down, so each device works without idling from its first action to its last
    when F = I = W: the bubble is only the start stagger, which overlapping consecutive
    steps hides.
    """
    check_sizes(num_devices, num_microbatches)
    orders = []
    for device in range(num_devices):
        warmup = min(2 * (num_devices - 1 - device) + 1, num_microbatches)
        orders.append(
            split_backward_order(
                device, num_microbatches, warmup, w_delay=2 * device, forward_last=True
            )
        )
    return flat_schedule("zb_h2", num_microbatches, orders)
