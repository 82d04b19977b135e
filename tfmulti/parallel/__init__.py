"""Model parallelism: split layers (Megatron-style tensor parallelism), layer placement, and
`keras.distribution` layouts sharded on TensorFlow (`shard`, `variable_bytes_per_device`).

Example:
    >>> from tfmulti.parallel import ParallelMLP, place
    >>> mlp = ParallelMLP(d_model=64, mlp_dim=256, devices=["/CPU:0", "/CPU:1"])
    >>> placed = place(model, balance="params", devices=["/CPU:0", "/CPU:1"])
"""

from tfmulti.parallel.causal_attention import attend_causally
from tfmulti.parallel.communication import (
    CommunicationBytes,
    cross_device_bytes,
    measure_communication,
)
from tfmulti.parallel.keras_distribution import shard
from tfmulti.parallel.mesh_layout import LayoutNotHonouredWarning
from tfmulti.parallel.parallel_attention import ParallelSelfAttention
from tfmulti.parallel.parallel_block import pre_ln_block, pre_ln_block_bytes
from tfmulti.parallel.parallel_mlp import ParallelMLP
from tfmulti.parallel.placement import PlacedModel, place, place_reference_model
from tfmulti.parallel.placement_summary import PlacementSummary
from tfmulti.parallel.shard_devices import resolve_shard_devices
from tfmulti.parallel.sharded_layer import (
    TensorParallelLayer,
    set_unsplit_weights,
    shards_of,
    unsplit_weights,
)
from tfmulti.parallel.split_dense import ColumnParallelDense, RowParallelDense
from tfmulti.parallel.tensor_reduction import (
    TENSOR_REDUCTIONS,
    set_tensor_reduction,
    tensor_reduction,
    tensor_reduction_scope,
)
from tfmulti.parallel.unsplit import TensorParallelModel, has_tensor_parallel_layers, unsplit_model
from tfmulti.parallel.variable_bytes import variable_bytes_per_device
from tfmulti.parallel.vocab_embedding import VocabParallelEmbedding

__all__ = [
    "ColumnParallelDense",
    "CommunicationBytes",
    "LayoutNotHonouredWarning",
    "ParallelMLP",
    "ParallelSelfAttention",
    "PlacedModel",
    "PlacementSummary",
    "RowParallelDense",
    "TENSOR_REDUCTIONS",
    "TensorParallelLayer",
    "TensorParallelModel",
    "VocabParallelEmbedding",
    "attend_causally",
    "cross_device_bytes",
    "has_tensor_parallel_layers",
    "measure_communication",
    "place",
    "place_reference_model",
    "pre_ln_block",
    "pre_ln_block_bytes",
    "resolve_shard_devices",
    "set_tensor_reduction",
    "set_unsplit_weights",
    "shard",
    "shards_of",
    "tensor_reduction",
    "tensor_reduction_scope",
    "unsplit_model",
    "unsplit_weights",
    "variable_bytes_per_device",
]
