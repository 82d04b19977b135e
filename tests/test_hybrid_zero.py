"""ZeRO over a hybrid mesh's data axis: each variable owned by one data replica, which alone
holds its optimizer state (stages 1-2) and, under stage 3, its weights; training equals one
device's."""

import gc
import weakref

import keras
import numpy as np
import pytest
from pipeline_runtime_models import FEATURES, Chain

from tfmulti.compat.keras_internals import variable_device, variable_storage
from tfmulti.hybrid import HybridPipelineModel, data_owners
from tfmulti.hybrid.data_owners import deal_owners
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


def _train(stage: int, optimizer: str):
    """A one-device chain and a data=2, pipe=2 hybrid at ZeRO `stage`, trained alike."""
    reference = Chain(_even_stages())
    reference.compile(optimizer=_optimizer(optimizer), loss="mse")
    hybrid = HybridPipelineModel(
        _even_stages, parse_mesh("data=2,pipe=2").replica_devices(_devices()), 2, "1f1b"
    )
    if stage:
        hybrid.shard_over_data_axis(stage)
    hybrid.compile(optimizer=_optimizer(optimizer), loss="mse")
    batches = _batches()
    reference(batches[0][0])
    hybrid(batches[0][0])
    for batch in batches:
        reference_loss = reference.train_on_batch(*batch)
        hybrid_loss = hybrid.train_on_batch(*batch)
    return reference, hybrid, reference_loss, hybrid_loss


@pytest.mark.parametrize("stage, optimizer", [(3, "adam"), (3, "sgd_momentum"), (1, "adam")])
def test_zero_on_a_hybrid_mesh_trains_to_one_devices_weights(stage, optimizer):
    reference, hybrid, reference_loss, hybrid_loss = _train(stage, optimizer)
    np.testing.assert_allclose(hybrid_loss, reference_loss, rtol=1e-5)
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


def test_stage_three_keeps_each_weight_on_its_owner_only(monkeypatch):
    """Every copy of a weight reads its owner's storage, on the owner's device for that
    stage; the non-owners' own copies are freed (nothing, not the traced step, keeps them)."""
    dropped = []
    share = data_owners.share_storage

    def share_and_watch(variable, source):
        dropped.append(weakref.ref(variable_storage(variable)))
        share(variable, source)

    monkeypatch.setattr(data_owners, "share_storage", share_and_watch)
    _, hybrid, _, _ = _train(3, "adam")
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
    _, hybrid, _, _ = _train(stage, "adam")
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
