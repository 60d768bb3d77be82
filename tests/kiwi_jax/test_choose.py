"""The compiler chooses: kiwi's compiled plan against the recipes, the faster one that fits runs.

The figures quoted were measured on 2x4 with ``compile_recipe`` and one kiwi compile
(``fit_compiles=1``, ``recipes=False``). The reference GPT (2 layers, hidden 32) under
400,000 B: ``tp`` compiles to 290,284 B at est. 0.089 ms, kiwi's plan to 389,156 B at est.
0.229 ms; so ``tp`` runs. The estimates are the compiled steps' (:mod:`kiwi_jax.estimate`).
"""

import importlib
import logging
import os
import warnings

import numpy as np
import pytest

import kiwi_jax
import solvers
from kiwi_jax import cli
from kiwi_jax.choose import KIWI, Choice, RecipeRow, choose, parse_recipes
from kiwi_jax.fit import FitStop
from kiwi_jax.models import build
from kiwi_jax.optimize import OptimizedStep
from kiwi_jax.recipes import Recipe, all_recipes

GPT = dict(layers=2, hidden=32, heads=2, seq=16, batch=8, vocab=64)
MLP = dict(layers=3, width=64, in_dim=32, out_dim=32, batch=16)
BUDGET = 400_000
OPTIONS = dict(memory_budget=BUDGET, cluster="v100-nvlink", time_limit=120.0, mip_gap=1e-2,
               fit_compiles=1)


# ------------------------------------------------------------------ the rule, no compiles
def _rows(*figures):
    return tuple(RecipeRow(name, nbytes, seconds) for name, nbytes, seconds in figures)


@pytest.mark.parametrize("kiwi,rows,winner", [
    pytest.param((90, 2.0), [("dp", 80, 1.0), ("tp", 70, 0.5)], "tp", id="fastest-fitting"),
    pytest.param((90, 2.0), [("dp", 120, 0.1), ("tp", 70, 3.0)], KIWI, id="kiwi-faster"),
    pytest.param((90, 2.0), [("dp", 120, 0.1), ("tp", 70, 2.0)], KIWI, id="tie-to-kiwi"),
    pytest.param((150, 2.0), [("tp", 70, 3.0)], "tp", id="kiwi-over-budget"),
    pytest.param((None, None), [("tp", 70, 3.0)], "tp", id="kiwi-no-plan"),
    pytest.param((None, None), [("dp", 120, 0.1)], KIWI, id="nothing-fits"),
])
def test_the_fastest_fitting_recipe_runs_when_kiwi_is_slower_or_does_not_fit(kiwi, rows,
                                                                             winner):
    choice = choose(100, *kiwi, _rows(*rows))
    assert choice.winner == winner
    assert choice.runs_recipe == (winner != KIWI)
    start = f"recipe {winner} runs" if winner != KIWI else \
        "kiwi's plan runs" if kiwi[0] is not None else "nothing runs"
    assert choice.describe().startswith(start), choice.describe()


def test_a_recipe_that_cannot_be_compiled_is_listed_not_chosen():
    choice = choose(100, 90, 2.0, (RecipeRow("tp/dots_saveable", None, None, "no blocks"),
                                   RecipeRow("dp", 80, 1.0)))
    assert choice.winner == "dp" and choice.best.name == "dp"
    assert "no blocks" in choice.table()


