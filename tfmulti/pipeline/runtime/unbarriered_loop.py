"""`tf.while_loop` without TensorFlow's barrier at the end of every round.

Inside a `tf.function`, TensorFlow traces a loop body with automatic control dependencies,
which make every value the body returns wait for every stateful op of the round (through
one NoOp). A pipeline round calls stateful stage functions on every device, so that
barrier lets no device start round i + 1 before every device has finished round i: the
loop runs in lock-step, and GPipe's forward loop took 1.8-2x its simulated time.

A pipeline step needs none of it: each device's actions are ordered by the device's own
token (which waits for the action's outputs and its stateful ops, `executor._when_ready`),
and values pass between rounds as loop variables. So the body is traced without automatic
control dependencies. TensorFlow reads that choice from a private attribute of the graph
the loop is built in (`while_v2.while_loop` and `cond_v2` read
`Graph._add_control_dependencies`); where that attribute is missing, the loop is built as
TensorFlow builds it, correct but in lock-step. `tests/test_unbarriered_loop.py` checks both
that TensorFlow still adds the barrier and that this loop has none.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

_FLAG = "_add_control_dependencies"


def while_loop_without_barrier(cond, body, loop_vars, **kwargs):
    """`tf.while_loop(cond, body, loop_vars, **kwargs)` whose body (and the `tf.cond`s in
    it) is traced without automatic control dependencies."""
    with _without_automatic_control_dependencies():
        return tf.while_loop(cond, body, loop_vars, **kwargs)


@contextlib.contextmanager
def _without_automatic_control_dependencies():
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(getattr(graph, _FLAG, None), bool):
        yield
        return
    saved = getattr(graph, _FLAG)
    setattr(graph, _FLAG, False)
    try:
        yield
    finally:
        setattr(graph, _FLAG, saved)
