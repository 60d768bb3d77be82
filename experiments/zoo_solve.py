"""The solver alone on the zoo's problems: what the solve costs of the plan time, apart from
tracing, the reference plan and the compiles of the budget search.

Each cell is a zoo model, a mesh of the simulated devices and a budget in bytes per device (the
zoo study's JSON gives a percentage budget's bytes as ``budget_bytes``). The model is traced
at its zoo sizes, its costed problem built as the decorator builds it, and solved once with the
library's default options (``solvers.solve``: ``kiwi``, layer ties, its gap and time limit);
per cell: status, gap, the plan's simulated step and peak, and the solve's seconds.

Usage: python -m experiments.zoo_solve --cells llama:4x2:516406 moe:4x2:486387 [--json]
       [--time-limit 60]

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set here when jax is not yet imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def solve_cell(model: str, mesh: str, budget: int, time_limit: float) -> dict:
    """Trace ``model``, build its problem on ``mesh`` and time one solve under ``budget``."""
    from experiments import zoo
    from experiments.common import PlanCompiler, timed_solve

    step, args = zoo.make(model)
    compiler = PlanCompiler.for_step(step, args, mesh)
    compiler.charge_stored()                     # as the decorator does for the fused model
    problem = compiler.build.problem
    return {"model": model, "mesh": mesh, "budget_bytes": budget,
            "operators": int(problem.num_nodes), **timed_solve(problem, budget, time_limit)}


def _cell(text: str) -> tuple[str, str, int]:
    try:
        model, mesh, budget = text.split(":")
        return model, mesh, int(budget)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected MODEL:MESH:BYTES, e.g. llama:4x2:516406") from None


def main(argv=None) -> dict:
    from experiments.common import write_result
    from solvers.options import DEFAULTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=_cell, nargs="+", required=True,
                        help="MODEL:MESH:BYTES, e.g. llama:4x2:516406")
    parser.add_argument("--time-limit", type=float, default=DEFAULTS.time_limit)
    parser.add_argument("--name", default="zoo_solve", help="results/<name>.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for model, mesh, budget in args.cells:
        row = solve_cell(model, mesh, budget, args.time_limit)
        print(f"{model:10s} {mesh:4s} {budget:>10,d} B: {row['status']}, "
              f"solve {row['solve_seconds']} s, step {row.get('step_seconds', float('nan')):.6g} s",
              file=sys.stderr, flush=True)
        rows.append(row)
    result = {"study": "zoo_solve", "time_limit": args.time_limit, "solver": DEFAULTS.solver,
              "mip_gap": DEFAULTS.mip_gap, "rows": rows}
    write_result(args.name, result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
