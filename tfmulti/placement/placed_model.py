"""Model parallelism for any Keras functional model: each layer on its own device.

`place` assigns every top-level unit of the graph (layer, nested model, `keras.ops` call)
a device, from an explicit map or the balancer, moves the unit's variables there and
returns a `PlacedModel` over the same layers whose forward and backward run each unit on
its device, so tensors cross devices only along graph edges. Units run one after another,
as in the unplaced model (no micro-batching; see `tfmulti.pipeline` for that).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from tfmulti.compat.keras_internals import OperationWrappingFunctional
from tfmulti.costing.cost_cache import CostCache, as_cost_cache
from tfmulti.costing.model_graph import functional_view
from tfmulti.pipeline.stages.spec_sample import sample_from_input_specs
from tfmulti.placement.device_map import (
    BALANCE_POLICIES,
    assign_balanced,
    assign_from_map,
    memory_bytes,
    read_placement_file,
    resolve_device_list,
)
from tfmulti.placement.summary import LayerPlacement, PlacementSummary
from tfmulti.placement.units import graph_units, unit_blocks
from tfmulti.platform.runtime.devices import logical_device_names
from tfmulti.platform.runtime.variable_moves import move_variable
from tfmulti.wrapped_model import WrappedModel

# Each unit runs in a name scope carrying its device index; TensorFlow names a gradient op
# after its forward op's scope, which is how backward ops find their unit's device.
_SCOPE_PREFIX = "tfmulti_device_"
_SCOPE_PATTERN = re.compile(_SCOPE_PREFIX + r"(\d+)(?:_\d+)*/")


class PlacedModel(WrappedModel, OperationWrappingFunctional, keras.Model):
    """A functional model whose units run, and keep variables and optimizer state, on devices.

    Shares its layers (and so its weights and weight-file layout) with the model it was
    made from. Made by `place`; compile, fit, evaluate, predict and callbacks work as for
    any Keras model; weights, `count_params`, saving and `summary` are those of the model
    it was made from (`to_model()`, see `WrappedModel`), so `save("file.keras")` and
    `save_weights` write files that load on one device. Backward ops are placed when
    the step is traced (the default); `run_eagerly=True` runs backward on the default
    device, and XLA (`jit_compile=True`) is refused since it would ignore the devices.

    Args:
        model: a functional model whose variables already sit on their units' devices.
        devices: the devices, in index order.
        unit_devices: device index of each unit, by unit name.
        placement_summary: what went where, for reports.
        source_model: the model the user placed (e.g. a Sequential); `model` by default.
    """

    def __init__(
        self,
        model: keras.Model,
        devices: Sequence[str],
        unit_devices: Mapping[str, int],
        placement_summary: PlacementSummary,
        source_model: keras.Model | None = None,
    ):
        super().__init__(model.input, model.output, name=model.name)
        self.devices = list(devices)
        self.unit_devices = dict(unit_devices)
        self.placement_summary = placement_summary
        source_model = model if source_model is None else source_model
        # Held in a closure, out of Keras's attribute tracking, so the weights file keeps
        # the unplaced model's layout.
        self._source_model = lambda: source_model

    def to_model(self) -> keras.Model:
        """The model that was placed: the same layers, so it holds the trained weights."""
        return self._source_model()

    def placement_table(self) -> str:
        """One line per layer: its device and cost, then each device's load."""
        return str(self.placement_summary)

    def _model_weights(self) -> list:
        return self.to_model().weights

    def _parts_built(self) -> bool:
        return True

    def train_step(self, data):
        if not tf.inside_function():
            return super().train_step(data)
        with tf.compat.v1.get_default_graph().device(self._device_of_gradient_op):
            return super().train_step(data)

    def _device_of_gradient_op(self, op) -> str:
        if op.device:
            return op.device
        scopes = _SCOPE_PATTERN.findall(op.name)
        return self.devices[int(scopes[-1])] if scopes else ""

    def wrap_operation(self, operation, function: Callable) -> Callable:
        """`function` (a call of `operation`) run on its unit's device, in a name scope
        that its gradient ops inherit."""
        # Keras runs the graph once while constructing the model, before devices are set.
        index = getattr(self, "unit_devices", {}).get(operation.name)
        if index is None:
            return function

        def call(*args, **kwargs):
            with tf.device(self.devices[index]), tf.name_scope(f"{_SCOPE_PREFIX}{index}"):
                return function(*args, **kwargs)

        return call


