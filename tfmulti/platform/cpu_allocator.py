"""TensorFlow's CPU allocator: tfmulti asks for the BFC allocator unless the user chose.

TensorFlow 2.21's default allocator for CPU devices is a `PoolAllocator` that keeps at
most 100 freed buffers and hands the rest back to the system. A training step under a
`tf.distribute` strategy, or on explicitly placed devices, can free more buffers than that:
each step then takes its memory from the system afresh, page by page. Measured on this
project's 2-core machine (4-layer Transformer, d_model 64, Keras `fit` under
`OneDeviceStrategy`, batch 16): about 4,000 minor page faults and 16 ms of kernel time a
step, and a step of 49-51 ms, against 6 faults, 3 ms and 25-28 ms with the BFC allocator
(the same as plain Keras without a strategy). At batch 32 the pool is large enough and
both allocators step alike, so the default's cost is not even monotonic in the batch.

TensorFlow reads `TF_CPU_ALLOCATOR_USE_BFC` once, when it first makes a CPU allocator (as
it starts its devices), so `prefer_bfc_cpu_allocator` must run before that. A value the
user set, "false" included, is kept. `tests/test_cpu_allocator.py` counts the default's
page faults, to tell when TensorFlow no longer needs this.
"""

from __future__ import annotations

import os

CPU_ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def prefer_bfc_cpu_allocator() -> bool:
    """Asks TensorFlow for its BFC CPU allocator unless `TF_CPU_ALLOCATOR_USE_BFC` is set.

    Returns:
        Whether the BFC allocator is asked for (the user's "false" or "0" keeps the default).

    Example:
        >>> prefer_bfc_cpu_allocator()  # before TensorFlow starts its devices
        True
    """
    value = os.environ.setdefault(CPU_ALLOCATOR_ENV, "true")
    return value.strip().lower() in ("true", "1")
