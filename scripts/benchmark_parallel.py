"""Benchmark: a tensor-parallel MLP over logical devices against the same MLP on one device.

For each d_model (hidden width 4x) and rows (batch x sequence length): training-step
time of `ParallelMLP` split over `--tensor_parallel` logical CPU devices and of the unsplit
`FeedForward` on one device, in alternating rounds (ABBA) so load from other processes
hits both alike; examples/sec and their ratio. Also the bytes the split layer moves per
step, measured in its traced graph and counted analytically. Logical CPU devices share
the machine's cores, so a gain shows only where both devices' matmuls overlap.

The `keras_llama` section builds a small KerasHub Llama under
`keras.distribution.ModelParallel` with `LlamaBackbone.get_layout_map` for each of
`--llama_ways` (1: unsharded; RxK: a (batch, model) mesh of R rows, the batch split over
them) and records variable bytes per device (model and Adam state separately) and
training examples/sec, timed in rotating rounds.

The `mesh3d` section trains the reference Transformer on 8 logical devices in each of
`--meshes` (data x pipe x tensor) with `scripts/train.py`, run by the planner's own
validation code on the planner's best layout for that mesh, and records measured against
predicted step seconds. Also the tensor-parallel bytes per step (each stage's split
Transformer blocks measured in their traced graph against their analytic count and the
planner's figure, and the vocabulary-split embedding, times micro-batches and replicas),
the bytes each device of a tensor group sends and receives in one step of one split
block, and for one reduction of a micro-batch's activations, the bytes each device
receives with reduce-to-one, the ring to the home device and the ring all-reduce.

The `tensor_reduce` section times, on --reduce_ways logical devices, a training step of a
stack of split Transformer blocks and one all-reduce of their activations with each
tensor reduction (`ring`: placed ring ops; `collective`: TensorFlow's CollectiveReduceV2),
in ABBA rounds in one process, and records the collective-to-ring ratios; also the bytes
each device receives over graph edges in the block step (a collective's own transfers are
not graph edges).

Prints a JSON list of records; `--out` writes it.

Example:
    python scripts/benchmark_parallel.py --d_models=1024,2048 --rows=2048 --out=/tmp/tp.json
    python scripts/benchmark_parallel.py --sections=keras_llama --llama_ways=1,2,4
    python scripts/benchmark_parallel.py --sections=mesh3d --meshes=data=2,pipe=2,tensor=2
    python scripts/benchmark_parallel.py --sections=tensor_reduce --reduce_ways=2,4
"""

import json
import statistics
import time

from absl import flags

from tfmulti.flags.console_flags import define_console_flags
from tfmulti.flags.parsing import run_script
from tfmulti.platform.runtime.tf_startup import start_tensorflow