def place(
    model: keras.Model,
    device_map: Mapping[str, int | str] | None = None,
    devices: Sequence[str | int] | None = None,
    balance: str | None = None,
    sample_input=None,
    print_fn: Callable[[str], None] | None = print,
    cost_cache: CostCache | str | os.PathLike | None = None,
) -> PlacedModel:
    """Places each layer of a functional model, with its variables and optimizer state, on a device.

    Moves `model`'s variables to their layers' devices (the model is changed in place,
    like `torch.nn.Module.to`) and returns a `PlacedModel` sharing its layers, so outputs
    and training are those of `model`. A nested model is one unit. Tied weights stay with
    the first unit, in topological order, that holds them.

    Args:
        model: a functional (or built Sequential) Keras model, compiled or not; compile the
            returned model to train.
        device_map: {"layer name or regex": device index or name}; see `assign_from_map`.
        devices: devices to use (names or logical device indices); all logical devices of
            the accelerator type by default.
        balance: instead of a map, "params", "time" or "memory": contiguous runs of units
            in topological order, split by the balancer on costs measured from the layers.
        sample_input: one batch of model input; adds measured time and memory to the
            summary. "time" and "memory" make one from the model's input specs when None
            (every input axis but the batch known).
        print_fn: prints the summary; None to stay quiet.
        cost_cache: where the layers' measured seconds are kept for the next placement of
            the same model (a JSON file's path or a `CostCache`); cached layers are not
            timed again.

    Returns:
        The `PlacedModel`; its `placement_summary` says what went where.

    Example:
        >>> placed = place(model, {"embedding": 0, "transformer_block_.*": 1, ".*": 2})
        >>> placed = place(model, balance="time", sample_input=x[:32], devices=[0, 1])
        >>> placed.compile(optimizer="adam", loss="mse")
    """
    source_model, model = model, functional_view(model)
    if (device_map is None) == (balance is None):
        raise ValueError(
            "Give exactly one of device_map (explicit) or balance ("
            f"{' / '.join(BALANCE_POLICIES)}). Received: device_map={device_map!r}, "
            f"balance={balance!r}"
        )
    if balance is not None and balance not in BALANCE_POLICIES:
        raise ValueError(
            f"balance must be one of {list(BALANCE_POLICIES)}. Received: balance={balance!r}"
        )
    if balance in ("time", "memory") and sample_input is None:
        sample_input = sample_from_input_specs(model, f"balance={balance!r}")
    devices = resolve_device_list(devices, logical_device_names())
    units = graph_units(model)
    blocks = unit_blocks(
        model,
        units,
        sample_input,
        time_units=sample_input is not None,
        cost_cache=as_cost_cache(cost_cache),
    )
    if device_map is not None:
        indices = assign_from_map(units, device_map, devices)
    else:
        indices = assign_balanced(blocks, len(devices), balance)
    unit_devices = {unit.name: index for unit, index in zip(units, indices, strict=True)}
    _move_variables(units, unit_devices, devices)
    measured = sample_input is not None
    summary = PlacementSummary(
        layers=tuple(
            LayerPlacement(
                name=unit.name,
                kind=type(unit.operation).__name__,
                device=devices[unit_devices[unit.name]],
                params=block.params,
                time=block.forward_time + block.backward_time if measured else None,
                memory=memory_bytes(block) if measured else None,
            )
            for unit, block in zip(units, blocks, strict=True)
        ),
        devices=tuple(devices),
        policy="explicit map" if balance is None else f"balance={balance}",
        cross_device_edges=tuple(
            (producer, unit.name)
            for unit in units
            for producer in unit.producers
            if unit_devices[producer] != unit_devices[unit.name]
        ),
    )
    if print_fn is not None:
        print_fn(str(summary))
    return PlacedModel(model, devices, unit_devices, summary, source_model)


def place_reference_model(
    model: keras.Model,
    devices: Sequence[str | int] | None,
    placement: str,
    sample_input=None,
    print_fn: Callable[[str], None] | None = print,
    cost_cache: CostCache | str | os.PathLike | None = None,
) -> tuple[PlacedModel, PlacementSummary]:
    """Places a model from a `--placement` value: "auto", a balance policy, or a JSON file.

    "auto" balances by measured time when `sample_input` is given, else by parameters.
    A file holds one JSON object {"layer name or regex": device index or name}, tried as
    `place`'s `device_map` (exact names first, then patterns in file order), e.g.
    {"embedding": 0, "transformer_block_0": 0, "transformer_block_.*": 1, "lm_head": 1}.

    Example:
        >>> placed, summary = place_reference_model(model, None, "auto", x[:32])
    """
    if placement == "auto":
        policy = "time" if sample_input is not None else "params"
        placed = place(model, None, devices, policy, sample_input, print_fn, cost_cache)
    elif placement in BALANCE_POLICIES:
        placed = place(model, None, devices, placement, sample_input, print_fn, cost_cache)
    else:
        device_map = read_placement_file(placement)
        placed = place(model, device_map, devices, None, sample_input, print_fn, cost_cache)
    return placed, placed.placement_summary


def _move_variables(units, unit_devices, devices) -> None:
    moved = set()
    for unit in units:
        for variable in getattr(unit.operation, "variables", ()):
            if id(variable) not in moved:
                moved.add(id(variable))
                move_variable(variable, devices[unit_devices[unit.name]])
