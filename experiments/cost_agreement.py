"""Cost agreement: does the cost model time and rank plans as XLA compiles them?

For one model and mesh, the plans of a budget sweep (``kiwi`` and ``alpa``, and the baseline
recipes ``alpa+dots`` and ``alpa+megatron``, at fractions of the reference plan's peak) are
applied and compiled on the simulated devices. Per plan the simulator's step time
(``Plan.predicted_step_seconds``) is set beside the compiled step's estimate
(:func:`kiwi_jax.estimate.compiled_cost`: XLA's kernels and collectives priced with the same
cluster), and the predicted peak beside the compiled one. Over the distinct plans (equal
fingerprints compile to the same program and count once): Kendall's tau of the two rankings,
the median and largest relative step error.

Each row also carries the terms that separate the two, measured on that plan:

- ``carried_seconds``: the resharding of the updated state back to the input's layout (the
  step returns its state where it read it); the compiled step runs it, and the model prices
  it (``ShardingProblem.carried``; it had no term for it before).
- ``reshard_merged_seconds``: the simulator charges resharding per edge; XLA reshards a value
  once per target layout, whatever the number of readers (``kiwi_jax.plan.attributed_comms``
  counts it so): the difference.
- ``all_reduce_latency_excess_seconds``: the all-reduce latencies the model charges (a share
  of one for the all-reduces it expects XLA's combiner to merge, one for each other) minus
  those of the compiled all-reduces.
- compute: the model's roofline per operator vs the roofline per fused kernel, split into the
  compute-bound part (matrix products: model dots vs kernels whose FLOPs bound them) and the
  rest (memory-bound: where fusion saves the model's per-operator reads and writes).

Usage: python -m experiments.cost_agreement [--json] [--quick] [--model gpt] [--layers 2]
       [--hidden 256] [--heads 4] [--seq 128] [--batch 16] [--vocab 2048] [--mesh 2x4]
       [--budgets 1.0 0.9 0.8 0.7] [--methods alpa alpa+dots alpa+megatron kiwi]
       [--fusion compiled|rules]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import solvers  # noqa: E402
from experiments.common import (TIED_MODELS, PlanCompiler, pyplot, results_path,  # noqa: E402
                                save_figure, write_result)
from hlo_tools.compiled import collectives  # noqa: E402
from hlo_tools.kernels import kernels  # noqa: E402
from kiwi_jax.compile import Prepared  # noqa: E402
from kiwi_jax.estimate import compiled_cost  # noqa: E402
from kiwi_jax.plan import attributed_comms, solve_plan  # noqa: E402
from kiwi_jax.sharding import comm_seconds  # noqa: E402
from kiwi_jax.strategies import latency_shares, operator_comm_seconds  # noqa: E402
from kiwi_jax.verify import carried_comms, predicted_compute_seconds  # noqa: E402

METHODS = ("alpa", "alpa+dots", "alpa+megatron", "kiwi")
BUDGETS = (1.0, 0.9, 0.8, 0.7)
QUICK = {"model": "mlp", "layers": 2, "mesh": "2x4", "budgets": (1.0, 0.7),
         "methods": ("alpa", "kiwi"),
         "config": {"batch": 64, "width": 64, "in_dim": 64, "out_dim": 64}}
"""``--quick``: a 2-layer MLP, two budgets (its backend calls: 0.1-0.2 s at 100%; at 70%,
1.7-7.7 s each, five of them proving the same plan: 32 s of the study's 46 s, 2 cores)."""
TOLERANCE = 0.15
"""The relative step error the model is meant to stay within."""


def relative(a: float, b: float) -> float:
    """(a - b) / b."""
    return (a - b) / b if b else float("inf")


def _measure(compiler: PlanCompiler, plan) -> dict:
    """Compile ``plan`` and set what the model predicts beside the compiled step."""
    build = compiler.build
    start = time.perf_counter()
    applied = compiler.compile(plan)
    compile_seconds = time.perf_counter() - start
    prepared = Prepared(compiler.traced, build, plan, applied, 0.0, compile_seconds, False)
    cost = compiled_cost(applied.compiled, compiler.mesh, build.cluster)
    mesh, cluster, device = build.mesh, build.cluster, build.cluster.device
    seconds = lambda comms: sum(comm_seconds(c, mesh, cluster) for c in comms)  # noqa: E731
    predicted = plan.predicted_step_seconds
    compute = predicted_compute_seconds(prepared)
    # the collectives the plan implies, each value's resharding to one layout once, priced as
    # the model prices them (combined all-reduces pay their share of one latency)
    shares = latency_shares(compiler.traced.graph)
    attributed = attributed_comms(build, plan.strategy, plan.keep)
    merged = sum(operator_comm_seconds(c, mesh, cluster, shares[node]) for node, c in attributed)
    latency = lambda axes: cluster.axis_link(mesh, axes).latency_s  # noqa: E731
    found = collectives(applied.compiled.as_text(),
                        np.arange(mesh.num_devices).reshape(mesh.shape))
    excess = (sum(latency(c.axes) * shares[node] for node, c in attributed
                  if c.kind == "all-reduce")
              - sum(latency(c.axes or (0, 1)) for c in found if c.kind == "all-reduce"))
    # compute-bound parts: the model's dots (every execution) and the kernels FLOPs bound
    problem = build.problem
    per_node, _, _ = problem.costs_of(plan.strategy)
    executions = np.ones(problem.num_nodes)
    for node, stages in plan.recompute_at.items():
        executions[node] += len(stages)
    dots = np.array([op == "dot" for op in problem.opcodes])
    bound = sum(k.flops / device.flops for k in kernels(applied.compiled.as_text())
                if k.flops / device.flops >= k.bytes / device.memory_bandwidth)
    return {
        "program": applied.program,
        "predicted_step_seconds": predicted, "estimated_step_seconds": cost.step_seconds,
        "step_error": relative(predicted, cost.step_seconds),
        "predicted_compute_seconds": compute, "estimated_compute_seconds": cost.compute_seconds,
        "predicted_comm_seconds": predicted - compute,
        "estimated_collective_seconds": cost.collective_seconds,
        "predicted_dot_seconds": float((per_node * executions)[dots].sum()),
        "estimated_flop_bound_seconds": float(bound),
        "compute_lower_seconds": cost.compute_lower_seconds,
        "compute_upper_seconds": cost.compute_upper_seconds,
        "carried_seconds": seconds(carried_comms(prepared)),
        "reshard_merged_seconds": (predicted - compute) - merged,
        "all_reduce_latency_excess_seconds": excess,
        "predicted_collectives": {k: sum(c.kind == k for _, c in attributed)
                                  for k in sorted({c.kind for _, c in attributed})},
        "compiled_collectives": {k: v["count"] for k, v in cost.collectives.items()},
        "flops": cost.flops, "kernel_flops": cost.kernel_flops,
        "bytes_accessed": cost.bytes_accessed, "kernel_bytes": cost.kernel_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "compiled_peak_bytes": int(applied.memory.peak_bytes),
        "memory_error": relative(plan.predicted_peak_bytes, applied.memory.peak_bytes),
        "compile_seconds": round(compile_seconds, 2),
    }


def sweep(compiler: PlanCompiler, methods, budgets, time_limit: float,
          reuse_layers: bool, charge_stored: bool = False) -> tuple[list[dict], int]:
    """One row per (budget, method): the plan's figures and, when one was found, what it
    compiled to; equal plans are compiled once. Returns the rows and the reference peak.
    ``charge_stored``: first compile the reference plan, as the decorator does for a percentage
    (:meth:`experiments.common.PlanCompiler.charge_stored`)."""
    if charge_stored:
        compiler.charge_stored(time_limit=time_limit)
    reference = solvers.reference_plan(compiler.build.problem, time_limit=time_limit)
    rows, measured = [], {}
    for fraction in budgets:
        budget = int(fraction * reference.peak_bytes)
        for method in methods:
            row = {"method": method, "budget_fraction": fraction, "budget_bytes": budget}
            start = time.perf_counter()
            try:
                plan = solve_plan(compiler.build, budget, method, time_limit=time_limit,
                                  reuse_layers=reuse_layers)
            except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError) as err:
                row.update(feasible=False, status=type(err).__name__)
            else:
                row.update(feasible=True, status=plan.status, fingerprint=plan.fingerprint,
                           solve_seconds=round(time.perf_counter() - start, 2),
                           recomputed_nodes=len(plan.recomputed))
                if plan.fingerprint not in measured:
                    measured[plan.fingerprint] = _measure(compiler, plan)
                row.update(measured[plan.fingerprint])
            print(f"  {fraction:5.0%} {method:14s} " + (
                f"predicted {row['predicted_step_seconds'] * 1e3:.4f} ms, estimated "
                f"{row['estimated_step_seconds'] * 1e3:.4f} ms ({row['step_error']:+.1%}); "
                f"peak {row['predicted_peak_bytes'] / 2**20:.2f} vs "
                f"{row['compiled_peak_bytes'] / 2**20:.2f} MiB" if row["feasible"]
                else row["status"]), file=sys.stderr, flush=True)
            rows.append(row)
    return rows, int(reference.peak_bytes)