define_console_flags()
SECTIONS = ["mlp", "keras_llama", "mesh3d", "tensor_reduce"]
MESH3D_DEVICES = 8
flags.DEFINE_multi_enum("sections", SECTIONS[:2], SECTIONS, "Benchmarks to run.")
flags.DEFINE_list("d_models", ["1024", "2048"], "Model widths; the MLP's hidden width is 4x.")
flags.DEFINE_list("rows", ["2048"], "Rows per step (batch x sequence length).")
flags.DEFINE_integer("sequence_length", 128, "Tokens per example.", lower_bound=1)
flags.DEFINE_integer("tensor_parallel", 2, "Devices the MLP is split over.", lower_bound=2)
flags.DEFINE_integer("steps", 3, "Timed steps per round and layout.", lower_bound=1)
flags.DEFINE_integer("rounds", 2, "ABBA rounds (each times both layouts twice).", lower_bound=1)
flags.DEFINE_list(
    "llama_ways",
    ["1", "2", "4", "2x2", "2x4"],
    "keras_llama: devices the layout shards over: K, or RxK for a (batch, model) mesh of R rows.",
)
flags.DEFINE_integer("llama_hidden_dim", 64, "keras_llama: hidden width (4 heads).", lower_bound=4)
flags.DEFINE_integer("llama_batch_size", 8, "keras_llama: examples per step.", lower_bound=1)
flags.DEFINE_multi_string(
    "meshes",
    ["data=2,pipe=2,tensor=2", "data=1,pipe=2,tensor=4", "data=2,pipe=1,tensor=4"]
    + ["data=4,pipe=2,tensor=1"],
    "mesh3d: meshes of 8 devices to train on (repeat the flag for more).",
)
flags.DEFINE_integer("mesh3d_layers", 4, "mesh3d: Transformer blocks.", lower_bound=2)
flags.DEFINE_integer("mesh3d_global_batch", 32, "mesh3d: examples per step.", lower_bound=8)
flags.DEFINE_integer("mesh3d_steps", 10, "mesh3d: training steps per epoch.", lower_bound=1)
flags.DEFINE_integer("mesh3d_epochs", 3, "mesh3d: epochs; all after the first timed.", 2)
flags.DEFINE_list("reduce_ways", ["2", "4"], "tensor_reduce: devices of the tensor group.")
flags.DEFINE_list(
    "reduce_shapes",
    ["32x32x64", "8x128x256"],
    "tensor_reduce: activation shapes BATCHxLENGTHxD_MODEL (4 heads, MLP 4 x D_MODEL).",
)
flags.DEFINE_integer("reduce_blocks", 2, "tensor_reduce: split blocks in the stack.", 1)
flags.DEFINE_string("out", None, "Write the JSON records to this file.")
flags.register_validator(
    "reduce_ways",
    lambda values: all(value.isdigit() and int(value) >= 2 for value in values),
    "each value must be an integer >= 2 (devices of the tensor group)",
)
flags.register_validator(
    "reduce_shapes",
    lambda values: all(_is_block_shape(value) for value in values),
    "each value must be BATCHxLENGTHxD_MODEL with D_MODEL a multiple of 4, e.g. 32x32x64",
)
flags.register_validator(
    "llama_ways",
    lambda values: all(_is_llama_mesh(value) for value in values),
    "each value must be K or RxK with positive integers (rows x devices the layout shards over)",
)
flags.register_validator(
    "rows",
    lambda values: all(int(v) % FLAGS.sequence_length == 0 for v in values),
    "each value must be a multiple of --sequence_length",
)
flags.register_validator(
    "meshes",
    lambda values: all(_is_mesh_of(MESH3D_DEVICES, value) for value in values),
    f"each value must be a mesh of {MESH3D_DEVICES} devices, e.g. data=2,pipe=2,tensor=2",
)
FLAGS = flags.FLAGS


def _is_mesh_of(num_devices: int, text: str) -> bool:
    from tfmulti.platform.mesh import parse_mesh

    try:
        return parse_mesh(text).num_devices == num_devices
    except ValueError:
        return False


def _is_block_shape(text: str) -> bool:
    parts = text.split("x")
    return (
        len(parts) == 3
        and all(p.isdigit() and int(p) > 0 for p in parts)
        and (int(parts[2]) % 4 == 0)
    )


def _training_step(layer, home_device):
    """A traced SGD step of `layer` on a squared-output loss; optimizer state on each
    variable's device."""
    import keras
    import tensorflow as tf

    from tfmulti.platform.runtime.optimizer_devices import place_optimizer_on_variable_devices

    optimizer = keras.optimizers.SGD(learning_rate=1e-3)
    place_optimizer_on_variable_devices(optimizer)

    @tf.function
    def step(inputs):
        with tf.device(home_device):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(layer(inputs)))
            gradients = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(gradients, layer.trainable_variables)
            return loss

    return step


def _step_seconds(step, inputs) -> list[float]:
    seconds = []
    for _ in range(FLAGS.steps):
        start = time.perf_counter()
        step(inputs).numpy()
        seconds.append(time.perf_counter() - start)
    return seconds


