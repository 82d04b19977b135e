"""ZeRO over a hybrid mesh's data axis: each variable owned by one data replica, which alone
holds its optimizer state (stages 1-2) and, under stage 3, its weights; training equals one
device's."""

import functools
import gc
import types
import weakref

import keras
import numpy as np
import pytest
from pipeline_runtime_models import FEATURES, Chain

from tfmulti.compat.keras_internals import variable_device, variable_storage
from tfmulti.hybrid import HybridPipelineModel, build_hybrid_model, data_owners
from tfmulti.hybrid.data_owners import deal_owners
from tfmulti.models import registry
from tfmulti.platform.mesh import parse_mesh
from tfmulti.platform.runtime.devices import full_device_name, logical_device_names
from tfmulti.run.device_memory import memory_section
from tfmulti.zero import zero_state_bytes

STEPS = 3
GLOBAL_BATCH = 16
WIDTH = 8


def _dense(units, seed, activation=None):
    return keras.layers.Dense(
        units, activation=activation, kernel_initializer=keras.initializers.GlorotUniform(seed)
    )


def _even_stages() -> list[keras.layers.Layer]:
    """Two stages of two dense layers, 6 -> 8 -> 6, each stage two kernels of 48: dealt to
    the two data replicas, each device of the mesh holds about half its stage."""
    return [
        keras.Sequential([_dense(WIDTH, 2 * stage, "tanh"), _dense(FEATURES, 2 * stage + 1)])
        for stage in range(2)
    ]


def _batches():
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype("float32"),
            rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype("float32"),
        )
        for _ in range(STEPS)
    ]


def _optimizer(name):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.Adam(0.01)


def _devices():
    return logical_device_names("CPU")[:4]


