"""Which `scripts/train.py --strategy` runs a mesh: the one place the planner decides it.

Pure Python. On one host: one device, `mirrored` (data only), `pipeline` (pipe only),
`model_parallel` (tensor only), `hybrid` (two or more axes). Over several hosts: data
only runs `multi_worker`, pipe only `pipeline` over the workers' devices, and anything
else `hybrid`.
"""

from __future__ import annotations

from tfmulti.platform.mesh import HybridMesh

# The strategies whose step runs through the pipeline executor (a hybrid mesh's replicas
# are pipelines, of one stage when pipe = 1).
EXECUTOR_STRATEGIES = ("pipeline", "hybrid")


def train_strategy(mesh: HybridMesh, hosts: int = 1) -> str:
    """The `--strategy` of `scripts/train.py` that runs `mesh` over `hosts` hosts.

    Example:
        >>> train_strategy(HybridMesh(data=2, tensor=2))
        'hybrid'
        >>> train_strategy(HybridMesh(data=4), hosts=2)
        'multi_worker'
    """
    sizes = {"data": mesh.data, "pipe": mesh.pipe, "tensor": mesh.tensor}
    axes_used = [name for name, size in sizes.items() if size > 1]
    if len(axes_used) > 1:
        return "hybrid"
    if not axes_used:
        return "one_device"
    axis = axes_used[0]
    if axis == "pipe":
        return "pipeline"
    if hosts > 1:
        return "multi_worker" if axis == "data" else "hybrid"
    return "mirrored" if axis == "data" else "model_parallel"