def test_recipes_option_is_parsed_and_bad_names_are_refused(mesh24):
    assert parse_recipes(True) == all_recipes() and parse_recipes(False) == ()
    assert parse_recipes(("fsdp/dots_saveable", "dp")) == (Recipe("fsdp", "dots_saveable"),
                                                           Recipe("dp"))
    assert parse_recipes("tp") == (Recipe("tp"),)
    with pytest.raises(ValueError, match=r"unknown recipe 'fsdp/dots'; the recipes are dp, "
                                         r"dp/dots_saveable"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB",
                          recipes=("dp", "fsdp/dots"))
    with pytest.raises(ValueError, match="unknown recipe 'zero'"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB", recipes="zero")
    with pytest.raises(ValueError, match="expected True, False or a sequence"):
        kiwi_jax.optimize(lambda s, b: s, mesh=mesh24, memory_budget="1GiB", recipes=3)


def test_the_cli_names_a_bad_recipe_before_any_work(capsys):
    assert cli.main(["verify", "--model", "mlp", "--recipes", "dp", "fsdp/dots"]) == 2
    assert "unknown recipe 'fsdp/dots'; the recipes are dp" in capsys.readouterr().err


def test_the_cli_refuses_a_negative_fit_deadline_before_any_work(capsys):
    assert cli.main(["verify", "--model", "mlp", "--fit-seconds", "-5"]) == 2
    assert "--fit-seconds: expected seconds >= 0, got -5" in capsys.readouterr().err


# ------------------------------------------------------------------ the decorator
@pytest.mark.scenario
def test_a_faster_recipe_runs_and_matches_the_plain_step(mesh24):
    """The GPT: ``tp`` fits and is estimated faster than kiwi's plan (which fits too), so
    ``tp`` runs, and it computes what the plain step does."""
    ref = build("gpt", **GPT)
    args = (*ref.init(0), ref.batch(0))
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=("tp",),
                             **OPTIONS)
    prepared = step.lower(*args)
    choice = prepared.choice
    assert isinstance(choice, Choice) and choice.winner == "tp", choice.table()
    assert prepared.runs_recipe and prepared.compiled is prepared.recipe.compiled
    assert step.plan is prepared.plan is not None          # kiwi's plan, which does not run
    assert choice.kiwi_bytes == prepared.applied.memory.peak_bytes and choice.kiwi_fits
    row, = choice.recipes
    assert row.name == "tp"
    assert row.fits(BUDGET) and row.step_seconds < choice.kiwi_step_seconds
    with open(os.devnull, "w") as sink:
        text = step.explain(file=sink)
    assert text.startswith("recipe tp runs: est.") and "kiwi's plan (not run" in text

    report = step.verify(*args, steps=2)
    assert report.runs == "tp" and report.predicted_peak_bytes is None
    assert report.fits and report.compiled_peak_bytes == row.compiled_bytes
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5
    assert "recipe tp" in report.table()

    model, optimizer = ref.init(0)                       # NNX: the modules update in place
    before = np.asarray(model.blocks[0].attn.q.kernel[...]).copy()
    loss = step(model, optimizer, ref.batch(0))
    assert step.prepared is prepared and np.isfinite(float(loss))
    assert not np.allclose(before, np.asarray(model.blocks[0].attn.q.kernel[...]))


def test_recipes_false_runs_kiwis_plan_where_a_recipe_would_win(tmp_path, mesh24):
    """The MLP under 200,000 B: kiwi's plan compiles to 109,804 B at est. 0.0458 ms, ``tp`` to
    45,324 B at est. 0.0153 ms; the MLP has no repeated blocks for ``dp/dots_saveable``."""
    ref = build("mlp", **MLP)
    args = (*ref.abstract_init(), ref.abstract_batch())
    options = {**OPTIONS, "memory_budget": 200_000, "cache_dir": tmp_path}
    alone = kiwi_jax.optimize(ref.train_step, mesh=mesh24, recipes=False, **options)
    kiwi = alone.lower(*args)
    assert kiwi.choice is None and alone.choice is None and not kiwi.runs_recipe
    assert kiwi.compiled is kiwi.applied.compiled

    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, recipes=("tp", "dp/dots_saveable"),
                             **options)
    prepared = step.lower(*args)
    choice = prepared.choice
    assert prepared.cached                                   # a cached plan is compared too
    assert choice.winner == "tp" and prepared.runs_recipe, choice.table()
    assert step.plan.fingerprint == kiwi.plan.fingerprint
    assert choice.kiwi_bytes == kiwi.applied.memory.peak_bytes
    tp, dots = choice.recipes
    assert tp.step_seconds < choice.kiwi_step_seconds
    assert dots.compiled_bytes is None and "no repeated blocks" in dots.error


