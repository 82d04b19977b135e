"""Measured block timings kept in a small JSON file, so a later run skips timing them.

`--partition=time` times each distinct block's forward and backward on one micro-batch.
The seconds stay valid while the block runs the same operations on the same shapes on the
same kind of device with the same TensorFlow, so an entry is keyed by `block_signature`
(class, config without name and seeds, weight shapes, input signature) and the whole file by
`environment()` (device kind, TensorFlow and Keras versions).

Beside the blocks, the file keeps the machine's own measured costs (`put_machine`): the
framework's per-step, per-replica and per-action costs, the all-reduce and how much
logical devices overlap (`tfmulti.planner.machine_benchmarks`), keyed by what they were
measured over and how ("devices=4,timing=4,callbacks").
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile

import keras
import tensorflow as tf
from absl import logging

COST_CACHE_FILE = "partition_costs.json"
_FORMAT = 1
# Config keys that choose initial values only, never which operations run or their shapes.
_VALUE_ONLY_KEYS = ("name", "seed")


def as_cost_cache(value) -> CostCache | None:
    """`value` as a `CostCache`: a JSON file's path, a `CostCache`, or None.

    Raises:
        ValueError: `value` is something else.
    """
    if isinstance(value, str | os.PathLike):
        return CostCache(os.fspath(value))
    if value is not None and not isinstance(value, CostCache):
        raise ValueError(
            f"cost_cache must be a JSON file's path or a CostCache. Received: cost_cache={value!r}"
        )
    return value


def block_signature(block: keras.Operation, inputs, arguments=None) -> str:
    """A key equal for blocks that cost the same: built `block` called on `inputs`.

    Two blocks of one class with equal configs (apart from names and seeds, which choose
    initial values only), equal weight shapes and dtypes, and inputs of equal shapes and
    dtypes run the same operations on the same shapes, so they take the same time; a
    Transformer's layers are timed once.

    Args:
        block: a built layer, or any Keras operation with a config (`keras.ops.cast`'s).
        inputs: the tensors it was called on (a structure of them).
        arguments: the call's other arguments, when they may change what it runs (a
            layer's `use_causal_mask=True`, an embedding's `reverse=True`): any structure
            of plain values, compared by their `repr`.

    Example:
        >>> block_signature(block, x)  # block already called on x
        '3f2a9c0d1e7b4a65'
    """
    description = {
        "class": f"{type(block).__module__}.{type(block).__qualname__}",
        "config": _without_value_only_keys(block.get_config()),
        "weights": [[list(v.shape), str(v.dtype)] for v in getattr(block, "weights", [])],
        "inputs": [[list(t.shape), t.dtype.name] for t in tf.nest.flatten(inputs)],
    }
    if arguments is not None:
        description["arguments"] = arguments
    text = json.dumps(description, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_value_only_keys(value):
    if isinstance(value, dict):
        return {
            key: _without_value_only_keys(item)
            for key, item in value.items()
            if key not in _VALUE_ONLY_KEYS
        }
    if isinstance(value, list | tuple):
        return [_without_value_only_keys(item) for item in value]
    return value


def environment() -> dict:
    """What else a timing depends on: the device kind and the library versions."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        device = f"GPU {details.get('device_name', 'unknown')}"
    else:
        device = f"CPU {_cpu_model()}"
    return {"device": device, "tensorflow": tf.__version__, "keras": keras.__version__}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CostCache:
    """Block timings read from and written to `path` (a JSON file).

    An unreadable or damaged file, or one measured elsewhere (another device kind or
    library version), counts as empty: timing runs again and `save` replaces it. A damaged
    file is reported in one warning line.

    Args:
        path: the JSON file, e.g. `<model_dir>/partition_costs.json`.
        remeasure: ignore what the file holds (time again), then overwrite it.

    Example:
        >>> cache = CostCache(os.path.join(model_dir, COST_CACHE_FILE))
        >>> seconds = cache.get(signature)  # (forward, backward) or None
    """

    def __init__(self, path: str, remeasure: bool = False):
        self.path = path
        self._environment = environment()
        self._entries: dict[str, dict] = {}
        self._machine: dict[str, dict] = {}
        if not remeasure:
            self._entries, self._machine = self._read()
        self._changed = False

    def _read(self) -> tuple[dict[str, dict], dict[str, dict]]:
        if not os.path.exists(self.path):
            return {}, {}
        try:
            with open(self.path) as handle:
                content = json.load(handle)
            entries = content["blocks"]
            for entry in entries.values():
                float(entry["forward_seconds"]), float(entry["backward_seconds"])
            machine = dict(content.get("machine", {}))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            logging.warning(
                "Ignoring the damaged block cost cache %s (%s: %s); timing the blocks again.",
                self.path,
                type(error).__name__,
                error,
            )
            return {}, {}
        if content.get("format") != _FORMAT or content.get("environment") != self._environment:
            logging.info(
                "Block cost cache %s was measured elsewhere (%s); timing the blocks again.",
                self.path,
                content.get("environment"),
            )
            return {}, {}
        return entries, machine

    def get_machine(self, key: str) -> dict | None:
        """The machine's measured costs kept under `key` (e.g. "devices=4,timing=4"), or None."""
        return self._machine.get(key)

    def put_machine(self, key: str, costs: dict) -> None:
        """Keeps the machine's measured costs (a JSON object) under `key`."""
        self._machine[key] = dict(costs)
        self._changed = True

    def get(self, signature: str) -> tuple[float, float] | None:
        """The cached (forward, backward) seconds of blocks with `signature`, or None."""
        entry = self._entries.get(signature)
        if entry is None:
            return None
        return float(entry["forward_seconds"]), float(entry["backward_seconds"])

    def put(self, signature: str, seconds: tuple[float, float], description: str) -> None:
        """Records the (forward, backward) seconds of blocks with `signature`."""
        forward, backward = seconds
        self._entries[signature] = {
            "forward_seconds": forward,
            "backward_seconds": backward,
            "block": description,
        }
        self._changed = True

    def save(self) -> None:
        """Writes the file if anything was added, atomically (a reader never sees half)."""
        if not self._changed:
            return
        directory = os.path.dirname(self.path) or "."
        os.makedirs(directory, exist_ok=True)
        content = {
            "format": _FORMAT,
            "environment": self._environment,
            "blocks": self._entries,
            "machine": self._machine,
        }
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
            json.dump(content, handle, indent=1, sort_keys=True)
        os.replace(handle.name, self.path)
        self._changed = False
