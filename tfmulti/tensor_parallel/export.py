"""Tensor-parallel models saved as plain single-device Keras: the same architecture, shards joined.

`unsplit_model` rebuilds a functional model from its config with every split layer
replaced by its plain Keras layer (`ColumnParallelDense` and `RowParallelDense` by
`Dense`, `VocabParallelEmbedding` by `Embedding`) and every layer that takes
`tensor_parallel_devices` (as the reference Transformer's do) rebuilt with none, then loads
the joined weights (`unsplit_weights`).
"""

from __future__ import annotations

import keras

from tfmulti.compat import keras_internals
from tfmulti.tensor_parallel.sharded_layer import TensorParallelLayer, unsplit_weights

# Split layers whose whole computation is one plain Keras layer, with the config keys
# they share; a split layer in any other setting has no single-layer twin.
_PLAIN_TWINS = {
    "ColumnParallelDense": (
        "Dense",
        ("units", "activation", "use_bias", "kernel_initializer", "bias_initializer"),
    ),
    "RowParallelDense": (
        "Dense",
        ("units", "activation", "use_bias", "kernel_initializer", "bias_initializer"),
    ),
    "VocabParallelEmbedding": ("Embedding", ("input_dim", "output_dim", "embeddings_initializer")),
}
# Settings under which a split layer's output is not the plain layer's.
_NO_TWIN = {"gather_output": False, "input_is_parallel": True}
_SPLIT_CLASS_NAMES = ("ParallelMLP", "ParallelSelfAttention", *_PLAIN_TWINS)


def has_tensor_parallel_layers(model: keras.Model) -> bool:
    """Whether any layer of `model`, at any depth, is a tensor-parallel layer."""
    return any(
        isinstance(layer, TensorParallelLayer)
        for layer in keras_internals.layers_within(model, include_self=False)
    )


def unsplit_model(model: keras.Model) -> keras.Model:
    """Returns a single-device copy of functional `model` with its split layers unsplit.

    The copy holds no tfmulti split layers, runs on one device and holds `model`'s
    weights, each split weight's shards joined; its predictions equal `model`'s.

    Raises:
        ValueError: a split layer has no plain twin in the setting it is used in.

    Example:
        >>> model = registry.build_model("transformer", (16,), 32, tensor_parallel=2)
        >>> unsplit_model(model).save("transformer.keras")
    """
    # A plain Functional over the same graph: subclasses (such as TensorParallelModel)
    # serialize without their graph.
    graph = keras.Model(model.inputs, model.outputs, name=model.name)
    config = _unsplit_config(keras.saving.serialize_keras_object(graph))
    plain = keras.saving.deserialize_keras_object(config)
    plain.set_weights(unsplit_weights(model))
    return plain


def _unsplit_config(node):
    """Copies a serialized Keras object with split layers replaced by their plain twins."""
    if isinstance(node, list):
        return [_unsplit_config(each) for each in node]
    if not isinstance(node, dict):
        return node
    node = {key: _unsplit_config(value) for key, value in node.items()}
    layer_config = node.get("config")
    if not isinstance(layer_config, dict):
        return node
    class_name = node.get("class_name")
    if class_name in _SPLIT_CLASS_NAMES:
        return _plain_twin(node, class_name, layer_config)
    if "tensor_parallel_devices" in layer_config:
        node["config"] = {**layer_config, "tensor_parallel_devices": None}
    return node


def _plain_twin(node: dict, class_name: str, layer_config: dict) -> dict:
    twin = _PLAIN_TWINS.get(class_name)
    blocking = {key: value for key, value in _NO_TWIN.items() if layer_config.get(key) == value}
    if twin is None or blocking:
        raise ValueError(
            f"Layer {layer_config.get('name')!r} ({class_name}) has no plain Keras layer "
            "that computes the same; to export it, use it inside a layer that takes "
            "tensor_parallel_devices and builds plain layers without them (as "
            f"models/transformer.py does). Received: {class_name}({blocking or ''})"
        )
    plain_class, shared_keys = twin
    plain_config = {key: layer_config[key] for key in ("name", "dtype", "trainable")}
    plain_config.update({key: layer_config[key] for key in shared_keys})
    # The rest of the entry (its name and inbound nodes in the graph) stays as it was.
    return {
        **node,
        "module": "keras.layers",
        "class_name": plain_class,
        "config": plain_config,
        "registered_name": None,
    }


class TensorParallelModel(keras.Model):
    """A functional model with tensor-parallel layers that saves as its unsplit twin.

    Shares its layers (and so its weights and `save_weights` layout) with the model it
    wraps; `save("file.keras")` writes `to_model()`, a plain single-device model that
    `keras.saving.load_model` loads without tfmulti.

    Args:
        model: a functional model built from `tfmulti.parallel` split layers.

    Example:
        >>> parallel = TensorParallelModel(model)
        >>> parallel.compile(optimizer="adam", loss="mse"); parallel.fit(x, y)
        >>> parallel.save("model.keras")
    """

    def __init__(self, model: keras.Model):
        super().__init__(model.input, model.output, name=model.name)

    def to_model(self) -> keras.Model:
        """The same architecture from plain Keras layers, holding the joined weights."""
        return unsplit_model(self)

    def save(self, filepath, *args, **kwargs):
        """Saves `to_model()` (see `keras.Model.save`): a plain single-device model."""
        self.to_model().save(filepath, *args, **kwargs)
