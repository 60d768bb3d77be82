"""Hand-written recipes as plans of kiwi's program (:mod:`kiwi_jax.recipe_plan`), on the zoo
Llama (and the reference GPT and MLP) on a 2x4 mesh: every argument takes the recipe's layout
and every value its policy's keep flag; the plan's objective is the simulator's price of it;
every recipe, with or without a block policy, is a plan of kiwi's program at its own predicted
memory (the program, keep flags free in the exact form of its chains, counts the peak the
simulator replays), and kiwi started from a recipe's plan is at least as fast at its
memory."""

import jax
import numpy as np
import pytest

from experiments import zoo
from kiwi_jax.apply import carried_pairs, in_program_order, trace_for_planning
from kiwi_jax.cluster import Cluster, MeshSpec
from kiwi_jax.compile import compile_plan
from kiwi_jax.plan import plan_from_solution
from kiwi_jax.recipe_plan import best_recipe_start, recipe_keep, recipe_pins, recipe_solution
from kiwi_jax.recipes import Recipe, compile_recipe
from kiwi_jax.recipe_specs import recipe_specs
from kiwi_jax.models.registry import build as reference
from kiwi_jax.problem import build_problem, with_free_layouts
from kiwi_jax.sharding import from_partition_spec
from kiwi_jax.step import functionalize
from solvers import simulate, solve
from solvers.options import SolverOptions
from solvers.solve import pinned_plan, program_peak

LLAMA = {"layers": 2, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 8, "seq": 8, "vocab": 64}
OPTIONS = SolverOptions(time_limit=60, mip_gap=1e-6)


def _planned(step, args):
    """The traced step and its problem on 2x4."""
    traced = trace_for_planning(functionalize(step, args), in_program_order(8))
    build = build_problem(traced.graph, MeshSpec.parse("2x4"), Cluster.parse("v100-nvlink"),
                          carried=carried_pairs(traced))
    return traced, build


def _reference(name: str, **sizes):
    """A reference model's traced step and problem on 2x4."""
    ref = reference(name, **sizes)
    return _planned(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()))


@pytest.fixture(scope="module")
def planned(mesh24):
    return _planned(*zoo.make("llama", **LLAMA))


class _Solutions(dict):
    """Each recipe's plan, solved when a test first asks for it."""

    def __init__(self, traced, build, mesh):
        super().__init__()
        self.args = traced, build, mesh

    def __missing__(self, name):
        self[name] = recipe_solution(*self.args, Recipe.parse(name), OPTIONS,
                                     least_memory=False)
        return self[name]


@pytest.fixture(scope="module")
def solutions(planned, mesh24):
    return _Solutions(*planned, mesh24)


# The four layouts, each block policy twice.
@pytest.mark.parametrize("name", ["dp", "fsdp", "tp", "fsdp+tp", "dp/dots_saveable",
                                  "tp/dots_saveable", "fsdp/nothing_saveable",
                                  "fsdp+tp/nothing_saveable"])
def test_recipe_plan_takes_the_recipes_layout_and_policy(name, planned, solutions, mesh24):
    traced, build = planned
    solution = solutions[name]
    specs = recipe_specs(traced.pure, mesh24, Recipe.parse(name).sharding)
    assert len(specs) == len(traced.graph.parameters)
    for node, partition_spec in zip(traced.graph.parameters, specs):
        rank = len(traced.graph.nodes[node].shape.dims)
        assert build.strategies[node][solution.strategy[node]].out == \
            from_partition_spec(partition_spec, rank, ("data", "model"), build.mesh)
    assert np.array_equal(solution.keep, recipe_keep(build, name))
    assert (Recipe.parse(name).policy == "none") == bool(solution.keep.all())
    sim = simulate(build.problem, solution.strategy, recompute_at=solution.recompute_at)
    assert solution.objective == pytest.approx(sim.step_seconds, rel=1e-9)
    assert solution.peak_bytes == sim.peak_bytes


@pytest.mark.parametrize("name", ["dp", "fsdp+tp", "dp/dots_saveable", "tp/dots_saveable",
                                  "fsdp/nothing_saveable", "fsdp+tp/nothing_saveable"])