def mlp_record(d_model: int, rows: int) -> dict:
    """Times one-device and tensor-parallel training steps of one MLP shape."""
    import numpy as np
    import tensorflow as tf

    from tfmulti.models.transformer import FeedForward
    from tfmulti.parallel import ParallelMLP, measure_communication, resolve_shard_devices

    devices = resolve_shard_devices(FLAGS.tensor_parallel)
    batch_size = rows // FLAGS.sequence_length
    input_shape = (batch_size, FLAGS.sequence_length, d_model)
    with tf.device(devices[0]):
        inputs = tf.constant(np.random.default_rng(0).normal(size=input_shape), tf.float32)
        unsplit = FeedForward(d_model, 4 * d_model, seed=0)
        unsplit.build(input_shape)
    split = ParallelMLP(d_model, 4 * d_model, devices)
    split.build(input_shape)
    split.set_unsplit_weights(unsplit.get_weights())
    steps = {
        "one_device": _training_step(unsplit, devices[0]),
        "tensor_parallel": _training_step(split, devices[0]),
    }
    for step in steps.values():
        step(inputs).numpy()  # trace and warm up
    seconds = {name: [] for name in steps}
    for _ in range(FLAGS.rounds):
        for name in ("one_device", "tensor_parallel", "tensor_parallel", "one_device"):
            seconds[name] += _step_seconds(steps[name], inputs)
    step_ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
    examples_per_sec = {name: 1000 * batch_size / ms for name, ms in step_ms.items()}
    measured = measure_communication(split, tf.TensorSpec(input_shape, tf.float32))
    analytic = split.communication_bytes(input_shape)
    return {
        "benchmark": "parallel_mlp",
        "d_model": d_model,
        "mlp_dim": 4 * d_model,
        "rows": rows,
        "batch_size": batch_size,
        "sequence_length": FLAGS.sequence_length,
        "tensor_parallel": FLAGS.tensor_parallel,
        "step_ms": step_ms,
        "examples_per_sec": examples_per_sec,
        "speedup": examples_per_sec["tensor_parallel"] / examples_per_sec["one_device"],
        "communication_bytes_per_step": {
            "measured": {"forward": measured.forward, "backward": measured.backward},
            "analytic": {"forward": analytic.forward, "backward": analytic.backward},
            "equal": measured == analytic,
        },
    }


def _is_llama_mesh(text: str) -> bool:
    parts = text.split("x")
    return len(parts) <= 2 and all(part.isdigit() and int(part) >= 1 for part in parts)


def _llama_mesh_shape(text: str) -> tuple[int, int]:
    """ "4" -> (1, 4); "2x4" -> (2, 4): rows of the batch axis, devices of the model axis."""
    parts = [int(part) for part in text.split("x")]
    return (1, parts[0]) if len(parts) == 1 else (parts[0], parts[1])


def _llama(mesh_text: str):
    """The small Llama causal LM, sharded by KerasHub's own layout map on a (rows, ways) mesh."""
    import contextlib

    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    scope = contextlib.nullcontext()
    shape = _llama_mesh_shape(mesh_text)
    if shape != (1, 1):
        devices = keras.distribution.list_devices("cpu")[: shape[0] * shape[1]]
        mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
        layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
        scope = keras.distribution.ModelParallel(layout_map=layout_map).scope()
    with scope:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=LLAMA_VOCABULARY,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=4,
            hidden_dim=FLAGS.llama_hidden_dim,
            intermediate_dim=4 * FLAGS.llama_hidden_dim,
        )
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


LLAMA_VOCABULARY = 256


