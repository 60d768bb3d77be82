"""Planning real train steps: layer ties, the 2-layer MLP on a 1x2 mesh, the ``plan`` command."""

import argparse
import dataclasses
import inspect
import json
import sys

import numpy as np
import pytest

import solvers
from hlo_tools.graph import Phase
from kiwi_jax.cli import main
from kiwi_jax.frontend import problem_for_step
from kiwi_jax.models import build
from kiwi_jax.plan import Plan

SOLVE_MODULE = sys.modules["solvers.solve"]     # solvers.solve is the function
SMALL_GPT = {"layers": 3, "hidden": 32, "heads": 2, "seq": 8, "batch": 4, "vocab": 64}


def _problem(name, mesh, **overrides):
    ref = build(name, **overrides)
    built, _ = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                mesh=mesh, cluster="v100-nvlink")
    return built.problem


@pytest.fixture(scope="module")
def gpt3():
    return _problem("gpt", "1x2", **SMALL_GPT)


def test_layer_ties_map_every_layer_onto_the_first(gpt3):
    tie = solvers.layer_ties(gpt3)
    assert np.array_equal(gpt3.ties, tie)             # filled when the problem was built
    for layer in (1, 2):
        nodes = np.flatnonzero(gpt3.layer == layer)
        tied = nodes[tie[nodes] != nodes]
        assert len(tied) / len(nodes) > 0.95
        assert (gpt3.layer[tie[tied]] == 0).mean() > 0.95
        assert (gpt3.layer[tie[tied]] != layer).all()
        for i in tied:
            j = tie[i]
            assert gpt3.opcodes[i] == gpt3.opcodes[j]
            assert gpt3.strategy_names[i] == gpt3.strategy_names[j]
    # the per-parameter updates of layers 1 and 2 (2/3 of the block parameters' updates; the
    # rest are layer 0's own and the embeddings' and final norm's) follow those of layer 0
    updates = np.flatnonzero((gpt3.phase == Phase.OPTIMIZER) & (gpt3.num_strategies > 1))
    assert (tie[updates] != updates).mean() > 0.4


def test_reuse_is_a_restriction_of_the_full_program():
    # two layers, the second tied to the first (57 s with three here, 30 s with two)
    gpt2 = _problem("gpt", "1x2", **{**SMALL_GPT, "layers": 2})
    budget = _tight_budget(gpt2)
    full = solvers.solve(gpt2, budget, solver="kiwi", reuse_layers=False)
    reused = solvers.solve(gpt2, budget, solver="kiwi", reuse_layers=True)
    assert reused.num_vars < full.num_vars
    assert full.objective <= reused.objective * (1 + 1e-6)
    tie = solvers.layer_ties(gpt2)
    leaders = gpt2.leaders[(tie[gpt2.leaders] != gpt2.leaders)]
    same = [reused.strategy[i] == reused.strategy[tie[i]] for i in leaders
            if gpt2.leader[tie[i]] == tie[i]]
    assert same and all(same)
    for solution in (full, reused):
        sim = solvers.simulate(gpt2, solution.strategy, recompute_at=solution.recompute_at)
        assert sim.peak_bytes <= budget
        assert sim.step_seconds == pytest.approx(solution.objective, rel=1e-6)


def test_the_reference_peak_counts_only_a_finished_peak_solve(gpt3, monkeypatch):
    """The 100% of percentage budgets does not depend on how far an unfinished peak-minimising
    solve got: without its optimum, the reference is the fastest plan as solved."""
    finished = solvers.reference_plan(gpt3)
    fastest = SOLVE_MODULE.solve_milp(gpt3, None, solvers.SolverOptions(
        solver="alpa", mip_gap=SOLVE_MODULE.REFERENCE_GAP, reuse_layers=True))
    monkeypatch.setattr(SOLVE_MODULE, "REFERENCE_PEAK_SHARE", 0.0)
    unfinished = solvers.reference_plan(gpt3)
    assert unfinished.objective == pytest.approx(finished.objective, rel=1e-9)
    assert unfinished.peak_bytes == fastest.peak_bytes > finished.peak_bytes


def test_two_layer_mlp_on_a_1x2_mesh():
    p = _problem("mlp", "1x2", layers=2, batch=256, width=128, in_dim=128, out_dim=128)
    reference = solvers.reference_plan(p)
    low, _ = solvers.min_feasible_budget(p, "kiwi")
    alpa_low, _ = solvers.min_feasible_budget(p, "alpa")
    assert low <= alpa_low                     # recomputation never needs more memory
    for solver in ("alpa", "kiwi", "kiwi-full"):
        sol = solvers.solve(p, max(alpa_low, int(0.9 * reference.peak_bytes)), solver=solver)
        sim = solvers.simulate(p, sol.strategy, recompute_at=sol.recompute_at)
        assert sim.step_seconds >= reference.objective * (1 - 1e-6)
        assert sim.step_seconds >= p.ideal_compute_seconds()


