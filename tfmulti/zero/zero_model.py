"""`ZeroDataParallel`: a Keras model trained data-parallel with its state sharded, ZeRO-style.

One traced step runs every replica's forward and backward on its device, reduce-scatters
the gradients to the owners of each weight block, lets the user's optimizer update the
blocks it owns (so optimizer state is sharded under every stage), then, under stages 1
and 2, copies the new blocks to every device. Stage 3 keeps no whole copies: each
replica gathers whole weights into its step and drops them after it. The devices may
be one host's or, with the chief driving, every worker's (`connected_cluster`).

The user's model keeps its layers; its trainable variables give up their storage once
sharded (`release_storage`) and are read, inside the step, through Keras' stateless call.
`weights`, `get_weights`, `save`, `save_weights` and `summary` are the plain model's, with
whole weights, and checkpoints hold whole weights and optimizer state, so a run resumes on
any number of devices.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf
from keras.utils import unpack_x_y_sample_weight

from tfmulti.compat.keras_internals import (
    call_takes_training,
    compiled_metrics,
    compute_loss,
    release_storage,
    restore_storage,
    skip_gradient_all_reduce,
    track_loss,
)
from tfmulti.platform.runtime.devices import logical_device_names
from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices
from tfmulti.wrapped_model import WrappedModel
from tfmulti.zero.formulas import check_stage
from tfmulti.zero.gather_on_read import GatherOnRead, regatherable_layers, regathered_layers
from tfmulti.zero.layout import padded_weights
from tfmulti.zero.optimizer_slots import SlotMap
from tfmulti.zero.sharded_weights import ShardedWeights

# Attributes Keras' weight saving must not walk into: `save_own_variables` writes their
# state whole instead, so checkpoints fit any device count.
_NOT_SAVED_WALKING = frozenset({"optimizer", "weight_blocks", "plain_model"})


class _Held:
    """Holds the user's model out of Keras' tracking, so the wrapper's own saving decides."""

    def __init__(self, model: keras.Model):
        self.model = model


