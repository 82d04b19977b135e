"""A model that spreads a user's model over devices answers Keras' calls as that model.

`PipelineModel`, `HybridPipelineModel` and `PlacedModel` hold the user's layers (or copies
of them) in structures of their own: stages, replicas, units. Keras would count, list,
save and summarise those structures. `WrappedModel` makes `weights` (and so
`trainable_weights`, `get_weights`), `set_weights`, `count_params`, `save`,
`save_weights`, `load_weights` and `summary` those of `to_model()`, the plain model
sharing the trained weights: weight lists and files interchange with the plain model,
and `keras.callbacks.ModelCheckpoint` writes files plain Keras loads. `variables` and
`trainable_variables`, what the optimizer holds and training differentiates, stay the
wrapper's own (replica 0's, for a hybrid model, whose other copies take its values).
"""

from __future__ import annotations

import keras
import numpy as np

from tfmulti.build_ahead import BuildsAheadOfTracing
from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices


class WrappedModel(BuildsAheadOfTracing):
    """Mixin, before `keras.Model`, for a model that trains a user's model spread over devices.

    A subclass gives:
        to_model(): the plain single-device model sharing the weights; raises ValueError
            while it cannot be made yet.
        _model_weights(): that model's weights in its order, without making it.
        _parts_built(): whether every part holding weights is built.
        placement_table(): one line per layer or block, saying where it runs.
        _use_xla(enabled), _check_optimizer(optimizer): optional, see `compile`.
        _weights_changed(): optional; called after weights are set or loaded from
            outside (a hybrid model copies them into its other replicas).
        build_parts(x), output_spec(x): optional; see `BuildsAheadOfTracing`, which builds
            what the first step would before it is traced.

    Example:
        >>> class PlacedModel(WrappedModel, keras.Model): ...
        >>> placed.summary()  # the plain model's table, then where each layer runs
    """

    def compile(self, *args, jit_compile=False, **kwargs):
        """Like `keras.Model.compile`; each optimizer slot and update follows its variable's
        device. `jit_compile` goes to `_use_xla`: one XLA cluster would merge the devices."""
        self._use_xla(jit_compile is True)
        super().compile(*args, jit_compile=False, **kwargs)
        if self.optimizer is not None:
            self._check_optimizer(getattr(self.optimizer, "inner_optimizer", self.optimizer))
            place_optimizer_on_variable_devices(self.optimizer)

    def _use_xla(self, enabled: bool) -> None:
        """Compiles the parts that run on one device each with XLA (refused by default)."""
        if enabled:
            raise ValueError(
                f"{type(self).__name__} runs each layer on its own device, which XLA "
                "compilation ignores. Received: jit_compile=True; use jit_compile=False."
            )

    def _check_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Refuses optimizer settings the model cannot honour (none by default)."""

    @property
    def weights(self):
        """The plain model's weights, in its order (one copy of them)."""
        return self._model_weights()

    def count_params(self):
        """Scalars in the plain model's weights; refused, as Keras does, before it is built."""
        if not self._parts_built():
            return keras.Model.count_params(self)
        return int(sum(np.prod(weight.shape) for weight in self.weights))

    def set_weights(self, weights):
        """Sets the plain model's weights, in its order, from NumPy arrays."""
        keras.Model.set_weights(self, weights)
        self._weights_changed()

    def save(self, filepath, *args, **kwargs):
        """Saves `to_model()`: a plain Keras model that `keras.saving.load_model` loads
        anywhere, without tfmulti."""
        self.to_model().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Writes the plain model's weights file, which loads into it on one device."""
        return self.to_model().save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Reads a weights file of the plain model; each variable keeps its device."""
        self.to_model().load_weights(filepath, *args, **kwargs)
        self._weights_changed()

    def summary(
        self,
        line_length=None,
        positions=None,
        print_fn=None,
        expand_nested=False,
        show_trainable=False,
        layer_range=None,
    ):
        """Keras' summary of the plain model, then where each of its layers or blocks runs.

        Arguments as for `keras.Model.summary`; `print_fn` also receives the placement.
        """
        options = dict(
            line_length=line_length,
            positions=positions,
            print_fn=print_fn,
            expand_nested=expand_nested,
            show_trainable=show_trainable,
            layer_range=layer_range,
        )
        try:
            model = self.to_model()
        except ValueError:
            # A stage list that has seen no input yet: summarise the stages themselves.
            keras.Model.summary(self, **options)
        else:
            model.summary(**options)
        placement = f'Placement of "{self.name}" ({type(self).__name__}):\n'
        (print_fn or print)(placement + self.placement_table())

    def _weights_changed(self) -> None:
        """Called after the weights were set or loaded from outside training."""
