"""Mesh sweep (KIWI Fig. 2): simulated overhead against the per-device budget for alpa,
alpa+dots, alpa+megatron and kiwi, per model and device mesh.

The 4-layer encoder (``bert``) and decoder (``gpt``) with KIWI's layer config (hidden 5120, 40
heads, seq 1024, batch 16, fp32) are traced with abstract arrays. For every mesh the budgets run
from the reference peak (the fastest ``alpa`` plan with no limit) down past the point where
every method fails; each method's smallest feasible budget is a point of its curve. The y value
is the simulated step time over the reference's (KIWI: overhead relative to Alpa with no
memory limit). The transformers' solves use layer reuse (identical layers share decisions;
the 100% point shows what that costs against the untied reference).

The ``compiled`` section does what the paper could not: the same sweep at a size that compiles
in seconds here, each plan applied and compiled by XLA on the simulated devices, and its
compiled per-device memory recorded next to the predicted one.

Usage: python -m experiments.mesh_sweep [--json] [--quick] [--models gpt bert]
       [--meshes 1x8 2x4 ...] [--step 0.05] [--time-limit 60] [--compiled-meshes 2x4 4x2]
(``--meshes`` with no value runs only the compiled section; ``--compiled-meshes`` with no
value skips it.)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import solvers  # noqa: E402
from experiments.common import (TIED_MODELS, PlanCompiler, budget_sweep, byte_unit,  # noqa: E402
                                overhead_axes, problem_of, pyplot, results_path, save_figure,
                                write_result)

MESHES = ("1x8", "2x4", "4x2", "8x1", "1x4", "2x2")
COMPILED_CONFIG = {"hidden": 256, "heads": 4, "seq": 128, "batch": 8}
"""The size the compiled section uses: the demo's GPT (a compile takes seconds)."""
QUICK_CONFIG = {"batch": 256, "width": 128, "in_dim": 128, "out_dim": 128}
"""``--quick``: a 2-layer MLP (seconds per solve; no attention, so alpa+megatron is alpa)."""
QUICK_MESH = "1x4"
"""``--quick``'s mesh: 9 s for the study alone, 19 s on 2x2."""
PAPER_MIN_BUDGET_GB = {("bert", "2x4"): 5.1, ("bert", "4x2"): 3.8, ("gpt", "2x4"): 6.8,
                       ("gpt", "4x2"): 4.9}
"""KIWI sec. 4.2: the smallest budgets only kiwi solved (GB per device)."""
TITLE = "Simulated overhead vs per-device budget (KIWI Fig. 2)"
COMPILED_TITLE = "Plans compiled by XLA: lines predicted, x = compiled per-device peak"


def _study(model, layers, mesh, config, step, time_limit, compiler=None) -> dict:
    start = time.perf_counter()
    print(f"{model} {layers} layers on {mesh}:", file=sys.stderr, flush=True)
    if compiler is None:
        build, _ = problem_of(model, layers, mesh, **config)
    else:
        build = compiler.build
    problem = build.problem
    reference = solvers.reference_plan(problem, time_limit=time_limit)
    rows = budget_sweep(problem, reference, step=step, time_limit=time_limit,
                        reuse_layers=model in TIED_MODELS,
                        on_plan=compiler and (lambda m, b, sol: compiler.compiled_memory(sol, b)))
    for row in rows:
        print(f"{model} {mesh} {row['budget_bytes'] / 2**20:9.2f} MiB {row['method']:14s} "
              + (f"{row['normalised_overhead']:.4f}" if row["feasible"] else row["status"])
              + (f"  compiled {row['compiled_peak_bytes'] / 2**20:.2f} MiB vs predicted "
                 f"{row['peak_bytes'] / 2**20:.2f}" if "compiled_peak_bytes" in row else ""),
              flush=True)
    kiwi_min = next((r["min_feasible_bytes"] for r in rows if r["method"] == "kiwi"), None)
    others = [r["min_feasible_bytes"] for r in rows if r["method"] != "kiwi"]
    return {"model": model, "layers": layers, "mesh": mesh, **config,
            "operators": problem.num_nodes, "reference_step_seconds": reference.objective,
            "reference_peak_bytes": int(reference.peak_bytes),
            "kiwi_min_feasible_bytes": kiwi_min,
            "baselines_min_feasible_bytes": min((b for b in others if b), default=None),
            "paper_kiwi_min_budget_gb": PAPER_MIN_BUDGET_GB.get((model, mesh)),
            "wall_seconds": round(time.perf_counter() - start, 1),
            "rows": [{"model": model, "mesh": mesh, **r} for r in rows]}


