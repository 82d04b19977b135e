"""Reference models for tfmulti, each an ordered list of blocks and one keras.Model.

Example:
    >>> from tfmulti.models import build_model
    >>> model = build_model("resnet", input_shape=(8, 8, 1), num_outputs=10, seed=0)
"""

from tfmulti.models.blocks import chain_blocks, derive_seed
from tfmulti.models.registry import (
    MODEL_NAMES,
    MODEL_SPECS,
    ModelSpec,
    build_blocks,
    build_model,
    check_model_accepts,
    model_options,
    model_spec,
)

__all__ = [
    "MODEL_NAMES",
    "MODEL_SPECS",
    "ModelSpec",
    "build_blocks",
    "build_model",
    "chain_blocks",
    "check_model_accepts",
    "derive_seed",
    "model_options",
    "model_spec",
]