@functools.cache
def _train(stage: int, optimizer: str):
    """A one-device chain and a data=2, pipe=2 hybrid at ZeRO `stage`, trained alike, once
    for every test that reads them; and a weak reference to each copy's own storage that
    stage 3 dropped for its owner's."""
    reference = Chain(_even_stages())
    reference.compile(optimizer=_optimizer(optimizer), loss="mse")
    hybrid = HybridPipelineModel(
        _even_stages, parse_mesh("data=2,pipe=2").replica_devices(_devices()), 2, "1f1b"
    )
    if stage:
        hybrid.shard_over_data_axis(stage)
    hybrid.compile(optimizer=_optimizer(optimizer), loss="mse")
    batches = _batches()
    dropped = []
    share = data_owners.share_storage

    def share_and_watch(variable, source):
        dropped.append(weakref.ref(variable_storage(variable)))
        share(variable, source)

    reference(batches[0][0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_owners, "share_storage", share_and_watch)
        hybrid(batches[0][0])  # builds the replicas
    for batch in batches:
        reference_loss = reference.train_on_batch(*batch)
        hybrid_loss = hybrid.train_on_batch(*batch)
    return types.SimpleNamespace(
        reference=reference,
        hybrid=hybrid,
        reference_loss=reference_loss,
        hybrid_loss=hybrid_loss,
        dropped=dropped,
    )


@pytest.mark.parametrize(
    "stage, optimizer", [(3, "adam"), (3, "sgd_momentum"), (2, "adam"), (1, "adam")]
)
def test_zero_on_a_hybrid_mesh_trains_to_one_devices_weights(stage, optimizer):
    run = _train(stage, optimizer)
    reference, hybrid = run.reference, run.hybrid
    np.testing.assert_allclose(run.hybrid_loss, run.reference_loss, rtol=1e-5)
    # `weights` (the plain model's, replica 0's) and every replica's copies are trained.
    for replica in [hybrid, *hybrid.replicas]:
        for actual, expected in zip(replica.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    owned_by_second = [
        index
        for index, variable in enumerate(hybrid.trainable_variables)
        if variable is hybrid.replicas[1].trainable_variables[index]
    ]
    assert owned_by_second, "no variable is owned by replica 1"


def test_stage_three_keeps_each_weight_on_its_owner_only():
    """Every copy of a weight reads its owner's storage, on the owner's device for that
    stage; the non-owners' own copies are freed (nothing, not the traced step, keeps them)."""
    run = _train(3, "adam")
    hybrid, dropped = run.hybrid, run.dropped
    owners = hybrid.trainable_variables
    for replica in hybrid.replicas:
        for variable, owned in zip(replica.trainable_variables, owners, strict=True):
            assert variable_storage(variable) is variable_storage(owned)
    for index, owned in enumerate(owners):
        owner = next(r for r in hybrid.replicas if r.trainable_variables[index] is owned)
        stage = owner.stage_of_variable(owned)
        assert full_device_name(variable_device(owned)) == full_device_name(
            owner.stage_devices[stage]
        )
    # Two replicas: each weight had one copy to drop.
    assert len(dropped) == len(owners)
    gc.collect()
    assert [ref for ref in dropped if ref() is not None] == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_each_device_holds_follow_the_zero_formulas_per_stage(stage):
    """Each stage holds 110 parameters (two 6x8 kernels and their biases): its two devices
    (one per data replica) each hold the ZeRO formula's share of them, to the size of a
    bias (whole variables are dealt, not rows); under stage 0 replica 0 holds all slots."""
    hybrid = _train(stage, "adam").hybrid
    memory = memory_section(hybrid, _devices())
    stage_params = sum(int(np.prod(v.shape)) for v in hybrid.replicas[0].stages[0].weights)
    assert stage_params == 2 * (FEATURES * WIDTH) + WIDTH + FEATURES
    expected = zero_state_bytes(stage, stage_params, 2)
    for device in _devices():
        held = memory[full_device_name(device)]
        assert held["weights"] == pytest.approx(expected.weights, rel=0.05), device
        if stage:
            # Adam's two moments, and on one device the step counter and learning rate.
            assert held["optimizer"] == pytest.approx(expected.optimizer, rel=0.05), device
    total = sum(held["weights"] for held in memory.values())
    assert total == 2 * stage_params * 4 * (2 if stage < 3 else 1)


def test_owners_are_dealt_by_size_on_each_pipeline_device():
    # The largest first, to the replica owning least on that device, then least overall.
    assert deal_owners([390, 185, 39, 13, 3], ["s1", "s0", "s1", "s1", "s1"], 2) == [
        0,
        1,
        1,
        1,
        1,
    ]
    assert deal_owners([48, 8, 48, 6, 48, 8, 48, 6], list("aaaabbbb"), 2) == [
        0,
        0,
        1,
        1,
        0,
        1,
        1,
        0,
    ]


def test_stage_three_after_the_first_call_or_an_unknown_stage_is_one_line():
    hybrid = HybridPipelineModel(
        _even_stages, parse_mesh("data=2,pipe=2").replica_devices(_devices()), 2, "1f1b"
    )
    with pytest.raises(ValueError, match=r"stages 1-3\. Received: --zero=4$"):
        hybrid.shard_over_data_axis(4)
    hybrid(_batches()[0][0])
    with pytest.raises(ValueError, match="shard it before its first call") as raised:
        hybrid.shard_over_data_axis(3)
    assert "\n" not in str(raised.value)


def test_xla_under_stage_three_is_one_line():
    # XLA compiles a stage for one device and cannot read a variable held on another
    # ("Trying to access resource ... located in device CPU:0 from device CPU:1").
    hybrid = HybridPipelineModel(
        _even_stages, parse_mesh("data=2,pipe=2").replica_devices(_devices()), 2, "1f1b"
    )
    hybrid.shard_over_data_axis(3)
    with pytest.raises(ValueError, match=r"jit_compile=True; compile without it") as raised:
        hybrid.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert "\n" not in str(raised.value)


# A data x pipe x tensor mesh on the 8 test devices: replica r's stage s splits the
# reference Transformer's layers over CPU:(4r + 2s) and CPU:(4r + 2s + 1).
MESH_3D = "data=2,pipe=2,tensor=2"
VOCABULARY, LENGTH, TOKEN_ROWS = 16, 8, 8
TRANSFORMER = {"num_layers": 2, "num_heads": 4, "d_model": 8}


def _transformer_blocks(devices=None):
    options = dict(TRANSFORMER)
    if devices is not None:
        options.update(tensor_parallel=len(devices), tensor_parallel_devices=list(devices))
    return registry.build_blocks("transformer", (LENGTH,), VOCABULARY, seed=0, **options)


def _token_batches():
    tokens = np.random.default_rng(0).integers(0, VOCABULARY, (STEPS * TOKEN_ROWS, LENGTH + 1))
    tokens = tokens.astype("int32")
    return [
        (
            tokens[step * TOKEN_ROWS : (step + 1) * TOKEN_ROWS, :-1],
            tokens[step * TOKEN_ROWS : (step + 1) * TOKEN_ROWS, 1:],
        )
        for step in range(STEPS)
    ]


def _device_number(device: str) -> int:
    return int(full_device_name(device).rsplit(":", 1)[-1])


def _train_on_3d_mesh(stage: int, optimizer: str):
    """The unsplit Transformer on one device and a data=2, pipe=2, tensor=2 hybrid at ZeRO
    `stage`, trained alike; and each copy stage 3 made read its owner's storage, as (the
    copy's device, the owner's device, its bytes, a weak reference to the dropped storage)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = registry.build_model("transformer", (LENGTH,), VOCABULARY, seed=0, **TRANSFORMER)
    reference.compile(optimizer=_optimizer(optimizer), loss=loss, jit_compile=False)
    hybrid = build_hybrid_model(
        _transformer_blocks,
        MESH_3D,
        num_microbatches=2,
        schedule="1f1b",
        devices=logical_device_names("CPU")[:8],
        make_split_blocks=_transformer_blocks,
    )
    hybrid.shard_over_data_axis(stage)
    hybrid.compile(optimizer=_optimizer(optimizer), loss=loss, jit_compile=False)
    batches = _token_batches()
    shared = []
    share = data_owners.share_storage

    def share_and_record(variable, source):
        dropped = variable_storage(variable)
        size = int(np.prod(dropped.shape)) * dropped.dtype.size
        shared.append(
            (variable_device(variable), variable_device(source), size, weakref.ref(dropped))
        )
        share(variable, source)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_owners, "share_storage", share_and_record)
        hybrid(batches[0][0])  # builds the replicas
    losses = [hybrid.train_on_batch(x, y) for x, y in batches]
    reference_losses = [reference.train_on_batch(x, y) for x, y in batches]
    return types.SimpleNamespace(
        hybrid=hybrid,
        reference=reference,
        losses=losses,
        reference_losses=reference_losses,
        shared=shared,
    )


@pytest.fixture(scope="module")
def zero3_on_3d_mesh():
    return _train_on_3d_mesh(3, "adam")


@pytest.mark.parametrize("stage, optimizer", [(3, "adam"), (2, "sgd_momentum")])
def test_zero_on_a_data_pipe_tensor_mesh_trains_to_one_devices_weights(request, stage, optimizer):
    if stage == 3:
        run = request.getfixturevalue("zero3_on_3d_mesh")
    else:
        run = _train_on_3d_mesh(stage, optimizer)
    np.testing.assert_allclose(run.losses, run.reference_losses, rtol=1e-5)
    expected = run.reference.get_weights()
    for replica in [run.hybrid, *run.hybrid.replicas]:
        for actual, weight in zip(replica.get_weights(), expected, strict=True):
            np.testing.assert_allclose(actual, weight, rtol=1e-5, atol=1e-6)
    # Owners are dealt shard by shard: some shards of split weights are replica 1's.
    owned_by_second = [
        variable.path
        for index, variable in enumerate(run.hybrid.trainable_variables)
        if variable is run.hybrid.replicas[1].trainable_variables[index]
    ]
    assert any("_shard_" in path for path in owned_by_second), owned_by_second


def test_stage_three_on_a_tensor_mesh_keeps_each_shard_on_its_owner_only(zero3_on_3d_mesh):
    """Every copy of a weight or of a tensor shard reads its owner's storage, on the owner's
    device for the same stage and tensor rank; the copies' own storage is freed."""
    hybrid = zero3_on_3d_mesh.hybrid
    owners = hybrid.trainable_variables
    for replica in hybrid.replicas:
        for variable, owned in zip(replica.trainable_variables, owners, strict=True):
            assert variable_storage(variable) is variable_storage(owned)
    # Two replicas: each trainable variable (a split weight's shard counts as one) had one
    # copy to drop, on the other replica's device for its stage and tensor rank: 4 devices on.
    assert len(zero3_on_3d_mesh.shared) == len(owners)
    for copy_device, owner_device, _, _ in zero3_on_3d_mesh.shared:
        assert abs(_device_number(copy_device) - _device_number(owner_device)) == 4
    assert sum("_shard_" in variable.path for variable in owners) > len(owners) / 2
    # Replica 0's stages are built by a symbolic call, whose traced custom gradients kept the
    # shards they read for the process's life until `run_on_device` left them out.
    gc.collect()
    assert [ref for _, _, _, ref in zero3_on_3d_mesh.shared if ref() is not None] == []


def test_bytes_each_device_holds_on_a_tensor_mesh_follow_the_zero_formula(zero3_on_3d_mesh):
    """Each of replica 0's devices (a stage's device for one tensor rank) holds Ψ_d
    parameters under zero=0, and so does its twin 4 devices on in replica 1; at stage 3 the
    two hold Ψ_d once between them, each about 4Ψ_d/2 bytes (the formula, to the size of a
    small variable: whole shards are dealt), with Adam's moments beside them."""
    hybrid = zero3_on_3d_mesh.hybrid
    devices = logical_device_names("CPU")[:8]
    memory = {_device_number(name): held for name, held in memory_section(hybrid, devices).items()}
    assert sorted(memory) == list(range(8))
    place_bytes = [0] * 4
    for copy_device, _, size, _ in zero3_on_3d_mesh.shared:
        place_bytes[_device_number(copy_device) % 4] += size
    assert sum(place_bytes) == 4 * hybrid.count_params()
    for place, held_bytes in enumerate(place_bytes):
        expected = zero_state_bytes(3, held_bytes // 4, 2)
        pair = [memory[place], memory[place + 4]]
        assert sum(held["weights"] for held in pair) == held_bytes
        for held in pair:
            assert held["weights"] == pytest.approx(expected.weights, rel=0.05), place
            assert held["optimizer"] in (2 * held["weights"], 2 * held["weights"] + 12)
    # Held once over the data axis: 4Ψ bytes of weights, where zero=0 holds 2 x 4Ψ.
    assert sum(held["weights"] for held in memory.values()) == 4 * hybrid.count_params()
