"""The simulator against hand-computed timelines."""

import numpy as np
import pytest

from solvers import reduced_schedule, simulate
from solvers.phase import Phase
from solvers.simulator import buffers, live_bytes
from solver_graphs import chain_problem, random_problem


def test_all_kept_timeline():
    p = chain_problem()
    sim = simulate(p, np.zeros(p.num_nodes, int), np.ones(p.num_nodes, bool))
    #            p     a    b    c   gc   gb   ga   update
    expected = [10, 110, 210, 211, 212, 312, 311, 121]
    assert sim.memory_timeline.tolist() == expected
    assert (sim.peak_bytes, sim.peak_time) == (312, 5)
    assert sim.step_seconds == pytest.approx(13.0)
    assert sim.recompute_seconds == 0.0


def test_dropping_a_recomputes_it_before_its_backward_reader():
    p = chain_problem()
    keep = np.ones(p.num_nodes, bool)
    keep[1] = False
    assert reduced_schedule(p, keep) == {1: (6,)}
    sim = simulate(p, np.zeros(p.num_nodes, int), keep)
    assert sim.memory_timeline.tolist() == [10, 110, 210, 111, 112, 212, 311, 121]
    assert sim.step_seconds == pytest.approx(14.0)
    assert sim.recompute_seconds == pytest.approx(1.0)


def test_schedule_with_a_chain_and_two_recomputations():
    p = chain_problem()
    # drop a and b; recompute a in stage 5 (needed by b's recomputation) and keep it to stage 6.
    sim = simulate(p, np.zeros(p.num_nodes, int), recompute_at={1: (5,), 2: (5,)})
    assert sim.memory_timeline.tolist() == [10, 110, 210, 111, 12, 312, 311, 121]
    assert sim.step_seconds == pytest.approx(13.0 + 1.0 + 5.0)


def test_live_bytes_name_what_the_timeline_holds():
    p = chain_problem()
    strategy = np.zeros(p.num_nodes, int)
    at_peak = live_bytes(p, strategy, 5, {1: (5,), 2: (5,)})
    # stage 5 (gb): p 10, a and b recomputed 100 each, c 1, gc 1, gb 100
    assert at_peak.sum() == 312
    assert at_peak[1] == 100 and at_peak[2] == 100         # a and b again, as recomputed
    for seed in range(5):
        q = random_problem(seed, layers=3)
        plan = reduced_schedule(q, np.arange(q.num_nodes) % 3 != 0)
        sim = simulate(q, np.zeros(q.num_nodes, int), recompute_at=plan)
        for stage in range(q.num_nodes):
            assert live_bytes(q, np.zeros(q.num_nodes, int), stage, plan).sum() == \
                sim.memory_timeline[stage]


def test_buffers_sum_to_the_timeline_beside_the_inputs():
    p = chain_problem()
    strategy = np.zeros(p.num_nodes, int)
    held = buffers(p, strategy, {1: (5,), 2: (5,)})
    assert (100, 1, 2) in held and (100, 5, 6) in held       # a, then a as recomputed
    for seed in range(5):
        q = random_problem(seed, layers=3)
        plan = reduced_schedule(q, np.arange(q.num_nodes) % 3 != 0)
        zero = np.zeros(q.num_nodes, int)
        timeline = simulate(q, zero, recompute_at=plan).memory_timeline
        inputs = q.memory_of(zero)[q.phase == Phase.PARAM].sum()
        for stage in range(q.num_nodes):
            assert inputs + sum(b for b, first, last in buffers(q, zero, plan)
                                if first <= stage <= last) == timeline[stage]


def test_recomputation_must_come_after_the_value():
    p = chain_problem()
    with pytest.raises(ValueError, match="cannot be recomputed in stage"):
        simulate(p, np.zeros(p.num_nodes, int), recompute_at={2: (2,)})


def test_only_forward_values_are_recomputed():
    p = chain_problem()
    with pytest.raises(ValueError, match="not a forward node"):
        simulate(p, np.zeros(p.num_nodes, int), recompute_at={4: (6,)})


def test_resharding_is_paid_again_by_a_recomputation():
    from solver_graphs import make_problem
    p = make_problem([Phase.PARAM, Phase.FORWARD, Phase.BACKWARD], [(0, 1), (1, 2)],
                     [[1.0, 1.0], [2.0, 3.0], [1.0]],
                     [[1, 1], [5, 5], [1]],
                     resharding=[[[0.0, 4.0], [4.0, 0.0]], [[0.0], [0.0]]])
    sim = simulate(p, [0, 1, 0], recompute_at={1: (2,)})
    assert sim.reshard_seconds == pytest.approx(4.0)
    assert sim.step_seconds == pytest.approx(1 + 3 + 4 + 1 + (3 + 4))