def plot(studies: list[dict], path, title: str) -> None:
    """One panel per (model, mesh): overhead against budget, a line per method."""
    plt = pyplot()
    meshes = list(dict.fromkeys(s["mesh"] for s in studies))
    models = list(dict.fromkeys(s["model"] for s in studies))
    fig, axes = plt.subplots(len(models), len(meshes), squeeze=False,
                             figsize=(2.6 * len(meshes) + 0.5, 2.4 * len(models) + 0.6))
    names = {"gpt": "decoder", "bert": "encoder"}
    for ax in axes.flat:
        ax.axis("off")
    for s in studies:
        ax = axes[models.index(s["model"])][meshes.index(s["mesh"])]
        ax.axis("on")
        overhead_axes(ax, s["rows"], f"{names.get(s['model'], s['model'])} {s['mesh']}",
                      s["reference_peak_bytes"])
        scale = byte_unit(s["reference_peak_bytes"])[0]
        for row in s["rows"]:
            if "compiled_peak_bytes" in row:
                ax.plot(row["compiled_peak_bytes"] / scale, row["normalised_overhead"], "x",
                        color="k", ms=4)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, title, path)


def replot() -> dict:
    """The PNGs of the JSON files in the results folder."""
    result = {}
    for name, part, title in (("mesh_sweep", "studies", TITLE), ("mesh_sweep_compiled",
                                                               "compiled", COMPILED_TITLE)):
        path = results_path(f"{name}.json")
        if path.exists():
            result[part] = json.loads(path.read_text())[part]
            plot(result[part], results_path(f"{name}.png"), title)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer MLP on 1x4, 25%% steps, compiled")
    parser.add_argument("--models", nargs="*", default=["gpt", "bert"])
    parser.add_argument("--meshes", nargs="*", default=list(MESHES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--step", type=float, default=0.05, help="budget step (fraction)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--compiled-meshes", nargs="*", default=["2x4", "4x2"],
                        help="meshes of the compiled section (none: skip it)")
    parser.add_argument("--replot", action="store_true",
                        help="draw the PNGs again from the JSON files (e.g. of a partial run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.replot:
        return replot()
    result = {"study": "mesh_sweep", "quick": args.quick, "time_limit": args.time_limit}
    if args.quick:
        quick = _study("mlp", 2, QUICK_MESH, QUICK_CONFIG, 0.25, args.time_limit,
                       PlanCompiler("mlp", 2, QUICK_MESH, **QUICK_CONFIG))
        result["studies"], result["compiled"] = [quick], [quick]
    else:
        result["studies"] = []
        for mesh in args.meshes:
            for model in args.models:
                result["studies"].append(_study(model, args.layers, mesh, {"preset": "kiwi"},
                                                args.step, args.time_limit))
                # written after every mesh and model: the full sweep takes hours on 2 cores
                write_result("mesh_sweep", {**result, "partial": True})
        result["compiled"] = [_study(model, 2, mesh, COMPILED_CONFIG, 0.1, args.time_limit,
                                     PlanCompiler(model, 2, mesh, **COMPILED_CONFIG))
                              for model in args.models for mesh in args.compiled_meshes]
    result["rows"] = [r for s in result["studies"] for r in s["rows"]]
    if result["studies"]:
        plot(result["studies"], results_path("mesh_sweep.png"), TITLE)
    if result["compiled"]:
        plot(result["compiled"], results_path("mesh_sweep_compiled.png"), COMPILED_TITLE)
    # each part keeps its own file, so the two can be run (and re-run) separately
    if result["compiled"] and not args.quick:
        write_result("mesh_sweep_compiled", {**result, "studies": [], "rows": []},
                     print_json=args.json and not result["studies"])
    if result["studies"]:
        write_result("mesh_sweep", {**result, "partial": False}, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
