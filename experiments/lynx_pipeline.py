"""Lynx and DawnPiper: search times, Lynx-HEU against Lynx-OPT, and simulated pipeline
throughput on GPT shapes like Lynx's.

Parts (each row is in the JSON):
1. ``heu_time``: Lynx-HEU's search for one layer of the 7B GPT (micro-batch 8, 1x4 mesh) applied
   to 1..96 layers under a budget that forces recomputation (pooled windows, the default, and
   the per-window program of the paper).
2. ``search_time``: partition + policy search of a 96-layer GPT (GPT-175B shape, fp32) over
   32 stages of a 1x8 H100 mesh, 80 GiB.
3. ``heu_vs_opt``: a 2-layer GPT (1 layer with ``--quick``: Lynx-OPT's staged program grows
   with the square of the operators) planned as one stage by Lynx-HEU and by Lynx-OPT started
   from HEU's plan; simulated step time, OPT's status and bound (Lynx-OPT's gap is against the
   larger of the backend's bound and the step that keeps everything, which no plan with the
   sharding fixed beats). ``heu_vs_opt_synthetic``: the same on
   random 3-layer graphs (4 operators per layer) where OPT is proven optimal.
4. ``throughput``: GPT-1.3B/7B/13B/23B shapes, 4 stages of a 1x4 mesh, 8 micro-batches,
   40 GiB, NVLink and PCIe: even split with full or selective recomputation (Lynx's baselines),
   even split with Lynx-HEU (+recomputation), Lynx partitioning (+all) and DawnPiper's.

Usage: python -m experiments.lynx_pipeline [--quick] [--json] [--opt-time-limit 120]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import numpy as np

import solvers
from experiments.common import (STUDY_GAP, problem_of, pyplot, results_path, save_figure,
                                write_result)
from kiwi_jax.pipeline import model_profile
from solvers import lynx
from solvers.pipeline import partition
from solvers.synthetic import layered_problem

GIB = 2**30
SHAPES = {  # name: (layers, hidden, heads)
    "gpt-1.3b": (24, 2048, 16), "gpt-7b": (32, 4096, 32), "gpt-13b": (40, 5120, 40),
    "gpt-23b": (52, 6144, 48)}
METHODS = (("even", "full"), ("even", "selective"), ("even", "lynx"), ("lynx", "lynx"),
           ("dawnpiper", "lynx"))
DEPTHS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def heu_time(profile, depths, exact_depths) -> list[dict]:
    """Search seconds of one layer's policy for ``depth`` layers held at once (the per-window
    program too at ``exact_depths``)."""
    ops = profile.layer_ops
    held = ops.kept_bytes(ops.needed | ops.pinned)
    rows = []
    for depth in depths:
        budget = 0.5 * depth * held
        for pooled in (True, False) if depth in exact_depths else (True,):
            start = time.perf_counter()
            policy = lynx.heu_policy(ops, budget, layers=depth, pooled=pooled,
                                     forward_windows=True, in_flight=1)
            rows.append({"layers": depth, "pooled": pooled,
                         "search_seconds": time.perf_counter() - start,
                         "status": policy.status.value, "num_vars": policy.num_vars,
                         "on_demand_seconds": policy.on_demand_seconds,
                         "overlapped_seconds": policy.overlapped_seconds,
                         "held_bytes": policy.held_bytes})
        _log(f"heu {depth:3d} layers: " + ", ".join(
            f"{r['search_seconds']:.3f} s {'pooled' if r['pooled'] else 'per window'}"
            for r in rows if r["layers"] == depth))
    return rows


def search_time(profile, stages, micro_batches, budget) -> list[dict]:
    rows = []
    for method in ("even", "lynx", "dawnpiper"):
        result = partition(profile, stages, micro_batches, budget, method=method)
        rows.append({"method": method, "layers": profile.layers, "stages": stages,
                     **result.summary()})
        _log(f"{profile.layers} layers, {method}: {result.search_seconds:.2f} s "
             f"({result.policies_solved} stage policies), fits {result.fits}")
    return rows


def heu_vs_opt(config, mesh, cluster, fractions, time_limit) -> list[dict]:
    build, _ = problem_of("gpt", mesh=mesh, cluster=cluster, **config)
    problem = build.problem
    reference = solvers.reference_plan(problem, time_limit=60)
    keep_all = solvers.simulate(problem, reference.strategy).step_seconds
    rows = []
    for fraction in fractions:
        budget = int(fraction * reference.peak_bytes)
        row = {"fraction": fraction, "budget_bytes": budget, "operators": problem.num_nodes}
        try:
            heu = lynx.lynx_heu(problem, budget, reference.strategy)
        except solvers.InfeasibleBudgetError as err:
            row.update(feasible=False, min_feasible_bytes=err.min_feasible_bytes)
            rows.append(row)
            continue
        opt = lynx.lynx_opt(problem, budget, reference.strategy, warm_start=heu,
                            time_limit=time_limit, mip_gap=STUDY_GAP)
        bound = opt.bound                   # at least the step that keeps everything
        row.update(feasible=True, heu_step_seconds=heu.objective,
                   heu_search_seconds=heu.solve_seconds + heu.build_seconds,
                   opt_step_seconds=opt.objective, opt_status=opt.status.value,
                   opt_gap=opt.gap, opt_bound_seconds=bound, opt_vars=opt.num_vars,
                   opt_seconds=opt.solve_seconds, heu_throughput_vs_opt=opt.objective
                   / heu.objective, heu_throughput_vs_bound=bound / heu.objective,
                   heu_overlapped_seconds=heu.overlapped_recompute_seconds,
                   opt_overlapped_seconds=opt.overlapped_recompute_seconds,
                   reference_step_seconds=reference.objective, keep_all_step_seconds=keep_all)
        _log(f"heu vs opt at {fraction:.0%}: {heu.objective * 1e3:.4f} vs "
             f"{opt.objective * 1e3:.4f} ms ({opt.status.value}, gap {opt.gap:.3%}); HEU at "
             f"{bound / heu.objective:.4f} of the bound's throughput")
        rows.append(row)
    return rows


def heu_vs_opt_synthetic(seeds, layers, width, cut, time_limit) -> list[dict]:
    """Lynx-HEU against a proven Lynx-OPT on random layered graphs small enough for it: the
    budget is the keep-all peak less ``cut`` of the layers' held activations."""
    rows = []
    for seed in seeds:
        problem = layered_problem(layers=layers, seed=seed, width=width)
        strategy = np.zeros(problem.num_nodes, np.int64)
        keep_all = solvers.simulate(problem, strategy)
        held = sum(int(problem.memory[i][0]) for i in np.flatnonzero(problem.recomputable))
        budget = int(keep_all.peak_bytes - cut * held)
        row = {"seed": seed, "operators": problem.num_nodes, "budget_bytes": budget}
        try:
            heu = lynx.lynx_heu(problem, budget, strategy)
        except solvers.InfeasibleBudgetError:
            rows.append({**row, "feasible": False})
            continue
        opt = lynx.lynx_opt(problem, budget, strategy, warm_start=heu, time_limit=time_limit,
                            mip_gap=STUDY_GAP)
        rows.append({**row, "feasible": True, "heu_step_seconds": heu.objective,
                     "opt_step_seconds": opt.objective, "opt_status": opt.status.value,
                     "heu_throughput_vs_opt": opt.objective / heu.objective,
                     "opt_seconds": opt.solve_seconds})
    done = [r for r in rows if r["feasible"]]
    if done:
        _log(f"heu vs opt on {len(done)} random layered graphs: worst "
             f"{min(r['heu_throughput_vs_opt'] for r in done):.4f} of OPT's throughput")
    return rows


