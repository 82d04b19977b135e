"""Which optimizer variables are slots of which weight block, so state saves whole.

An optimizer built on the blocks of `ShardedWeights` creates its per-weight state (Adam's
moments, momentum, an EMA's averages) with `add_variable_from_reference`, one slot per
block and kind. Joining block j's t-th slot over j gives weight k's t-th slot whole: the
layout a checkpoint keeps, whatever the number of devices that wrote it or reads it.
"""

from __future__ import annotations

import keras


class SlotMap:
    """Records the slots an optimizer creates for each reference variable.

    Example:
        >>> slots = SlotMap.build(optimizer, blocks)
        >>> slots.of(blocks[0])  # [momentum, velocity] for Adam
    """

    def __init__(self):
        self._slots: dict[int, list] = {}

    @classmethod
    def build(cls, optimizer: keras.optimizers.Optimizer, variables: list) -> SlotMap:
        """Builds `optimizer` on `variables` while recording each slot's reference variable."""
        slot_map = cls()
        recorders = []
        for target in _optimizers_within(optimizer):
            add = target.add_variable_from_reference

            def recording(reference_variable, *args, _add=add, **kwargs):
                slot = _add(reference_variable, *args, **kwargs)
                slot_map._slots.setdefault(id(reference_variable), []).append(slot)
                return slot

            object.__setattr__(target, "add_variable_from_reference", recording)
            recorders.append((target, add))
        try:
            optimizer.build(variables)
        finally:
            for target, add in recorders:
                object.__setattr__(target, "add_variable_from_reference", add)
        return slot_map

    def of(self, variable) -> list:
        """The slots of `variable`, in the order the optimizer made them."""
        return self._slots.get(id(variable), [])

    def all_slots(self) -> set[int]:
        """Ids of every recorded slot."""
        return {id(slot) for slots in self._slots.values() for slot in slots}


def _optimizers_within(optimizer) -> list:
    """`optimizer` and, for a LossScaleOptimizer, the optimizer it wraps."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if inner is None else [optimizer, inner]
