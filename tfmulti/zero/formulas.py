"""What ZeRO's stages hold per device and send per step, as Rajbhandari et al. (SC'20) count it.

Pure Python. With Ψ parameters over N data-parallel devices, weights of `weight_bytes`,
gradients of `gradient_bytes` and `optimizer_bytes` of optimizer state per parameter:

| stage | weights | gradients | optimizer state |
|---|---|---|---|
| 0 (plain data parallelism) | Ψw | Ψg | ΨK |
| 1 (optimizer state sharded) | Ψw | Ψg | ΨK/N |
| 2 (+ gradients) | Ψw | Ψg/N | ΨK/N |
| 3 (+ weights) | Ψw/N | Ψg/N | ΨK/N |

Float32 Adam (w = g = 4, K = 8) gives 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N and 16Ψ/N.

Example:
    >>> zero_state_bytes(3, 1000, 4).total
    4000.0
"""

from __future__ import annotations

import dataclasses

ZERO_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of training state one device holds."""

    weights: float
    gradients: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def check_stage(stage: int) -> None:
    """Raises a one-line ValueError unless `stage` is a ZeRO stage."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"--zero must be one of {list(ZERO_STAGES)}. Received: --zero={stage}")


def zero_state_bytes(
    stage: int,
    num_params: float,
    num_devices: int,
    weight_bytes: float = 4,
    gradient_bytes: float = 4,
    optimizer_bytes: float = 8,
) -> StateBytes:
    """Bytes of weights, gradients and optimizer state per device under ZeRO `stage`.

    Args:
        stage: 0 to 3.
        num_params: Ψ, the model's trainable parameters.
        num_devices: N, the devices of the data axis.
        weight_bytes, gradient_bytes: bytes per parameter (4 in float32; mixed precision
            keeps float32 weights and computes in 16 bits).
        optimizer_bytes: optimizer state per parameter (8 for Adam's two float32 slots,
            4 for SGD with momentum, 0 for plain SGD).
    """
    check_stage(stage)
    shard = 1.0 / num_devices
    return StateBytes(
        weights=num_params * weight_bytes * (shard if stage >= 3 else 1.0),
        gradients=num_params * gradient_bytes * (shard if stage >= 2 else 1.0),
        optimizer=num_params * optimizer_bytes * (shard if stage >= 1 else 1.0),
    )


def zero_step_traffic(
    stage: int,
    num_params: float,
    num_devices: int,
    weight_bytes: float = 4,
    regather_for_backward: bool = True,
) -> float:
    """Bytes each device sends per step: 2Ψ(N-1)/N for stages 0-2, 3Ψ(N-1)/N for stage 3.

    Stages 0-2 reduce-scatter gradients and all-gather weights (an all-reduce is the two);
    stage 3 all-gathers weights once more, for the backward pass, unless the gathered
    weights stay until the backward has used them (`regather_for_backward=False`, FSDP's
    `reshard_after_forward=False`, as `ZeroDataParallel` runs): 2Ψ(N-1)/N again.
    """
    check_stage(stage)
    passes = 3 if stage == 3 and regather_for_backward else 2
    return passes * num_params * weight_bytes * (num_devices - 1) / num_devices
