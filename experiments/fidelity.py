"""Fidelity: the planner's memory and step time against what XLA compiles, over models, meshes
and the plans the solver returns.

For every model (the reference GPT, encoder and MLP, and the user-style zoo of
:mod:`experiments.zoo`) and mesh, the plans of a budget sweep (``kiwi`` by default, at fractions
of the reference plan's peak) are applied and compiled on the simulated devices, exactly as
:mod:`experiments.cost_agreement` does for one model (its ``sweep`` and ``agreement`` are used
here). One point per distinct plan:

- memory: the simulator's predicted per-device peak against the compiled step's argument +
  output + temp - alias (``memory_error`` = predicted / compiled - 1); the target is 10%;
- time: the simulator's step against the compiled step's estimate
  (:func:`kiwi_jax.estimate.compiled_cost`; ``step_error``), and per model and mesh the Kendall
  tau of the two rankings.

The summary lists every point outside the memory target. Failures (a model that does not
trace, a budget with no plan) are rows with their reason; the study never stops on one.

Usage: python -m experiments.fidelity [--json] [--quick] [--models gpt llama ...]
       [--meshes 1x1 1x8 2x4 4x2] [--budgets 1.0 0.9 0.8 0.7] [--methods kiwi]
       [--time-limit 30] [--name fidelity]
Writes results/<NAME>.json (after every model and mesh) and results/<NAME>.png.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from experiments import zoo  # noqa: E402
from experiments.common import PlanCompiler, pyplot, results_path, save_figure, write_result  # noqa: E402,E501
from experiments.cost_agreement import agreement, sweep  # noqa: E402

REFERENCE = {
    "gpt": dict(layers=2, hidden=256, heads=4, seq=128, batch=16, vocab=2048),
    "bert": dict(layers=2, hidden=256, heads=4, seq=128, batch=16, vocab=2048),
    "mlp": dict(layers=4, width=512, in_dim=256, out_dim=256, batch=256),
}
"""The reference models and their sizes (those of :mod:`experiments.cost_agreement`)."""
MODELS = (*REFERENCE, *zoo.MODELS)
MESHES = ("1x1", "1x8", "2x4", "4x2")
BUDGETS = (1.0, 0.9, 0.8, 0.7)
MEMORY_TARGET = 0.10
"""|predicted / compiled - 1| the memory model is meant to stay within (issue target)."""
QUICK = {"models": ("mlp", "llama"), "meshes": ("2x4",), "budgets": (1.0, 0.8)}


def _compiler(model: str, mesh: str, cluster: str) -> PlanCompiler:
    if model in REFERENCE:
        config = dict(REFERENCE[model])
        return PlanCompiler(model, config.pop("layers"), mesh, cluster, **config)
    step, args = zoo.make(model)          # the zoo's own sizes, abstract arrays
    return PlanCompiler.for_step(step, args, mesh, cluster)


def _group(model: str, mesh: str, budgets, methods, time_limit: float, cluster: str,
           charge_stored: bool = True) -> dict:
    """Sweep one model on one mesh; every failure is recorded, not raised."""
    start = time.perf_counter()
    group = {"model": model, "mesh": mesh}
    try:
        compiler = _compiler(model, mesh, cluster)
        rows, reference_peak = sweep(compiler, methods, budgets, time_limit, reuse_layers=True,
                                     charge_stored=charge_stored)
    except Exception as error:  # a model that does not trace or plan is a row
        group.update(error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    else:
        for row in rows:
            if row["feasible"]:
                row["memory_within_target"] = abs(row["memory_error"]) <= MEMORY_TARGET
        group.update(nodes=int(compiler.build.problem.num_nodes),
                     reference_peak_bytes=reference_peak, rows=rows,
                     agreement=agreement(rows))
    group["wall_seconds"] = round(time.perf_counter() - start, 1)
    return group


def summary(groups: list[dict]) -> dict:
    """Over every distinct plan of every group: how many meet the memory target, the points
    that miss it, and the step-time agreement (per-group taus, pooled errors)."""
    points = [(g["model"], g["mesh"], r) for g in groups if "rows" in g
              for r in {r["fingerprint"]: r for r in g["rows"] if r["feasible"]}.values()]
    memory = [abs(r["memory_error"]) for _, _, r in points]
    step = [abs(r["step_error"]) for _, _, r in points]
    taus = [g["agreement"]["kendall_tau"] for g in groups
            if "agreement" in g and g["agreement"]["kendall_tau"] is not None]
    misses = [{"model": m, "mesh": mesh, "method": r["method"],
               "budget_fraction": r["budget_fraction"],
               "memory_error": round(r["memory_error"], 4)}
              for m, mesh, r in points if not r["memory_within_target"]]
    return {"points": len(points), "memory_within_target": len(points) - len(misses),
            "median_abs_memory_error": statistics.median(memory) if memory else None,
            "max_abs_memory_error": max(memory, default=None),
            "median_abs_step_error": statistics.median(step) if step else None,
            "median_kendall_tau": statistics.median(taus) if taus else None,
            "groups_failed": [{"model": g["model"], "mesh": g["mesh"], "error": g["error"]}
                              for g in groups if "error" in g],
            "memory_misses": misses}


def plot(result: dict, path) -> None:
    """Per model (x), each plan's memory error and step error (y, %), marked by mesh, with the
    targets as bands."""
    plt = pyplot()
    groups = [g for g in result["groups"] if "rows" in g]
    models = list(dict.fromkeys(g["model"] for g in groups))
    meshes = list(dict.fromkeys(g["mesh"] for g in groups))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.8 * len(models) + 2), 6.4), sharex=True)
    panels = ((axes[0], "memory_error", "predicted / compiled memory - 1 (%)", MEMORY_TARGET),
              (axes[1], "step_error", "predicted / estimated step - 1 (%)", 0.15))
    markers = "osD^v<>"
    for ax, key, label, band in panels:
        for k, mesh in enumerate(meshes):
            xs, ys = [], []
            for g in groups:
                if g["mesh"] != mesh:
                    continue
                for r in {r["fingerprint"]: r for r in g["rows"] if r["feasible"]}.values():
                    xs.append(models.index(g["model"]) + (k - (len(meshes) - 1) / 2) * 0.15)
                    ys.append(100 * r[key])
            if xs:
                ax.scatter(xs, ys, s=16, marker=markers[k % len(markers)], label=mesh)
        ax.axhspan(-100 * band, 100 * band, color="0.9", zorder=0)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7, ncol=len(meshes))
    axes[1].set_xticks(range(len(models)), models, rotation=30, fontsize=7)
    stats = result["summary"]
    save_figure(fig, f"{stats['memory_within_target']} of {stats['points']} plans within "
                     f"{MEMORY_TARGET:.0%} of the compiled memory; median |step error| "
                     f"{(stats['median_abs_step_error'] or 0):.1%}", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the MLP and the Llama on 2x4")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--meshes", nargs="+", default=list(MESHES))
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS),
                        help="fractions of the reference plan's peak")
    parser.add_argument("--methods", nargs="+", default=["kiwi"])
    parser.add_argument("--cluster", default="v100-nvlink")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    parser.add_argument("--name", default="fidelity", help="results/<NAME>.json and .png")
    parser.add_argument("--fusion", choices=("compiled", "rules"), default="compiled",
                        help="one device: charge what the compiled reference plan stores, as "
                             "the decorator does for a percentage, or the fusion rules alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    models, meshes, budgets = ((QUICK["models"], QUICK["meshes"], QUICK["budgets"])
                               if args.quick else (args.models, args.meshes, args.budgets))
    start = time.perf_counter()
    result = {"study": "fidelity", "quick": args.quick, "cluster": args.cluster,
              "methods": list(args.methods), "budgets": list(budgets),
              "time_limit": args.time_limit, "memory_target": MEMORY_TARGET,
              "fusion": args.fusion, "groups": []}
    for model in models:
        for mesh in meshes:
            print(f"{model} on {mesh}:", file=sys.stderr, flush=True)
            group = _group(model, mesh, budgets, args.methods, args.time_limit, args.cluster,
                           charge_stored=args.fusion == "compiled")
            if "error" in group:
                print(f"  failed: {group['error']}", file=sys.stderr, flush=True)
            result["groups"].append(group)
            result["summary"] = summary(result["groups"])
            write_result(args.name, result)
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    if result["summary"]["points"]:
        plot(result, results_path(f"{args.name}.png"))
    write_result(args.name, result, print_json=args.json)
    return result


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