def throughput(shapes, clusters, micro_batch_sizes, stages, micro_batches, budget, seq,
               mesh, vocab) -> list[dict]:
    rows = []
    for name, (layers, hidden, heads) in shapes.items():
        for cluster in clusters:
            for micro_batch in micro_batch_sizes:
                profile = model_profile("gpt", layers=layers, mesh=mesh, cluster=cluster,
                                        micro_batch=micro_batch, hidden=hidden, heads=heads,
                                        seq=seq, vocab=vocab)
                results = {}
                for method, policy in METHODS:
                    results[method, policy] = partition(profile, stages, micro_batches, budget,
                                                        method=method, policy=policy)
                base, selective = results["even", "full"], results["even", "selective"]
                for result in results.values():
                    rows.append({"model": name, "cluster": cluster, "micro_batch": micro_batch,
                                 **result.summary(),
                                 "vs_full_recompute": result.throughput / base.throughput
                                 if base.fits and result.fits else None,
                                 "vs_selective": result.throughput / selective.throughput
                                 if selective.fits and result.fits else None})
                best = results["lynx", "lynx"]
                _log(f"{name} {cluster} mbs {micro_batch}: lynx {best.throughput:.3f} "
                     f"samples/s, full {base.throughput:.3f}, selective "
                     f"{selective.throughput:.3f}")
    return rows


