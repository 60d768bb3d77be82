"""Chains of recomputation inside a layer: a dropped value recomputed from other dropped values
of its layer, as ``jax.checkpoint`` around a block does, in the program, the simulator and the
baseline rules."""

import dataclasses
import itertools
import sys

import numpy as np
import pytest

import solvers
from solvers import InfeasibleBudgetError, simulate, solve
from solvers.heuristics import keep_layer_inputs
from solvers.joint import build_joint
from solvers.linexpr import var
from solvers.phase import Phase
from solvers.reuse import with_layer_ties
from solver_graphs import layered_problem, make_problem, random_problem


def _layers(p, layers: int, width: int):
    """``random_problem``'s forward and backward operators labelled with their layer."""
    layer = np.full(p.num_nodes, -1)
    first = 1 + layers                                   # after x and the parameters
    for lay in range(layers):
        layer[first + lay * width: first + (lay + 1) * width] = lay
    backward = first + layers * width + 2                # after the loss and its gradient
    for lay in reversed(range(layers)):                  # per layer: width + 1 (the grad)
        layer[backward: backward + width + 1] = lay
        backward += width + 1
    assert (p.phase[layer >= 0] != Phase.PARAM).all()
    return with_layer_ties(dataclasses.replace(p, layer=layer))


def test_a_layer_is_recomputed_at_the_start_of_its_backward_pass():
    p = layered_problem(layers=2)                # per layer a -> b -> c, backward c, b, a
    fb, stage = p.first_bwd_use, p.recompute_stage
    for lay in range(2):
        a, b, c = np.flatnonzero((p.layer == lay) & (p.phase == Phase.FORWARD))
        assert p.chained(a, b) and p.chained(b, c)
        assert fb[c] < fb[b] < fb[a]
        assert stage[a] == stage[b] == stage[c] == fb[c]
    loss = int(np.flatnonzero((p.layer < 0) & (p.phase == Phase.FORWARD))[0])
    assert not p.chained(int(np.flatnonzero(p.layer == 1)[-1]), loss)


def test_full_recomputation_keeps_only_what_crosses_a_layer_boundary():
    p = layered_problem(layers=2)
    keep = keep_layer_inputs(p)
    dropped = {(int(p.layer[i]), k) for i in np.flatnonzero(~keep & p.recomputable)
               for k in [int(np.flatnonzero(np.flatnonzero(p.layer == p.layer[i]) == i)[0])]}
    assert dropped == {(0, 0), (0, 1), (1, 0), (1, 1)}    # a and b of both layers; c kept
    kept_peak = simulate(p, np.zeros(p.num_nodes, int)).peak_bytes
    assert simulate(p, np.zeros(p.num_nodes, int), keep).peak_bytes < kept_peak


def _keep_sets(p):
    """Every ``(dropped set, keep flags)`` the rule allows: a dropped value's droppable inputs
    are kept or dropped values of its own layer it may chain from."""
    candidates = np.flatnonzero(p.droppable)
    operands = p.operands()
    for dropped in itertools.product((False, True), repeat=len(candidates)):
        gone = {int(i) for i, d in zip(candidates, dropped) if d}
        if any(i in gone and not p.chained(i, j) for j in gone for i in operands[j]):
            continue
        keep = np.ones(p.num_nodes, bool)
        keep[list(gone)] = False
        yield gone, keep


def _brute_force(p, budget: int) -> float:
    """The fastest keep flags under ``budget`` (one strategy per node)."""
    strategy = np.zeros(p.num_nodes, int)
    best = float("inf")
    for _, keep in _keep_sets(p):
        sim = simulate(p, strategy, keep)
        if sim.peak_bytes <= budget:
            best = min(best, sim.step_seconds)
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])       # seeds whose optimum recomputes a chain
def test_the_program_with_chains_is_sound_against_the_exhaustive_search(seed):
    """The program bounds the stages a chain gives from above, so its plans are never faster
    than the exhaustive search's, they fit as the simulator replays them, and on these seeds
    it reaches the exhaustive optimum, chains included, on most budgets."""
    p = _layers(random_problem(seed, layers=2, width=3, max_strategies=1), 2, 3)
    operands = p.operands()
    peak = simulate(p, np.zeros(p.num_nodes, int)).peak_bytes
    chains = matched = 0
    fractions = (0.96, 0.9, 0.88, 0.86)
    for fraction in fractions:
        budget = int(fraction * peak)
        expected = _brute_force(p, budget)
        try:
            sol = solve(p, budget, solver="kiwi", reuse_layers=False, mip_gap=1e-9)
        except InfeasibleBudgetError:
            continue
        assert sol.objective >= expected * (1 - 1e-6)
        sim = simulate(p, sol.strategy, recompute_at=sol.recompute_at)
        assert sim.peak_bytes <= sol.claimed_peak_bytes <= budget
        matched += sol.objective == pytest.approx(expected, rel=1e-6)
        chains += any(i in sol.recompute_at for j in sol.recompute_at for i in operands[j])
    assert chains, "no budget of this seed is won by recomputing a chain"
    assert matched >= len(fractions) // 2


