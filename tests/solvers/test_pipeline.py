"""The 1F1B simulator (hand-computed schedules) and the three partitionings on a synthetic
model."""

import dataclasses

import numpy as np
import pytest

from solvers.lynx import LayerOps
from solvers.pipeline import (Block, ModelProfile, partition, plan_stage, simulate_1f1b)


def test_one_stage_runs_its_micro_batches_back_to_back():
    assert simulate_1f1b([1.0], [2.0], 0.5, 4, optimizer=[0.25]) == pytest.approx(12.25)


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (3, 3)])
def test_uniform_stages_take_m_plus_s_minus_1_slots(stages, micro_batches):
    # 1F1B with equal stages, F = B and no transfer: (m + S - 1) (F + B).
    seconds = simulate_1f1b([1.0] * stages, [1.0] * stages, 0.0, micro_batches)
    assert seconds == pytest.approx((micro_batches + stages - 1) * 2.0)


def test_two_stages_by_hand():
    # F0=1 B0=2, F1=2 B1=1, transfer 0.5, 2 micro-batches. Stage 1: F(0) 1.5-3.5, B(0) 3.5-4.5,
    # F(1) 4.5-6.5 (its input arrived at 3), B(1) 6.5-7.5. Stage 0: F(0) 0-1, F(1) 1-2,
    # B(0) 5-7 (gradient at 4.5 + 0.5), B(1) 8-10.
    assert simulate_1f1b([1.0, 2.0], [2.0, 1.0], 0.5, 2) == pytest.approx(10.0)


def _profile(layers=8, held=100, static=50) -> ModelProfile:
    ops = LayerOps(
        nodes=np.arange(3), names=("a", "attention_core/b", "c"),
        compute=np.array([1.0, 2.0, 0.5]), comm=np.zeros(3), memory=np.array([40, 50, 10]),
        operands=((), (0,), (1,)), needed=np.array([True, True, False]),
        pinned=np.array([False, False, True]), forward_windows=np.array([0.6]),
        backward_windows=np.array([1.2]), backward_window_nodes=np.array([9]),
        forward_seconds=3.5, backward_seconds=7.0)
    layer = Block(3.5, 7.0, 0.1, static, held)
    return ModelProfile(layer_ops=ops, layer=layer, embed=Block(0.5, 1.0, 0.5, 200, 10),
                        head=Block(2.0, 4.0, 0.5, 200, 20), layers=layers, workspace_bytes=30,
                        boundary_bytes=10, link_latency=0.01, link_bandwidth=1e3, micro_batch=2)


def test_earlier_stages_hold_more_micro_batches():
    profile = _profile()
    plans = [plan_stage(profile, s, 2, 4, 8, 10**6, policy="none") for s in range(4)]
    assert [p.in_flight for p in plans] == [4, 3, 2, 1]
    middle = [p.peak_bytes for p in plans[1:3]]
    assert middle[0] - middle[1] == 2 * 100            # one more micro-batch of 2 layers
    assert all(p.fits and p.on_demand_seconds == 0 for p in plans)


def test_stage_peak_is_static_workspace_and_held_activations():
    profile = _profile()
    plan = plan_stage(profile, 1, 3, 4, 8, 10**6, policy="full")
    # full recomputation holds only the layer output c (10 bytes) per layer and micro-batch
    assert plan.peak_bytes == 3 * 50 + 30 + 3 * 3 * 10
    assert plan.backward_seconds == pytest.approx(3 * (7.0 + 3.0))


def test_lynx_policy_fits_where_keeping_everything_does_not():
    profile = _profile()
    budget = plan_stage(profile, 0, 2, 4, 8, 10**6, policy="none").peak_bytes - 100
    assert not plan_stage(profile, 0, 2, 4, 8, budget, policy="none").fits
    lynx = plan_stage(profile, 0, 2, 4, 8, budget, policy="lynx")
    full = plan_stage(profile, 0, 2, 4, 8, budget, policy="full")
    assert lynx.fits and lynx.peak_bytes <= budget
    assert lynx.step_seconds <= full.step_seconds


@pytest.mark.parametrize("method", ["even", "lynx", "dawnpiper"])
def test_partitions_cover_every_layer_and_fit(method):
    profile = _profile(layers=12)
    result = partition(profile, 4, 8, 2000, method=method)
    summary = result.summary()
    assert sum(summary["stage_layers"]) == 12 and min(summary["stage_layers"]) >= 1
    assert result.fits and all(b <= 2000 for b in summary["stage_peak_bytes"])
    assert summary["simulated_throughput"] == pytest.approx(8 * 2 / result.step_seconds)


def test_lynx_partitioning_is_never_slower_than_the_even_split():
    for budget in (1500, 2000, 4000):
        profile = _profile(layers=12)
        even = partition(profile, 4, 8, budget, method="even")
        lynx = partition(profile, 4, 8, budget, method="lynx")
        assert lynx.step_seconds <= even.step_seconds


def test_even_split_balances_parameters_with_the_embedding_and_head():
    profile = dataclasses.replace(_profile(layers=10), head=Block(2.0, 4.0, 0.5, 300, 20))
    result = partition(profile, 4, 8, 10**6, method="even", policy="none")
    static = [s.layers * 50 + (200 if s.index == 0 else 0) + (300 if s.index == 3 else 0)
              for s in result.stages]
    assert max(static) == 350         # the last stage holds the head and at least one layer


def test_a_budget_no_stage_fits_reports_it():
    result = partition(_profile(), 4, 8, 100, method="lynx")
    assert not result.fits and result.throughput == 0.0
    assert result.summary()["simulated_step_seconds"] is None


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="one layer at least per stage"):
        partition(_profile(layers=3), 4, 8, 10**6)
