"""Every private TensorFlow function or attribute tfmulti uses, each behind a named function.

TensorFlow has no public way to record an op on the gradient tapes without the
`IdentityN` of `tf.custom_gradient`, to run a collective all-reduce with explicit keys,
to ask whether an op is stateful, or to give MultiWorkerMirroredStrategy more than one
CPU device per worker. Each of these is a small function here; one whose private name is
gone fails with one line naming the TensorFlow version (`MissingTensorFlowInternal`).
`tests/test_compat_internals.py` calls each on the installed TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy
from tensorflow.python.eager import record
from tensorflow.python.ops import collective_ops

from tfmulti.compat.tf_profiler import tensorflow_version

# Checked on TensorFlow 2.21.0 by tests/test_compat_internals.py; setup.py allows no newer
# TensorFlow. Raise after running that test on a newer one.
FIRST_CHECKED_TENSORFLOW = (2, 20)
FIRST_UNCHECKED_TENSORFLOW = (2, 22)


class MissingTensorFlowInternal(RuntimeError):
    """A private TensorFlow name tfmulti relies on is missing from the installed TensorFlow."""


def _private(owner, name: str, what: str):
    """`owner.<name>`, or a `MissingTensorFlowInternal` naming `what` and the TensorFlow."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise MissingTensorFlowInternal(
            f"tfmulti needs TensorFlow's private {what}, which TensorFlow {tf.__version__} "
            f"lacks; tfmulti is checked on TensorFlow {_release(FIRST_CHECKED_TENSORFLOW)} up "
            f"to {_release(FIRST_UNCHECKED_TENSORFLOW)} (exclusive). "
            f"Received: tensorflow=={tf.__version__}"
        ) from None


def _release(version: tuple[int, ...]) -> str:
    return ".".join(str(number) for number in version)


def is_checked_tensorflow() -> bool:
    """Whether the installed TensorFlow is in the range these functions were checked on."""
    return FIRST_CHECKED_TENSORFLOW <= tensorflow_version() < FIRST_UNCHECKED_TENSORFLOW


# Gradient tapes


def stop_recording():
    """A context in which ops are not recorded on any gradient tape (`record.stop_recording`)."""
    return _private(record, "stop_recording", "eager.record.stop_recording")()


def any_tape_recording() -> bool:
    """Whether a gradient tape is active here, whatever it watches
    (`record.could_possibly_record`)."""
    return _private(record, "could_possibly_record", "eager.record.could_possibly_record")()


def should_record_backprop(tensors: Sequence[tf.Tensor]) -> bool:
    """Whether an active gradient tape watches one of `tensors`
    (`record.should_record_backprop`)."""
    return _private(record, "should_record_backprop", "eager.record.should_record_backprop")(
        tensors
    )


def record_operation(
    name: str, outputs: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor], backward: Callable
) -> None:
    """Records an op from `inputs` to `outputs` with gradient `backward` on the active tapes,
    as `tf.custom_gradient` does but without its `IdentityN` (`record.record_operation`)."""
    _private(record, "record_operation", "eager.record.record_operation")(
        name, outputs, inputs, backward
    )


# Collectives


def all_reduce_v2(tensor: tf.Tensor, **kwargs) -> tf.Tensor:
    """A `CollectiveReduceV2` sum of `tensor` over a group (`collective_ops.all_reduce_v2`),
    with the group and instance keys the caller chooses, which no public API takes."""
    return _private(collective_ops, "all_reduce_v2", "collective_ops.all_reduce_v2")(
        tensor, **kwargs
    )


def call_with_captures(function, args: Sequence[tf.Tensor], captures: Sequence[tf.Tensor]):
    """Calls the concrete `function` on `args` with `captures` in place of the tensors
    (variable handles) it captured when traced (`ConcreteFunction._call_flat`): a copy of
    a model calls the functions traced for the first copy on its own variables."""
    call_flat = _private(function, "_call_flat", "ConcreteFunction._call_flat")
    return call_flat(list(args), list(captures))


# Graphs


def is_stateful(op: tf.Operation) -> bool:
    """Whether `op` reads or changes state, so it may not be pruned or merged
    (`Operation._is_stateful`)."""
    return _private(op, "_is_stateful", "Operation._is_stateful")


# Strategies


def multi_worker_strategy_on_logical_cpus(
    resolver, options, num_logical_cpus: int
) -> tf.distribute.MultiWorkerMirroredStrategy:
    """A MultiWorkerMirroredStrategy whose workers each replicate over `num_logical_cpus` CPU
    devices; the public one uses CPU:0 only
    (`CollectiveAllReduceExtended._initialize_local_devices`)."""
    extended_class = _private(
        collective_all_reduce_strategy,
        "CollectiveAllReduceExtended",
        "collective_all_reduce_strategy.CollectiveAllReduceExtended",
    )
    _private(
        extended_class,
        "_initialize_local_devices",
        "CollectiveAllReduceExtended._initialize_local_devices",
    )

    class LogicalCpuExtended(extended_class):
        def _initialize_local_devices(self, cluster_resolver, worker_device):
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(num_logical_cpus))
            return devices, "CPU"

    strategy_class = tf.distribute.MultiWorkerMirroredStrategy
    strategy = strategy_class.__new__(strategy_class)
    super(strategy_class, strategy).__init__(
        LogicalCpuExtended(strategy, cluster_resolver=resolver, communication_options=options)
    )
    return strategy


def step_trace(name: str, step: int) -> tf.profiler.experimental.Trace:
    """A profiler trace event marking one training step, with the private root flag
    (`_r=1`) TensorBoard's profile step view needs; Keras' own callback omits it."""
    return tf.profiler.experimental.Trace(name, step_num=step, _r=1)


# Preemption


def stop_peer_preemption_watcher(
    handler: tf.distribute.experimental.PreemptionCheckpointHandler,
) -> None:
    """Ends, and waits for, the thread of a multi-worker `PreemptionCheckpointHandler` that
    waits on the coordination service for a peer's preemption
    (`PreemptionCheckpointHandler._stop_cluster_wise_termination_watcher_thread`, which sets
    the key the thread waits for, on every worker's behalf, then joins it). TensorFlow calls
    it on preemption and in the handler's `__del__`, which never runs while that thread holds
    the handler. Calling it again, or on one process (no thread), does nothing."""
    _private(
        handler,
        "_stop_cluster_wise_termination_watcher_thread",
        "PreemptionCheckpointHandler._stop_cluster_wise_termination_watcher_thread",
    )()
