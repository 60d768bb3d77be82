"""The user-style zoo: what kiwi-jax does with train steps written the way Flax users write them.

For every model of :mod:`experiments.zoo` (nothing in them is shaped for the planner), the step
is traced once (does it lower to a graph kiwi-jax plans, how many layers are found in it, how
many of its nodes fall in them) and then, per mesh and budget, run through
``kiwi_jax.optimize(step, mesh=..., memory_budget=...)`` exactly as a user would: planned,
applied and compiled. Per cell: the problem's size, plan and compile seconds, the solver's
status, the predicted peak against the compiled peak, the compiled peak over the budget and
whether it fits, the compiled-cost estimate of the program that runs (``compiled_step_seconds``:
``kiwi_jax.estimate.compiled_cost``), the budget the solver was finally given (the decorator
searches the solver's budget until the compiled step fits and uses it; ``plan.fit``, the
search, is in the row), and the numerics of three applied steps against three plain jitted steps from the same concrete
state (``kiwi_jax.verify.compare_numerics``: the loss within 1e-6, each state leaf within 1e-5
or within 10x its noise floor, the plain step data-parallel on the mesh against the plain step
on one device). Every failure is a row with its stage, the exception's type and the first
line of its message; the study itself never stops on one.

Budgets are the decorator's percentages: ``"100%"`` is the compiled memory of the fastest
``alpa`` plan with no memory limit (the reference plan), ``"80%"`` four fifths of it.

Usage: python -m experiments.zoo_study [--json] [--quick] [--models llama vit ...]
       [--meshes 1x1 1x8 2x4 4x2] [--budgets 100% 80%] [--time-limit 60] [--order auto]
       [--name zoo]
       python -m experiments.zoo_study --table results/zoo.json    # its markdown tables
Writes results/<NAME>.json after every cell (NAME defaults to ``zoo``) and prints the JSON as
the last line with ``--json``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kiwi_jax  # noqa: E402
from experiments import zoo  # noqa: E402
from experiments.common import write_result  # noqa: E402
from hlo_tools.layers import layer_report  # noqa: E402
from kiwi_jax.apply import ORDERS  # noqa: E402
from kiwi_jax.estimate import compiled_cost  # noqa: E402
from kiwi_jax.frontend import trace  # noqa: E402
from kiwi_jax.step import functionalize  # noqa: E402
from kiwi_jax.verify import compare_numerics  # noqa: E402

MESHES = ("1x1", "1x8", "2x4", "4x2")
BUDGETS = ("100%", "80%")
NUMERICS_STEPS = 3
QUICK = {"models": ("llama",), "meshes": ("2x4",), "budgets": ("150%",),
         "sizes": {"layers": 1, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 8, "seq": 8,
                   "vocab": 32}, "time_limit": 30.0}
"""``--quick``: a one-layer Llama of width 16 on 2x4 at 1.5 x the reference budget."""


def _error(stage: str, error: BaseException) -> dict:
    """The row fields of a failure: its stage, the exception's type and first message line."""
    lines = str(error).strip().splitlines()
    return {"stage": stage, "type": type(error).__name__, "message": lines[0] if lines else ""}


def _mesh(text: str):
    shape = tuple(int(n) for n in text.lower().split("x"))
    return jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def traced_row(name: str, sizes: dict) -> dict:
    """Trace the model's step once: does it lower, and the layers found in its graph."""
    row = {"model": name, "sizes": sizes}
    start = time.perf_counter()
    try:
        step, args = zoo.make(name, **sizes)
        graph = trace(step, *args).graph
    except Exception as error:  # every failure is a row
        row.update(lowers=False, error=_error("trace", error))
    else:
        report = layer_report(graph)
        row.update(lowers=True, graph_nodes=len(graph.nodes), layers_found=report.layers,
                   layers_uniform=report.uniform, layer_structures=report.structures,
                   fraction_in_layers=round(report.fraction_in_layers, 4))
    row["trace_seconds"] = round(time.perf_counter() - start, 2)
    return row


