"""Block timing for `--partition=time`: blocks that cost the same are timed once, and the
timings kept in a cost cache are reused by the next run instead of timing again."""

import json
import logging
import shutil

import keras
import numpy as np
import pytest

import tfmulti.pipeline.stages.block_partition as partition
from tfmulti.costing.cost_cache import CostCache, block_signature
from tfmulti.models import build_blocks
from tfmulti.pipeline.balance import Block
from tfmulti.pipeline.stages.split_summary import MeasuredStageSeconds

VOCAB, SEQUENCE = 32, 8
TRANSFORMER = dict(num_layers=4, num_heads=2, d_model=16)
# Embedding, one TransformerBlock for all four layers, head.
DISTINCT_BLOCKS = 3


@pytest.fixture
def timed(monkeypatch):
    """The blocks `time_block` was asked to time, in order."""
    calls = []
    original = partition.time_block

    def counting(block, inputs, **kwargs):
        calls.append(block.name)
        return original(block, inputs, **kwargs)

    monkeypatch.setattr(partition, "time_block", counting)
    return calls


def _blocks(**options):
    return build_blocks("transformer", (SEQUENCE,), VOCAB, seed=0, **{**TRANSFORMER, **options})


def _tokens(batch_size=4):
    return np.random.default_rng(0).integers(0, VOCAB, (batch_size, SEQUENCE)).astype("int32")


def _time_costs(blocks, cache=None):
    return partition.block_costs(blocks, "time", _tokens(), cache)


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory) -> str:
    """A cost cache holding the timings of `_blocks()`, measured once for the module."""
    path = str(tmp_path_factory.mktemp("filled_cache") / "costs.json")
    _time_costs(_blocks(), CostCache(path))
    return path


def _copy_of(filled_cache: str, tmp_path) -> str:
    path = str(tmp_path / "costs.json")
    shutil.copyfile(filled_cache, path)
    return path


def test_identical_transformer_layers_are_timed_once_and_share_their_seconds(timed):
    costs = _time_costs(_blocks())

    assert len(timed) == DISTINCT_BLOCKS
    layers = costs[1:-1]
    assert len({(block.forward_time, block.backward_time) for block in layers}) == 1
    assert [block.name for block in costs] == [block.name for block in _blocks()]


def test_blocks_that_differ_in_shape_are_each_timed(timed):
    blocks = [keras.layers.Dense(units, name=f"dense_{units}") for units in (8, 16, 8)]

    partition.block_costs(blocks, "time", np.zeros((4, 8), "float32"))

    # dense_8 after dense_16 takes 16 inputs, not 8: a different weight shape.
    assert timed == ["dense_8", "dense_16", "dense_8"]


def test_signature_ignores_names_and_seeds_but_not_sizes():
    x = np.zeros((4, 6), "float32")

    def built(layer):
        layer(x)
        return block_signature(layer, x)

    dense = dict(kernel_initializer=keras.initializers.GlorotUniform(seed=1))
    reference = built(keras.layers.Dense(5, name="a", **dense))
    renamed = built(
        keras.layers.Dense(5, name="b", kernel_initializer=keras.initializers.GlorotUniform(seed=7))
    )
    wider = built(keras.layers.Dense(6, name="a", **dense))

    assert renamed == reference
    assert wider != reference
    assert block_signature(keras.layers.Dense(5, name="a", **dense), x[:2]) != reference


def test_cache_is_written_by_the_first_measurement_and_read_by_the_next(tmp_path, timed):
    path = str(tmp_path / "costs.json")
    first = _time_costs(_blocks(), CostCache(path))
    assert len(timed) == DISTINCT_BLOCKS
    with open(path) as handle:
        assert len(json.load(handle)["blocks"]) == DISTINCT_BLOCKS

    second = _time_costs(_blocks(), CostCache(path))

    assert len(timed) == DISTINCT_BLOCKS  # nothing timed again
    assert second == first


def test_another_model_config_times_only_its_changed_blocks(tmp_path, filled_cache, timed):
    path = _copy_of(filled_cache, tmp_path)

    _time_costs(_blocks(mlp_dim=48), CostCache(path))

    # The embedding and head keep their shapes; the layers' MLP changed.
    assert timed == ["transformer_block_0"]
    with open(path) as handle:
        assert len(json.load(handle)["blocks"]) == DISTINCT_BLOCKS + 1


def test_remeasure_times_every_distinct_block_again(tmp_path, filled_cache, timed):
    path = _copy_of(filled_cache, tmp_path)

    _time_costs(_blocks(), CostCache(path, remeasure=True))

    assert len(timed) == DISTINCT_BLOCKS


def test_timings_from_another_environment_are_not_reused(tmp_path, filled_cache, timed):
    path = tmp_path / "costs.json"
    with open(filled_cache) as handle:
        content = json.load(handle)
    content["environment"]["tensorflow"] = "0.0.1"
    path.write_text(json.dumps(content))

    _time_costs(_blocks(), CostCache(str(path)))

    assert len(timed) == DISTINCT_BLOCKS


@pytest.mark.parametrize(
    "damage",
    [
        "{not json",
        '{"format": 1, "blocks": []}',
        '{"format": 1, "blocks": {"abc": {"forward_seconds": "fast"}}}',
        "",
    ],
)
def test_a_damaged_cache_is_ignored_with_one_warning_and_replaced(tmp_path, timed, caplog, damage):
    path = tmp_path / "costs.json"
    path.write_text(damage)

    with caplog.at_level(logging.WARNING):
        costs = _time_costs(_blocks(), CostCache(str(path)))

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert len(timed) == DISTINCT_BLOCKS and len(costs) == len(_blocks())
    assert len(json.loads(path.read_text())["blocks"]) == DISTINCT_BLOCKS


def test_time_partition_balances_the_cached_seconds(tmp_path, filled_cache, timed):
    path = _copy_of(filled_cache, tmp_path)
    first = partition.partition_blocks(
        _blocks(), 3, "time", sample_input=_tokens(), cache=CostCache(path)
    )

    second = partition.partition_blocks(
        _blocks(), 3, "time", sample_input=_tokens(), cache=CostCache(path)
    )

    assert timed == []  # every block's seconds came from the cache
    assert second == first


def test_measured_stage_seconds_sum_their_blocks():
    costs = [Block(forward_time=f, backward_time=2 * f) for f in (1.0, 2.0, 3.0, 4.0)]

    seconds = MeasuredStageSeconds.from_blocks(costs, [1, 3])

    assert seconds.forward == (1.0, 5.0, 4.0)
    assert seconds.backward == (2.0, 10.0, 8.0)
