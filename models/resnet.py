"""A small ResNet: a conv stem, residual blocks that carry their own skip, a pooled head."""

from __future__ import annotations

from collections.abc import Sequence

import keras

from tfmulti.models.blocks import check_image_shape, derive_seed

NORMALIZATIONS = ("batch", "layer")


def make_normalization(normalization: str, dtype=None) -> keras.layers.Layer:
    """Returns a BatchNormalization ("batch") or a per-position LayerNormalization ("layer")."""
    if normalization == "batch":
        return keras.layers.BatchNormalization(dtype=dtype)
    if normalization == "layer":
        return keras.layers.LayerNormalization(dtype=dtype)
    raise ValueError(
        f"normalization must be one of {list(NORMALIZATIONS)}. "
        f"Received: normalization={normalization!r}"
    )


@keras.saving.register_keras_serializable(package="tfmulti")
class ResidualBlock(keras.layers.Layer):
    """Two 3x3 convolutions with normalization, added to the block's input, then ReLU.

    When the block changes the channel count or strides, the skip path is a
    1x1 strided convolution with normalization; otherwise it is the identity.

    Args:
        filters: output channels.
        strides: stride of the first convolution (2 halves height and width).
        normalization: "batch" or "layer".
        seed: seeds the block's weights.

    Example:
        >>> block = ResidualBlock(32, strides=2)
        >>> block(keras.ops.zeros((1, 8, 8, 16))).shape
        (1, 4, 4, 32)
    """

    def __init__(self, filters, strides=1, normalization="batch", seed=0, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.strides = strides
        self.normalization = normalization
        self.seed = seed
        self.conv_1 = self._conv(3, strides, seed_index=0)
        self.norm_1 = make_normalization(normalization, self.dtype_policy)
        self.conv_2 = self._conv(3, 1, seed_index=1)
        self.norm_2 = make_normalization(normalization, self.dtype_policy)
        self.projection = None
        self.projection_norm = None

    def _conv(self, kernel_size, strides, seed_index):
        return keras.layers.Conv2D(
            self.filters,
            kernel_size,
            strides=strides,
            padding="same",
            use_bias=False,
            kernel_initializer=keras.initializers.HeNormal(derive_seed(self.seed, seed_index)),
            dtype=self.dtype_policy,
        )

    def build(self, input_shape):
        self.conv_1.build(input_shape)
        output_shape = self.conv_1.compute_output_shape(input_shape)
        self.norm_1.build(output_shape)
        self.conv_2.build(output_shape)
        self.norm_2.build(output_shape)
        if self.strides != 1 or input_shape[-1] != self.filters:
            self.projection = self._conv(1, self.strides, seed_index=2)
            self.projection.build(input_shape)
            self.projection_norm = make_normalization(self.normalization, self.dtype_policy)
            self.projection_norm.build(output_shape)

    def call(self, inputs):
        residual = keras.ops.relu(self.norm_1(self.conv_1(inputs)))
        residual = self.norm_2(self.conv_2(residual))
        shortcut = inputs
        if self.projection is not None:
            shortcut = self.projection_norm(self.projection(inputs))
        return keras.ops.relu(residual + shortcut)

    def compute_output_shape(self, input_shape):
        return self.conv_1.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            strides=self.strides,
            normalization=self.normalization,
            seed=self.seed,
        )
        return config


def build_blocks(
    input_shape: Sequence[int],
    num_outputs: int,
    seed: int = 0,
    stage_filters: Sequence[int] = (16, 32),
    blocks_per_stage: int = 1,
    normalization: str = "batch",
) -> list[keras.layers.Layer]:
    """Builds the ResNet as a stem block, one block per residual block, and a head block.

    Every stage after the first starts with a stride-2 residual block.

    Args:
        input_shape: (height, width, channels) of one image.
        num_outputs: number of classes (logits).
        seed: seeds every weight (see `derive_seed`).
        stage_filters: channels of each stage; the stem uses the first.
        blocks_per_stage: residual blocks in each stage.
        normalization: "batch" (BatchNormalization) or "layer" (LayerNormalization,
            independent of the batch, so micro-batching does not change results).

    Example:
        >>> [type(block).__name__ for block in build_blocks((8, 8, 1), 10)]
        ['Sequential', 'ResidualBlock', 'ResidualBlock', 'Sequential']
    """
    check_image_shape("resnet", input_shape)
    make_normalization(normalization)
    if not stage_filters or blocks_per_stage < 1:
        raise ValueError(
            "A ResNet needs at least one stage of at least one block. "
            f"Received: stage_filters={stage_filters}, blocks_per_stage={blocks_per_stage}"
        )
    stem_conv = keras.layers.Conv2D(
        stage_filters[0],
        3,
        padding="same",
        use_bias=False,
        kernel_initializer=keras.initializers.HeNormal(derive_seed(seed, 0)),
    )
    stem = keras.Sequential(
        [stem_conv, make_normalization(normalization), keras.layers.ReLU()], name="resnet_stem"
    )
    blocks = [stem]
    for stage, filters in enumerate(stage_filters):
        for index in range(blocks_per_stage):
            strides = 2 if stage > 0 and index == 0 else 1
            blocks.append(
                ResidualBlock(
                    filters,
                    strides=strides,
                    normalization=normalization,
                    seed=derive_seed(seed, len(blocks)),
                    name=f"resnet_stage_{stage}_block_{index}",
                )
            )
    logits = keras.layers.Dense(
        num_outputs,
        kernel_initializer=keras.initializers.GlorotUniform(derive_seed(seed, len(blocks))),
        # Logits stay float32 under mixed precision, the Keras convention.
        dtype="float32",
    )
    blocks.append(
        keras.Sequential([keras.layers.GlobalAveragePooling2D(), logits], name="resnet_head")
    )
    return blocks