class _Graph:
    """A hand-written problem, one node at a time: phase, operands, compute seconds, bytes and
    layer (-1: none) per node; one strategy each."""

    def __init__(self):
        self.phases, self.edges, self.layer, self.compute, self.memory = [], [], [], [], []

    def node(self, phase, inputs, seconds, nbytes, lay=-1) -> int:
        self.phases.append(phase)
        self.edges.extend((j, len(self.phases) - 1) for j in inputs)
        self.layer.append(lay)
        self.compute.append([seconds])
        self.memory.append([nbytes])
        return len(self.phases) - 1

    def problem(self, outputs):
        return make_problem(self.phases, self.edges, self.compute, self.memory,
                            layer=self.layer, outputs=outputs)


def _branch_problem():
    """Two layers of x -> a -> f -> b (+ x): f, a residual branch's output, is read by no
    backward operator; backward: gb reads b, ga reads a."""
    graph = _Graph()
    node = graph.node
    h = node(Phase.PARAM, [], 0.0, 10)
    acts = []
    for lay in range(2):
        a = node(Phase.FORWARD, [h], 1.0, 20, lay)
        f = node(Phase.FORWARD, [a], 1.0, 100, lay)
        b = node(Phase.FORWARD, [f, h], 1.0, 100, lay)
        acts.append((a, b))
        h = b
    loss = node(Phase.FORWARD, [h], 0.1, 1)
    g = node(Phase.BACKWARD, [loss], 0.1, 1)
    for lay in (1, 0):
        a, b = acts[lay]
        g = node(Phase.BACKWARD, [g, b], 1.0, 10, lay)
        g = node(Phase.BACKWARD, [g, a], 1.0, 10, lay)
    update = node(Phase.OPTIMIZER, [g, 0], 0.1, 10)
    return graph.problem(outputs=(loss, update))


def _program_peaks(p, keep) -> tuple[int, int]:
    """The peak the program counts for keep flags (one strategy per node, peak minimised):
    with them fixed, and with them free but held at those values by rows (the exact form
    kiwi falls back to)."""
    fixed = build_joint(p, None, fixed_keep=keep, minimize_peak=True)
    free = build_joint(p, None, minimize_peak=True, exact_chains=True)
    for node, index in free.m_vars.items():
        free.model.add_row(var(index), float(keep[node]), float(keep[node]))
    return tuple(joint.claimed_peak(joint.model.solve("highs", time_limit=10, mip_gap=1e-9).x)
                 for joint in (fixed, free))


def test_the_program_counts_every_chain_through_a_value_the_backward_pass_does_not_read():
    """Over every keep set the rule allows, the program's peak equals the simulator's, keep
    flags fixed or free (a branch dropped for nothing included: it is not recomputed)."""
    p = _branch_problem()
    f = [int(i) for i in np.flatnonzero((p.phase == Phase.FORWARD) & ~p.z & (p.layer >= 0))]
    assert len(f) == 2 and p.droppable[f].all() and not p.recomputable[f].any()
    strategy = np.zeros(p.num_nodes, int)
    checked = 0
    for gone, keep in _keep_sets(p):
        simulated = simulate(p, strategy, keep).peak_bytes
        assert _program_peaks(p, keep) == (simulated, simulated), gone
        checked += bool(gone & set(f))
    assert checked >= 4


def _random_chain_problem(seed: int, layers: int = 2, width: int = 5):
    """Layers of ``width`` forward operators, each reading the one before it and at random the
    layer's input; about half of them read by the backward pass (the rest only by the next
    operator, as a GELU's inner terms are), with random sizes."""
    rng = np.random.default_rng(seed)
    graph = _Graph()
    node = graph.node
    h = x = node(Phase.PARAM, [], 0.0, 10)
    layers_ops = []
    for lay in range(layers):
        ops = [node(Phase.FORWARD, [h], 1.0, int(rng.integers(10, 100)), lay)]
        for _ in range(width - 1):
            inputs = [ops[-1]] + ([h] if rng.random() < 0.3 else [])
            ops.append(node(Phase.FORWARD, inputs, float(rng.uniform(0.5, 2)),
                            int(rng.integers(10, 100)), lay))
        read = [op for op in ops[:-1] if rng.random() < 0.5] + [ops[-1]]
        layers_ops.append(read)
        h = ops[-1]
    loss = node(Phase.FORWARD, [h], 0.1, 1)
    g = node(Phase.BACKWARD, [loss], 0.1, 1)
    for lay in reversed(range(layers)):
        for op in reversed(layers_ops[lay]):
            g = node(Phase.BACKWARD, [g, op], 1.0, 5, lay)
    update = node(Phase.OPTIMIZER, [g, x], 0.1, 10)
    return graph.problem(outputs=(loss, update))


