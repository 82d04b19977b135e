"""A small GPT-like causal Transformer language model.

Blocks: token + position embedding, pre-LN Transformer blocks (causal
multi-head self-attention and an MLP, each behind a residual), and a head of
final LayerNorm and vocabulary logits. Attention and MLP are separate layers,
`CausalSelfAttention` and `FeedForward`, so they can be swapped (e.g. for
tensor-parallel versions) without touching the block. With `tensor_parallel=K` the
attention, MLP and token embedding are the split layers of `tfmulti.parallel`, drawn
from the same seeded initializers, so the model starts from the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops

from tfmulti.models.blocks import derive_seed
from tfmulti.parallel import (
    ParallelMLP,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    attend_causally,
    pre_ln_block,
    pre_ln_block_bytes,
    resolve_shard_devices,
)
from tfmulti.tensor_parallel.transfer_bytes import tensor_bytes

# GPT-2's initial weight scale.
_INIT_STDDEV = 0.02


def _normal(seed: int) -> keras.initializers.Initializer:
    return keras.initializers.RandomNormal(stddev=_INIT_STDDEV, seed=seed)


def _attention_initializers(seed: int) -> list[keras.initializers.Initializer]:
    """Kernel initializers of the query, key, value and output projections."""
    return [_normal(derive_seed(seed, index)) for index in range(4)]


def _feed_forward_initializers(seed: int) -> list[keras.initializers.Initializer]:
    """Kernel initializers of the MLP's hidden and output layers."""
    return [_normal(derive_seed(seed, index)) for index in range(2)]