def test_kiwis_plan_runs_when_no_recipe_fits(mesh24):
    """The MLP under 150,000 B: ``dp`` compiles to 167,980 B; kiwi's plan fits."""
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=("dp",),
                             **{**OPTIONS, "memory_budget": 150_000})
    prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    choice = prepared.choice
    assert choice.winner == KIWI and not prepared.runs_recipe and choice.kiwi_fits
    assert prepared.compiled is prepared.applied.compiled and choice.best is None
    assert "none of the 1 recipes fits" in choice.describe()


def _counted_recipe_compiles(monkeypatch) -> list:
    """The decorator's calls of ``compile_recipes`` (each compiles every recipe), recorded."""
    module, compiled = importlib.import_module("kiwi_jax.optimize"), []
    real = module.compile_recipes
    monkeypatch.setattr(module, "compile_recipes",
                        lambda *a, **k: compiled.append(a) or real(*a, **k))
    return compiled


@pytest.mark.parametrize("recipes", [False, ("fsdp+tp",)], ids=["kiwi-alone", "fsdp+tp"])
def test_kiwis_plan_over_the_budget_warns_only_when_it_runs(recipes, monkeypatch, mesh24):
    """An MLP of dimensions 2x4 does not divide, under the reference plan's predicted peak
    (4,076 B; it compiles to 5,700 B) with one compile: kiwi's plan compiles over the budget
    (4,484 B); ``fsdp+tp`` fits it (3,260 B) and runs instead, without the warning. The
    recipes are compiled once, for the budget search and the choice. The whole-block
    recomputation is searched on the mesh too, once, from its fastest plan (4,592 B) down, and
    its second plan fits (2,784 B); here it is then set aside, so that kiwi's plan is over the
    budget, as it is on models whose whole-block plans do not fit either."""
    compiled, blocks = _counted_recipe_compiles(monkeypatch), []
    real = OptimizedStep._whole_blocks
    monkeypatch.setattr(OptimizedStep, "_whole_blocks",
                        lambda *a, **k: blocks.append(real(*a, **k)))
    ref = build("mlp", layers=2, width=24, in_dim=12, out_dim=12, batch=6)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=recipes,
                             **{**OPTIONS, "memory_budget": 4_076})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    over = [w for w in caught if "running the one that compiled smallest" in str(w.message)]
    [whole] = blocks
    assert whole.solver == "alpa+full" and whole.fit.stop == FitStop.BLOCKS and whole.fit.fits
    searched = [trial for trial in whole.fit.trials if trial.blocks]
    assert [trial.compiled_peak_bytes > 4_076 for trial in searched] == [True, False]
    assert whole.fit.trials[whole.fit.chosen] is searched[-1]
    assert not prepared.plan.fit.fits and len(compiled) == bool(recipes)
    assert prepared.runs_recipe == bool(recipes) and len(over) == (not recipes)
    assert prepared.plan.fit.stop != FitStop.BLOCKS


def test_the_budget_search_stops_where_a_recipe_that_fits_is_faster(monkeypatch, mesh24):
    """The MLP under 70,000 B: kiwi's first plan compiles to 75,684 B (its weights gathered
    again and its gradients tied into the backward pass) at est. 0.0459 ms; ``tp`` fits
    (45,324 B) at est. 0.0153 ms. Plans under less memory are slower still, so the search
    stops after its first compile (of three allowed), and ``tp`` runs; the recipes are
    compiled once, for the search and the choice. (Under 100,000 B, where this test ran
    before the gradients were tied in, kiwi's first plan now fits: 75,428 B.) On the
    per-operator model: with ``auto``, which chooses the fused model for this MLP, the first
    plan fits."""
    compiled = _counted_recipe_compiles(monkeypatch)
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=("tp",),
                             **{**OPTIONS, "memory_budget": 70_000, "fit_compiles": 3,
                                "memory_model": "operator"})
    prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    fit = prepared.plan.fit
    assert fit.stop == FitStop.BEATEN and fit.compiles == fit.solves == 1 and not fit.fits
    assert prepared.choice.winner == "tp" and len(compiled) == 1


