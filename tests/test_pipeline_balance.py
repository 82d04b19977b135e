"""The stage balancer against brute force, and its simple policies."""

import itertools
import random

import pytest

from tfmulti.pipeline import Block, balance, build_schedule, parse_partition_spec, simulate
from tfmulti.pipeline.simulate import CostModel, StageCost


def _random_case(rng):
    num_blocks = rng.randint(2, 8)
    num_stages = rng.randint(1, min(4, num_blocks))
    blocks = [
        Block(
            forward_time=rng.randint(1, 5),
            backward_time=rng.randint(1, 9),
            params=rng.randint(0, 5),
            activation_bytes=rng.randint(0, 5),
        )
        for _ in range(num_blocks)
    ]
    return blocks, num_stages, rng.randint(1, 10), rng.choice(["gpipe", "1f1b", "zb_h1"])


def _brute_force(blocks, num_stages, num_microbatches, schedule_name, memory_cap):
    """Every split that fits: (step time, largest stage params) of each."""
    schedule = build_schedule(schedule_name, num_stages, num_microbatches)
    peak_live = simulate(schedule).peak_activations
    outcomes = []
    for cuts in itertools.combinations(range(1, len(blocks)), num_stages - 1):
        edges = (0, *cuts, len(blocks))
        segments = [blocks[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]
        memory = [
            sum(b.param_bytes for b in seg) + peak_live[s] * sum(b.activation_bytes for b in seg)
            for s, seg in enumerate(segments)
        ]
        if memory_cap is not None and max(memory) > memory_cap:
            continue
        stages = tuple(
            StageCost(sum(b.forward_time for b in seg), sum(b.backward_time for b in seg))
            for seg in segments
        )
        step = simulate(schedule, CostModel(stages)).makespan
        outcomes.append((step, max(sum(b.params for b in seg) for seg in segments)))
    return outcomes


@pytest.mark.parametrize("with_memory_cap", [False, True])
def test_time_and_params_policies_match_brute_force_on_small_random_cases(with_memory_cap):
    rng = random.Random(7 + with_memory_cap)
    checked = 0
    for _ in range(80):
        blocks, num_stages, num_microbatches, schedule = _random_case(rng)
        cap = rng.randint(20, 80) if with_memory_cap else None
        outcomes = _brute_force(blocks, num_stages, num_microbatches, schedule, cap)
        kwargs = dict(schedule=schedule, memory_cap=cap)
        if not outcomes:
            with pytest.raises(ValueError, match="memory_cap"):
                balance(blocks, num_stages, num_microbatches, "time", **kwargs)
            continue
        checked += 1
        best_step = min(step for step, _ in outcomes)
        fastest = balance(blocks, num_stages, num_microbatches, "time", **kwargs)
        assert fastest.step_time_lower_bound <= best_step <= fastest.step_time
        if num_microbatches >= num_stages:
            assert fastest.step_time == best_step
        else:
            # Few micro-batches: fill and drain dominate; the search stays close.
            assert fastest.step_time <= 1.1 * best_step
        if cap is not None:
            assert max(fastest.stage_memory) <= cap
        lightest = balance(blocks, num_stages, num_microbatches, "params", **kwargs)
        stage_params = [
            sum(b.params for b in blocks[start:end]) for start, end in lightest.stage_ranges
        ]
        assert max(stage_params) == min(params for _, params in outcomes)
    assert checked > 30


def test_uniform_gives_equal_block_counts_with_the_remainder_first():
    partition = balance([Block()] * 10, 4, 8, "uniform")
    assert partition.boundaries == (3, 6, 8)
    assert [end - start for start, end in partition.stage_ranges] == [3, 3, 2, 2]


def test_manual_split_points_define_the_stages():
    partition = balance([Block()] * 12, 4, 8, "manual", boundaries=(3, 6, 9))
    assert partition.stage_ranges == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert partition.stage_times == (9, 9, 9, 9)
    assert partition.step_time == (8 + 3) * 9


@pytest.mark.parametrize("boundaries", [(3, 6), (3, 3, 9), (0, 6, 9), (3, 6, 12)])
def test_bad_manual_split_points_are_rejected(boundaries):
    with pytest.raises(ValueError, match="Received"):
        balance([Block()] * 12, 4, 8, "manual", boundaries=boundaries)


def test_heavier_last_blocks_get_shorter_stages():
    blocks = [Block(1, 2)] * 8 + [Block(3, 6)] * 4
    partition = balance(blocks, 4, 16, "time")
    sizes = [end - start for start, end in partition.stage_ranges]
    assert sizes[-1] < sizes[0]
    assert max(partition.stage_times) == 18


def test_hundreds_of_blocks_are_balanced_near_the_lower_bound():
    rng = random.Random(3)
    blocks = [Block(rng.random(), 2 * rng.random(), params=100) for _ in range(300)]
    partition = balance(blocks, 8, 32, "time")
    assert len(partition.boundaries) == 7
    # The step is m x bottleneck plus fill and drain, here at most (m+p-1)/m of it.
    assert partition.step_time <= partition.step_time_lower_bound * (32 + 7) / 32


def test_memory_cap_that_nothing_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="No split into 2 stages fits memory_cap=1"):
        balance([Block(params=10)] * 4, 2, 4, "time", memory_cap=1)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("uniform", ("uniform", None)),
        ("params", ("params", None)),
        ("time", ("time", None)),
        ("manual:3,6,9", ("manual", (3, 6, 9))),
    ],
)
def test_partition_specs_parse(spec, expected):
    assert parse_partition_spec(spec) == expected


@pytest.mark.parametrize("spec", ["fast", "manual:", "manual:3,x", "uniform:2"])
def test_bad_partition_specs_name_what_works(spec):
    with pytest.raises(ValueError, match="manual:3,6,9"):
        parse_partition_spec(spec)