def plot(result, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = result["heu_time"]
    for pooled, label in ((True, "pooled windows"), (False, "per window (paper)")):
        pts = [(r["layers"], r["search_seconds"]) for r in rows if r["pooled"] == pooled]
        axes[0].plot(*zip(*pts), marker="o", label=label)
    axes[0].axhline(1.0, color="grey", ls=":", label="1 s target")
    axes[0].set_xlabel("layers")
    axes[0].set_ylabel("Lynx-HEU search (s)")
    axes[0].legend(fontsize=8)
    rows = [r for r in result["throughput"] if r["vs_full_recompute"] is not None]
    labels = sorted({(r["model"], r["cluster"], r["micro_batch"]) for r in rows})
    width = 0.8 / len(METHODS)
    for k, (method, policy) in enumerate(METHODS):
        values = [next((r["vs_full_recompute"] for r in rows if (r["model"], r["cluster"],
                        r["micro_batch"]) == lab and (r["method"], r["policy"]) == (method,
                                                                                   policy)), 0)
                  for lab in labels]
        axes[1].bar(np.arange(len(labels)) + k * width, values, width,
                    label=f"{method} + {policy}")
    axes[1].set_xticks(np.arange(len(labels)) + 0.4,
                       [f"{m}\n{c.split('-')[1]} mbs{b}" for m, c, b in labels], fontsize=6)
    axes[1].set_ylabel("throughput / (even + full recompute)")
    top = max((r["vs_full_recompute"] for r in rows), default=1.0)
    axes[1].set_ylim(0.8, top + 0.12)
    axes[1].legend(fontsize=7, ncol=3, loc="upper center")
    save_figure(fig, "Lynx / DawnPiper (simulated, 4 stages, 8 micro-batches)", path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    parser.add_argument("--opt-time-limit", type=float, default=120.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        tiny = {"hidden": 32, "heads": 2, "seq": 16, "vocab": 64}
        depth_profile = model_profile("gpt", layers=8, mesh="1x2", micro_batch=4, **tiny)
        big = dataclasses.replace(depth_profile, layers=16)        # same layer, deeper
        setup = {"depths": (1, 4, 16), "exact_depths": (1,), "stages": 4, "search_budget": GIB,
                 "opt_config": {"layers": 1, "hidden": 32, "heads": 2, "seq": 16, "batch": 16,
                                "vocab": 64},
                 "opt_mesh": "1x2", "fractions": (0.95,), "opt_time_limit": 5,
                 "synthetic_seeds": range(2),
                 "shapes": {"gpt-tiny": (8, 32, 2)}, "clusters": ("a100-nvlink",),
                 "micro_batch_sizes": (4,), "seq": 16, "vocab": 64, "mesh": "1x2",
                 "budget": 8 * 2**20}
    else:
        depth_profile = model_profile("gpt", layers=32, mesh="1x4", micro_batch=8,
                                      hidden=4096, heads=32, seq=1024)
        big = model_profile("gpt", layers=96, mesh="1x8", cluster="h100", micro_batch=1,
                            hidden=12288, heads=96, seq=1024)
        setup = {"depths": DEPTHS, "exact_depths": DEPTHS, "stages": 32,
                 "search_budget": 80 * GIB,
                 "opt_config": {"layers": 2, "hidden": 64, "heads": 2, "seq": 32,
                                "batch": 32, "vocab": 64},
                 "opt_mesh": "1x4", "fractions": (0.99, 0.97, 0.95, 0.9),
                 "synthetic_seeds": range(20),
                 "opt_time_limit": args.opt_time_limit, "shapes": SHAPES,
                 "clusters": ("a100-nvlink", "a100-pcie"), "micro_batch_sizes": (8, 16),
                 "seq": 1024, "vocab": 51200, "mesh": "1x4", "budget": 40 * GIB}
    result = {"study": "lynx_pipeline", "quick": args.quick,
              "heu_time": heu_time(depth_profile, setup["depths"], setup["exact_depths"]),
              "search_time": search_time(big, setup["stages"], 8, setup["search_budget"]),
              "heu_vs_opt": heu_vs_opt(setup["opt_config"], setup["opt_mesh"], "a100-pcie",
                                       setup["fractions"], setup["opt_time_limit"]),
              "heu_vs_opt_synthetic": heu_vs_opt_synthetic(
                  setup["synthetic_seeds"], 3, 4, 0.5, setup["opt_time_limit"]),
              "throughput": throughput(setup["shapes"], setup["clusters"],
                                       setup["micro_batch_sizes"], 4, 8, setup["budget"],
                                       setup["seq"], setup["mesh"], setup["vocab"])}
    plot(result, results_path("lynx_pipeline.png"))
    write_result("lynx_pipeline", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
