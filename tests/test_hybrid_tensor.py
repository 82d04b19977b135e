"""3D meshes (data x pipe x tensor): pipelined copies whose stages split their layers over
tensor devices train like the unsplit Transformer on one device."""

import os

import keras
import numpy as np
import pytest
from pipeline_runtime_models import device_index

from tfmulti.hybrid import build_hybrid_model
from tfmulti.models import registry
from tfmulti.parallel import ColumnParallelDense
from tfmulti.platform.mesh import MeshError, parse_mesh
from tfmulti.platform.runtime.devices import logical_device_names

VOCABULARY, LENGTH, BATCH, STEPS = 16, 8, 8, 3
OPTIONS = {"num_layers": 2, "num_heads": 4, "d_model": 8}


def _blocks(devices=None):
    options = dict(OPTIONS)
    if devices is not None:
        options.update(tensor_parallel=len(devices), tensor_parallel_devices=list(devices))
    return registry.build_blocks("transformer", (LENGTH,), VOCABULARY, seed=0, **options)


def _reference():
    return registry.build_model("transformer", (LENGTH,), VOCABULARY, seed=0, **OPTIONS)


def _batches():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCABULARY, (STEPS * BATCH, LENGTH + 1)).astype("int32")
    return [
        (tokens[rows, :-1], tokens[rows, 1:])
        for rows in (slice(step * BATCH, (step + 1) * BATCH) for step in range(STEPS))
    ]


def _optimizer(name):
    return keras.optimizers.SGD(0.5) if name == "sgd" else keras.optimizers.Adam(0.02)


def _probe():
    """Held-out tokens: the first batch reversed."""
    return _batches()[0][0][::-1]


@pytest.fixture(scope="module")
def one_device_run(shared_dir):
    """`one_device_run(optimizer)`: the unsplit model's losses over the batches and its
    logits on the probe after them, trained once per session for every mesh's test."""

    def run(optimizer):
        def fill(directory):
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            reference = _reference()
            reference.compile(optimizer=_optimizer(optimizer), loss=loss, jit_compile=False)
            losses = [reference.train_on_batch(x, y) for x, y in _batches()]
            logits = reference.predict(_probe(), verbose=0)
            np.savez(os.path.join(directory, "run.npz"), losses=losses, logits=logits)

        directory = shared_dir(f"hybrid_tensor_one_device_{optimizer}", fill)
        with np.load(os.path.join(directory, "run.npz")) as saved:
            return saved["losses"], saved["logits"]

    return run


@pytest.mark.parametrize(
    "mesh_text, optimizer",
    [
        ("data=2,pipe=2,tensor=2", "sgd"),
        # One stage per copy (it broke once while 2,2,2 still passed). Adam on a 3D mesh:
        # test_hybrid_zero.py's data=2,pipe=2,tensor=2 runs.
        ("data=2,pipe=1,tensor=2", "sgd"),
    ],
)
def test_data_pipe_tensor_mesh_trains_like_the_unsplit_model_on_one_device(
    one_device_run, mesh_text, optimizer
):
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    mesh = parse_mesh(mesh_text)
    hybrid = build_hybrid_model(
        _blocks,
        mesh_text,
        num_microbatches=2,
        schedule="1f1b",
        devices=logical_device_names("CPU")[: mesh.num_devices],
        make_split_blocks=_blocks,
    )
    hybrid.compile(optimizer=_optimizer(optimizer), loss=loss, jit_compile=False)
    reference_losses, reference_logits = one_device_run(optimizer)
    losses = [hybrid.train_on_batch(x, y) for x, y in _batches()]
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    # The trained weights agree: the same logits on held-out tokens.
    np.testing.assert_allclose(hybrid.predict(_probe(), verbose=0), reference_logits, atol=1e-5)
    # Replica r's stage s splits its layers over the K devices from (r * pipe + s) * K.
    tensor = mesh.tensor
    for replica_index, replica in enumerate(hybrid.replicas):
        for stage_index, stage in enumerate(replica.stages):
            split = [
                layer for layer in stage._flatten_layers() if isinstance(layer, ColumnParallelDense)
            ]
            first = (replica_index * mesh.pipe + stage_index) * tensor
            assert split
            for layer in split:
                shard_devices = {device_index(v)[1] for v in layer.trainable_variables}
                assert shard_devices == set(range(first, first + tensor))


def test_a_tensor_mesh_without_split_layers_or_with_chunks_is_one_clear_error():
    devices = logical_device_names("CPU")[:8]
    with pytest.raises(MeshError, match=r"needs a model built from split layers"):
        build_hybrid_model(_blocks, "data=2,pipe=2,tensor=2", 2, devices=devices)
    with pytest.raises(MeshError, match=r"Received: chunks=2; use chunks=1"):
        build_hybrid_model(
            _blocks,
            "data=1,pipe=2,tensor=4",
            2,
            "interleaved_1f1b",
            chunks=2,
            devices=devices,
            make_split_blocks=_blocks,
        )


def test_stage_device_groups_follow_the_mesh_order():
    groups = parse_mesh("data=2,pipe=2,tensor=2").stage_device_groups(list("abcdefgh"))
    assert groups == [[["a", "b"], ["c", "d"]], [["e", "f"], ["g", "h"]]]
