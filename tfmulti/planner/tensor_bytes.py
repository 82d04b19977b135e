"""Bytes the tensor groups of a layout move per training step, predicted from block costs.

Pure Python. Split blocks keep their activations replicated on every device of the group
(Megatron's layout, `tfmulti.parallel.pre_ln_block`): each split block all-reduces its
output `tensor_allreduces` times per pass, forward and backward, a ring moving 2(K-1) x S
in all; its replicated weights go from the group's first device to the other K-1 each
step. A run of consecutive split blocks within a stage hands the replicas on, so only
where the run starts does its input go along the chain to K-1 devices (forward), and
only where it ends does its output gradient (backward): (K-1) x S each. Blocks that
cannot be split (`tensor_allreduces` = 0: the embedding, the head) move nothing here.
"""

from __future__ import annotations

from tfmulti.planner.costs import ModelCosts
from tfmulti.planner.scoring import Layout


def tensor_group_bytes(costs: ModelCosts, layout: Layout, global_batch: int) -> float:
    """Bytes the layout's tensor groups move in one step, over all replicas and micro-batches.

    Example:
        >>> tensor_group_bytes(costs, layout, global_batch=32)
        12435456.0
    """
    group = layout.mesh.tensor
    if group == 1:
        return 0.0
    microbatch = global_batch / layout.mesh.data / layout.num_microbatches
    edges = (0, *layout.boundaries, len(costs.blocks))
    per_microbatch = 0.0
    for start, end in zip(edges[:-1], edges[1:], strict=True):
        for index in range(start, end):
            block = costs.blocks[index]
            if not block.tensor_allreduces:
                continue
            activations = block.activation_bytes_per_example * microbatch
            passes = 2
            per_microbatch += passes * block.tensor_allreduces * 2 * (group - 1) * activations
            per_microbatch += (group - 1) * block.tensor_replicated_bytes
            starts_run = index == start or not costs.blocks[index - 1].tensor_allreduces
            ends_run = index == end - 1 or not costs.blocks[index + 1].tensor_allreduces
            if starts_run:
                previous = costs.blocks[index - 1] if index > 0 else block
                per_microbatch += (group - 1) * previous.activation_bytes_per_example * microbatch
            if ends_run:
                per_microbatch += (group - 1) * activations
    return per_microbatch * layout.num_microbatches * layout.mesh.data