def test_cli_plan_json(capsys):
    args = ["plan", "--model", "mlp", "--layers", "2", "--batch", "256", "--width", "128",
            "--mesh", "2x4", "--budget", "90%", "--solver", "kiwi", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("solver", "backend", "status", "feasible", "solve_seconds",
                "predicted_step_seconds", "predicted_peak_bytes", "budget_bytes", "num_vars",
                "num_constraints", "recomputed_nodes", "objective_step_seconds",
                "claimed_peak_bytes", "ideal_compute_seconds", "fingerprint"):
        assert key in result
    assert result["feasible"] and result["predicted_peak_bytes"] <= result["budget_bytes"]
    # the simulator's replay of the plan prices it as the solver's program does
    assert result["predicted_step_seconds"] == pytest.approx(result["objective_step_seconds"])


def test_cli_plan_infeasible_budget_names_the_smallest(capsys):
    args = ["plan", "--model", "mlp", "--layers", "2", "--batch", "256", "--width", "128",
            "--mesh", "2x4", "--budget", "1KiB", "--solver", "alpa", "--json"]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "smallest feasible budget for alpa is" in captured.err
    result = json.loads(captured.out.strip().splitlines()[-1])
    assert result["feasible"] is False and result["min_feasible_budget_bytes"] > 1024


def test_plan_of_a_traced_step_round_trips_through_json():
    from kiwi_jax.frontend import trace
    from kiwi_jax.plan import solve_plan
    from kiwi_jax.problem import build_problem

    ref = build("mlp", layers=2, batch=256, width=128, in_dim=128, out_dim=128)
    traced = trace(ref.train_step, *ref.abstract_init(), ref.abstract_batch())
    built = build_problem(traced.graph, "2x4", "v100-nvlink")
    plan = solve_plan(built, "90%", solver="kiwi")
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert len(plan.strategy) == len(plan.specs) == built.problem.num_nodes
    assert plan.recompute_at == solvers.reduced_schedule(built.problem, plan.keep)
    again = Plan.from_json(plan.to_json())
    assert again.strategy.tolist() == plan.strategy.tolist()
    assert again.keep.tolist() == plan.keep.tolist()
    assert again.specs == plan.specs
    assert again.summary() == plan.summary()
    assert again.recompute_at == plan.recompute_at
    assert again.fingerprint == plan.fingerprint
    assert again.simulation.memory_timeline.tolist() == plan.simulation.memory_timeline.tolist()
    flipped = np.array(plan.keep)
    flipped[int(np.flatnonzero(built.problem.recomputable)[0])] ^= True
    other = dataclasses.replace(plan, solution=dataclasses.replace(plan.solution, keep=flipped))
    assert other.fingerprint != plan.fingerprint


def test_plan_of_another_format_is_not_read():
    with pytest.raises(ValueError, match="plan format 1, this kiwi-jax reads format 3"):
        Plan.from_json(json.dumps({"solver": "kiwi", "keep": []}))


def test_the_decorator_the_cli_and_solve_share_the_solver_defaults(monkeypatch):
    from kiwi_jax import cli
    from kiwi_jax.optimize import Options, optimize

    defaults = solvers.SolverOptions()
    names = [f.name for f in dataclasses.fields(defaults)]
    solve = inspect.signature(solvers.solve).parameters
    assert {name: solve[name].default for name in names} == dataclasses.asdict(defaults)
    fields = {f.name: f.default for f in dataclasses.fields(Options)}
    keywords = {name: p.default for name, p in inspect.signature(optimize).parameters.items()}
    shared = ("solver", "backend", "time_limit", "mip_gap", "reuse_layers")
    assert {name: fields[name] for name in shared} == {name: keywords[name] for name in shared} \
        == {name: getattr(defaults, name) for name in shared}

    parsed = {}

    def parse(argv) -> dict:
        """The arguments ``kiwi-jax`` parses from ``argv`` (the command does not run)."""
        command = argv[0]
        monkeypatch.setattr(cli, f"_cmd_{command}", lambda args: parsed.update(vars(args)) or {})
        assert cli.main(argv) == 0
        return dict(parsed)

    plan, verify = parse(["plan"]), parse(["verify"])
    for args in (plan, verify):
        assert (args["solver"], args["backend"], args["time_limit"], args["gap"],
                args["reuse_layers"]) == (defaults.solver, defaults.backend,
                                          defaults.time_limit, defaults.mip_gap,
                                          defaults.reuse_layers)
    assert (plan["seed"], plan["threads"]) == (defaults.seed, defaults.threads)
    pipeline = parse(["pipeline"])
    assert (pipeline["backend"], pipeline["time_limit"]) == (defaults.backend, defaults.time_limit)
    assert parse(["plan", "--no-reuse-layers"])["reuse_layers"] is False
    assert parse(["verify", "--no-reuse-layers"])["reuse_layers"] is False
    # the search against the compiled step: one default for the decorator and `verify`
    assert verify["fit_compiles"] == fields["fit_compiles"] == keywords["fit_compiles"]
    # the recipes: compared by default, as by the decorator; --no-recipes or names
    assert cli._verify_recipes(argparse.Namespace(**verify)) is True \
        is fields["recipes"] is keywords["recipes"]
    assert cli._verify_recipes(argparse.Namespace(**parse(["verify", "--no-recipes"]))) is False
    assert cli._verify_recipes(argparse.Namespace(**parse(["verify", "--recipes", "dp", "tp"]))
                               ) == ("dp", "tp")



def test_the_cli_and_the_decorator_give_the_same_plan(capsys, mesh24):
    from kiwi_jax.optimize import optimize

    config = dict(layers=2, batch=256, width=128)
    argv = ["plan", "--model", "mlp", "--mesh", "2x4", "--budget", "90%", "--json"]
    argv += [a for k, v in config.items() for a in (f"--{k}", str(v))]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = build("mlp", **config)
    # the plan as solved (no search against the compiled step, which the CLI does not compile)
    # in bytes: the decorator's percentages are of the reference plan's compiled memory
    step = optimize(ref.train_step, mesh=mesh24, memory_budget=printed["budget_bytes"],
                    cache_dir=False, fit_compiles=0, recipes=False)
    plan = step.lower(*ref.abstract_init(), ref.abstract_batch()).plan
    assert plan.summary()["budget_bytes"] == printed["budget_bytes"]
    assert plan.fingerprint == printed["fingerprint"]


@pytest.fixture(scope="module")
def gpt6():
    return _problem("gpt", "1x2", **{**SMALL_GPT, "layers": 6})


@pytest.fixture(scope="module")
def gpt6_budget(gpt6):
    """:func:`_tight_budget` of ``gpt6``, found once for the module's solves under it."""
    return _tight_budget(gpt6)


def test_the_tied_program_leaves_out_the_rows_of_inner_repeats_only(gpt6):
    inner = solvers.reuse.inner_repeats(gpt6, gpt6.ties)
    assert set(np.unique(gpt6.layer[inner]).tolist()) == {2, 3}
    assert inner[gpt6.layer >= 0].sum() == ((gpt6.layer == 2) | (gpt6.layer == 3)).sum()
    assert not solvers.reuse.inner_repeats(gpt6, np.arange(gpt6.num_nodes)).any()  # untied


def _tight_budget(problem):
    """Halfway from a budget a plan fits (the smallest peak found in 8 s) to the reference's."""
    reference = solvers.reference_plan(problem)
    _, fits = solvers.min_feasible_budget(problem, "kiwi", reuse_layers=True, time_limit=8.0)
    return (fits + reference.peak_bytes) // 2


def test_left_out_rows_cost_nothing_and_the_plan_fits(gpt6, gpt6_budget, monkeypatch):
    """Without the inner repeats' rows the tied program is a relaxation: its plan, replayed,
    fits the budget and is no slower than the plan of the program with every row."""
    budget = gpt6_budget
    fewer = solvers.solve(gpt6, budget, solver="kiwi", reuse_layers=True, mip_gap=1e-6)
    monkeypatch.setattr(SOLVE_MODULE, "_skipped_times", lambda *args: None)
    full = solvers.solve(gpt6, budget, solver="kiwi", reuse_layers=True, mip_gap=1e-6)
    assert fewer.num_constraints < full.num_constraints
    for plan in (fewer, full):
        assert solvers.simulate(gpt6, plan.strategy, recompute_at=plan.recompute_at
                                ).peak_bytes <= budget
    assert fewer.objective <= full.objective * (1 + 1e-6)


def test_a_layer_over_the_budget_gets_its_rows_back(gpt6, gpt6_budget, monkeypatch, caplog):
    """Leave out every row: the program's plan is the fastest one, over the budget, and the
    solve puts the rows of the layers (and of the rest of the step) it is over in back until
    its plan fits."""
    budget = gpt6_budget
    monkeypatch.setattr(SOLVE_MODULE, "_skipped_times",
                        lambda problem, *args: np.ones(problem.num_nodes, bool))
    with caplog.at_level("INFO", logger="solvers.solve"):
        plan = solvers.solve(gpt6, budget, solver="kiwi", reuse_layers=True)
    assert "left out memory rows" in caplog.text
    assert solvers.simulate(gpt6, plan.strategy, recompute_at=plan.recompute_at
                            ).peak_bytes <= budget
