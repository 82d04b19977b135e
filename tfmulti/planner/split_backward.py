"""How a block's backward divides when a zero-bubble schedule splits it into I and W.

A split schedule runs a stage's backward as two functions cut from its traced graph
(`StageFunctions.input_grad` and `weight_grad`): I computes the input gradients and what
W will read, W the weight gradients. The two together cost more than the whole backward B
(each reads again what B kept in one function), and I is much more than half of B: every
elementwise op of the backward lies on the input-gradient path, while W holds only the
weights' matmuls. So the shares are measured, on the functions the executor runs.

Times are taken as shares of the block's cut B, less the time of calling an empty
function, so the fixed cost of a call is not counted as compute (the cost model charges
each action's dispatch separately, `MachineCosts.per_action`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import tensorflow as tf

from tfmulti.pipeline.runtime.stage_functions import StageFunctions, gather_feeds

_CALLS_PER_ROUND = 7


def split_backward_shares(block, inputs, rounds: int = 3) -> tuple[float, float]:
    """(I / B, W / B) of `block` on `inputs`, its gradients cut as the executor cuts them.

    A piece with nothing to compute has a share of 0: I without float inputs, W without
    trainable weights.

    Args:
        block: called as `block(inputs, training=True)`, with `trainable_variables`
            (built).
        inputs: what `block` is timed on; float inputs get input gradients.
        rounds: B, I and W are timed in turn this many times; the fastest round of each
            counts, since other processes only ever slow a function down.

    Example:
        >>> input_share, weight_share = split_backward_shares(dense, tf.ones([8, 16]))
    """
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(inputs)]
    traced = StageFunctions(block, differentiate_inputs=True, remat=False).for_inputs(flat, inputs)
    produced = traced.forward(*flat)
    outputs, residuals = produced[: traced.num_outputs], produced[traced.num_outputs :]
    sources = {
        "input": flat,
        "residual": residuals,
        "output_grad": [tf.ones_like(t) for t in outputs if t.dtype.is_floating],
    }
    input_grad_results = traced.input_grad(*gather_feeds(traced.input_grad_feeds, sources))
    carried = dict(sources, carry=list(input_grad_results[traced.num_input_grads :]))
    pieces = {
        "backward": (traced.backward, gather_feeds(traced.backward_feeds, sources)),
        "input_grad": (traced.input_grad, gather_feeds(traced.input_grad_feeds, sources)),
        "weight_grad": (traced.weight_grad, gather_feeds(traced.weight_grad_feeds, carried)),
    }
    empty = tf.function(lambda: tf.constant(0.0), autograph=False).get_concrete_function()
    calls = {name: _bound(function, args) for name, (function, args) in pieces.items()}
    calls["empty"] = empty
    fastest = dict.fromkeys(calls, float("inf"))
    for call in calls.values():
        call()  # the first call of a function pays its instantiation
    for _ in range(rounds):
        for name, call in calls.items():
            fastest[name] = min(fastest[name], _median_seconds(call))
    compute = {name: max(fastest[name] - fastest["empty"], 0.0) for name in pieces}
    # A piece that computes nothing (no float input to differentiate, no weights) is free.
    if not traced.input_gradient_specs and not traced.carry_specs:
        compute["input_grad"] = 0.0
    if not traced.weights:
        compute["weight_grad"] = 0.0
    if compute["backward"] <= 0.0:
        return 0.5, 0.5
    return (
        compute["input_grad"] / compute["backward"],
        compute["weight_grad"] / compute["backward"],
    )


class SplitShares:
    """`split_backward_shares` of blocks, each distinct signature measured once.

    Example:
        >>> shares = SplitShares()
        >>> input_share, weight_share = shares.of(block, x, block_signature(block, x))
    """

    def __init__(self, rounds: int = 3):
        self.rounds = rounds
        self._shares: dict[str, tuple[float, float]] = {}

    def of(self, block, inputs, signature: str | None) -> tuple[float, float]:
        """`block`'s (I / B, W / B) on `inputs`; a signature measured before is not again."""
        if signature is not None and signature in self._shares:
            return self._shares[signature]
        shares = split_backward_shares(block, inputs, self.rounds)
        if signature is not None:
            self._shares[signature] = shares
        return shares


def _bound(function, args) -> Callable:
    return lambda: function(*args)


def _median_seconds(call: Callable) -> float:
    times = []
    for _ in range(_CALLS_PER_ROUND):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)
