"""What the schedule builders share: size checks, the split-backward order of the
zero-bubble schedules, and freezing per-device orders into a `Schedule`. Pure Python."""

from __future__ import annotations

import collections

from tfmulti.pipeline.actions import FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action, Schedule


def split_backward_order(
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


def check_sizes(num_devices: int, num_microbatches: int) -> None:
    """Refuses fewer than one device or micro-batch."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1. Received: num_devices={num_devices}")
    if num_microbatches < 1:
        raise ValueError(
            f"num_microbatches must be >= 1. Received: num_microbatches={num_microbatches}"
        )


def flat_schedule(name: str, num_microbatches: int, orders: list[list[Action]]) -> Schedule:
    """A schedule of one stage per device, device d running `orders[d]`."""
    return Schedule(name, num_microbatches, tuple(range(len(orders))), frozen(orders))


def frozen(orders: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    """Per-device orders as the tuples a `Schedule` holds."""
    return tuple(tuple(order) for order in orders)