def test_recipe_is_a_plan_of_kiwis_program_at_its_own_memory(name, planned, solutions):
    _, build = planned
    problem, solution = build.problem, solutions[name]
    assert program_peak(problem, solution.strategy, solution.keep, OPTIONS) == \
        solution.peak_bytes
    every = {i: int(s) for i, s in enumerate(solution.strategy)}
    fixed = pinned_plan(problem, solution.keep, every, OPTIONS, budget_bytes=solution.peak_bytes)
    assert fixed.objective == pytest.approx(solution.objective, rel=1e-9)


@pytest.mark.parametrize("name", ["dp", "fsdp+tp"])
def test_kiwi_started_from_a_recipe_is_at_least_as_fast(name, planned, solutions):
    _, build = planned
    solution = solutions[name]
    kiwi = solve(build.problem, solution.peak_bytes, time_limit=3, warm_start=solution,
                 search_min_feasible=False)
    assert kiwi.peak_bytes <= solution.peak_bytes
    assert kiwi.objective <= solution.objective * (1 + 1e-3)


def test_least_memory_recipe_plan_is_as_fast_and_holds_no_more(planned, solutions, mesh24):
    traced, build = planned
    fastest = solutions["tp"]
    least = recipe_solution(traced, build, mesh24, Recipe.parse("tp"), OPTIONS)
    assert least.objective == pytest.approx(fastest.objective, rel=1e-6)
    assert least.peak_bytes <= fastest.peak_bytes
    sim = simulate(build.problem, least.strategy, recompute_at=least.recompute_at)
    assert (least.objective, least.peak_bytes) == (sim.step_seconds, sim.peak_bytes)
    assert np.array_equal(least.keep, fastest.keep)


@pytest.mark.scenario
def test_the_solvers_start_is_the_fastest_recipe_that_fits_of_the_first_policy_with_one(
        planned, solutions, mesh24):
    traced, build = planned
    keep_all = [Recipe.parse("dp"), Recipe.parse("fsdp")]
    both = max(solutions[r.name].peak_bytes for r in keep_all)
    start = best_recipe_start(traced, build, mesh24, keep_all, both, OPTIONS)
    assert start.objective == min(solutions[r.name].objective for r in keep_all)
    smallest = solutions["fsdp/nothing_saveable"]     # dp does not fit there: the next policy
    start = best_recipe_start(traced, build, mesh24, [Recipe.parse("dp"), Recipe.parse(
        smallest.solver.split()[-1])], smallest.peak_bytes, OPTIONS)
    # the least memory of the recipe's fastest layouts is a time-limited solve each time: the
    # start's may hold less than the fixture's (68,632 against 71,648 B in one scenario run)
    assert start.solver == smallest.solver and start.peak_bytes <= smallest.peak_bytes


def test_a_layout_outside_the_strategies_is_named(planned, mesh24):
    traced, build = planned
    node = traced.graph.parameters[0]
    narrowed = list(build.strategies)
    narrowed[node] = [s for s in build.strategies[node] if any(s.out)] or \
        build.strategies[node][1:]
    build_without = type(build)(build.graph, build.mesh, build.cluster, narrowed, build.problem,
                                build.unsupported)
    with pytest.raises(ValueError, match="is not among its strategies"):
        recipe_pins(traced, build_without, mesh24, "dp")


@pytest.mark.parametrize("name", ["dp/nothing_saveable", "tp/dots_saveable"])
def test_a_reference_gpts_block_policies_are_plans_of_kiwis_program_at_their_memory(
        name, mesh24):
    """The reference GPT's blocks keep their residual stream's sum, so a dropped chain is
    recomputed later than its earliest stage (before, the program held it from there:
    1.24-1.44x the replayed peak at hidden 1024 on 2x4). Where a plan decides tied nodes
    apart, it is counted in the untied program (``program_peak``)."""
    traced, build = _reference("gpt", layers=2, hidden=16, heads=2, seq=8, batch=8, vocab=64)
    problem = build.problem
    solution = recipe_solution(traced, build, mesh24, Recipe.parse(name), OPTIONS,
                               least_memory=False)
    late = {i for i, t in problem.dropped_stages(solution.keep).items()
            if t > problem.recompute_stage[i]}
    assert late                                     # chains recomputed after their earliest
    assert program_peak(problem, solution.strategy, solution.keep, OPTIONS) == \
        solution.peak_bytes


