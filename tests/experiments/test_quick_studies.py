"""The quick versions of the experiment studies: each writes its JSON and PNG, prints the JSON
as its last stdout line, and its figures obey what the solvers guarantee."""

import json

import pytest

from experiments import (bandwidth_sweep, cost_agreement, heap_gap, lynx_pipeline, mesh_sweep,
                         optimality, remat_baselines, report, sized_fidelity, solver_scaling,
                         vs_recipes, zoo_solve)
from experiments.common import SWEEP_METHODS

TOL = 1e-6


@pytest.fixture()
def results(tmp_path, monkeypatch):
    monkeypatch.setenv("KIWI_RESULTS_DIR", str(tmp_path))
    return tmp_path


def _run(module, results, capsys, study: str, *argv: str) -> dict:
    returned = module.main(["--quick", "--json", *argv])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["study"] == study
    assert json.loads((results / f"{study}.json").read_text())["rows"] == printed["rows"]
    assert (results / f"{study}.png").stat().st_size > 10_000
    assert len(printed["rows"]) == len(returned["rows"])
    return printed


def _by_budget(rows) -> dict:
    table = {}
    for row in rows:
        table.setdefault(row["budget_bytes"], {})[row["method"]] = row
    return table


def test_mesh_sweep_quick(results, capsys):
    result = _run(mesh_sweep, results, capsys, "mesh_sweep")
    rows = result["rows"]
    assert {"mesh", "budget_bytes", "method", "feasible", "normalised_overhead"} <= \
        set(next(r for r in rows if r["feasible"]))
    table = _by_budget(rows)
    feasible = [b for b, methods in table.items() if any(r["feasible"] for r in methods.values())]
    assert feasible and len(feasible) < len(table), "the sweep goes past where all methods fail"
    for methods in table.values():
        kiwi = methods["kiwi"]
        for row in methods.values():
            if row["feasible"]:       # kiwi fits wherever a baseline does, and is no slower
                assert kiwi["feasible"]
                assert kiwi["normalised_overhead"] <= row["normalised_overhead"] + TOL
                assert row["peak_bytes"] <= row["budget_bytes"]
    for method in SWEEP_METHODS:        # more memory never gives a slower plan
        steps = [r["normalised_overhead"] for r in sorted(rows, key=lambda r: r["budget_bytes"])
                 if r["method"] == method and r["feasible"]]
        assert all(b <= a + TOL for a, b in zip(steps, steps[1:]))
    # every plan of the small study was applied and compiled by XLA
    compiled = [r for r in result["compiled"][0]["rows"] if r["feasible"]]
    assert compiled and all(r["compiled_peak_bytes"] > 0 for r in compiled)
    assert (results / "mesh_sweep_compiled.png").exists()
    assert "| mlp | 1x4 |" in report.mesh_table(result)
    assert report.compiled_table(result).count("| mlp | 1x4 |") == len(compiled)


def test_bandwidth_sweep_quick(results, capsys):
    result = _run(bandwidth_sweep, results, capsys, "bandwidth_sweep")
    assert [s["slowdown"] for s in result["sweeps"]] == [1, 10, 100]
    first = [s["reference_step_seconds"] for s in result["sweeps"]]
    assert first[0] < first[1] < first[2], "slower links make the fastest plan slower"
    for sweep in result["sweeps"]:
        for methods in _by_budget(sweep["rows"]).values():
            if methods["alpa"]["feasible"]:
                assert methods["kiwi"]["normalised_overhead"] <= \
                    methods["alpa"]["normalised_overhead"] + TOL
    assert report.bandwidth_table(result).count("| 100x |") == len(result["sweeps"][2]["rows"]) // 4


def test_solver_scaling_quick(results, capsys):
    result = _run(solver_scaling, results, capsys, "solver_scaling")
    rows = result["rows"]
    assert {"layers", "operators", "solver", "solve_seconds"} <= set(rows[0])
    ops = {r["layers"]: r["operators"] for r in rows}
    assert list(ops) == [2, 3] and ops[2] < ops[3]
    for row in rows:
        assert row["feasible"] and row["solve_seconds"] > 0
        # a tied plan is a plan of the full program: never faster than the full solve's optimum
        if row["reuse_layers"] and row["status"] == "optimal":
            full = next(r for r in rows if r["layers"] == row["layers"] and not r["reuse_layers"]
                        and (r["solver"], r["budget_fraction"])
                        == (row["solver"], row["budget_fraction"]))
            if full["status"] == "optimal":
                assert full["normalised_step"] <= row["normalised_step"] * (1 + 1e-4)
    assert report.scaling_table(result).count("\n") == len(ops) + 1       # a line per depth


