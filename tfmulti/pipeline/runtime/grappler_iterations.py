"""Runs TensorFlow's graph optimiser (Grappler) once over a pipeline's step, not twice.

Before a traced function first runs, Grappler optimises its graph; by default its meta
optimiser goes over the whole graph twice. A pipeline's step graph holds the schedule's
prologue and epilogue as inlined copies of the stages, so it is several times one
device's, and the second pass costs about as much as the first while changing little
(on the 6-layer reference Transformer at m=32: 4 of 10 Grappler seconds for 1.7% fewer
nodes, the same step time; see BUILD.md). `optimised_once(function)` makes every call of
`function` run with one iteration, so the functions it traces on its first call, and the
instantiation Grappler optimises, get that setting; a setting the user chose is kept.

TensorFlow passes the options of a function call from the calling thread's
`context.function_call_options`, which has no public setter
(`tfmulti.compat.tf_internals.functions_called_with`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from tfmulti.compat import tf_internals

_ONE = rewriter_config_pb2.RewriterConfig.ONE
_DEFAULT = rewriter_config_pb2.RewriterConfig.DEFAULT_NUM_ITERS


def call_config() -> config_pb2.ConfigProto:
    """The session config the calling thread passes to the functions it calls."""
    return tf_internals.function_call_config()


@contextlib.contextmanager
def one_grappler_iteration() -> Iterator[None]:
    """Functions called (and traced) inside are optimised by one Grappler iteration,
    unless the thread's config already sets the number of iterations."""
    config = call_config()
    rewrite = config.graph_options.rewrite_options
    if rewrite.meta_optimizer_iterations != _DEFAULT:
        yield
        return
    rewrite.meta_optimizer_iterations = _ONE
    with tf_internals.functions_called_with(config):
        yield


def optimised_once(function: Callable | None) -> Callable | None:
    """`function`, each call run inside `one_grappler_iteration` (None stays None)."""
    if function is None or getattr(function, "_optimised_once", False):
        return function

    @functools.wraps(function)
    def call(*args, **kwargs):
        with one_grappler_iteration():
            return function(*args, **kwargs)

    call._optimised_once = True
    return call


class OptimisedOnceSteps:
    """A `keras.Model` mixin: the training, test and predict functions Keras makes run
    with `one_grappler_iteration`."""

    def make_train_function(self, force=False):
        super().make_train_function(force=force)
        self.train_function = optimised_once(self.train_function)
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force=force)
        self.test_function = optimised_once(self.test_function)
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force=force)
        self.predict_function = optimised_once(self.predict_function)
        return self.predict_function