def agreement(rows: list[dict]) -> dict:
    """Over the distinct compiled plans: Kendall's tau of predicted vs estimated step times
    (None with fewer than two plans, or where one side gives every plan the same time: no
    ranking to agree with), the median and largest |relative step error|, and how many are
    within TOLERANCE."""
    from scipy.stats import kendalltau

    plans = list({r["fingerprint"]: r for r in rows if r["feasible"]}.values())
    errors = [abs(r["step_error"]) for r in plans]
    out = {"plans": len(plans), "kendall_tau": None, "kendall_p": None,
           "median_abs_step_error": statistics.median(errors) if errors else None,
           "max_abs_step_error": max(errors, default=None),
           "within_tolerance": sum(e <= TOLERANCE for e in errors),
           "median_abs_memory_error": statistics.median(
               abs(r["memory_error"]) for r in plans) if plans else None}
    if len(plans) >= 2:
        tau = kendalltau([r["predicted_step_seconds"] for r in plans],
                         [r["estimated_step_seconds"] for r in plans])
        if not math.isnan(tau.statistic):
            out["kendall_tau"], out["kendall_p"] = float(tau.statistic), float(tau.pvalue)
    return out


def plot(result: dict, path) -> None:
    """Predicted vs estimated step (one point per distinct plan, y = x and the tolerance band),
    and predicted vs compiled peak memory."""
    plt = pyplot()
    plans = list({r["fingerprint"]: r for r in result["rows"] if r["feasible"]}.values())
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.8))
    markers = {"alpa": "o", "alpa+dots": "s", "alpa+megatron": "^", "kiwi": "D"}
    panels = ((axes[0], "estimated_step_seconds", "predicted_step_seconds", 1e3, "ms",
               "step: compiled estimate", "step: predicted (simulator)"),
              (axes[1], "compiled_peak_bytes", "predicted_peak_bytes", 1 / 2**20, "MiB",
               "peak: compiled", "peak: predicted"))
    for ax, x_key, y_key, scale, unit, x_label, y_label in panels:
        for method in dict.fromkeys(r["method"] for r in plans):
            pts = [(r[x_key] * scale, r[y_key] * scale) for r in plans if r["method"] == method]
            ax.scatter(*zip(*pts), marker=markers.get(method, "."), s=22, label=method)
        values = [r[k] * scale for r in plans for k in (x_key, y_key)]
        lo, hi = (min(values) * 0.9, max(values) * 1.1) if values else (0, 1)
        line = np.linspace(lo, hi, 2)
        ax.plot(line, line, color="k", lw=0.8, label="y = x")
        ax.plot(line, line * (1 + TOLERANCE), color="0.6", lw=0.6, ls="--",
                label=f"±{TOLERANCE:.0%}")
        ax.plot(line, line * (1 - TOLERANCE), color="0.6", lw=0.6, ls="--")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"{x_label} ({unit})", fontsize=8)
        ax.set_ylabel(f"{y_label} ({unit})", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    stats = result["agreement"]
    tau = "-" if stats["kendall_tau"] is None else f"{stats['kendall_tau']:.2f}"
    save_figure(fig, f"{result['model']} {result['layers']} layers on {result['mesh']} "
                     f"({result['cluster']}): {stats['plans']} plans, Kendall tau {tau}, "
                     f"median |step error| {stats['median_abs_step_error'] or 0:.1%}", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer MLP, 2 budgets")
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--cluster", default="v100-nvlink")
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS),
                        help="fractions of the reference plan's peak")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--fusion", choices=("compiled", "rules"), default="compiled",
                        help="compile the reference plan first, as the decorator does for a "
                             "percentage: on a mesh `auto` chooses its memory model against that "
                             "compile, on one device the values it stores are charged; or plan "
                             "with the per-operator model's rules alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        model, layers, mesh = QUICK["model"], QUICK["layers"], QUICK["mesh"]
        config, budgets, methods = QUICK["config"], QUICK["budgets"], QUICK["methods"]
    else:
        model, layers, mesh = args.model, args.layers, args.mesh
        config = {k: getattr(args, k) for k in ("hidden", "heads", "seq", "batch", "vocab")}
        budgets, methods = tuple(args.budgets), tuple(args.methods)
    start = time.perf_counter()
    print(f"{model} {layers} layers {config} on {mesh}:", file=sys.stderr, flush=True)
    compiler = PlanCompiler(model, layers, mesh, args.cluster, **config)
    rows, reference_peak = sweep(compiler, methods, budgets, args.time_limit,
                                 reuse_layers=model in TIED_MODELS,
                                 charge_stored=args.fusion == "compiled")
    result = {"study": "cost_agreement", "quick": args.quick, "model": model, "layers": layers,
              "mesh": mesh, "cluster": args.cluster, **config, "methods": list(methods),
              "budgets": list(budgets), "time_limit": args.time_limit, "fusion": args.fusion,
              "memory_model": compiler.build.memory_model,
              "reference_peak_bytes": reference_peak, "tolerance": TOLERANCE,
              "agreement": agreement(rows), "rows": rows,
              "wall_seconds": round(time.perf_counter() - start, 1)}
    plot(result, results_path("cost_agreement.png"))
    write_result("cost_agreement", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
