"""Which all-reduce tensor-parallel layers trace: placed ring ops or TensorFlow's collectives.

- "ring" (the default): a ring reduce-scatter and all-gather of ordinary placed ops
  (`tfmulti.collectives.ring`); the transfers are graph edges that can be counted.
- "collective": one `CollectiveReduceV2` per device of the group
  (`tfmulti.collectives.collective_all_reduce`), NCCL when the group is all GPUs.

The setting is read when a layer's call is traced, so set it before the first training
step (Keras traces `fit`'s step lazily) and keep it for the run.
"""

from __future__ import annotations

import contextlib

from tfmulti.names import TENSOR_REDUCTION_NAMES as TENSOR_REDUCTIONS

_current = "ring"


def tensor_reduction() -> str:
    """The reduction tensor-parallel layers trace now: "ring" or "collective"."""
    return _current


def set_tensor_reduction(name: str) -> None:
    """Makes tensor-parallel layers traced from now on reduce with `name`.

    Args:
        name: "ring" or "collective".

    Example:
        >>> set_tensor_reduction("collective")
    """
    global _current
    if name not in TENSOR_REDUCTIONS:
        raise ValueError(
            f"The tensor reduction must be one of {TENSOR_REDUCTIONS}. Received: {name!r}"
        )
    _current = name


@contextlib.contextmanager
def tensor_reduction_scope(name: str):
    """Within the block, tensor-parallel layers traced reduce with `name`; restored after.

    Example:
        >>> with tensor_reduction_scope("collective"):
        ...     model.fit(dataset, epochs=1)
    """
    previous = _current
    set_tensor_reduction(name)
    try:
        yield
    finally:
        set_tensor_reduction(previous)
