"""Lynx: the per-layer program (hand-worked layers), the overlap credit of the simulator, and
Lynx-HEU / Lynx-OPT on a layered problem."""

import dataclasses

import numpy as np
import pytest

import solvers
from solvers import lynx
from solvers.backend import MilpResult, Model
from solvers.solution import Status
from solvers.lynx import LayerOps, heu_policy, policy_from_keep
from solver_graphs import chain_problem, layered_problem


def _chain_layer(comm_a=0.0, windows=(2.5,)) -> LayerOps:
    """a -> b -> c; a (1 s) and b (2 s) are read by the backward pass, c is the layer's output
    (pinned); 10 bytes each."""
    return LayerOps(
        nodes=np.arange(3), names=("a", "attention_core/b", "c"),
        compute=np.array([1.0, 2.0, 0.5]), comm=np.array([comm_a, 0.0, 0.0]),
        memory=np.array([10, 10, 10]), operands=((), (0,), (1,)),
        needed=np.array([True, True, False]), pinned=np.array([False, False, True]),
        forward_windows=np.zeros(0), backward_windows=np.array(windows),
        backward_window_nodes=np.arange(len(windows)) + 10, forward_seconds=3.5,
        backward_seconds=7.0)


@pytest.mark.parametrize("pooled", [True, False])
def test_with_nothing_held_a_hides_under_the_window_and_b_runs_on_demand(pooled):
    # Both recomputations (3 s) do not fit the 2.5 s window; b in the window would need a
    # before it, and a on demand comes after it: the optimum hides a and recomputes b on demand.
    policy = heu_policy(_chain_layer(), activation_budget=10, pooled=pooled)
    assert policy.keep.tolist() == [False, False, True]
    assert policy.phase.tolist() == [0, 1, -1]
    assert policy.on_demand_seconds == pytest.approx(2.0)
    assert policy.overlapped_seconds == pytest.approx(1.0)
    assert policy.held_bytes == 10


def test_memory_left_over_keeps_the_expensive_value():
    policy = heu_policy(_chain_layer(), activation_budget=20)
    assert policy.keep.tolist() == [False, True, True]
    assert policy.on_demand_seconds == 0.0 and policy.overlapped_seconds == pytest.approx(1.0)


def test_layers_and_micro_batches_in_flight_multiply_the_held_bytes():
    # held bytes = layers x in_flight x (pinned c + kept values), 10 bytes each
    assert heu_policy(_chain_layer(), activation_budget=39, layers=2).keep.sum() == 1
    assert heu_policy(_chain_layer(), activation_budget=40, layers=2).keep.sum() == 2
    assert heu_policy(_chain_layer(), activation_budget=40, layers=2, in_flight=2).keep.sum() == 1
    assert heu_policy(_chain_layer(), activation_budget=39, layers=2, in_flight=2) is None


def test_an_operator_with_a_collective_is_recomputed_on_demand_only():
    policy = heu_policy(_chain_layer(comm_a=0.1, windows=(10.0,)), activation_budget=10)
    assert policy.phase[0] == policy.windows               # on demand
    assert policy.on_demand_seconds == pytest.approx(1.1 + 2.0)  # b waits for a


def test_full_recomputation_recomputes_what_the_dropped_values_read():
    ops = _chain_layer()
    full = policy_from_keep(ops, np.zeros(3, bool))
    assert full.keep.tolist() == [False, False, True]
    assert full.recomputed.tolist() == [True, True, False]
    assert full.on_demand_seconds == pytest.approx(3.0) and full.overlapped_seconds == 0.0
    selective = policy_from_keep(ops, np.array(["attention_core" not in n for n in ops.names]))
    assert selective.keep.tolist() == [True, False, True]
    assert selective.on_demand_seconds == pytest.approx(2.0)