@pytest.mark.parametrize("seed", range(4))
def test_the_program_counts_what_the_simulator_replays_for_any_keep_flags(seed):
    """On random layers with chains through values the backward pass does not read, for up to
    40 keep sets the rule allows (chains recomputed before, at or after their earliest stage),
    the program's peak equals the simulator's, keep flags fixed or free."""
    p = _random_chain_problem(seed)
    assert (p.droppable & ~p.recomputable).any()
    rng = np.random.default_rng(seed)
    keep_sets = list(_keep_sets(p))
    strategy = np.zeros(p.num_nodes, int)
    for k in rng.permutation(len(keep_sets))[:40]:
        gone, keep = keep_sets[k]
        simulated = simulate(p, strategy, keep).peak_bytes
        assert _program_peaks(p, keep) == (simulated, simulated), sorted(gone)


def _long_chain_problem():
    """One layer x -> a -> f1 -> f2 -> f3 -> b: f1..f3 (100 B each) are read by no backward
    operator; gb reads b, ga reads a. Dropped together, the chain is recomputed at the start of
    the layer's backward pass (stage gb), in node order."""
    graph = _Graph()
    node = graph.node
    x = node(Phase.PARAM, [], 1.0, 10)
    a = node(Phase.FORWARD, [x], 1.0, 10, 0)
    f1 = node(Phase.FORWARD, [a], 1.0, 100, 0)
    f2 = node(Phase.FORWARD, [f1], 1.0, 100, 0)
    f3 = node(Phase.FORWARD, [f2], 1.0, 100, 0)
    b = node(Phase.FORWARD, [f3], 1.0, 10, 0)
    loss = node(Phase.FORWARD, [b], 1.0, 1)
    g = node(Phase.BACKWARD, [loss], 1.0, 1)
    gb = node(Phase.BACKWARD, [g, b], 1.0, 1, 0)
    ga = node(Phase.BACKWARD, [gb, a], 1.0, 1, 0)
    update = node(Phase.OPTIMIZER, [ga, x], 1.0, 10)
    return graph.problem(outputs=(loss, update)), gb


def test_a_chains_intermediates_are_freed_after_their_last_reader_in_the_recomputation():
    """f1 is freed once f2 is recomputed, so at most two of the three are alive at once: at
    their recomputation the layer's backward stage holds x, loss, g and a again, and 200 B of
    the chain; b, recomputed after them, and gb, the stage's own value, come later."""
    p, gb = _long_chain_problem()
    keep = np.ones(p.num_nodes, bool)
    keep[1:6] = False                              # a, f1, f2, f3, b dropped
    assert p.dropped_stages(keep) == {i: gb for i in range(1, 6)}
    strategy = np.zeros(p.num_nodes, int)
    sim = simulate(p, strategy, keep)
    assert sim.memory_timeline[gb] == 10 + 1 + 1 + 10 + 200
    assert sim.peak_bytes == sim.memory_timeline[gb]
    joint = build_joint(p, None, fixed_keep=keep, minimize_peak=True)
    result = joint.model.solve("highs", time_limit=10, mip_gap=1e-9)
    assert joint.claimed_peak(result.x) == sim.peak_bytes


@pytest.mark.parametrize("seed", [1, 2, 5, 6])
def test_the_smallest_feasible_budget_is_the_one_solve_plans_at(seed):
    """On these layers the bounded form of the chains' lifetimes holds more at its smallest
    peak than the keep flags of some plan replay to; the smallest budget kiwi names (its
    error's, :func:`solvers.min_peak_plan`'s) is the smallest replayed peak of any keep flags
    (exhaustively), where ``solve`` plans, and no plan fits under it."""
    p = _random_chain_problem(seed)
    strategy = np.zeros(p.num_nodes, int)
    smallest = min(simulate(p, strategy, keep).peak_bytes for _, keep in _keep_sets(p))
    bounded = build_joint(p, None, minimize_peak=True, tie=p.ties)
    solved = bounded.model.solve("highs", time_limit=10, mip_gap=1e-9)
    assert bounded.claimed_peak(solved.x) > smallest
    plan, lower = solvers.min_peak_plan(p, "kiwi")
    assert lower == plan.budget_bytes == smallest
    assert solve(p, smallest, solver="kiwi").peak_bytes <= smallest
    with pytest.raises(InfeasibleBudgetError) as error:
        solve(p, smallest - 1, solver="kiwi")
    assert error.value.lower_bound_bytes == error.value.min_feasible_bytes == smallest


