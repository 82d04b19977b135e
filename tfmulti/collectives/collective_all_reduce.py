"""A sum all-reduce over a tensor group with TensorFlow's collective ops (NCCL on GPUs).

`collective_ops.all_reduce_v2` runs one op per device of the group; the runtime moves the
data itself (a ring on CPUs, NCCL on GPUs), so the graph holds no Send/Recv pairs for it.
Four things make it safe to call from anywhere a tensor-parallel layer is traced:

- Group keys: one per set of devices, and instance keys: one per call, both from a range
  far above the keys `tf.distribute`'s `CollectiveKeys` (from 1) and
  `tfmulti.collectives.worker_sums` (from 2**20) hand out.
- Ordering tokens: one resource per device, passed to every collective on it, so the
  collectives on one device run in the order they were traced; every device of a group
  is traced in the same order, so no two devices wait for each other's next collective.
  Without them TensorFlow 2.21 does not even complete one two-device all-reduce on logical
  CPU devices (it times out waiting for the peer).
- A repeated execution of a traced collective (a function called per micro-batch, a loop
  body per round) is told apart by TensorFlow itself: the runtime keys each execution by
  the step, and by the loop frame and iteration it runs in.
- Tied outputs: each device's sum reads an empty slice of every other's (`_tied`), so
  nothing that cuts or prunes the graph by its data edges can keep some of a group's
  collectives without the others, which would wait for their peers forever.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import tensorflow as tf

from tfmulti.collectives.key_ranges import TENSOR_GROUP_KEYS_START
from tfmulti.collectives.multi_device_op import multi_device_op, zeros_where_missing
from tfmulti.compat import tf_internals
from tfmulti.platform.runtime.devices import canonical_device_name, device_key

_KEY_BASE = TENSOR_GROUP_KEYS_START
_GROUPS_PER_TASK_BITS = 12
# A collective whose peers do not arrive within this fails instead of hanging.
DEFAULT_TIMEOUT_SECONDS = 600.0
_timeout_seconds = [DEFAULT_TIMEOUT_SECONDS]


def set_collective_timeout(seconds: float | None) -> None:
    """Makes collectives traced from now on fail after `seconds` (None: the default, 600 s).

    Example:
        >>> set_collective_timeout(120.0)  # scripts/train.py --collective_timeout=120
    """
    if seconds is not None and not seconds > 0:
        raise ValueError(f"The collective timeout must be > 0 seconds. Received: {seconds!r}")
    _timeout_seconds[0] = DEFAULT_TIMEOUT_SECONDS if seconds is None else float(seconds)


class _Keys:
    """Group keys per set of devices and a fresh instance key per collective call."""

    def __init__(self):
        self._lock = threading.Lock()
        self._groups: dict[tuple, tuple[int, int]] = {}  # devices: (task, key)
        self._instances = itertools.count(_KEY_BASE)
        self._tokens: dict[str, tf.Tensor] = {}  # device: ordering token

    def group_key(self, devices: Sequence[str]) -> int:
        """The same key for the same devices; each worker (task) keys its groups in a range
        of its own, as every worker numbers its local groups from 0."""
        members = tuple(sorted(canonical_device_name(device) for device in devices))
        task = tf.DeviceSpec.from_string(devices[0]).task or 0
        with self._lock:
            if members not in self._groups:
                local = sum(1 for known, _ in self._groups.values() if known == task)
                self._groups[members] = (task, _KEY_BASE + (task << _GROUPS_PER_TASK_BITS) + local)
            return self._groups[members][1]

    def instance_key(self) -> int:
        with self._lock:
            return next(self._instances)

    def ordering_token(self, device: str) -> tf.Tensor:
        """A resource handle on `device`, made once outside any traced function."""
        name = canonical_device_name(device)
        with self._lock:
            if name not in self._tokens:
                # A bare handle, not a variable: a distribution strategy's scope would
                # turn a variable into a mirrored one on the strategy's devices.
                with tf.init_scope(), tf.device(name):
                    self._tokens[name] = tf.raw_ops.VarHandleOp(
                        dtype=tf.float32, shape=[], shared_name=f"tfmulti_collective_order{name}"
                    )
            return self._tokens[name]


_KEYS = _Keys()


def communication_hint(devices: Sequence[str]) -> str:
    """The collective implementation for a group: "nccl" if all its devices are GPUs, else "ring".

    Example:
        >>> communication_hint(["/device:CPU:0", "/device:CPU:1"])
        'ring'
    """
    types = {device_key(d)[0] or "CPU" for d in devices}
    return "nccl" if types == {"GPU"} else "ring"


def sum_on_every_device(tensors: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Returns the sum of the K tensors (tensor k on device k) on every device; not differentiable.

    One `CollectiveReduceV2` per device, all with the group's key and one new instance key.

    Example:
        >>> sums = sum_on_every_device([a_on_cpu0, b_on_cpu1], ["/CPU:0", "/CPU:1"])
    """
    if len(tensors) != len(devices):
        raise ValueError(
            f"Give one tensor per device. Received: {len(tensors)} tensors, devices={devices}"
        )
    if len(devices) == 1:
        with tf.device(devices[0]):
            return [tf.identity(tensors[0])]
    if tf.executing_eagerly():
        # Eager ops run one at a time, so device 0's would wait for a peer never started;
        # a function launches the K ops together.
        return tf.function(lambda *values: _collective_sums(values, devices))(*tensors)
    return _collective_sums(tensors, devices)