def keras_llama_records() -> list[dict]:
    """Variable bytes per device and examples/sec of the Llama on each (rows, ways) mesh."""
    import numpy as np

    from tfmulti.parallel import variable_bytes_per_device

    rng = np.random.default_rng(0)
    shape = (FLAGS.llama_batch_size, FLAGS.sequence_length)
    inputs = {
        "token_ids": rng.integers(0, LLAMA_VOCABULARY, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    targets = rng.integers(0, LLAMA_VOCABULARY, shape).astype("int32")
    ways_list = list(FLAGS.llama_ways)
    models = {ways: _llama(ways) for ways in ways_list}
    seconds = {ways: [] for ways in ways_list}
    for model in models.values():
        model.train_on_batch(inputs, targets)  # trace, build the optimizer, warm up
    for round_index in range(FLAGS.rounds):
        order = ways_list if round_index % 2 == 0 else ways_list[::-1]
        for ways in order:
            for _ in range(FLAGS.steps):
                start = time.perf_counter()
                models[ways].train_on_batch(inputs, targets)
                seconds[ways].append(time.perf_counter() - start)
    records = []
    for ways, model in models.items():
        step_ms = 1000 * statistics.median(seconds[ways])
        weights = variable_bytes_per_device(model)
        records.append(
            {
                "benchmark": "keras_model_parallel_llama",
                "ways": ways,
                "mesh_shape": list(_llama_mesh_shape(ways)),
                "hidden_dim": FLAGS.llama_hidden_dim,
                "batch_size": FLAGS.llama_batch_size,
                "sequence_length": FLAGS.sequence_length,
                "step_ms": step_ms,
                "examples_per_sec": 1000 * FLAGS.llama_batch_size / step_ms,
                "variable_bytes_per_device": weights,
                "optimizer_bytes_per_device": variable_bytes_per_device(model, "optimizer"),
                "max_variable_bytes_on_a_device": max(weights.values()),
            }
        )
    return records


def _planned_layouts(costs, meshes: list[str]) -> list:
    """The planner's best layout of each mesh (its fastest prediction), in `meshes` order."""
    from tfmulti.planner import Hardware, search_layouts

    best = {}
    # Logical devices share the machine's cores: their work does not overlap.
    hardware = Hardware(shared_compute=True)
    for layout in search_layouts(costs, MESH3D_DEVICES, FLAGS.mesh3d_global_batch, hardware):
        best.setdefault(str(layout.mesh), layout)
    missing = [mesh for mesh in meshes if mesh not in best]
    if missing:
        raise ValueError(
            f"The planner has no layout of {missing} for this model; it can split the "
            f"Transformer {costs.tensor_parallel_sizes} ways. Received: --meshes={meshes}"
        )
    return [best[mesh] for mesh in meshes]


def _tensor_group_bytes(costs, layout) -> dict:
    """Bytes the tensor groups move per step: each stage's split Transformer blocks measured
    in their traced graph, counted analytically and predicted by the planner, and the
    vocabulary-split embedding (times micro-batches and replicas); the bytes each device of
    a group sends and receives in one step of one split block; and in one reduction of a
    micro-batch's activations, the bytes each device receives with reduce-to-one, the ring
    to the home device (standalone split layers, the embedding) and the ring all-reduce."""
    import tensorflow as tf

    from tfmulti.data import load_source
    from tfmulti.models import registry
    from tfmulti.models.transformer import TransformerBlock
    from tfmulti.parallel import (
        TENSOR_REDUCTIONS,
        measure_communication,
        resolve_shard_devices,
        tensor_reduction_scope,
    )
    from tfmulti.planner import tensor_group_bytes
    from tfmulti.tensor_parallel.shard_devices import device_key
    from tfmulti.tensor_parallel.transfer_bytes import received_bytes, sent_bytes, step_graph

    mesh = layout.mesh
    info = load_source(costs.dataset).info
    microbatch = FLAGS.mesh3d_global_batch // mesh.data // layout.num_microbatches
    all_devices = resolve_shard_devices(MESH3D_DEVICES)
    edges = (0, *layout.boundaries, len(costs.blocks))
    measured, analytic = dict.fromkeys(TENSOR_REDUCTIONS, 0), 0
    for stage, (start, end) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        group = all_devices[stage * mesh.tensor : (stage + 1) * mesh.tensor]
        blocks = registry.build_blocks(
            costs.model,
            info.input_shape,
            info.num_classes,
            tensor_parallel=mesh.tensor,
            tensor_parallel_devices=group,
            **costs.model_options,
        )
        tokens = tf.zeros((microbatch, *info.input_shape), tf.int32)
        with tf.device(group[0]):  # the stage's device, where its unsplit weights live
            activations = blocks[0](tokens)
        split = [block for block in blocks[start:end] if isinstance(block, TransformerBlock)]
        spec = tf.TensorSpec(activations.shape)
        with tf.device(group[0]):
            for block in split:
                block.build(spec.shape)
        for reduction in TENSOR_REDUCTIONS:
            with tensor_reduction_scope(reduction):
                graph = step_graph(split, spec, group[0])
            measured[reduction] += sum(received_bytes(graph, group[0]).values())
        for index, block in enumerate(split):
            moved = block.communication_bytes(
                spec.shape, enters=index == 0, exits=index == len(split) - 1
            )
            analytic += moved.forward + moved.backward
        if stage == 0:
            embedding = blocks[0].token_embedding
            embedding_bytes = measure_communication(
                embedding, tf.TensorSpec(tokens.shape, tokens.dtype)
            )
            embedding_analytic = embedding.communication_bytes(tokens.shape)
            one_block = step_graph(split[:1], spec, group[0])
            keys = [device_key(device) for device in group]
            block_step = {
                "shape": list(spec.shape),
                "received_bytes_per_device": [
                    received_bytes(one_block, group[0]).get(key, 0) for key in keys
                ],
                "sent_bytes_per_device": [
                    sent_bytes(one_block, group[0]).get(key, 0) for key in keys
                ],
            }
            one_reduction = _one_reduction(spec.shape, group)
    per_step = mesh.data * layout.num_microbatches
    return {
        "split_blocks_bytes_per_step": {
            **{f"measured_{name}": per_step * moved for name, moved in measured.items()},
            "analytic": per_step * analytic,
            "planner": tensor_group_bytes(costs, layout, FLAGS.mesh3d_global_batch),
        },
        "embedding_bytes_per_step": {
            "measured": per_step * (embedding_bytes.forward + embedding_bytes.backward),
            "analytic": per_step * (embedding_analytic.forward + embedding_analytic.backward),
        },
        "one_block_step": block_step,
        "one_reduction": one_reduction,
    }


def _one_reduction(shape, devices) -> dict:
    """Bytes each device receives in one sum of K tensors of `shape`, by collective."""
    import tensorflow as tf

    from tfmulti.collectives.placed_steps import reduce_partial_sums
    from tfmulti.collectives.replicated import sum_on_every_device
    from tfmulti.tensor_parallel.shard_devices import device_key
    from tfmulti.tensor_parallel.transfer_bytes import received_bytes

    partials = []
    for device in devices:
        with tf.device(device):
            partials.append(tf.identity(tf.random.normal(shape)))

    def reduce_to_one(partials, devices):
        with tf.device(devices[0]):
            return tf.add_n(partials)

    received = {}
    collectives = (
        ("reduce_to_one", reduce_to_one),
        ("ring_to_home", reduce_partial_sums),
        ("all_reduce", sum_on_every_device),
    )
    for name, reduce in collectives:

        @tf.function
        def traced(reduce=reduce):
            # Nothing returned: a function's outputs would be copied to one device.
            reduce(partials, devices)

        by_device = received_bytes(traced.get_concrete_function().graph, devices[0])
        received[name] = [by_device.get(device_key(device), 0) for device in devices]
    return {"shape": list(shape), "received_bytes_per_device": received}


class _Stack:
    """Layers applied in turn, with their trainable variables, for `_training_step`."""

    def __init__(self, layers):
        self.layers = layers
        self.trainable_variables = [v for layer in layers for v in layer.trainable_variables]

    def __call__(self, inputs):
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs


def _all_reduce_step(devices):
    """A traced sum of one tensor per device on every device; each device's sum is read
    there (a scalar leaves it), so nothing is pruned and no sum is copied whole."""
    import tensorflow as tf

    from tfmulti.collectives.replicated import sum_on_every_device

    @tf.function
    def step(inputs):
        partials = []
        for index, device in enumerate(devices):
            with tf.device(device):
                partials.append(inputs * float(index + 1))
        totals = []
        for device, total in zip(devices, sum_on_every_device(partials, devices), strict=True):
            with tf.device(device):
                totals.append(tf.reduce_sum(total))
        return tf.add_n(totals)

    return step


def tensor_reduce_records() -> list[dict]:
    """Step time of split Transformer blocks and of one all-reduce, ring against collective."""
    import numpy as np
    import tensorflow as tf

    from tfmulti.models.transformer import TransformerBlock
    from tfmulti.parallel import TENSOR_REDUCTIONS, resolve_shard_devices, tensor_reduction_scope
    from tfmulti.tensor_parallel.shard_devices import device_key
    from tfmulti.tensor_parallel.transfer_bytes import received_bytes, step_graph

    records = []
    for ways in (int(value) for value in FLAGS.reduce_ways):
        devices = resolve_shard_devices(ways)
        for text in FLAGS.reduce_shapes:
            shape = tuple(int(part) for part in text.split("x"))
            width = shape[-1]
            blocks = [
                TransformerBlock(width, 4, 4 * width, seed=index, tensor_parallel_devices=devices)
                for index in range(FLAGS.reduce_blocks)
            ]
            for block in blocks:
                block.build(shape)
            with tf.device(devices[0]):
                inputs = tf.constant(np.random.default_rng(0).normal(size=shape), tf.float32)
            steps, graph_bytes = {}, {}
            for reduction in TENSOR_REDUCTIONS:
                with tensor_reduction_scope(reduction):
                    steps[f"blocks_{reduction}"] = _training_step(_Stack(blocks), devices[0])
                    steps[f"all_reduce_{reduction}"] = _all_reduce_step(devices)
                    for kind in ("blocks", "all_reduce"):
                        steps[f"{kind}_{reduction}"](inputs).numpy()  # trace and warm up
                    graph = step_graph(blocks, tf.TensorSpec(shape), devices[0])
                by_device = received_bytes(graph, devices[0])
                graph_bytes[reduction] = [by_device.get(device_key(d), 0) for d in devices]
            seconds = {name: [] for name in steps}
            for _ in range(FLAGS.rounds):
                for kind in ("blocks", "all_reduce"):
                    for reduction in ("ring", "collective", "collective", "ring"):
                        name = f"{kind}_{reduction}"
                        seconds[name] += _step_seconds(steps[name], inputs)
            step_ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
            records.append(
                {
                    "benchmark": "tensor_reduce",
                    "tensor_parallel": ways,
                    "shape": list(shape),
                    "blocks": FLAGS.reduce_blocks,
                    "step_ms": step_ms,
                    "collective_over_ring": {
                        kind: step_ms[f"{kind}_collective"] / step_ms[f"{kind}_ring"]
                        for kind in ("blocks", "all_reduce")
                    },
                    "blocks_graph_received_bytes_per_device": graph_bytes,
                    "timed_steps_each": FLAGS.rounds * 2 * FLAGS.steps,
                }
            )
    return records


def mesh3d_records() -> list[dict]:
    """Measured against predicted step time of the planner's best layout of each mesh."""
    import tempfile

    from tfmulti.planner.measure import measure_model_costs
    from tfmulti.planner.validation import measure_layouts
    from tfmulti.platform.mesh import parse_mesh

    batch = FLAGS.mesh3d_global_batch
    costs = measure_model_costs(
        "transformer",
        "tokens",
        {"num_layers": FLAGS.mesh3d_layers},
        batch_sizes=[batch // 8, batch],
    )
    meshes = [str(parse_mesh(text)) for text in FLAGS.meshes]
    layouts = _planned_layouts(costs, meshes)
    measurements = measure_layouts(
        layouts,
        costs,
        batch,
        tempfile.mkdtemp(prefix="mesh3d_"),
        epochs=FLAGS.mesh3d_epochs,
        steps_per_epoch=FLAGS.mesh3d_steps,
        repeats=1,
    )
    records = []
    for layout, measurement in zip(layouts, measurements, strict=True):
        measured = measurement.measured_step_time
        record = {
            "benchmark": "mesh3d",
            "mesh": str(layout.mesh),
            "schedule": layout.schedule,
            "num_microbatches": layout.num_microbatches,
            "boundaries": list(layout.boundaries),
            "num_layers": FLAGS.mesh3d_layers,
            "global_batch": batch,
            "predicted_step_seconds": layout.step_time,
            "measured_step_seconds": measured,
            "measured_over_predicted": measured / layout.step_time if measured else None,
            "error": measurement.error,
            "train_flags": list(measurement.flags),
        }
        if layout.mesh.tensor > 1:
            record.update(_tensor_group_bytes(costs, layout))
        records.append(record)
    return records


def main(argv):
    del argv
    start_tensorflow(FLAGS.tf_log_level)
    from tfmulti.platform.runtime.devices import configure_logical_devices

    llama_ways = [rows * ways for rows, ways in map(_llama_mesh_shape, FLAGS.llama_ways)]
    mesh_devices = [MESH3D_DEVICES] if "mesh3d" in FLAGS.sections else []
    reduce_ways = [int(v) for v in FLAGS.reduce_ways] if "tensor_reduce" in FLAGS.sections else []
    configure_logical_devices(
        max([FLAGS.tensor_parallel, *llama_ways, *mesh_devices, *reduce_ways]), device_type="CPU"
    )
    records = []
    if "mlp" in FLAGS.sections:
        for d_model in (int(value) for value in FLAGS.d_models):
            for rows in (int(value) for value in FLAGS.rows):
                records.append(mlp_record(d_model, rows))
                print(json.dumps(records[-1]), flush=True)
    if "keras_llama" in FLAGS.sections:
        for record in keras_llama_records():
            records.append(record)
            print(json.dumps(record), flush=True)
    if "mesh3d" in FLAGS.sections:
        for record in mesh3d_records():
            records.append(record)
            print(json.dumps(record), flush=True)
    if "tensor_reduce" in FLAGS.sections:
        for record in tensor_reduce_records():
            records.append(record)
            print(json.dumps(record), flush=True)
    print(json.dumps(records, indent=1))
    if FLAGS.out:
        with open(FLAGS.out, "w") as out_file:
            json.dump(records, out_file, indent=1)


if __name__ == "__main__":
    run_script(main, user_errors=(ValueError,))