@pytest.mark.scenario
def test_optimality_quick(results, capsys):
    # on 2x2: kiwi-full solves to its optimum at every budget, the study in 23 s (44 s on 2x4)
    result = _run(optimality, results, capsys, "optimality", "--mesh", "2x2")
    rows = result["rows"]
    assert [r["budget_fraction"] for r in rows] == [0.2, 0.4, 0.6, 0.8]
    assert {"kiwi_latency", "kiwi_full_latency", "kiwi_solve_seconds",
            "kiwi_full_solve_seconds"} <= set(rows[0])
    both = [r for r in rows if r["kiwi_latency"] and r["kiwi_full_latency"]]
    assert both
    for row in both:        # every reduced plan is a staged plan
        assert row["kiwi_full_latency"] <= row["kiwi_latency"] * (1 + 1e-4)
    table = report.optimality_table(result)
    assert table.count("infeasible") + table.count("timeout_no_incumbent") == \
        sum((r["kiwi_latency"] is None) + (r["kiwi_full_latency"] is None) for r in rows)


@pytest.mark.scenario
def test_lynx_pipeline_quick(results, capsys):
    returned = lynx_pipeline.main(["--quick", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["study"] == "lynx_pipeline" and len(printed["throughput"]) == \
        len(returned["throughput"])
    assert (results / "lynx_pipeline.png").stat().st_size > 10_000
    assert {r["layers"] for r in printed["heu_time"]} == {1, 4, 16}
    assert {r["method"] for r in printed["search_time"]} == {"even", "lynx", "dawnpiper"}
    rows = {(r["method"], r["policy"]): r for r in printed["throughput"]}
    for row in rows.values():
        assert sum(row["stage_layers"]) == 8
        if row["fits"]:
            assert max(row["stage_peak_bytes"]) <= 8 * 2**20
    # the Lynx partitioning starts from the even split and only takes moves that help
    assert rows["lynx", "lynx"]["simulated_throughput"] >= \
        rows["even", "lynx"]["simulated_throughput"] - TOL
    opt = printed["heu_vs_opt"][0]
    assert opt["feasible"] and opt["opt_step_seconds"] <= opt["heu_step_seconds"] * (1 + TOL)
    # keeping everything is a bound on OPT, not above its plan
    assert opt["keep_all_step_seconds"] <= opt["opt_step_seconds"] * (1 + TOL)
    assert opt["heu_throughput_vs_bound"] <= opt["heu_throughput_vs_opt"] + TOL


@pytest.mark.scenario
def test_remat_baselines_quick(results, capsys):
    returned = remat_baselines.main(["--quick", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["study"] == "remat_baselines" and printed == json.loads(
        (results / "remat_baselines.json").read_text())
    assert (results / "remat_baselines.png").stat().st_size > 10_000
    rows = printed["variants"]
    assert set(rows) == set(returned["variants"]) == {"plain", "dots_saveable",
                                                       "nothing_saveable", "kiwi@1"}
    plain, budget = rows["plain"], printed["budgets"]["1"]
    assert budget == plain["compiled_peak_bytes"] and plain["max_state_rel_diff"] == 0.0
    for name, row in rows.items():
        assert row["fits"]["1"] == (row["compiled_peak_bytes"] <= budget)
        assert row["step_ms_min"] <= row["step_ms_median"]
        assert row["max_state_rel_diff"] < 1e-5 and row["max_loss_rel_diff"] < 1e-5, name
    # per-block remat holds less than the plain step, recomputing everything least of all
    assert rows["nothing_saveable"]["compiled_peak_bytes"] <= \
        rows["dots_saveable"]["compiled_peak_bytes"] < plain["compiled_peak_bytes"]
    kiwi = rows["kiwi@1"]
    assert kiwi["budget_bytes"] == budget and kiwi["operators"] > 0
    # the search of the solver's budget: its record is the step that ran
    assert printed["fit_compiles"] == 6 and 1 <= kiwi["fit_compiles_spent"] <= 6
    assert kiwi["fit"]["compiles"] == kiwi["fit_compiles_spent"]
    assert kiwi["fit_ratio"] == kiwi["compiled_peak_bytes"] / budget


def test_vs_recipes_quick(results, capsys):
    result = _run(vs_recipes, results, capsys, "vs_recipes")
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"dp", "fsdp/nothing_saveable", "kiwi@4.000MiB"}
    dp, fsdp, kiwi = rows["dp"], rows["fsdp/nothing_saveable"], rows["kiwi@4.000MiB"]
    assert fsdp["compiled_bytes"] < dp["compiled_bytes"]        # the state sharded 8 ways
    assert dp["step_seconds"] > 0 and fsdp["step_seconds"] > 0
    assert kiwi["kind"] == "kiwi" and kiwi["budget_bytes"] == 4 * 2**20
    assert kiwi["fits"] == (kiwi["compiled_bytes"] <= kiwi["budget_bytes"])


def test_vs_recipes_sizes_any_model_argument(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    vs_recipes.add_model_arguments(parser)
    args = parser.parse_args(["--zoo", "vit", "--dim", "768", "--size", "image_size=224",
                              "--size", "patch_size=16"])
    assert vs_recipes.model_sizes(args) == {"dim": 768, "image_size": 224, "patch_size": 16}
    with pytest.raises(SystemExit):
        vs_recipes.main(["--zoo", "vit", "--size", "image_size"])
    assert "--size 'image_size': expected NAME=N" in capsys.readouterr().err


def test_zoo_solve_times_one_solve_per_cell(results, capsys):
    # 10 MB per device holds the zoo Llama on one device whole: a plan that keeps everything
    result = zoo_solve.main(["--cells", "llama:1x1:10000000", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["rows"] == json.loads((results / "zoo_solve.json").read_text())["rows"]
    (row,) = result["rows"]
    assert (row["model"], row["mesh"], row["budget_bytes"]) == ("llama", "1x1", 10_000_000)
    assert row["status"] == "optimal" and 0 < row["peak_bytes"] <= 10_000_000
    assert row["step_seconds"] > 0 and row["solve_seconds"] >= 0
    with pytest.raises(SystemExit):
        zoo_solve.main(["--cells", "llama:1x1"])
    assert "expected MODEL:MESH:BYTES" in capsys.readouterr().err


def test_sized_fidelity_compiles_the_reference_plan_at_its_sizes(results, capsys):
    result = sized_fidelity.main(["--models", "mixer", "--memory-models", "operator", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["rows"] == json.loads((results / "sized_fidelity.json").read_text())["rows"]
    (row,) = result["rows"]
    assert (row["model"], row["mesh"], row["memory_model"]) == ("mixer", "2x4", "operator")
    assert row["compiled_bytes"] > 100 * 2**20          # activations of a 224x224 batch of 16
    assert row["memory_error"] == round(row["predicted_bytes"] / row["compiled_bytes"] - 1, 4)


@pytest.mark.scenario
def test_cost_agreement_quick(results, capsys):
    result = _run(cost_agreement, results, capsys, "cost_agreement")
    rows = result["rows"]
    assert {(r["method"], r["budget_fraction"]) for r in rows} == \
        {(m, b) for m in ("alpa", "kiwi") for b in (1.0, 0.7)}
    plans = {r["fingerprint"]: r for r in rows if r["feasible"]}
    assert len(plans) >= 2
    for row in plans.values():
        assert row["predicted_step_seconds"] > 0 and row["estimated_step_seconds"] > 0
        assert row["step_error"] == pytest.approx(
            row["predicted_step_seconds"] / row["estimated_step_seconds"] - 1)
        assert row["estimated_step_seconds"] == pytest.approx(
            row["estimated_compute_seconds"] + row["estimated_collective_seconds"])
        assert row["compute_lower_seconds"] <= row["compute_upper_seconds"]
        assert row["kernel_flops"] == pytest.approx(row["flops"], rel=0.02)
        assert row["compiled_peak_bytes"] > 0
    stats = result["agreement"]
    errors = sorted(abs(r["step_error"]) for r in plans.values())
    assert stats["plans"] == len(plans) and stats["max_abs_step_error"] == errors[-1]
    assert errors[0] <= stats["median_abs_step_error"] <= errors[-1]
    if stats["kendall_tau"] is None:        # one side times every plan alike: no ranking
        assert min(len({r[f"{side}_step_seconds"] for r in plans.values()})
                   for side in ("predicted", "estimated")) == 1
    else:
        assert -1.0 <= stats["kendall_tau"] <= 1.0


def test_the_best_fit_heap_reuses_what_a_freed_buffer_leaves():
    # a (100 B) lives in stages 0-5; b (60 B) 0-2 and c (50 B) 3-5 share the place above a.
    assert heap_gap.best_fit_heap([(100, 0, 5), (60, 0, 2), (50, 3, 5)], alignment=1) == 160
    # d (50 B, 3-4) beside c: larger first, d takes b's place and c goes on top.
    held = [(100, 0, 5), (60, 0, 2), (40, 3, 5), (50, 3, 4)]
    assert heap_gap.best_fit_heap(held, alignment=1) == 100 + 50 + 40
    assert heap_gap.best_fit_heap([(100, 0, 1), (100, 2, 3)], alignment=1) == 100
    assert heap_gap.best_fit_heap([(100, 0, 1), (1, 1, 1)], alignment=64) == 128 + 64