class _PlanningProcess:
    """Process 0 of two, as :func:`kiwi_jax.multihost.exchange` returns it (nothing sent)."""

    is_planner, process_count = True, 2

    def publish_plan(self, plan_json, error=None):
        self.published = plan_json

    def check(self, key, plan_fingerprint):
        self.checked = plan_fingerprint


def test_several_processes_run_kiwis_plan_without_comparing(monkeypatch, caplog, mesh24):
    """Every process must run the same program and only kiwi's plan is shared: the recipes
    are not compiled, a warning says so, and process 0 publishes kiwi's plan."""
    process, compiled = _PlanningProcess(), []
    module = importlib.import_module("kiwi_jax.optimize")    # the package's name is the function
    monkeypatch.setattr(module, "exchange", lambda timeout: process)
    monkeypatch.setattr(module, "compile_recipes", lambda *a, **k: compiled.append(a) or ((), {}))
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False,
                             **{**OPTIONS, "memory_budget": 200_000})
    with caplog.at_level("WARNING"):
        prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    assert "2 processes plan this step: the recipes are not compared" in caplog.text
    assert prepared.choice is None and not prepared.runs_recipe and not compiled
    assert process.checked == prepared.plan.fingerprint and process.published


@pytest.mark.parametrize("no_plan_error", [
    lambda budget: solvers.InfeasibleBudgetError("kiwi", budget, 2 * budget),
    lambda budget: solvers.SolverTimeoutError("kiwi: no plan found within the time limit",
                                              budget)], ids=["infeasible", "time-out"])
def test_a_budget_kiwi_has_no_plan_for_runs_a_recipe_that_fits(no_plan_error, monkeypatch,
                                                               mesh24):
    """kiwi's planner raising InfeasibleBudgetError (as it does for the GPT under 205,000 B,
    where its model's smallest feasible budget is 210,616 B and ``fsdp+tp/nothing_saveable``
    compiles to 198,948 B; that solve takes a minute, so here the planner is replaced), or
    SolverTimeoutError (the zoo encoder-decoder on 2x4 at 80%: no plan in 60 s)."""
    ref = build("mlp", **MLP)
    budget = 100_000            # dp compiles to 167,980 B, fsdp to 35,940 B
    error = no_plan_error(budget)

    def no_plan(*_):
        raise error

    monkeypatch.setattr(OptimizedStep, "_planned", no_plan)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False,
                             recipes=("dp", "fsdp"),
                             **{**OPTIONS, "memory_budget": budget})
    prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    choice = prepared.choice
    assert prepared.plan is None and prepared.applied is None and step.plan is None
    assert choice.winner == "fsdp" and choice.kiwi_bytes is None
    assert [row.fits(budget) for row in choice.recipes] == [False, True]
    assert choice.kiwi_error == str(error)
    assert prepared.compiled is prepared.recipe.compiled
    assert prepared.recipe.memory.peak_bytes <= budget
    with open(os.devnull, "w") as sink:
        assert "kiwi has no plan for the budget" in step.explain(file=sink)


def test_a_linen_step_runs_a_recipe_like_kiwis_plan(monkeypatch, mesh24):
    """A Linen step under a recipe returns (state, metrics) and matches the plain step (kiwi's
    planner is replaced by one that has no plan, so ``dp`` runs without a solve)."""
    ref = build("linen_mlp", layers=4, width=16, batch=8)

    def no_plan(*_):
        raise solvers.InfeasibleBudgetError("kiwi", 2**30, None)

    monkeypatch.setattr(OptimizedStep, "_planned", no_plan)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=("dp",),
                             **{**OPTIONS, "memory_budget": 2**30})
    (state,), batch = ref.init(0), ref.batch(0)
    report = step.verify(state, batch, steps=2)
    assert step.choice.winner == "dp" and report.runs == "dp" and report.fits
    assert report.max_loss_rel_diff <= 1e-5 and report.max_param_rel_diff <= 1e-5
    new_state, metrics = step(state, batch)
    assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_without_a_recipe_that_fits_kiwis_error_stands(mesh24):
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=("fsdp",),
                             **{**OPTIONS, "memory_budget": 1_000, "fit_compiles": 0})
    with pytest.raises(solvers.InfeasibleBudgetError, match="smallest feasible budget"):
        step.lower(*ref.abstract_init(), ref.abstract_batch())


