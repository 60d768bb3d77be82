"""Optimality of the reduced program (KIWI Table 1): ``kiwi`` against ``kiwi-full`` on a 7-layer
MLP at 20/40/60/80% of the reference peak.

Latencies are simulated step times normalised by the reference plan (the fastest ``alpa`` plan
with no memory limit), as in KIWI's table; solve times are the mean over repeated solves with a
95% confidence interval (Student's t), each the wall time of the whole ``solve`` call (its
warm-start stages and model builds included). The MLP is activation-heavy (batch 2048, width
1024, fp32) so that recomputation matters; ``--quick`` uses 2 layers of width 128 and one
repeat.

Usage: python -m experiments.optimality [--json] [--quick] [--repeats 3] [--time-limit 1800]
       [--full-time-limit 600 --full-repeats 1]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

import solvers
from experiments.common import (STUDY_GAP, problem_of, pyplot, results_path, save_figure,
                                write_result)

KIWI_TABLE1 = {0.2: (8.35, 1717.18, 8.35, 0.79), 0.4: (4.88, 660.41, 5.09, 0.91),
               0.6: (2.71, 718.49, 3.13, 0.80), 0.8: (1.54, 39.71, 1.72, 0.67)}
"""KIWI Table 1: budget -> (full latency, full seconds, reduced latency, reduced seconds)."""
FULL_SHAPE = {"batch": 2048, "width": 1024}
"""Activation-heavy, so that recomputation matters (fp32)."""
QUICK_SHAPE = {"batch": 256, "width": 128, "in_dim": 128, "out_dim": 128}
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def _interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (0 for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = _T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _solve(problem, solver, budget, reference, repeats, time_limit) -> dict:
    """Repeated solves: the best plan's latency and the solve time's mean and 95% interval;
    only a ``status`` when no plan was found (``infeasible``, ``timeout_no_incumbent``)."""
    runs, walls = [], []
    for seed in range(repeats):
        start = time.perf_counter()
        try:
            runs.append(solvers.solve(problem, budget, solver=solver, seed=seed,
                                      time_limit=time_limit, mip_gap=STUDY_GAP,
                                      reuse_layers=False, search_min_feasible=False))
        except solvers.InfeasibleBudgetError:
            return {"status": "infeasible"}
        except solvers.SolverTimeoutError:
            return {"status": "timeout_no_incumbent"}
        walls.append(time.perf_counter() - start)       # warm-start stages and builds included
    seconds = _interval(walls)
    best = min(runs, key=lambda r: r.objective)
    sim = solvers.simulate(problem, best.strategy, recompute_at=best.recompute_at)
    return {"latency": sim.step_seconds / reference.objective, "solve_seconds": seconds[0],
            "solve_seconds_ci95": seconds[1], "status": best.status.value, "gap": best.gap,
            "num_vars": best.num_vars, "recomputed": int(len(best.recomputed)),
            "recompute_events": int(sum(len(v) for v in best.recompute_at.values()))}


def plot(result: dict, path) -> None:
    """Normalised latency and solve seconds (95% interval) of kiwi and kiwi-full per budget,
    next to KIWI's Table 1."""
    plt = pyplot()
    fig, (lat, sec) = plt.subplots(1, 2, figsize=(9, 3.4))
    rows = result["rows"]
    x = np.arange(len(rows))
    for i, (name, key, paper) in enumerate((("kiwi-full", "kiwi_full", 0), ("kiwi", "kiwi", 2))):
        lat.bar(x + (i - 0.5) * 0.4, [r[f"{key}_latency"] or 0 for r in rows], 0.4,
                color=f"C{i}", label=f"{name} (ours)")
        lat.plot(x + (i - 0.5) * 0.4, [KIWI_TABLE1[r["budget_fraction"]][paper] for r in rows],
                 "_", color="k", ms=14, mew=2)
        sec.errorbar(x + (i - 0.5) * 0.2, [r[f"{key}_solve_seconds"] or np.nan for r in rows],
                     yerr=[r[f"{key}_solve_seconds_ci95"] or 0 for r in rows], fmt="o",
                     color=f"C{i}", capsize=3, label=f"{name} (ours)")
        sec.plot(x + (i - 0.5) * 0.2, [KIWI_TABLE1[r["budget_fraction"]][paper + 1]
                                       for r in rows], "_", color="k", ms=10, mew=2)
    for ax in (lat, sec):
        ax.set_xticks(x, [f"{r['budget_fraction']:.0%}" for r in rows])
        ax.set_xlabel("budget (bars/dots missing: infeasible; black: KIWI Table 1)", fontsize=8)
    lat.set_ylabel("step / alpa no limit")
    sec.set_ylabel("solve seconds (95% interval)")
    sec.set_yscale("log")
    lat.legend(fontsize=7)
    save_figure(fig, f"{result['layers']}-layer MLP on {result['mesh']}: reduced vs full "
                "program (KIWI Table 1)", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers of width 128, one repeat")
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--time-limit", type=float, default=1800.0)
    parser.add_argument("--full-time-limit", type=float, default=None,
                        help="kiwi-full's limit (default: --time-limit)")
    parser.add_argument("--full-repeats", type=int, default=None,
                        help="kiwi-full's repeats (default: --repeats)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    layers, repeats = (2, 1) if args.quick else (args.layers, args.repeats)
    full_repeats = repeats if args.quick or args.full_repeats is None else args.full_repeats
    full_limit = args.time_limit if args.full_time_limit is None else args.full_time_limit
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    built, _ = problem_of("mlp", layers, args.mesh, **shape)
    problem = built.problem
    reference = solvers.reference_plan(problem)
    rows = []
    for fraction in (0.2, 0.4, 0.6, 0.8):
        budget = int(fraction * reference.peak_bytes)
        kiwi = _solve(problem, "kiwi", budget, reference, repeats, args.time_limit)
        full = _solve(problem, "kiwi-full", budget, reference, full_repeats, full_limit)
        paper = KIWI_TABLE1[fraction]
        row = {"budget_fraction": fraction, "budget_bytes": budget,
               "kiwi_feasible": "latency" in kiwi, "kiwi_full_feasible": "latency" in full,
               "paper_kiwi_full_latency": paper[0], "paper_kiwi_full_solve_seconds": paper[1],
               "paper_kiwi_latency": paper[2], "paper_kiwi_solve_seconds": paper[3]}
        for name, res in (("kiwi", kiwi), ("kiwi_full", full)):
            for key in ("latency", "solve_seconds", "solve_seconds_ci95", "status", "gap",
                        "num_vars", "recomputed", "recompute_events"):
                row[f"{name}_{key}"] = res.get(key)
        if row["kiwi_feasible"] and row["kiwi_full_feasible"]:
            row["latency_ratio"] = kiwi["latency"] / full["latency"]
            row["speedup"] = full["solve_seconds"] / max(kiwi["solve_seconds"], 1e-9)
        rows.append(row)
        print(f"{fraction:.0%}: " + ", ".join(
            f"{name} {row[f'{key}_latency']:.3f} in {row[f'{key}_solve_seconds']:.2f} s"
            if row[f"{key}_latency"] is not None else f"{name} {row[f'{key}_status']}"
            for name, key in (("kiwi", "kiwi"), ("kiwi-full", "kiwi_full"))), flush=True)
    result = {"study": "optimality", "layers": layers, "mesh": args.mesh, **shape,
              "operators": problem.num_nodes, "repeats": repeats, "full_repeats": full_repeats,
              "time_limit": args.time_limit, "full_time_limit": full_limit,
              "reference_step_seconds": reference.objective,
              "reference_peak_bytes": reference.peak_bytes, "rows": rows}
    plot(result, results_path("optimality.png"))
    write_result("optimality", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
