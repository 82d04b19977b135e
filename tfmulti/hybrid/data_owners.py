"""ZeRO over a hybrid mesh's data axis: each trainable variable owned by one data replica.

The owner holds the variable's optimizer state and updates it (stages 1-2); under stage 3
it also holds the variable's only storage, which every other replica's copy of the
variable reads where it lives (`hold_owned_weights_only`). With tensor > 1 each shard of
a split weight is a variable of its own, on its replica's device for its stage and tensor
rank, so shards are owned, held and read one by one, as whole weights are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from tfmulti.compat.keras_internals import share_storage, variable_storage


def check_zero_stage(stage: int, data_axis_across_workers: bool) -> None:
    """Raises a one-line ValueError unless ZeRO `stage` can shard a hybrid mesh's data axis:
    stages 1-3, with every data replica in the chief's program."""
    if stage not in (1, 2, 3):
        raise ValueError(
            "--zero under --strategy=hybrid shards state over the data axis: stages 1-3. "
            f"Received: --zero={stage}"
        )
    if data_axis_across_workers:
        raise ValueError(
            "--zero under --strategy=hybrid needs the data replicas in the chief's program; "
            f"use --cross_host_axis=pipe (or one host). Received: --zero={stage} with "
            "--cross_host_axis=data"
        )


def deal_owners(sizes: Sequence[int], places: Sequence[Hashable], num_replicas: int) -> list[int]:
    """The data replica owning each variable, balanced by size on each pipeline device.

    Variables of one place (a pipeline device: a stage, or a device's chunks; with tensor >
    1, a stage's device for one tensor rank) are dealt out largest first, each to the
    replica owning the fewest elements of that place so far, ties going to the replica
    owning the fewest elements overall, then the lowest index (PyTorch's
    `ZeroRedundancyOptimizer` deals all parameters this way; per place, every device of the
    mesh gets about 1/N of its place's state).

    Args:
        sizes: each variable's number of elements.
        places: each variable's device in replica 0 (any hashable key).
        num_replicas: N, the data replicas.

    Example:
        >>> deal_owners([390, 185, 39, 13, 3], ["s1", "s0", "s1", "s1", "s1"], 2)
        [0, 1, 1, 1, 1]
    """
    if len(sizes) != len(places):
        raise ValueError(
            f"deal_owners needs one place per variable. Received: {len(sizes)} sizes, "
            f"{len(places)} places"
        )
    owners = [0] * len(sizes)
    totals = [0] * num_replicas
    place_loads: dict[Hashable, list[int]] = {}
    for index in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        loads = place_loads.setdefault(places[index], [0] * num_replicas)
        owner = min(range(num_replicas), key=lambda r: (loads[r], totals[r], r))
        owners[index] = owner
        loads[owner] += sizes[index]
        totals[owner] += sizes[index]
    return owners


def hold_owned_weights_only(replicas: Sequence, owners: Sequence[int]) -> None:
    """Stage 3: every replica's copy of trainable variable k reads its owner's storage, and
    gives up its own (freed once nothing else refers to it).

    A tensor shard's copies read the owner's shard, on the owner's device for the same
    stage and tensor rank. A stage split over a tensor group traces its own functions on
    each replica (its ops are pinned to the replica's devices), and TensorFlow's placer
    runs a read of a variable on the variable's device whatever device the read was
    pinned to, so the value is read on the owner's device and sent to the reader's.
    Called before any step is traced, so no traced function keeps a dropped variable.

    Args:
        replicas: the data replicas (`PipelineModel`s), built, with equal weights.
        owners: the owning replica of each of their trainable variables, in their order.
    """
    copies = [replica.trainable_variables for replica in replicas]
    for index, owner in enumerate(owners):
        held = copies[owner][index]
        for replica in copies:
            if replica[index] is not held:
                share_storage(replica[index], held)


def same_storage(variable, other) -> bool:
    """Whether two Keras variables read the same `tf.Variable` (a stage-3 copy and its
    owner's variable)."""
    storage = variable_storage(variable)
    return storage is not None and storage is variable_storage(other)