def cell(name: str, sizes: dict, mesh: str, budget: str, time_limit: float,
         order: str = "auto") -> dict:
    """Plan, apply, compile and check one model on one mesh under one budget (``order``: the
    decorator's, the order the graph is planned in)."""
    row = {"model": name, "mesh": mesh, "budget": budget, "time_limit": time_limit}
    start = time.perf_counter()
    try:
        step, args = zoo.make(name, abstract=False, seed=0, **sizes)
        optimized = kiwi_jax.optimize(step, mesh=_mesh(mesh), memory_budget=budget,
                                      time_limit=time_limit, cache_dir=False, order=order,
                                      recipes=False)      # the study is of kiwi's own plans
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared = optimized.lower(*args)
        row["warnings"] = [str(w.message).splitlines()[0] for w in caught
                           if issubclass(w.category, UserWarning)]
    except Exception as error:  # every failure is a row
        row.update(planned=False, error=_error("plan", error))
        row["wall_seconds"] = round(time.perf_counter() - start, 2)
        return row
    problem, plan = prepared.build.problem, prepared.plan
    layers = sorted({int(v) for v in np.asarray(problem.layer) if v >= 0})
    compiled_peak = int(prepared.applied.memory.peak_bytes)
    row.update(
        planned=True, layers=len(layers), nodes=int(problem.num_nodes),
        nodes_after_merge=int(len(problem.leaders)),
        strategy_variables=int(problem.num_strategies.sum()),
        num_vars=plan.solution.num_vars, num_constraints=plan.solution.num_constraints,
        solver=plan.solver, status=plan.status, gap=float(plan.solution.gap),
        plan_seconds=round(prepared.plan_seconds, 2),
        solve_seconds=round(plan.solve_seconds, 2),
        compile_seconds=round(prepared.compile_seconds, 2),
        budget_bytes=int(plan.budget_bytes), solver_budget_bytes=plan.solver_budget_bytes,
        predicted_peak_bytes=int(plan.predicted_peak_bytes), compiled_peak_bytes=compiled_peak,
        compiled_over_budget=compiled_peak / plan.budget_bytes,
        compiled_over_predicted=compiled_peak / max(plan.predicted_peak_bytes, 1),
        fits=compiled_peak <= plan.budget_bytes, recomputed_nodes=len(plan.recomputed),
        program=prepared.applied.program,
        predicted_step_seconds=float(plan.predicted_step_seconds),
        compiled_step_seconds=compiled_cost(prepared.applied.compiled, optimized.options.mesh,
                                            prepared.build.cluster).step_seconds,
        fit_compiles_spent=None if plan.fit is None else plan.fit.compiles,
        fit=None if plan.fit is None else plan.fit.to_dict())
    try:
        numerics = compare_numerics(prepared, functionalize(step, args), NUMERICS_STEPS,
                                    _mesh(mesh))
    except Exception as error:  # every failure is a row
        row.update(numerics=None, error=_error("numerics", error))
    else:
        row["numerics"] = numerics.to_dict()
    row["wall_seconds"] = round(time.perf_counter() - start, 2)
    return row


def _progress(row: dict) -> str:
    where = f"  {row['model']:10s} {row['mesh']:4s} {row['budget']:>5s}"
    if not row.get("planned"):
        return f"{where} FAILED ({row['error']['type']}: {row['error']['message'][:90]})"
    mib = 2**20
    numerics = row.get("numerics") or {}
    text = (f"{where} {row['layers']} layers, {row['status']}, plan {row['plan_seconds']:.1f} s; "
            f"peak {row['predicted_peak_bytes'] / mib:.3f} predicted, "
            f"{row['compiled_peak_bytes'] / mib:.3f} compiled MiB "
            f"{'as its export ' if row.get('program') == 'blocks' else ''}"
            f"({row['compiled_over_budget']:.3f} x budget, "
            f"{'fits' if row['fits'] else 'over'}), "
            f"est. {row['compiled_step_seconds'] * 1e3:.4f} ms")
    if numerics:
        text += (f"; state diff {numerics['max_param_rel_diff']:.1e}, numerics "
                 f"{'ok' if numerics['ok'] else 'FAIL'}")
    elif "error" in row:
        text += f"; numerics FAILED ({row['error']['type']})"
    return text + f" [{row['wall_seconds']:.0f} s]"


