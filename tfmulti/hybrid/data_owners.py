"""ZeRO over a hybrid mesh's data axis: each trainable variable owned by one data replica.

The owner holds the variable's optimizer state and updates it (stages 1-2); under stage 3
it also holds the variable's only storage, which every other replica's copy of the
variable reads where it lives (`hold_owned_weights_only`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from tfmulti.compat.keras_internals import share_storage, variable_device, variable_storage


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


def hold_owned_weights_only(replicas: Sequence, owners: Sequence[int]) -> None:
    """Stage 3: every replica's copy of trainable variable k reads its owner's storage, and
    gives up its own (freed once nothing else refers to it).

    Args:
        replicas: the data replicas (`PipelineModel`s), built, with equal weights.
        owners: the owning replica of each of their trainable variables, in their order.

    Raises:
        ValueError: in one line, for a stage whose weights span several devices (a tensor
            group): its traced functions place their reads themselves.
    """
    for stage in replicas[0].stages:
        held_on = {variable_device(v) for v in stage.trainable_variables}
        if len(held_on) > 1:
            raise ValueError(
                f"--zero=3 under --strategy=hybrid reads each weight from its owner; stage "
                f"{stage.name!r} splits its weights over {len(held_on)} devices (a tensor "
                "group). Received: a mesh with tensor > 1; use --zero=2 or tensor=1."
            )
    copies = [replica.trainable_variables for replica in replicas]
    for index, owner in enumerate(owners):
        held = copies[owner][index]
        for replica in copies:
            if replica[index] is not held:
                share_storage(replica[index], held)


def distinct_storage(variables: Iterable) -> list:
    """The `tf.Variable`s behind `variables`, each once (a variable without Keras storage
    stands for itself)."""
    held, seen = [], set()
    for variable in variables:
        storage = variable_storage(variable)
        storage = variable if storage is None else storage
        if id(storage) not in seen:
            seen.add(id(storage))
            held.append(storage)
    return held


def same_storage(variable, other) -> bool:
    """Whether two Keras variables read the same `tf.Variable` (a stage-3 copy and its
    owner's variable)."""
    storage = variable_storage(variable)
    return storage is not None and storage is variable_storage(other)
