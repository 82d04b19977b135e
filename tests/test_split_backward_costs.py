"""A split backward's I and W, measured on the executor's cut functions and costed apart.

Zero-bubble schedules run a stage's backward as I then W. Measured here, I + W costs
more than the whole B and I is most of it; the planner used to assume I = W = B / 2.
"""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmulti.pipeline import CostModel, StageCost, build_schedule, simulate
from tfmulti.pipeline.balance import Block, balance, stage_cost
from tfmulti.planner.costs import AffineTime, BlockCost, Hardware, ModelCosts, blocks_at
from tfmulti.planner.costs import load_costs as load_cost_file
from tfmulti.planner.costs import save_costs as save_cost_file
from tfmulti.planner.measure import mean_shares, measure_model_costs
from tfmulti.planner.scoring import score_layout
from tfmulti.planner.split_backward import SplitShares, split_backward_shares
from tfmulti.platform.mesh import HybridMesh


def test_a_measured_input_gradient_time_is_what_each_i_action_takes():
    stage = StageCost(forward=1.0, backward=2.0, weight_grad=0.8, input_grad=1.7)
    assert (stage.duration("I"), stage.duration("W"), stage.duration("B")) == (1.7, 0.8, 2.0)
    assert StageCost(forward=1.0, backward=2.0, weight_grad=0.5).input_grad == 1.5
    with pytest.raises(ValueError, match="must be >= 0"):
        StageCost(input_grad=-1.0)


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_h2", "interleaved_zb"])
def test_every_device_of_a_split_schedule_is_busy_m_times_f_plus_i_plus_w(schedule):
    chunks = 2 if schedule == "interleaved_zb" else None
    plan = build_schedule(schedule, 4, 8, chunks)
    forward, backward, weight_grad, input_grad = 1.0, 2.0, 0.7, 1.9
    stage = StageCost(forward, backward, weight_grad, input_grad=input_grad)
    result = simulate(plan, CostModel((stage,) * plan.num_stages))
    per_device = 8 * (forward + input_grad + weight_grad) * (chunks or 1)
    assert result.busy_time == pytest.approx((per_device,) * 4)


def test_the_first_stage_hands_no_gradient_back_so_its_w_is_the_whole_backward():
    blocks = [
        Block(1.0, 2.0, input_grad_time=1.6, weight_grad_time=0.6),
        Block(0.5, 1.0, input_grad_time=0.9, weight_grad_time=0.3),
    ]
    first = stage_cost(blocks, hands_gradients_back=False)
    assert (first.input_grad, first.weight_grad, first.backward) == (0.0, 3.0, 3.0)
    later = stage_cost(blocks)
    assert (later.input_grad, later.weight_grad, later.backward) == pytest.approx((2.5, 0.9, 3.0))
    unmeasured = stage_cost([Block(1.0, 2.0), blocks[0]])
    assert (unmeasured.input_grad, unmeasured.weight_grad) == (2.0, 2.0)


def _cost(name, input_grad_share=None, weight_grad_share=None, allreduces=0):
    return BlockCost(
        name,
        params=100,
        forward_seconds=AffineTime(0.001, 0.0001),
        backward_seconds=AffineTime(0.002, 0.0002),
        activation_bytes_per_example=1000.0,
        tensor_allreduces=allreduces,
        input_grad_share=input_grad_share,
        weight_grad_share=weight_grad_share,
    )


def _model(blocks):
    return ModelCosts("transformer", {}, "tokens", None, tuple(blocks), (1, 2), (8, 64))


def test_block_shares_turn_into_i_and_w_times_with_the_tensor_allreduce_in_i():
    costs = _model([_cost("a", 1.2, 0.4, allreduces=2), _cost("b")])
    split, whole = blocks_at(costs, 10, 2, Hardware())
    compute = 0.002 + 0.0002 * 10 / 2
    communication = split.backward_time - compute
    assert communication > 0
    assert split.input_grad_time == pytest.approx(1.2 * compute + communication)
    assert split.weight_grad_time == pytest.approx(0.4 * compute)
    assert (whole.input_grad_time, whole.weight_grad_time) == (None, None)