def run(models, meshes, budgets, sizes: dict, time_limit: float, name: str, quick: bool,
        print_json: bool, order: str = "auto") -> dict:
    """The whole study; the result file is rewritten after every cell."""
    start = time.perf_counter()
    result = {"study": "zoo_study", "quick": quick, "models": list(models),
              "meshes": list(meshes), "budgets": list(budgets), "sizes": sizes,
              "time_limit": time_limit, "order": order, "numerics_steps": NUMERICS_STEPS,
              "jax": jax.__version__, "traced": [], "rows": []}
    model_sizes = sizes if quick else {}
    for model in models:
        traced = traced_row(model, model_sizes)
        result["traced"].append(traced)
        found = (f"{traced['layers_found']} layers, {traced['graph_nodes']} nodes"
                 if traced["lowers"] else
                 f"FAILED ({traced['error']['type']}: {traced['error']['message'][:90]})")
        print(f"{model}: traced in {traced['trace_seconds']:.1f} s, {found}", file=sys.stderr,
              flush=True)
    for mesh in meshes:                 # mesh by mesh: a cut-short run has whole meshes
        for model in models:
            for budget in budgets:
                row = cell(model, model_sizes, mesh, budget, time_limit, order)
                row["sizes"] = model_sizes
                result["rows"].append(row)
                print(_progress(row), file=sys.stderr, flush=True)
                result["wall_seconds"] = round(time.perf_counter() - start, 1)
                write_result(name, result)
    write_result(name, result, print_json=print_json)
    return result


def markdown(result: dict) -> str:
    """The study's tables in markdown: the models that do not lower (once each), then one row
    per planned cell (or its failure)."""
    mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    lines = ["| model | lowers | layers found | graph nodes | in layers |",
             "| --- | --- | --- | --- | --- |"]
    for t in result["traced"]:
        if t["lowers"]:
            lines.append(f"| {t['model']} | yes | {t['layers_found']} | {t['graph_nodes']} | "
                         f"{t['fraction_in_layers']:.0%} |")
        else:
            lines.append(f"| {t['model']} | no: `{t['error']['type']}`: "
                         f"{t['error']['message']} | | | |")
    lines += ["", "| model | mesh | budget | layers | nodes (merged) | strategies | plan s | "
              "status | predicted MiB | compiled MiB | compiled / budget | fits | "
              "solver budget / budget | state diff, 3 steps (numerics) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
              "| --- |"]
    lowers = {t["model"] for t in result["traced"] if t["lowers"]}
    for r in result["rows"]:
        if r["model"] not in lowers:
            continue
        where = f"| {r['model']} | {r['mesh']} | {r['budget']} |"
        if not r.get("planned"):
            lines.append(f"{where} failed: `{r['error']['type']}`: {r['error']['message']} "
                         "| | | | | | | | | | |")
            continue
        numerics = r.get("numerics") or {}
        diff = (f"{numerics['max_param_rel_diff']:.1e} "
                f"({'ok' if numerics.get('ok') else 'FAILS'})" if numerics
                else f"failed: `{r['error']['type']}`")
        solver_budget = (r["solver_budget_bytes"] or r["budget_bytes"]) / r["budget_bytes"]
        lines.append(
            f"{where} {r['layers']} | {r['nodes']} ({r['nodes_after_merge']}) | "
            f"{r['strategy_variables']} | {r['plan_seconds']:.1f} | {r['status']} | "
            f"{mib(r['predicted_peak_bytes'])} | {mib(r['compiled_peak_bytes'])} | "
            f"{r['compiled_over_budget']:.3f} | {'yes' if r['fits'] else 'no'} | "
            f"{solver_budget:.3f} | {diff} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=zoo.MODELS)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS),
                        help="memory_budget values: percentages of the reference plan's "
                             "compiled memory or sizes such as 6MiB")
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per solve")
    parser.add_argument("--order", default="auto", choices=ORDERS,
                        help="the order the graph is planned in (kiwi_jax.optimize's order)")
    parser.add_argument("--name", default="zoo", help="results/<name>.json")
    parser.add_argument("--quick", action="store_true",
                        help="a one-layer Llama of width 16 on 2x4 at 1.5 x the reference budget")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--table", metavar="JSON",
                        help="print the markdown tables of a result file and exit")
    args = parser.parse_args(argv)
    if args.table:
        result = json.loads(pathlib.Path(args.table).read_text())
        print(markdown(result))
        return result
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        return run(QUICK["models"], QUICK["meshes"], QUICK["budgets"], QUICK["sizes"],
                   QUICK["time_limit"], args.name, True, args.json, args.order)
    return run(args.models, args.meshes, args.budgets, {}, args.time_limit, args.name, False,
               args.json, args.order)


if __name__ == "__main__":
    main()