def _collective_sums(tensors: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    group_key = _KEYS.group_key(devices)
    instance_key = _KEYS.instance_key()
    hint = communication_hint(devices)
    collectives = []
    for device, tensor in zip(devices, tensors, strict=True):
        with tf.device(device):
            collectives.append(
                tf_internals.all_reduce_v2(
                    tensor,
                    group_size=len(devices),
                    group_key=group_key,
                    instance_key=instance_key,
                    communication_hint=hint,
                    timeout=_timeout_seconds[0],
                    ordering_token=_KEYS.ordering_token(device),
                )
            )
    return _tied(collectives, devices)


def _tied(collectives: list[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """Each device's sum, made to read an empty slice of every other device's.

    Whatever reads one device's sum then runs the whole group's collective: a graph cut
    that follows data edges only (the pipeline's stage pieces, `GraphCut`) or prunes what
    is not read keeps all K ops or none, never some devices' without their peers', which
    would wait for them forever. The slices have no elements, so no bytes move, and
    `IdentityN` passes the sum on without a copy.
    """
    empties = []
    for device, collective in zip(devices, collectives, strict=True):
        with tf.device(device):
            empties.append(tf.reshape(collective, [-1])[:0])
    tied = []
    for index, (device, collective) in enumerate(zip(devices, collectives, strict=True)):
        others = empties[:index] + empties[index + 1 :]
        with tf.device(device):
            tied.append(tf.raw_ops.IdentityN(input=[collective, *others])[0])
    return tied


def all_reduce(tensors: Sequence[tf.Tensor], devices: Sequence[str]) -> list[tf.Tensor]:
    """The sum of the K tensors on every device, differentiable.

    Output k is the sum of all inputs, so input j's gradient is the sum of every output's
    gradient: the backward is the same all-reduce of the output gradients.

    Example:
        >>> sums = all_reduce([a_on_cpu0, b_on_cpu1], ["/CPU:0", "/CPU:1"])
    """
    tensors = list(tensors)
    return multi_device_op(
        "collective_all_reduce",
        lambda values: sum_on_every_device(values, devices),
        lambda gradients: sum_on_every_device(
            zeros_where_missing(gradients, tensors, devices), devices
        ),
        tensors,
    )


def reduce_to_first(partials: Sequence[tf.Tensor], devices: Sequence[str]) -> tf.Tensor:
    """The sum of the K partials on devices[0], by an all-reduce over the group.

    The other devices' sums are not read; devices[0]'s is tied to them (`_tied`), so
    every device's collective stays in the graph. Backward, the gradient on
    devices[0] is all-reduced with zeros from the others, which gives it to every device
    without any device sending more than its share.

    Example:
        >>> total = reduce_to_first(partials, ["/CPU:0", "/CPU:1"])  # on /CPU:0
    """
    partials = list(partials)

    def forward(values):
        return sum_on_every_device(values, devices)[:1]

    def backward(gradients):
        if gradients[0] is None:
            return [None] * len(devices)
        missing = [gradients[0]] + [None] * (len(devices) - 1)
        return sum_on_every_device(zeros_where_missing(missing, partials, devices), devices)

    return multi_device_op("collective_reduce_to_first", forward, backward, partials)[0]