def test_a_solve_that_finds_no_plan_in_time_answers_with_the_one_an_error_named(monkeypatch):
    """At the budget an infeasible budget's error names (the exact form's smallest peak, under
    the bounded form's), a solve whose backend finds no plan in time answers with the plan of
    that peak (on the zoo's Llama, ViT and encoder-decoder on 2x4 the budgeted program found
    none in 30 s there)."""
    p = _random_chain_problem(1)
    plan, _ = solvers.min_peak_plan(p, "kiwi")

    def no_plan_in_time(*args, **kwargs):
        raise solvers.SolverTimeoutError("no plan found in time")

    monkeypatch.setattr(sys.modules["solvers.solve"], "_solve", no_plan_in_time)
    answer = solve(p, plan.budget_bytes, solver="kiwi")
    assert answer.status == solvers.Status.TIMEOUT_WITH_INCUMBENT
    assert np.array_equal(answer.keep, plan.keep) and answer.peak_bytes <= plan.budget_bytes
    with pytest.raises(solvers.SolverTimeoutError):      # a budget it does not fit
        solve(p, plan.budget_bytes - 1, solver="kiwi")


def test_a_problem_built_again_gets_the_smallest_peak_found_for_the_first(monkeypatch):
    """Each ``optimize`` of a step traces it and builds its own problem: the smallest-peak
    answer found for one is given to another built alike without solving again, and not to a
    problem that differs."""
    first, again, other = (_random_chain_problem(seed) for seed in (2, 2, 3))
    assert first is not again and first.digest == again.digest != other.digest
    answer = solvers.min_peak_plan(first, "kiwi")
    assert answer[0] is not None

    def solved_again(*args, **kwargs):
        raise AssertionError("solved again")

    monkeypatch.setattr(sys.modules["solvers.solve"], "_formulation", solved_again)
    assert solvers.min_peak_plan(again, "kiwi") == answer
    with pytest.raises(AssertionError, match="solved again"):
        solvers.min_peak_plan(other, "kiwi")


@pytest.mark.parametrize("exact_chains", [False, True])
def test_on_one_device_the_bytes_alive_as_sums_give_the_recurrences_plans(exact_chains,
                                                                          monkeypatch):
    """One strategy per node: the memory rows are the sums of the terms alive at each time
    (``Builder._sums``); above ``SUMS_MAX_NONZEROS`` the recurrence's variables. Both forms have
    the same smallest peak and the same optimum at every budget, and each claims a peak
    between the simulator's and the budget."""
    p = _layers(random_problem(0, layers=2, width=3, max_strategies=1), 2, 3)
    caps = (solvers.joint.SUMS_MAX_NONZEROS, 0)

    def solved(cap, budget):
        monkeypatch.setattr(solvers.joint, "SUMS_MAX_NONZEROS", cap)
        joint = build_joint(p, budget, minimize_peak=budget is None, exact_chains=exact_chains)
        return joint, joint.model.solve("highs", time_limit=10, mip_gap=1e-9)

    (sums, by_sums), (recurrence, by_recurrence) = (solved(cap, None) for cap in caps)
    assert recurrence.model.num_vars == sums.model.num_vars + len(recurrence.alive)
    assert by_sums.objective == pytest.approx(by_recurrence.objective, rel=1e-6)
    smallest = sums.claimed_peak(by_sums.x)
    assert smallest == recurrence.claimed_peak(by_recurrence.x)
    peak = simulate(p, np.zeros(p.num_nodes, int)).peak_bytes
    fractions = (1.0, 0.96, 0.9, 0.86)
    assert smallest <= fractions[-1] * peak
    for fraction in fractions:
        budget = int(fraction * peak)
        (sums, by_sums), (recurrence, by_recurrence) = (solved(cap, budget) for cap in caps)
        assert by_sums.objective == pytest.approx(by_recurrence.objective, rel=1e-6)
        for joint, result in ((sums, by_sums), (recurrence, by_recurrence)):
            strategy, keep = joint.decode(p, result.x)
            replayed = simulate(p, strategy, keep).peak_bytes
            assert replayed <= joint.claimed_peak(result.x) <= budget