def test_kiwi_solves_again_from_a_recipe_that_fits_where_its_own_search_found_none(
        monkeypatch, caplog, mesh24):
    """kiwi's own search ending without a plan (here made to time out) is run again from the
    fastest recipe plan that fits the budget as replayed; the answer is at least as fast. On
    the per-operator model: with ``auto`` the reference plan is compiled first, fits the
    budget and runs, with nothing solved."""
    module = importlib.import_module("kiwi_jax.optimize")
    solve_plan, starts = module.solve_plan, []

    def no_plan_without_a_start(build_, budget, solver, **options):
        starts.append(options.get("warm_start"))
        if starts[-1] is None:
            raise solvers.SolverTimeoutError("kiwi: no plan found within the time limit", budget)
        return solve_plan(build_, budget, solver, **options)

    monkeypatch.setattr(module, "solve_plan", no_plan_without_a_start)
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False,
                             recipes=("dp", "fsdp"),
                             **{**OPTIONS, "fit_compiles": 0, "memory_model": "operator"})
    with caplog.at_level(logging.WARNING, logger="kiwi_jax.optimize"):
        prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    assert len(starts) == 2 and starts[0] is None
    assert starts[1].solver in ("recipe dp", "recipe fsdp")
    assert starts[1].peak_bytes <= BUDGET
    assert prepared.plan.predicted_step_seconds <= starts[1].objective * (1 + 1e-9)
    assert "solving again from a recipe's plan that fits" in caplog.text


@pytest.mark.parametrize("fit_compiles", [2, 0])
def test_a_time_out_without_a_recipe_start_solves_again_from_the_least_memory(
        fit_compiles, monkeypatch, caplog, mesh24):
    """kiwi's own solve timing out under the budget, with no recipe to start from
    (``recipes=False``): the program's smallest-peak plan fits the budget here, so the solve
    runs again from it, and the answer is no slower. Without a budget search
    (``fit_compiles=0``) the time-out stands, as it did."""
    module = importlib.import_module("kiwi_jax.optimize")
    solve_plan, starts = module.solve_plan, []

    def first_solve_times_out(build_, budget, solver, **options):
        starts.append(options.get("warm_start"))
        if len(starts) == 1:
            raise solvers.SolverTimeoutError("kiwi: no plan found within the time limit", budget)
        return solve_plan(build_, budget, solver, **options)

    monkeypatch.setattr(module, "solve_plan", first_solve_times_out)
    ref = build("mlp", **MLP)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh24, cache_dir=False, recipes=False,
                             **{**OPTIONS, "fit_compiles": fit_compiles,
                                "memory_model": "operator"})
    if not fit_compiles:
        with pytest.raises(solvers.SolverTimeoutError, match="no plan found"):
            step.lower(*ref.abstract_init(), ref.abstract_batch())
        assert len(starts) == 1
        return
    with caplog.at_level(logging.WARNING, logger="kiwi_jax.optimize"):
        prepared = step.lower(*ref.abstract_init(), ref.abstract_batch())
    assert starts[0] is None and starts[1] is not None
    least, _ = solvers.min_peak_plan(prepared.build.problem, time_limit=OPTIONS["time_limit"])
    assert starts[1].peak_bytes == least.peak_bytes <= BUDGET
    assert prepared.plan.predicted_step_seconds <= starts[1].objective * (1 + 1e-9)
    assert "solving again from the plan of the least memory" in caplog.text