@keras.saving.register_keras_serializable(package="tfmulti")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each token and of its position.

    Args:
        vocab_size: number of distinct tokens.
        sequence_length: longest sequence (number of learned positions).
        d_model: embedding width.
        seed: seeds the two embedding tables.
        tensor_parallel_devices: if given, the token table's rows are split over these
            devices (`VocabParallelEmbedding`).

    Example:
        >>> layer = TokenAndPositionEmbedding(vocab_size=16, sequence_length=8, d_model=4)
        >>> layer(keras.ops.zeros((2, 8), "int32")).shape
        (2, 8, 4)
    """

    def __init__(
        self, vocab_size, sequence_length, d_model, seed=0, tensor_parallel_devices=None, **kwargs
    ):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.d_model = d_model
        self.seed = seed
        self.tensor_parallel_devices = tensor_parallel_devices
        token_initializer = _normal(derive_seed(seed, 0))
        if tensor_parallel_devices:
            self.token_embedding = VocabParallelEmbedding(
                vocab_size,
                d_model,
                tensor_parallel_devices,
                embeddings_initializer=token_initializer,
                dtype=self.dtype_policy,
            )
        else:
            self.token_embedding = keras.layers.Embedding(
                vocab_size,
                d_model,
                embeddings_initializer=token_initializer,
                dtype=self.dtype_policy,
            )
        self.position_embedding = keras.layers.Embedding(
            sequence_length,
            d_model,
            embeddings_initializer=_normal(derive_seed(seed, 1)),
            dtype=self.dtype_policy,
        )

    def build(self, input_shape):
        self.token_embedding.build(input_shape)
        self.position_embedding.build((self.sequence_length,))

    def call(self, tokens):
        positions = ops.arange(ops.shape(tokens)[-1])
        return self.token_embedding(tokens) + self.position_embedding(positions)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.d_model)

    def get_config(self):
        config = super().get_config()
        config.update(
            vocab_size=self.vocab_size,
            sequence_length=self.sequence_length,
            d_model=self.d_model,
            seed=self.seed,
            tensor_parallel_devices=self.tensor_parallel_devices,
        )
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class CausalSelfAttention(keras.layers.Layer):
    """Multi-head self-attention in which each position sees only itself and earlier ones.

    Args:
        d_model: input and output width; split evenly over the heads.
        num_heads: number of attention heads.
        seed: seeds the query, key, value and output projections.

    Example:
        >>> layer = CausalSelfAttention(d_model=8, num_heads=2)
        >>> layer(keras.ops.zeros((2, 5, 8))).shape
        (2, 5, 8)
    """

    def __init__(self, d_model, num_heads, seed=0, **kwargs):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(
                "d_model must be a multiple of num_heads. "
                f"Received: d_model={d_model}, num_heads={num_heads}"
            )
        self.d_model = d_model
        self.num_heads = num_heads
        self.seed = seed
        self.query, self.key, self.value, self.output_projection = (
            keras.layers.Dense(d_model, kernel_initializer=initializer, dtype=self.dtype_policy)
            for initializer in _attention_initializers(seed)
        )
        self.softmax = keras.layers.Softmax(axis=-1, dtype=self.dtype_policy)

    def build(self, input_shape):
        for projection in (self.query, self.key, self.value, self.output_projection):
            projection.build(input_shape)

    def _split_heads(self, x, length):
        x = ops.reshape(x, (-1, length, self.num_heads, self.d_model // self.num_heads))
        return ops.transpose(x, (0, 2, 1, 3))

    def call(self, inputs):
        length = ops.shape(inputs)[1]
        query = self._split_heads(self.query(inputs), length)
        key = self._split_heads(self.key(inputs), length)
        value = self._split_heads(self.value(inputs), length)
        attended = ops.transpose(attend_causally(query, key, value, self.softmax), (0, 2, 1, 3))
        return self.output_projection(ops.reshape(attended, (-1, length, self.d_model)))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(d_model=self.d_model, num_heads=self.num_heads, seed=self.seed)
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class FeedForward(keras.layers.Layer):
    """The Transformer MLP: a GELU dense layer of width mlp_dim, then back to d_model.

    Args:
        d_model: input and output width.
        mlp_dim: hidden width.
        seed: seeds the two dense layers.

    Example:
        >>> FeedForward(d_model=8, mlp_dim=32)(keras.ops.zeros((2, 5, 8))).shape
        (2, 5, 8)
    """

    def __init__(self, d_model, mlp_dim, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.mlp_dim = mlp_dim
        self.seed = seed
        hidden_initializer, output_initializer = _feed_forward_initializers(seed)
        self.hidden = keras.layers.Dense(
            mlp_dim,
            activation="gelu",
            kernel_initializer=hidden_initializer,
            dtype=self.dtype_policy,
        )
        self.output_projection = keras.layers.Dense(
            d_model, kernel_initializer=output_initializer, dtype=self.dtype_policy
        )

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.output_projection.build((*input_shape[:-1], self.mlp_dim))

    def call(self, inputs):
        return self.output_projection(self.hidden(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(d_model=self.d_model, mlp_dim=self.mlp_dim, seed=self.seed)
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class TransformerBlock(keras.layers.Layer):
    """A pre-LN Transformer block: x + attention(norm(x)), then x + mlp(norm(x)).

    Args:
        d_model: width of the residual stream.
        num_heads: attention heads.
        mlp_dim: hidden width of the MLP.
        seed: seeds the attention and MLP weights.
        tensor_parallel_devices: if given, attention heads and MLP hidden units are split
            over these devices (`ParallelSelfAttention`, `ParallelMLP`).

    Example:
        >>> TransformerBlock(d_model=8, num_heads=2, mlp_dim=32)(keras.ops.zeros((2, 5, 8))).shape
        (2, 5, 8)
    """

    def __init__(self, d_model, num_heads, mlp_dim, seed=0, tensor_parallel_devices=None, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.num_heads = num_heads
        self.mlp_dim = mlp_dim
        self.seed = seed
        self.tensor_parallel_devices = tensor_parallel_devices
        attention_seed, feed_forward_seed = derive_seed(seed, 0), derive_seed(seed, 1)
        self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        if tensor_parallel_devices:
            self.attention = ParallelSelfAttention(
                d_model,
                num_heads,
                tensor_parallel_devices,
                kernel_initializers=_attention_initializers(attention_seed),
                dtype=self.dtype_policy,
            )
            hidden_initializer, output_initializer = _feed_forward_initializers(feed_forward_seed)
            self.feed_forward = ParallelMLP(
                d_model,
                mlp_dim,
                tensor_parallel_devices,
                hidden_initializer=hidden_initializer,
                output_initializer=output_initializer,
                dtype=self.dtype_policy,
            )
        else:
            self.attention = CausalSelfAttention(
                d_model, num_heads, seed=attention_seed, dtype=self.dtype_policy
            )
            self.feed_forward = FeedForward(
                d_model, mlp_dim, seed=feed_forward_seed, dtype=self.dtype_policy
            )

    def build(self, input_shape):
        for layer in (self.attention_norm, self.attention, self.mlp_norm, self.feed_forward):
            layer.build(input_shape)

    def call(self, inputs):
        if self.tensor_parallel_devices:
            # Norms, biases and residual adds on every device of the group (Megatron).
            return pre_ln_block(
                inputs, self.attention_norm, self.attention, self.mlp_norm, self.feed_forward
            )
        x = inputs + self.attention(self.attention_norm(inputs))
        return x + self.feed_forward(self.mlp_norm(x))

    def replicated_weight_bytes(self) -> int:
        """Bytes of the weights every device of a tensor group reads (the others are split):
        the two norms' scales and offsets, in the variables' dtype (norms do not autocast),
        and the biases added after each reduction, in the compute dtype."""
        width = (self.d_model,)
        return 4 * tensor_bytes(width, self.variable_dtype) + 2 * tensor_bytes(
            width, self.compute_dtype
        )

    def communication_bytes(self, input_shape, enters: bool = True, exits: bool = True):
        """Bytes the tensor-parallel block moves per forward and backward pass
        (`tfmulti.parallel.pre_ln_block_bytes`); `enters`/`exits`: its input is not handed
        on by a block before it / its output goes to a layer on one device."""
        return pre_ln_block_bytes(
            input_shape,
            self.compute_dtype,
            len(self.tensor_parallel_devices),
            self.replicated_weight_bytes(),
            enters=enters,
            exits=exits,
        )

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(
            d_model=self.d_model,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
            seed=self.seed,
            tensor_parallel_devices=self.tensor_parallel_devices,
        )
        return config


@keras.saving.register_keras_serializable(package="tfmulti")
class LanguageModelHead(keras.layers.Layer):
    """The final LayerNorm and the dense layer giving one logit per vocabulary token.

    Args:
        vocab_size: number of logits per position.
        seed: seeds the vocabulary projection.

    Example:
        >>> LanguageModelHead(vocab_size=16)(keras.ops.zeros((2, 5, 8))).shape
        (2, 5, 16)
    """

    def __init__(self, vocab_size, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.seed = seed
        self.final_norm = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.logits = keras.layers.Dense(
            vocab_size, kernel_initializer=_normal(seed), dtype=self.dtype_policy
        )

    def build(self, input_shape):
        self.final_norm.build(input_shape)
        self.logits.build(input_shape)

    def call(self, inputs):
        return self.logits(self.final_norm(inputs))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.vocab_size)

    def get_config(self):
        config = super().get_config()
        config.update(vocab_size=self.vocab_size, seed=self.seed)
        return config


def build_blocks(
    input_shape: Sequence[int],
    num_outputs: int,
    seed: int = 0,
    vocab_size: int | None = None,
    sequence_length: int | None = None,
    num_layers: int = 2,
    num_heads: int = 4,
    d_model: int = 64,
    mlp_dim: int | None = None,
    tensor_parallel: int = 1,
    tensor_parallel_devices: Sequence[str] | str | None = None,
) -> list[keras.layers.Layer]:
    """Builds the language model as an embedding block, num_layers blocks and a head block.

    Args:
        input_shape: (sequence_length,), the token positions of one example.
        num_outputs: the vocabulary size (one logit per token).
        seed: seeds every weight (see `derive_seed`).
        vocab_size: optional; must equal num_outputs when given.
        sequence_length: optional; must equal input_shape[0] when given.
        num_layers: Transformer blocks.
        num_heads: attention heads; must divide d_model.
        d_model: width of the residual stream.
        mlp_dim: hidden width of each MLP; 4 * d_model if None.
        tensor_parallel: K > 1 splits every attention (by heads), MLP (by hidden units)
            and the token embedding (by vocabulary rows) over K devices; num_heads,
            mlp_dim and the vocabulary must be divisible by K.
        tensor_parallel_devices: the K devices (names, or one comma-separated string);
            None means the first K logical devices.

    Example:
        >>> [type(b).__name__ for b in build_blocks((32,), 64, num_layers=1)]
        ['TokenAndPositionEmbedding', 'TransformerBlock', 'LanguageModelHead']
    """
    input_shape = tuple(int(size) for size in input_shape)
    if len(input_shape) != 1:
        raise ValueError(
            "The transformer takes token sequences of shape (sequence_length,). "
            f"Received: input_shape={input_shape}"
        )
    if vocab_size is not None and vocab_size != num_outputs:
        raise ValueError(
            "vocab_size must equal the number of outputs (the dataset's vocabulary). "
            f"Received: vocab_size={vocab_size}, num_outputs={num_outputs}"
        )
    if sequence_length is not None and sequence_length != input_shape[0]:
        raise ValueError(
            "sequence_length must equal the dataset's sequence length. "
            f"Received: sequence_length={sequence_length}, input_shape={input_shape}"
        )
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1. Received: num_layers={num_layers}")
    if tensor_parallel < 1:
        raise ValueError(
            "tensor_parallel must be >= 1 (1: no split). "
            f"Received: tensor_parallel={tensor_parallel}"
        )
    devices = None
    if tensor_parallel > 1 or tensor_parallel_devices is not None:
        devices = resolve_shard_devices(tensor_parallel, tensor_parallel_devices)
    blocks = [
        TokenAndPositionEmbedding(
            num_outputs,
            input_shape[0],
            d_model,
            seed=derive_seed(seed, 0),
            tensor_parallel_devices=devices,
            name="embedding",
        )
    ]
    for index in range(num_layers):
        blocks.append(
            TransformerBlock(
                d_model,
                num_heads,
                mlp_dim or 4 * d_model,
                seed=derive_seed(seed, index + 1),
                tensor_parallel_devices=devices,
                name=f"transformer_block_{index}",
            )
        )
    # Logits stay float32 under mixed precision, the Keras convention.
    blocks.append(
        LanguageModelHead(
            num_outputs, seed=derive_seed(seed, num_layers + 1), name="lm_head", dtype="float32"
        )
    )
    return blocks
