"""Solver benchmark: the targets of the solver layer, measured.

Sections (each prints a line per solve and goes into results/solver_bench.json):
- ``targets``: the 4-layer KIWI-config GPT and encoder on a 2x4 mesh at 80% of the reference
  peak: ``kiwi`` solved on the full graph and with layer reuse; solve seconds, status, simulated
  step time against ``alpa``'s.
- ``sweep``: the same models over budgets from 100% down, every solver: which are feasible and
  their simulated step time (kiwi never slower than alpa; kiwi feasible where the baselines are
  not).
- ``depth``: ``kiwi`` with layer reuse on deeper GPTs (20 layers: target under 30 s).
- ``backends``: HiGHS against CP-SAT on the same programs.
- ``tricks``: what follower merging and layer reuse cost in step time on a 2-layer GPT small
  enough to solve every variant to optimality, and the memory rows the recurrence keeps.

Usage: python -m experiments.solver_bench [--json] [--quick] [--sections targets sweep ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import solvers
import solvers.joint
from experiments.common import STUDY_GAP, problem_of, write_result

log = logging.getLogger(__name__)

SECTIONS = ("targets", "sweep", "depth", "backends", "tricks")


def _problem(model: str, layers: int, mesh: str = "2x4", merge: bool = True, **overrides):
    """The problem of a reference model (KIWI's layer config for gpt and bert unless
    overridden)."""
    kwargs = {"preset": "kiwi"} if model in ("gpt", "bert") and not overrides else {}
    build, seconds = problem_of(model, layers, mesh, merge=merge, **kwargs, **overrides)
    return build.problem, seconds


def _row(problem, solver, budget, reference, **options) -> dict:
    options = {"reuse_layers": False, "mip_gap": STUDY_GAP, **options}   # the study's settings
    start = time.perf_counter()
    row = {"solver": solver, "budget_bytes": budget,
           "budget_fraction": round(budget / reference.peak_bytes, 4) if budget else None,
           "reuse_layers": options["reuse_layers"],
           "backend": options.get("backend", solvers.DEFAULT_BACKEND)}
    try:
        sol = solvers.solve(problem, budget, solver=solver, **options)
    except solvers.InfeasibleBudgetError as err:
        row.update(feasible=False, status="infeasible", min_feasible_bytes=err.min_feasible_bytes)
    except solvers.SolverTimeoutError:
        row.update(feasible=False, status="timeout_no_incumbent")
    else:
        sim = solvers.simulate(problem, sol.strategy, recompute_at=sol.recompute_at)
        row.update(feasible=True, status=sol.status.value, gap=sol.gap,
                   solve_seconds=round(sol.solve_seconds, 3),
                   model_build_seconds=round(sol.build_seconds, 3), num_vars=sol.num_vars,
                   num_constraints=sol.num_constraints, step_seconds=sim.step_seconds,
                   normalised_step=sim.step_seconds / reference.objective,
                   peak_bytes=sim.peak_bytes, recomputed=int(len(sol.recomputed)))
    row["wall_seconds"] = round(time.perf_counter() - start, 3)
    print(json.dumps(row), flush=True)
    return row


def targets(models, layers, time_limit) -> list[dict]:
    rows = []
    for model in models:
        problem, _ = _problem(model, layers)
        reference = solvers.reference_plan(problem, time_limit=time_limit)
        budget = int(0.8 * reference.peak_bytes)
        for solver, reuse in (("alpa", False), ("kiwi", False), ("kiwi", True)):
            row = _row(problem, solver, budget, reference, time_limit=time_limit,
                       reuse_layers=reuse)
            rows.append({"model": model, "layers": layers, "operators": problem.num_nodes,
                         **row})
    return rows


def sweep(models, layers, fractions, time_limit) -> list[dict]:
    rows = []
    for model in models:
        problem, _ = _problem(model, layers)
        reference = solvers.reference_plan(problem, time_limit=time_limit)
        for fraction in fractions:
            budget = int(fraction * reference.peak_bytes)
            for solver in ("alpa", "alpa+dots", "alpa+megatron", "alpa+full", "kiwi"):
                rows.append({"model": model, "layers": layers, **_row(
                    problem, solver, budget, reference, time_limit=time_limit,
                    reuse_layers=True)})
    return rows


def depth(depths, time_limit) -> list[dict]:
    rows = []
    for layers in depths:
        problem, built = _problem("gpt", layers)
        reference = solvers.reference_plan(problem, time_limit=time_limit)
        row = _row(problem, "kiwi", int(0.8 * reference.peak_bytes), reference,
                   time_limit=time_limit, reuse_layers=True)
        rows.append({"model": "gpt", "layers": layers, "operators": problem.num_nodes,
                     "problem_seconds": round(built, 2), **row})
    return rows


def tricks(time_limit) -> list[dict]:
    """What follower merging and layer reuse cost in step time, and how many memory rows the
    ends-only recurrence keeps, on a GPT small enough for every variant to solve to optimality."""
    config = {"hidden": 256, "heads": 4, "seq": 128, "batch": 8}
    rows = []
    for merge in (True, False):
        problem, _ = _problem("gpt", 2, merge=merge, **config)
        reference = solvers.reference_plan(problem, time_limit=time_limit)
        budget = int(0.75 * reference.peak_bytes)
        for reuse in ((False, True) if merge else (False,)):
            row = _row(problem, "kiwi", budget, reference, time_limit=time_limit,
                       reuse_layers=reuse)
            joint = solvers.joint.build_joint(problem, budget,
                                              tie=solvers.layer_ties(problem) if reuse else None)
            rows.append({"model": "gpt", "layers": 2, **config, "merge": merge,
                         "strategy_variables": int(len(problem.leaders)),
                         "operators": problem.num_nodes, "memory_rows": len(joint.alive),
                         **row})
    return rows


def backends(model, layers, time_limit, **overrides) -> list[dict]:
    problem, _ = _problem(model, layers, **overrides)
    reference = solvers.reference_plan(problem, time_limit=time_limit)
    rows = []
    for backend in ("highs", "cpsat"):
        for solver, fraction in (("alpa", None), ("alpa", 0.7), ("kiwi", 0.7)):
            budget = None if fraction is None else int(fraction * reference.peak_bytes)
            rows.append({"model": model, "layers": layers, **_row(
                problem, solver, budget, reference, backend=backend, time_limit=time_limit)})
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--quick", action="store_true",
                        help="small models only (a minute on 2 cores)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--models", nargs="*", default=["gpt", "bert"])
    parser.add_argument("--fractions", type=float, nargs="*",
                        default=[1.0, 0.8, 0.6, 0.5, 0.4, 0.3])
    parser.add_argument("--depths", type=int, nargs="*", default=[8, 20])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = {"study": "solver_bench", "quick": args.quick}
    if args.quick:
        # quick runs use a 3-layer MLP: the same code paths, seconds per solve
        if "targets" in args.sections or "sweep" in args.sections:
            problem, _ = _problem("mlp", 3, batch=1024, width=512)
            reference = solvers.reference_plan(problem)
            result["sweep"] = [
                {"model": "mlp", "layers": 3,
                 **_row(problem, solver, int(f * reference.peak_bytes), reference,
                        time_limit=args.time_limit)}
                for f in (0.9, 0.7) for solver in ("alpa", "kiwi")]
        if "backends" in args.sections:
            result["backends"] = backends("mlp", 3, args.time_limit, batch=1024, width=512)
    else:
        if "targets" in args.sections:
            result["targets"] = targets(args.models, 4, args.time_limit)
        if "depth" in args.sections:
            result["depth"] = depth(args.depths, args.time_limit)
        if "backends" in args.sections:
            result["backends"] = backends("mlp", 7, args.time_limit, batch=2048, width=1024)
        if "sweep" in args.sections:
            result["sweep"] = sweep(args.models, 4, args.fractions, args.time_limit)
        if "tricks" in args.sections:
            result["tricks"] = tricks(max(args.time_limit, 300.0))
    write_result("solver_bench", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
