"""The public names of model parallelism, in one place: split layers (`tensor_parallel/`),
layer placement (`placement/`) and `keras.distribution` on TensorFlow (`keras_distribution/`).

Example:
    >>> from tfmulti.parallel import ParallelMLP, place
    >>> mlp = ParallelMLP(d_model=64, mlp_dim=256, devices=["/CPU:0", "/CPU:1"])
    >>> placed = place(model, balance="params", devices=["/CPU:0", "/CPU:1"])
"""

from tfmulti.collectives.tensor_reduction import (
    TENSOR_REDUCTIONS,
    set_tensor_reduction,
    tensor_reduction,
    tensor_reduction_scope,
)
from tfmulti.keras_distribution.mesh_layout import LayoutNotHonouredWarning
from tfmulti.keras_distribution.sharding import shard
from tfmulti.keras_distribution.variable_bytes import variable_bytes_per_device
from tfmulti.placement.placed_model import PlacedModel, place, place_reference_model
from tfmulti.placement.summary import PlacementSummary
from tfmulti.tensor_parallel.causal_attention import attend_causally
from tfmulti.tensor_parallel.export import (
    TensorParallelModel,
    has_tensor_parallel_layers,
    unsplit_model,
)
from tfmulti.tensor_parallel.parallel_attention import ParallelSelfAttention
from tfmulti.tensor_parallel.parallel_block import pre_ln_block, pre_ln_block_bytes
from tfmulti.tensor_parallel.parallel_mlp import ParallelMLP
from tfmulti.tensor_parallel.shard_devices import resolve_shard_devices
from tfmulti.tensor_parallel.sharded_layer import (
    TensorParallelLayer,
    set_unsplit_weights,
    shards_of,
    unsplit_weights,
)
from tfmulti.tensor_parallel.split_dense import ColumnParallelDense, RowParallelDense
from tfmulti.tensor_parallel.transfer_bytes import (
    CommunicationBytes,
    cross_device_bytes,
    measure_communication,
)
from tfmulti.tensor_parallel.vocab_embedding import VocabParallelEmbedding

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