class ZeroDataParallel(WrappedModel, keras.Model):
    """A built Keras model trained data-parallel over `devices` with ZeRO stage `stage`.

    Args:
        model: the user's model, built (its weights exist).
        devices: the data-parallel devices; the global batch is split between them.
        stage: 1 shards optimizer state, 2 also gradients, 3 also weights.

    Example:
        >>> zero = tfmulti.zero.ZeroDataParallel(model, ["/device:CPU:0", "/device:CPU:1"], 3)
        >>> zero.compile(optimizer="adam", loss="mse")
        >>> zero.fit(dataset)  # batched with the global batch size
        >>> zero.save("model.keras")  # the plain model, whole weights
    """

    def __init__(self, model: keras.Model, devices, stage: int, **kwargs):
        check_stage(stage)
        if stage == 0:
            raise ValueError(
                "ZeroDataParallel shards state from stage 1 on; stage 0 is plain data "
                "parallelism (tfmulti.get_strategy('mirrored')). Received: stage=0"
            )
        if not model.built:
            raise ValueError(
                f"Build model {model.name!r} before sharding it (call it on a batch or "
                "`model.build(input_shape)`)."
            )
        super().__init__(name=kwargs.pop("name", f"zero{stage}_{model.name}"), **kwargs)
        self._held = _Held(model)
        self.stage = stage
        self.data_devices = tuple(devices)
        self._sharded = ShardedWeights(
            model.trainable_variables, self.data_devices, keep_whole_copies=stage < 3
        )
        # Tracked: the blocks are what the optimizer trains and Keras' fit sees.
        self.weight_blocks = self._sharded.owned_variables
        self._slots: SlotMap | None = None
        self._regathered = regatherable_layers(model, self._sharded) if stage == 3 else []
        release_storage(model.trainable_variables)
        self.built = True

    # What Keras asks of a wrapped model

    @property
    def plain_model(self) -> keras.Model:
        """The user's model (its trainable weights live as blocks while training)."""
        return self._held.model

    def _model_weights(self):
        return self.plain_model.weights

    def _parts_built(self) -> bool:
        return True

    def placement_table(self) -> str:
        kinds = {1: "optimizer state", 2: "optimizer state and gradients", 3: "all state"}
        return (
            f"ZeRO stage {self.stage}: {kinds[self.stage]} sharded over "
            f"{len(self.data_devices)} devices: {', '.join(self.data_devices)}"
        )

    def to_model(self) -> keras.Model:
        """The plain model, for its structure (`summary`, `count_params`); its weights'
        values are read inside `whole_weights()`."""
        return self.plain_model

    @contextlib.contextmanager
    def whole_weights(self):
        """The plain model with its trainable weights whole (on the host) while inside.

        Example:
            >>> with zero.whole_weights() as model:
            ...     model.save("model.keras")
        """
        variables = self.plain_model.trainable_variables
        host = logical_device_names("CPU")[0]
        restore_storage(variables, self._sharded.whole_numpy(), host)
        try:
            yield self.plain_model
        finally:
            release_storage(variables)

    def save(self, filepath, *args, **kwargs):
        with self.whole_weights() as model:
            model.save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        with self.whole_weights() as model:
            return model.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        with self.whole_weights() as model:
            model.load_weights(filepath, *args, **kwargs)
            whole = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
        self._sharded.assign_whole(whole)

    def get_weights(self):
        with self.whole_weights() as model:
            return model.get_weights()

    def set_weights(self, weights):
        with self.whole_weights() as model:
            model.set_weights(weights)
            whole = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
        self._sharded.assign_whole(whole)

    def step_graph(self, x_spec: tf.TensorSpec, y_spec: tf.TensorSpec) -> tf.Graph:
        """The training step traced for a batch of no rows, so every tensor that crosses
        devices in it is state: weights gathered, gradients reduce-scattered, new blocks
        copied (`transfer_bytes.sent_bytes(..., skip_scalars=True)` counts them).

        Args:
            x_spec, y_spec: one example's input and target (shape without the batch axis).
        """

        def empty(spec):
            return tf.TensorSpec((0, *spec.shape), spec.dtype)

        step = tf.function(lambda x, y: self.train_step((x, y)), autograph=False)
        return step.get_concrete_function(empty(x_spec), empty(y_spec)).graph

    def sharding_record(self) -> dict:
        """What the run's record says of the sharding: stage, devices, the weights padded
        to rows that divide by the devices (rows added), and the parameters with padding."""
        layouts = dict(
            zip((v.path for v in self._sharded.variables), self._sharded.layouts, strict=True)
        )
        return {
            "stage": self.stage,
            "devices": list(self.data_devices),
            "padded_weights": padded_weights(layouts),
            "parameters_with_padding": sum(
                layout.shard_size * layout.num_shards for layout in layouts.values()
            ),
        }

    def weight_storage(self) -> list:
        """Every variable holding weights: the blocks, each device's copies, and the
        plain model's non-trainable state (on the host)."""
        return [
            *self._sharded.storage(),
            *self.plain_model.non_trainable_variables,
        ]

    def _weights_changed(self) -> None:
        pass

    def __dir__(self):
        return [name for name in super().__dir__() if name not in _NOT_SAVED_WALKING]

    # Training

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        if self.optimizer is not None:
            place_optimizer_on_variable_devices(self.optimizer)
            skip_gradient_all_reduce(self.optimizer)  # the step reduce-scatters them
            self._slots = SlotMap.build(self.optimizer, self.weight_blocks)
            finalize = self.optimizer.finalize_variable_values

            def finalize_blocks(var_list):
                # `fit` ends by finalizing `trainable_weights`, the plain model's; an EMA
                # optimizer writes its averages into what it trained: the blocks.
                finalize(self.weight_blocks)
                if self.stage < 3:
                    self._sharded.all_gather_updates()

            object.__setattr__(self.optimizer, "finalize_variable_values", finalize_blocks)

    def output_spec(self, x):
        # The plain model's: a symbolic call of this model would go through `__call__`,
        # which no step uses (each step runs the replicas itself).
        return self.plain_model.compute_output_spec(x)

    def call(self, inputs, training=False):
        outputs, _ = self._replica_outputs(inputs, training=training)
        return outputs

    def _replica_outputs(self, inputs, training: bool):
        """Every replica's share of `inputs` through the model on its device, outputs joined."""
        parts = _split_rows(inputs, len(self.data_devices))
        outputs = []
        for replica, device in enumerate(self.data_devices):
            with tf.device(device):
                values = None if self.stage == 3 else self._sharded.whole_values(replica)
                output, _, _ = self._forward(replica, values, parts[replica], training)
                outputs.append(output)
        return keras.tree.map_structure(lambda *xs: tf.concat(xs, 0), *outputs), parts

    def _forward(self, replica: int, whole_values, x, training: bool):
        """(outputs, new non-trainable values, losses) of one replica's forward: on whole
        weights it holds (stages 1-2), or gathering each layer's where it runs (stage 3)."""
        model = self.plain_model
        state = [tf.identity(v.value) for v in model.non_trainable_variables]
        if whole_values is not None:
            return model.stateless_call(
                whole_values, state, x, return_losses=True, training=training
            )
        scope = GatherOnRead(
            self._sharded, replica, list(zip(model.non_trainable_variables, state, strict=True))
        )
        with scope, regathered_layers(self._regathered, scope):
            if call_takes_training(model):
                outputs = model.call(x, training=training)
            else:
                outputs = model.call(x)
            losses = model.losses
        new_state = [scope.get_current_value(v) for v in model.non_trainable_variables]
        return outputs, new_state, losses

    def train_step(self, data):
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        num_replicas = len(self.data_devices)
        x_parts = _split_rows(x, num_replicas)
        y_parts = _split_rows(y, num_replicas)
        weight_parts = _split_rows(sample_weight, num_replicas)
        total_rows = tf.cast(_rows(x), tf.float32)
        gradients, shares, losses, new_states = [], [], [], []
        for replica, device in enumerate(self.data_devices):
            with tf.device(device):
                rows = tf.cast(_rows(x_parts[replica]), tf.float32)
                share = rows / total_rows
                values = None if self.stage == 3 else self._sharded.whole_values(replica)
                with tf.GradientTape() as tape:
                    if values is not None:
                        tape.watch(values)
                    y_pred, new_state, extra = self._forward(
                        replica, values, x_parts[replica], training=True
                    )
                    loss = compute_loss(
                        self, x_parts[replica], y_parts[replica], y_pred, weight_parts[replica]
                    )
                    loss = loss + tf.add_n([tf.cast(e, loss.dtype) for e in extra] or [0.0])
                    scaled = self.optimizer.scale_loss(loss)
                # Stage 3 differentiates the block reads, each replica's gradients cut
                # into blocks already; stages 1-2 differentiate their whole weights.
                replica_gradients = tape.gradient(scaled, values or self.weight_blocks)
                if self.stage == 1:
                    # Stage 1 holds every gradient whole until the backward ends, then
                    # reduce-scatters; stage 2 sends each as soon as it exists.
                    replica_gradients = _after_all(replica_gradients)
                gradients.append(replica_gradients)
                shares.append(tf.where(rows > 0, share, 0.0))
                losses.append(tf.where(rows > 0, loss * share, 0.0))
                new_states.append(new_state)
                if compiled_metrics(self) is not None:
                    compiled_metrics(self).update_state(
                        y_parts[replica], y_pred, weight_parts[replica]
                    )
        if self.stage == 3:
            reduced = self._sharded.reduce_blocks(gradients, shares)
        else:
            reduced = self._sharded.reduce_scatter(gradients, shares)
        self.optimizer.apply(reduced, self.weight_blocks)
        if self.stage < 3:
            self._sharded.all_gather_updates()
        self._assign_replica_states(new_states)
        track_loss(self, tf.add_n(losses), total_rows)
        return self.get_metrics_result()

    def test_step(self, data):
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        y_pred, _ = self._replica_outputs(x, training=False)
        loss = compute_loss(self, x, y, y_pred, sample_weight, training=False)
        track_loss(self, loss, _rows(x))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        x, _, _ = unpack_x_y_sample_weight(data)
        return self._replica_outputs(x, training=False)[0]

    def _assign_replica_states(self, new_states: list[list[tf.Tensor]]) -> None:
        """Sets each non-trainable variable (BatchNorm statistics, seeds) from the replicas:
        floats to their mean over replicas, others to the first replica's value."""
        for index, variable in enumerate(self.plain_model.non_trainable_variables):
            values = [state[index] for state in new_states]
            if variable.dtype.startswith("float"):
                variable.assign(tf.add_n(values) / len(values))
            else:
                variable.assign(values[0])

    # Whole-state saving

    def save_own_variables(self, store):
        """Writes whole weights and whole optimizer state, whatever the device count."""
        for key, value in self._whole_state().items():
            store[key] = value

    def load_own_variables(self, store):
        """Reads `save_own_variables`' whole state and splits it over this run's devices."""
        expected = self._whole_state()
        missing = sorted(set(expected) - set(store.keys()))
        if missing or len(store.keys()) != len(expected):
            raise ValueError(
                f"expected {len(expected)} ZeRO state entries, found {len(store.keys())} "
                f"(missing {missing[:3]})"
            )
        weights = [np.asarray(store[f"weight.{k}"]) for k in range(len(self._sharded.layouts))]
        self._sharded.assign_whole(weights)
        for index, variable in enumerate(self.plain_model.non_trainable_variables):
            variable.assign(np.asarray(store[f"state.{index}"]))
        for key, variable in self._optimizer_entries():
            variable.assign(np.asarray(store[key]))
        for k, layout in enumerate(self._sharded.layouts):
            for t, slots in enumerate(self._slots_by_kind(k)):
                pieces = layout.split(np.asarray(store[f"slot.{k}.{t}"]))
                for slot, piece in zip(slots, pieces, strict=True):
                    slot.assign(piece)

    def _whole_state(self) -> dict[str, np.ndarray]:
        state = {f"weight.{k}": value for k, value in enumerate(self._sharded.whole_numpy())}
        for index, variable in enumerate(self.plain_model.non_trainable_variables):
            state[f"state.{index}"] = keras.ops.convert_to_numpy(variable.value)
        for key, variable in self._optimizer_entries():
            state[key] = keras.ops.convert_to_numpy(variable.value)
        for k, layout in enumerate(self._sharded.layouts):
            for t, slots in enumerate(self._slots_by_kind(k)):
                state[f"slot.{k}.{t}"] = layout.join(
                    [keras.ops.convert_to_numpy(slot.value) for slot in slots]
                )
        return state

    def _optimizer_entries(self) -> list[tuple[str, keras.Variable]]:
        """The optimizer's variables that are not per-block slots (step count, loss scale)."""
        if self.optimizer is None or self._slots is None:
            return []
        slot_ids = self._slots.all_slots()
        return [
            (f"optimizer.{index}", variable)
            for index, variable in enumerate(
                v for v in self.optimizer.variables if id(v) not in slot_ids
            )
        ]

    def _slots_by_kind(self, weight: int) -> list[list]:
        """slots[t][j]: the t-th kind of optimizer slot of weight `weight`, block j."""
        if self._slots is None:
            return []
        per_block = [self._slots.of(block) for block in self._sharded.owned[weight]]
        return [list(kind) for kind in zip(*per_block, strict=True)]


def _rows(tensors):
    """The rows of a batch: a number where its shape says, else a tensor."""
    first = keras.tree.flatten(tensors)[0]
    return first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]


def _split_rows(tensors, parts: int) -> list:
    """`tensors` cut into `parts` near-equal row blocks (as `np.array_split`); None stays None."""
    if tensors is None:
        return [None] * parts
    rows = _rows(tensors)
    bounds = [(rows * index) // parts for index in range(parts + 1)]
    return [
        keras.tree.map_structure(lambda t, a=bounds[i], b=bounds[i + 1]: t[a:b], tensors)
        for i in range(parts)
    ]


def _after_all(tensors: list) -> list:
    """`tensors`, each released only once all of them exist."""
    dense = [tf.convert_to_tensor(t) for t in tensors]
    with tf.control_dependencies(dense):
        return [tf.identity(t) for t in dense]
