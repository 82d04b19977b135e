"""ZeRO over a hybrid mesh's data axis: each trainable variable owned by one data replica.

The owner holds the variable's optimizer state and updates it (stages 1-2); under stage 3
it also holds the variable's only storage, which every other replica's copy of the
variable reads where it lives (`hold_owned_weights_only`).
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

    Variables of one place (a pipeline device: a stage, or a device's chunks) are dealt
    out largest first, each to the replica owning the fewest elements of that place so
    far, ties going to the replica owning the fewest elements overall, then the lowest
    index (PyTorch's `ZeroRedundancyOptimizer` deals all parameters this way; per place,
    every device of the mesh gets about 1/N of its stage's state).

    Args:
        sizes: each variable's number of elements.
        places: each variable's pipeline device (any hashable key).
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


def hold_owned_weights_only(copies: Sequence[Sequence], owners: Sequence[int]) -> None:
    """Stage 3: every replica's copy of variable k reads its owner's storage, and gives up
    its own (freed once nothing else refers to it).

    Args:
        copies: per replica, its trainable variables (Keras variables), in one order.
        owners: the owning replica of each variable, in that order.
    """
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