def test_the_simulator_credits_recomputation_beside_a_collective_that_does_not_wait_for_it():
    p = chain_problem()
    comm = [np.zeros(1) for _ in range(p.num_nodes)]
    comm[4] = np.array([0.5])                 # gc issues a collective; it reads c, not a
    comm[6] = np.array([0.5])                 # ga issues one too, but it reads a
    p = dataclasses.replace(p, comm=tuple(comm))
    strategy = np.zeros(p.num_nodes, np.int64)
    base = solvers.simulate(p, strategy).step_seconds
    beside = solvers.simulate(p, strategy, recompute_at={1: (4,)}, overlap=True)
    assert beside.overlapped_recompute_seconds == pytest.approx(0.5)
    assert beside.step_seconds == pytest.approx(base + 1.0 - 0.5)
    waited = solvers.simulate(p, strategy, recompute_at={1: (6,)}, overlap=True)
    assert waited.overlapped_recompute_seconds == 0.0
    assert waited.step_seconds == pytest.approx(base + 1.0)
    plain = solvers.simulate(p, strategy, recompute_at={1: (4,)})
    assert plain.step_seconds == pytest.approx(base + 1.0)


def test_heu_hides_a_layers_recomputation_under_the_next_layers_collective():
    p = layered_problem(layers=2, window_comm=1.5)
    strategy = np.zeros(p.num_nodes, np.int64)
    keep_all = solvers.simulate(p, strategy)
    budget = keep_all.peak_bytes - 100
    plan = lynx.lynx_heu(p, budget, strategy)
    sim = solvers.simulate(p, strategy, recompute_at=plan.recompute_at, overlap=True)
    assert sim.peak_bytes <= budget and plan.peak_bytes == sim.peak_bytes
    assert plan.objective == pytest.approx(sim.step_seconds)
    assert plan.hidden_under and plan.overlapped_recompute_seconds > 0
    hidden_in = {p.layer[t] for t in plan.hidden_under.values()}
    hidden_from = {p.layer[i] for i in plan.hidden_under}
    assert hidden_from == {0} and hidden_in == {1}          # layer 0's a under layer 1's gb


def test_opt_is_never_slower_than_heu_and_its_objective_is_the_simulated_step():
    p = layered_problem(layers=2, window_comm=1.5)
    strategy = np.zeros(p.num_nodes, np.int64)
    budget = solvers.simulate(p, strategy).peak_bytes - 100
    heu = lynx.lynx_heu(p, budget, strategy)
    opt = lynx.lynx_opt(p, budget, strategy, warm_start=heu, time_limit=30)
    sim = solvers.simulate(p, strategy, recompute_at=opt.recompute_at, overlap=True)
    assert opt.status == solvers.Status.OPTIMAL
    assert opt.objective == pytest.approx(sim.step_seconds)
    assert sim.peak_bytes <= budget
    assert opt.objective <= heu.objective + 1e-9


def test_opt_without_a_plan_of_its_own_answers_with_its_warm_start(monkeypatch):
    # HiGHS completes a partial start only after presolve; a time limit that ends before that
    # (a slow machine) leaves the backend without an incumbent although one was given.
    p = layered_problem(layers=2, window_comm=1.5)
    strategy = np.zeros(p.num_nodes, np.int64)
    budget = solvers.simulate(p, strategy).peak_bytes - 100
    heu = lynx.lynx_heu(p, budget, strategy)
    nothing = MilpResult(Status.TIMEOUT_NO_INCUMBENT, None, float("nan"), float("nan"), 0.5)
    monkeypatch.setattr(Model, "solve", lambda self, *args, **kwargs: nothing)
    opt = lynx.lynx_opt(p, budget, strategy, warm_start=heu, time_limit=1)
    # its gap is against the step that keeps everything (no plan with this sharding is faster)
    keep_all = solvers.simulate(p, strategy).step_seconds
    assert opt.status == Status.TIMEOUT_WITH_INCUMBENT
    assert opt.gap == pytest.approx(1 - keep_all / heu.objective) and 0 < opt.gap < 1
    assert opt.recompute_at == heu.recompute_at
    assert opt.objective == pytest.approx(heu.objective) and opt.peak_bytes <= budget
    with pytest.raises(solvers.SolverError, match="no plan"):
        lynx.lynx_opt(p, budget, strategy, time_limit=1)


