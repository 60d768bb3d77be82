"""Bandwidth sweep (KIWI Fig. 3): the 4-layer KIWI-config decoder on a (1, 4) mesh with links
1x, 10x and 100x slower than NVLink; every method over the budget sweep, and how much kiwi
recomputes at each bandwidth.

Step times are normalised by the fastest no-limit ``alpa`` plan at full bandwidth, so the cost
of slower links shows; budgets are fractions of each bandwidth's own reference peak.

Usage: python -m experiments.bandwidth_sweep [--json] [--quick] [--step 0.05] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import solvers
from experiments.common import (TIED_MODELS, budget_sweep, overhead_axes, problem_of, pyplot,
                                results_path, save_figure, write_result)

SLOWDOWNS = (1, 10, 100)
QUICK = {"model": "mlp", "layers": 2, "mesh": "1x4",
         "config": {"batch": 256, "width": 128, "in_dim": 128, "out_dim": 128}}


def _bandwidth(model, layers, mesh, config, slowdown, step, time_limit, base) -> dict:
    cluster = "v100-nvlink" if slowdown == 1 else f"v100-nvlink@{slowdown}x"
    start = time.perf_counter()
    print(f"links {slowdown}x slower:", file=sys.stderr, flush=True)
    build, _ = problem_of(model, layers, mesh, cluster=cluster, **config)
    problem = build.problem
    reference = solvers.reference_plan(problem, time_limit=time_limit)
    base = base or reference.objective
    rows = budget_sweep(problem, reference, step=step, time_limit=time_limit,
                        reuse_layers=model in TIED_MODELS)
    for row in rows:
        row.update(slowdown=slowdown, cluster=cluster)
        if row["feasible"]:
            row["normalised_to_full_bandwidth"] = row["step_seconds"] / base
        print(f"{slowdown:>4}x {row['budget_fraction']:7.2%} {row['method']:14s} "
              + (f"{row['normalised_overhead']:.4f} recomputed {row['recomputed_nodes']:4d} "
                 f"({row['recomputed_bytes'] / 2**20:,.1f} MiB)" if row["feasible"]
                 else row["status"]), flush=True)
    return {"slowdown": slowdown, "cluster": cluster, "operators": problem.num_nodes,
            "reference_step_seconds": reference.objective,
            "reference_peak_bytes": int(reference.peak_bytes),
            "wall_seconds": round(time.perf_counter() - start, 1), "rows": rows}


def plot(sweeps: list[dict], path) -> None:
    """A panel per bandwidth (step time over the full-bandwidth reference) and one with kiwi's
    recomputed bytes against the budget."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(sweeps) + 1, figsize=(3.0 * (len(sweeps) + 1), 2.9))
    for ax, sweep in zip(axes, sweeps):
        rows = [dict(r, normalised_overhead=r.get("normalised_to_full_bandwidth"))
                for r in sweep["rows"]]
        overhead_axes(ax, rows, f"links {sweep['slowdown']}x slower",
                      sweep["reference_peak_bytes"])
        ax.set_ylabel("step / alpa no limit at 1x", fontsize=8)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for sweep in sweeps:
        pts = sorted((r["budget_fraction"], r["recomputed_bytes"] / 2**30) for r in sweep["rows"]
                     if r["method"] == "kiwi" and r["feasible"])
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="D", ms=3, label=f"{sweep['slowdown']}x")
    ax.set_title("kiwi: recomputed bytes", fontsize=9)
    ax.set_xlabel("budget / reference peak", fontsize=8)
    ax.set_ylabel("GiB recomputed per device", fontsize=8)
    ax.invert_xaxis()
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    save_figure(fig, "4-layer decoder on (1, 4), slower links (KIWI Fig. 3)", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer MLP, 25%% steps")
    parser.add_argument("--step", type=float, default=0.05)
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        setup, step = QUICK, 0.25
    else:
        setup = {"model": "gpt", "layers": 4, "mesh": "1x4", "config": {"preset": "kiwi"}}
        step = args.step
    sweeps, base = [], None
    for slowdown in SLOWDOWNS:
        sweeps.append(_bandwidth(setup["model"], setup["layers"], setup["mesh"],
                                 setup["config"], slowdown, step, args.time_limit, base))
        base = sweeps[0]["reference_step_seconds"]
    result = {"study": "bandwidth_sweep", "quick": args.quick, "model": setup["model"],
              "layers": setup["layers"], "mesh": setup["mesh"], "time_limit": args.time_limit,
              "sweeps": sweeps, "rows": [r for s in sweeps for r in s["rows"]]}
    plot(sweeps, results_path("bandwidth_sweep.png"))
    write_result("bandwidth_sweep", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
