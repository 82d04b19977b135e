"""The collective key ranges tfmulti uses: apart from each other and from tf.distribute's.

TensorFlow's collective ops meet by (group key, instance key); two collectives that share
a key by accident wait on each other or exchange the wrong tensors. MultiWorkerMirroredStrategy
hands out its keys from 1 upwards; tfmulti's own stay far above them.
"""

from __future__ import annotations

# Cross-worker sums (hybrid meshes): one group per local device type and index.
WORKER_SUM_KEYS = range(1 << 20, 1 << 24)
# Tensor-group all-reduces: groups per set of devices, and one instance per call.
TENSOR_GROUP_KEYS_START = 1 << 24