def test_cost_file_keeps_the_shares_and_an_older_file_loads_without_them(tmp_path):
    costs = _model([_cost("a", 1.1, 0.35), _cost("b", 0.0, 1.0)])
    path = str(tmp_path / "costs.json")
    save_cost_file(costs, path)
    assert load_cost_file(path) == costs
    data = json.loads(open(path).read())
    for block in data["blocks"]:
        del block["input_grad_share"], block["weight_grad_share"]
    older = ModelCosts.from_json(data)
    assert [(b.input_grad_share, b.weight_grad_share) for b in older.blocks] == [(None, None)] * 2


def _zb_and_1f1b_times(costs):
    blocks = blocks_at(costs, 8, 1, Hardware())
    return {
        name: score_layout(blocks, HybridMesh(pipe=2), name, 4, 1, (1,), Hardware()).step_time
        for name in ("zb_h1", "1f1b")
    }


def test_a_split_dearer_than_the_whole_backward_slows_zero_bubble_and_not_1f1b():
    halves = _zb_and_1f1b_times(_model([_cost("a"), _cost("b")]))
    measured = _zb_and_1f1b_times(_model([_cost("a", 1.3, 0.5), _cost("b", 1.3, 0.5)]))
    assert measured["1f1b"] == halves["1f1b"]
    assert measured["zb_h1"] > halves["zb_h1"]
    assert halves["zb_h1"] < halves["1f1b"]


def test_mean_shares_average_each_blocks_shares_over_the_batch_sizes():
    rows = [[(1.0, 0.2), (0.0, 1.0)], [(0.8, 0.4), (0.0, 0.8)]]
    assert mean_shares(rows) == [pytest.approx((0.9, 0.3)), pytest.approx((0.0, 0.9))]


def test_pieces_with_nothing_to_compute_have_no_share():
    embedding = keras.layers.Embedding(50, 16)
    ids = tf.constant(np.arange(32).reshape(4, 8) % 50)
    embedding(ids)
    input_share, weight_share = split_backward_shares(embedding, ids, rounds=1)
    assert input_share == 0.0 and weight_share >= 0.0
    activation = keras.layers.Activation("tanh")
    features = tf.ones([64, 128])
    activation(features)
    input_share, weight_share = split_backward_shares(activation, features, rounds=1)
    assert weight_share == 0.0 and input_share >= 0.0


def test_blocks_of_one_signature_are_measured_once(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "tfmulti.planner.split_backward.split_backward_shares",
        lambda block, inputs, rounds: calls.append(block) or (0.9, 0.4),
    )
    shares = SplitShares()
    assert shares.of("one", None, "same") == (0.9, 0.4)
    assert shares.of("two", None, "same") == (0.9, 0.4)
    assert shares.of("three", None, None) == (0.9, 0.4)
    assert calls == ["one", "three"]


def test_measured_reference_model_costs_carry_each_blocks_shares():
    costs = measure_model_costs(
        "transformer", "tokens", {"num_layers": 1, "d_model": 32}, batch_sizes=(4, 8), rounds=1
    )
    shares = [(block.input_grad_share, block.weight_grad_share) for block in costs.blocks]
    assert all(math.isfinite(s) and s >= 0 for pair in shares for s in pair)
    # Token ids get no gradient: the embedding's I computes nothing.
    assert shares[0][0] == 0.0
    # Every later block has weights and a float input: both parts do work.
    assert all(input_share > 0 and weight_share > 0 for input_share, weight_share in shares[1:])


def test_the_balancer_splits_for_a_zero_bubble_schedule_by_its_measured_i_and_w():
    # Equal F and B everywhere; the first block's I is dear, the last block's W is dear.
    def blocks(input_grads):
        return [
            Block(1.0, 2.0, input_grad_time=i, weight_grad_time=w, name=str(n))
            for n, (i, w) in enumerate(input_grads)
        ]

    dear_late_input = blocks([(1.0, 1.0)] * 3 + [(6.0, 0.2)] * 3)
    even = blocks([(1.0, 1.0)] * 6)
    assert balance(even, 2, 4, "time", schedule="zb_h1").boundaries == (3,)
    # The first stage's backward runs as W alone whatever I costs, so blocks with a dear
    # I belong there: the split moves right.
    chosen = balance(dear_late_input, 2, 4, "time", schedule="zb_h1").boundaries
    assert chosen[0] > 3