def test_an_infeasible_budget_names_the_smallest_heu_finds():
    p = layered_problem(layers=2)
    strategy = np.zeros(p.num_nodes, np.int64)
    with pytest.raises(solvers.InfeasibleBudgetError, match="smallest feasible budget") as err:
        lynx.lynx_heu(p, 50, strategy)
    assert err.value.min_feasible_bytes > 50
    lynx.lynx_heu(p, err.value.min_feasible_bytes, strategy)


def test_a_problem_built_without_ties_ties_nothing_and_heu_says_so():
    p = layered_problem(layers=2)
    assert solvers.reuse.has_ties(p.ties)                  # filled where the problem is made
    untied = dataclasses.replace(p, ties=None)
    assert np.array_equal(untied.ties, np.arange(p.num_nodes))
    with pytest.raises(ValueError, match="with_layer_ties"):
        lynx.lynx_heu(untied, None, np.zeros(p.num_nodes, np.int64))
    assert np.array_equal(solvers.with_layer_ties(untied).ties, p.ties)


def test_solve_dispatches_lynx_heu_on_the_reference_plans_sharding():
    p = layered_problem(layers=2, window_comm=1.5)
    budget = solvers.simulate(p, np.zeros(p.num_nodes, np.int64)).peak_bytes - 100
    plan = solvers.solve(p, budget, solver="lynx-heu")
    reference = solvers.reference_plan(p)
    direct = lynx.lynx_heu(p, budget, reference.strategy)
    assert plan.solver == "lynx-heu" and plan.peak_bytes <= budget
    assert plan.recompute_at == direct.recompute_at and plan.hidden_under == direct.hidden_under
    assert plan.objective == pytest.approx(direct.objective)
    opt = solvers.solve(p, budget, solver="lynx-opt", time_limit=30)   # from HEU's plan
    assert opt.solver == "lynx-opt" and opt.objective <= plan.objective + 1e-9


def test_solve_passes_seed_and_threads_to_every_lynx_program(monkeypatch):
    p = layered_problem(layers=2, window_comm=1.5)
    budget = solvers.simulate(p, np.zeros(p.num_nodes, np.int64)).peak_bytes - 100
    calls, solve = [], Model.solve

    def spy(self, backend, **kwargs):
        calls.append((backend, kwargs.get("seed", 0), kwargs.get("threads", 1)))
        # run on one thread: HiGHS sizes its scheduler once per process, at the first solve
        return solve(self, backend, **{**kwargs, "threads": 1})

    monkeypatch.setattr(Model, "solve", spy)
    solvers.solve(p, budget, solver="lynx-opt", seed=3, threads=2, time_limit=30)
    assert len(calls) > 2 and set(calls) == {("highs", 3, 2)}   # reference, HEU's, OPT's


def test_solve_refuses_lynx_options_it_cannot_honour():
    p = layered_problem(layers=2)
    budget = solvers.simulate(p, np.zeros(p.num_nodes, np.int64)).peak_bytes - 100
    with pytest.raises(ValueError, match="lynx-heu solves one layer.*Use lynx-opt"):
        solvers.solve(p, budget, solver="lynx-heu", reuse_layers=False)
    heu = solvers.solve(p, budget, solver="lynx-heu")
    with pytest.raises(ValueError, match="lynx-heu starts from no plan"):
        solvers.solve(p, budget, solver="lynx-heu", warm_start=heu)
    other = dataclasses.replace(heu, strategy=heu.strategy + 1)
    with pytest.raises(ValueError, match="keeps the reference plan's sharding"):
        solvers.solve(p, budget, solver="lynx-opt", warm_start=other)

