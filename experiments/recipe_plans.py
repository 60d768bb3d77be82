"""The hand-written recipes as plans of kiwi's program, against the recipes compiled.

Each recipe (:mod:`kiwi_jax.recipes`) is made a plan of the step's program
(:func:`kiwi_jax.recipe_plan.recipe_solution`: its argument layout pinned, its block policy's
keep flags, the rest of the layout solved for) and priced by the simulator. Per recipe:

- ``predicted_*``: the simulator's step and per-device peak of that plan;
- ``program_peak_bytes``: the peak kiwi's program itself counts for the plan
  (:func:`solvers.solve.program_peak`); equal to the predicted peak where the program contains
  the recipe at its own memory;
- ``recipe_*``: the recipe compiled as plain JAX (``compile_recipe``): its per-device memory
  (argument + output + temp - alias) and the estimated step of the compiled program;
- ``applied_*``: the recipe's plan applied and compiled as the decorator runs a plan.

The summary has Kendall's tau of the predicted steps against the compiled recipes' estimates
(does the model rank the recipes as the compiled programs do?) and the memory ratios.

Usage: python -m experiments.recipe_plans [--json] [--zoo llama | --model gpt] [--mesh 2x4]
       [--layers 2 --dim 16 ...] [--recipes dp fsdp ...] [--memory-model auto]
       [--order auto] [--name recipe_plans]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

from experiments.common import PlanCompiler, write_result  # noqa: E402
from experiments.vs_recipes import add_model_arguments, model_sizes, model_step  # noqa: E402


def recipe_row(compiler: PlanCompiler, recipe, cluster: str) -> dict:
    """One recipe: its plan's prediction, the program's count, the recipe and its plan
    compiled."""
    from kiwi_jax.plan import plan_from_solution
    from kiwi_jax.recipe_plan import recipe_solution
    from kiwi_jax.recipes import compile_recipe
    from solvers.options import SolverOptions
    from solvers.solve import program_peak

    start = time.perf_counter()
    solution = recipe_solution(compiler.traced, compiler.build, compiler.mesh, recipe)
    plan_seconds = time.perf_counter() - start
    problem = compiler.build.problem
    compiled = compile_recipe(compiler.train_step, compiler.args, compiler.mesh, recipe, cluster)
    plan = plan_from_solution(compiler.build, solution, int(solution.peak_bytes))
    applied = compiler.compile(plan)
    row = {"recipe": recipe.name, "plan_seconds": round(plan_seconds, 2),
           "recomputed": int(len(solution.recomputed)),
           "predicted_step_seconds": solution.objective,
           "predicted_peak_bytes": int(solution.peak_bytes),
           "program_peak_bytes": program_peak(problem, solution.strategy, solution.keep,
                                              SolverOptions()),
           "recipe_bytes": compiled.peak_bytes, "recipe_step_seconds": compiled.step_seconds,
           "applied_bytes": applied.memory.peak_bytes, "applied_program": applied.program}
    row["predicted_over_recipe"] = row["predicted_peak_bytes"] / row["recipe_bytes"]
    row["program_over_predicted"] = row["program_peak_bytes"] / row["predicted_peak_bytes"]
    return row


def summary(rows: list[dict]) -> dict:
    """Rank agreement of the predicted steps with the compiled recipes' estimates, and the
    memory ratios' range."""
    from scipy.stats import kendalltau

    tau = kendalltau([r["predicted_step_seconds"] for r in rows],
                     [r["recipe_step_seconds"] for r in rows])
    ratios = [r["predicted_over_recipe"] for r in rows]
    return {"recipes": len(rows),
            "kendall_tau": None if math.isnan(tau.statistic) else float(tau.statistic),
            "predicted_over_recipe_min": min(ratios), "predicted_over_recipe_max": max(ratios),
            "contained": sum(r["program_peak_bytes"] <= r["predicted_peak_bytes"] for r in rows)}


def table(rows: list[dict]) -> str:
    lines = ["| recipe | predicted B | program B | recipe compiled B | predicted / compiled "
             "| plan applied B | predicted ms | recipe est. ms |", "|" + " --- |" * 8]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['predicted_peak_bytes']:,} | "
                     f"{r['program_peak_bytes']:,} | {r['recipe_bytes']:,} | "
                     f"{r['predicted_over_recipe']:.3f} | {r['applied_bytes']:,} | "
                     f"{r['predicted_step_seconds'] * 1e3:.4f} | "
                     f"{r['recipe_step_seconds'] * 1e3:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    from kiwi_jax.apply import ORDERS
    from kiwi_jax.problem import MEMORY_MODELS
    from kiwi_jax.recipes import Recipe, all_recipes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--cluster", default="v100-nvlink")
    parser.add_argument("--recipes", nargs="+", default=None, help="default: all twelve")
    parser.add_argument("--memory-model", default="auto", choices=MEMORY_MODELS,
                        help="fused: the values the reference plan compiled stores charged, "
                             "as the decorator does")
    parser.add_argument("--order", default="auto", choices=ORDERS,
                        help="the schedule replayed (kiwi_jax.optimize's order)")
    parser.add_argument("--name", default="recipe_plans", help="results/<name>.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = model_sizes(args)
    name, step, example = model_step(args, sizes)
    compiler = PlanCompiler.for_step(step, example, args.mesh, args.cluster, args.memory_model,
                                     args.order)
    compiler.charge_stored()
    recipes = [Recipe.parse(r) for r in args.recipes] if args.recipes else all_recipes()
    rows = []
    for recipe in recipes:
        rows.append(recipe_row(compiler, recipe, args.cluster))
        print(f"{recipe.name}: predicted {rows[-1]['predicted_peak_bytes']:,} B, compiled "
              f"{rows[-1]['recipe_bytes']:,} B", flush=True)
    result = {"model": name, "sizes": sizes, "mesh": args.mesh, "cluster": args.cluster,
              "memory_model": compiler.build.memory_model, "order": args.order,
              "operators": int(compiler.build.problem.num_nodes), "rows": rows,
              "summary": summary(rows)}
    print(table(rows))
    print(result["summary"])
    write_result(args.name, result, args.json)
    return result


if __name__ == "__main__":
    main()
