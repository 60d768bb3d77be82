"""Solve time against depth, against the targets: what a user waits for between calling the
decorator and the first compile, on the KIWI-config GPT (abstract arrays, 2x4 mesh, embedded
backend, the library's default solver options: layer ties on, gap 5e-3, 60 s).

Per depth, the stages a percentage budget costs are timed apart:

- ``trace_seconds``: lowering the step and building the costed problem;
- ``reference_seconds``: the reference plan (the 100% of a percentage budget);
- ``solve_seconds``: ``solvers.solve`` at the budget (warm-start stages and final solve).

The target applies to ``solve_seconds`` (issue targets: 4 layers at 80% in 10 s or less, 20
layers in 15 s, 96 layers in 30 s). With ``--untied``, the untied program is solved too (same
limit) and the tied plan's step is set against it (``tied_over_untied``; when the untied solve
is not proven optimal, that is a bound, not the distance to the optimum).

Usage: python -m experiments.solve_time [--json] [--depths 4 20 96] [--fraction 0.8]
       [--untied 4] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import solvers
from experiments.common import problem_of, timed_solve, write_result
from solvers.options import DEFAULTS

TARGETS = {4: 10.0, 20: 15.0, 96: 30.0}
"""Depth -> solve seconds the planner is meant to stay within."""


def depth_row(layers: int, mesh: str, fraction: float, time_limit: float,
              untied: bool) -> dict:
    """Trace, reference and solve the GPT of ``layers`` layers; each stage timed."""
    start = time.perf_counter()
    build, _ = problem_of("gpt", layers, mesh, preset="kiwi")
    problem = build.problem
    row = {"layers": layers, "operators": int(problem.num_nodes),
           "trace_seconds": round(time.perf_counter() - start, 2)}
    start = time.perf_counter()
    reference = solvers.reference_plan(problem, time_limit=time_limit)
    row["reference_seconds"] = round(time.perf_counter() - start, 2)
    budget = int(fraction * reference.peak_bytes)
    row.update(budget_bytes=budget, **timed_solve(problem, budget, time_limit))
    target = TARGETS.get(layers)
    row["target_seconds"] = target
    row["meets_target"] = None if target is None else bool(
        row["status"] in ("optimal", "feasible") and row["solve_seconds"] <= target)
    if untied:
        full = timed_solve(problem, budget, time_limit, reuse_layers=False)
        row["untied"] = full
        if "step_seconds" in full and "step_seconds" in row:
            row["tied_over_untied"] = row["step_seconds"] / full["step_seconds"]
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=list(TARGETS))
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--fraction", type=float, default=0.8,
                        help="budget as a fraction of the reference plan's peak")
    parser.add_argument("--untied", type=int, nargs="*", default=[4],
                        help="depths at which the untied program is solved too")
    parser.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for layers in args.depths:
        row = depth_row(layers, args.mesh, args.fraction, args.time_limit,
                        layers in args.untied)
        print(f"{layers:3d} layers {row['operators']:6d} ops: trace {row['trace_seconds']} s, "
              f"reference {row['reference_seconds']} s, solve {row['solve_seconds']} s "
              f"({row['status']}; target {row['target_seconds']} s)", file=sys.stderr,
              flush=True)
        rows.append(row)
    result = {"study": "solve_time", "model": "gpt", "preset": "kiwi", "mesh": args.mesh,
              "fraction": args.fraction, "time_limit": args.time_limit,
              "solver": DEFAULTS.solver, "mip_gap": DEFAULTS.mip_gap, "rows": rows}
    write_result("solve_time", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
