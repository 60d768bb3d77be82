"""Solver scalability (KIWI Fig. 4 and Table 2): operators, variables and solve seconds of
``alpa`` and ``kiwi`` at 90% and 100% budgets, full graph and with layer reuse, for encoders of
depth 1 to 20 (KIWI's layer config, abstract arrays, 2x4 mesh).

``solve_seconds`` is the wall time of ``solvers.solve`` end to end (warm-start solves
included); ``backend_seconds`` the final solve alone. A solve that reaches the time limit is
marked (status ``feasible`` with its gap, or ``timeout_no_incumbent``).

Usage: python -m experiments.solver_scaling [--json] [--quick] [--depths 1 2 4 ...]
       [--time-limit 60]
"""

from __future__ import annotations

import argparse
import logging
import time

import solvers
from experiments.common import (KIWI_TABLE2, STUDY_GAP, problem_of, pyplot, results_path,
                                save_figure, write_result)

DEPTHS = (1, 2, 4, 8, 12, 16, 20)
QUICK = {"model": "mlp", "depths": (2, 3), "mesh": "1x4",
         "config": {"batch": 256, "width": 128, "in_dim": 128, "out_dim": 128}}
"""The smoke run (``--quick``): on 1x4 its solves take 7 s, on 2x2 38 s, to plans of the same
normalised steps (1.1473 and 1.2639 at 90%)."""


def _solve_row(problem, solver, fraction, reference, reuse, time_limit) -> dict:
    budget = int(fraction * reference.peak_bytes)
    row = {"solver": solver, "budget_fraction": fraction, "budget_bytes": budget,
           "reuse_layers": reuse}
    start = time.perf_counter()
    try:
        sol = solvers.solve(problem, budget, solver=solver, time_limit=time_limit,
                            mip_gap=STUDY_GAP, reuse_layers=reuse, search_min_feasible=False)
    except solvers.InfeasibleBudgetError:
        row.update(feasible=False, status="infeasible")
    except solvers.SolverTimeoutError:
        row.update(feasible=False, status="timeout_no_incumbent")
    else:
        sim = solvers.simulate(problem, sol.strategy, recompute_at=sol.recompute_at)
        row.update(feasible=True, status=sol.status.value, gap=sol.gap,
                   backend_seconds=round(sol.solve_seconds, 3), num_vars=sol.num_vars,
                   num_constraints=sol.num_constraints,
                   normalised_step=sim.step_seconds / reference.objective)
    row["solve_seconds"] = round(time.perf_counter() - start, 3)
    return row


def _depth(model, layers, mesh, config, time_limit) -> list[dict]:
    build, seconds = problem_of(model, layers, mesh, **config)
    problem = build.problem
    reference = solvers.reference_plan(problem, time_limit=time_limit)
    rows = []
    for fraction in (1.0, 0.9):
        for solver in ("alpa", "kiwi"):
            for reuse in (False, True):
                row = {"layers": layers, "operators": problem.num_nodes,
                       "paper_operators": KIWI_TABLE2.get(layers) if model == "bert" else None,
                       "problem_seconds": round(seconds, 2),
                       **_solve_row(problem, solver, fraction, reference, reuse, time_limit)}
                print(f"{layers:3d} layers {problem.num_nodes:6d} ops {solver:5s} "
                      f"{fraction:.0%} {'tied' if reuse else 'full':4s} "
                      f"{row['solve_seconds']:8.2f} s {row['status']}"
                      + (f" step {row['normalised_step']:.4f}" if row["feasible"] else ""),
                      flush=True)
                rows.append(row)
    return rows


def plot(rows: list[dict], path, time_limit: float) -> None:
    """Solve seconds against depth (a line per solver, budget and graph) and operators
    against depth next to KIWI's Table 2."""
    plt = pyplot()
    fig, (ax, ops) = plt.subplots(1, 2, figsize=(10, 3.6))
    keys = dict.fromkeys((r["solver"], r["budget_fraction"], r["reuse_layers"]) for r in rows)
    for i, (solver, fraction, reuse) in enumerate(keys):
        pts = sorted((r["layers"], r["solve_seconds"], r["status"]) for r in rows
                     if (r["solver"], r["budget_fraction"], r["reuse_layers"])
                     == (solver, fraction, reuse))
        x, y, status = zip(*pts)
        line, = ax.plot(x, y, marker="o" if solver == "kiwi" else "s", ms=3,
                        ls="-" if reuse else "--", color=f"C{i}",
                        label=f"{solver} {fraction:.0%} {'layer reuse' if reuse else 'full graph'}")
        hit = [(a, b) for a, b, s in pts if s not in ("optimal", "infeasible")]
        if hit:
            ax.plot(*zip(*hit), "x", color=line.get_color(), ms=7)
    ax.axhline(time_limit, color="0.6", lw=0.8, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("solve seconds (x: stopped at the time limit)")
    ax.legend(fontsize=6)
    depth = sorted({(r["layers"], r["operators"], r["paper_operators"]) for r in rows})
    ops.plot([d[0] for d in depth], [d[1] for d in depth], marker="o", label="ours (HLO graph)")
    paper = [(d[0], d[2]) for d in depth if d[2]]
    if paper:
        ops.plot(*zip(*paper), marker="s", label="KIWI Table 2")
    ops.set_xlabel("layers")
    ops.set_ylabel("operators")
    ops.legend(fontsize=7)
    save_figure(fig, "Solver scalability (KIWI Fig. 4, Table 2)", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLPs of depth 2 and 3 on 1x4")
    parser.add_argument("--depths", type=int, nargs="*", default=list(DEPTHS))
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        setup = QUICK
    else:
        setup = {"model": "bert", "depths": args.depths, "mesh": args.mesh,
                 "config": {"preset": "kiwi"}}
    rows = [row for layers in setup["depths"] for row in
            _depth(setup["model"], layers, setup["mesh"], setup["config"], args.time_limit)]
    result = {"study": "solver_scaling", "quick": args.quick, "model": setup["model"],
              "mesh": setup["mesh"], "time_limit": args.time_limit, "rows": rows}
    plot(rows, results_path("solver_scaling.png"), args.time_limit)
    write_result("solver_scaling", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