def test_a_layout_that_sets_tied_layers_apart_is_planned_untied(mesh24):
    """Megatron's column and row splits alternate over the reference MLP's layers, which the
    ties make one: the recipe is planned in the untied program, its pins kept."""
    traced, build = _reference("mlp", layers=3, width=16)
    recipe = Recipe.parse("tp")
    pins = recipe_pins(traced, build, mesh24, recipe)
    tie = build.problem.ties
    assert any(int(tie[node]) in pins and pins[int(tie[node])] != s for node, s in pins.items())
    solution = recipe_solution(traced, build, mesh24, recipe, OPTIONS)
    assert all(solution.strategy[node] == s for node, s in pins.items())


@pytest.mark.parametrize("name", ["dp/dots_saveable", "dp/nothing_saveable"])
def test_a_block_policy_applied_as_kiwis_plan_compiles_to_the_recipes_memory(name):
    """The reference GPT on one device, its attention scores the largest values: recipe
    ``name`` as kiwi's plan, applied by the interpreter, compiles within 8% of the recipe run
    as ``jax.checkpoint`` (measured: 1.021 and 1.057). The causal mask's ``jnp.where`` is an
    inlined call; its select, recomputed, must be rerun with the chain that reads it, not read
    as the forward pass left it (before, 1.447 and 1.346: each layer's masked scores held
    from the forward pass to the backward pass)."""
    ref = reference("gpt", layers=2, hidden=32, heads=4, seq=256, batch=2, vocab=64)
    args = (*ref.abstract_init(), ref.abstract_batch())
    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    traced = trace_for_planning(functionalize(ref.train_step, args), in_program_order(1))
    build = build_problem(traced.graph, MeshSpec.parse("1x1"), Cluster.parse("v100-nvlink"),
                          carried=carried_pairs(traced))
    solution = recipe_solution(traced, build, mesh, name, OPTIONS)
    applied = compile_plan(traced, build, plan_from_solution(build, solution,
                                                             int(solution.peak_bytes)),
                           mesh, traced.pure)
    recipe = compile_recipe(ref.train_step, args, mesh, name)
    assert applied.memory.peak_bytes <= 1.08 * recipe.peak_bytes


def _updates_as_the_recipe_does(traced, build, solution, mesh) -> None:
    """``dp``'s plan pays no resharding of the carried state, and compiles within 2% of the
    ``dp`` recipe."""
    problem = build.problem
    carried = sum(problem.carried_resharding[k][solution.strategy[v], solution.strategy[p]]
                  for k, (v, p) in enumerate(problem.carried))
    assert carried == 0.0
    applied = compile_plan(traced, build, plan_from_solution(build, solution,
                                                             int(solution.peak_bytes)),
                           mesh, traced.pure)
    step, args = zoo.make("llama", **LLAMA)
    recipe = compile_recipe(step, args, mesh, "dp")
    assert applied.memory.peak_bytes <= 1.02 * recipe.peak_bytes


@pytest.mark.xfail(strict=True, reason="merged followers take the most split free strategy: "
                   "the update runs split and the new state is all-gathered back "
                   "(docs/cost_model.md, 'Update chains in their operand's spec')")
def test_the_data_parallel_plan_updates_in_place_as_the_recipe_does(planned, solutions, mesh24):
    """``dp`` replicates the state, and XLA compiles the recipe's update replicated on the
    all-reduced gradient. As kiwi's plan, the update's merged followers (:mod:`kiwi_jax.merge`)
    take the most split free strategy, so the plan runs the update split and pays a gather of
    the new state back into its layout (0.32 ms here). The program with the layouts left free
    does not (the next test); it is solved where memory does not bind, and this one stays the
    search's program."""
    traced, build = planned
    _updates_as_the_recipe_does(traced, build, solutions["dp"], mesh24)


def test_with_the_layouts_left_free_the_data_parallel_plan_updates_as_the_recipe_does(
        planned, mesh24):
    """The test above, on the program with the layouts left free
    (:func:`kiwi_jax.problem.with_free_layouts`): the solver places each update chain's head
    and the backward pass's layout operators, so ``dp``'s plan updates in the state's own
    layout and gathers nothing back."""
    traced, build = planned
    free = with_free_layouts(build)
    assert len(free.problem.leaders) > len(build.problem.leaders)
    assert (free.problem.ties == build.problem.ties).all()
    solution = recipe_solution(traced, free, mesh24, Recipe.parse("dp"), OPTIONS,
                               least_memory=False)
    _updates_as_the_recipe_does(traced, free, solution, mesh24)
