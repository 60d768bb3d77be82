"""kiwi's plan against the plain step and per-block remat policies, at one budget, on one device.

For a GPT (or encoder) train step on one device, a 1x1 mesh (so a plan decides recomputation
only), this measures each variant's compiled memory (argument + output + temp - alias), the
allocator's peak while it runs (``memory_stats()["peak_bytes_in_use"]``, where the backend
keeps one: GPUs do, the CPU does not) and its step time (median over ``--steps`` steps after
``--warmup``):

  plain             the step under jax.jit
  dots_saveable     every block under jax.checkpoint(policy=dots_saveable)
  nothing_saveable  every block under jax.checkpoint(policy=nothing_saveable)
  kiwi@F            kiwi_jax.optimize with memory_budget = F x the plain step's compiled memory
                    (its search of the solver's budget against the compiled step, at most
                    ``--fit-compiles`` compiles, is reported: ``fit_compiles_spent``,
                    ``fit_ratio`` = compiled / budget, and every trial under ``fit``)
  kiwi@POLICY       the same with memory_budget = POLICY's compiled memory (``--at-baselines``)

and, per budget, which variants fit it. Numerics: each variant's loss and train state after three
steps from the same initial state, against the plain step's (``max_rel_diff``: per leaf, the norm
of the difference over the norm). Every variant runs in a process of its own, so the allocator's
peak is its own; the plans are cached under the work directory.

Usage: python -m experiments.remat_baselines [--quick] [--layers 4 --hidden 256 ...]
       [--budgets 0.8 0.6] [--baselines dots_saveable] [--cluster h100]
       [--at-baselines] [--memory-model operator] [--fit-compiles 6]
       [--matmul-precision highest] [--name NAME] [--json]
Writes results/<NAME>.json and .png (step time against memory, budgets as lines; NAME defaults
to remat_baselines).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from kiwi_jax.fit import FIT_COMPILES
from kiwi_jax.problem import MEMORY_MODELS

BASELINES = ("plain", "dots_saveable", "nothing_saveable")
"""Variants that need no plan; kiwi's are named ``kiwi@<fraction>``."""

NUMERICS_STEPS = 3

QUICK = dict(layers=2, hidden=64, heads=4, seq=128, batch=8, vocab=128, steps=2, warmup=1,
             budgets=[1.0], time_limit=30.0)
"""``--quick``: a GPT small enough for the CPU (seconds per variant)."""


def _config(args) -> dict:
    return dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                batch=args.batch, vocab=args.vocab)


# --------------------------------------------------------------------------- one variant
def _compiled_step(variant: str, ref, args, budget_bytes: int | None, options: dict):
    """``(compiled, placed_args, state_out, extra)`` for one variant."""
    import jax

    from kiwi_jax.compile import compiler_options
    from kiwi_jax.step import carried_state, functionalize

    pure = functionalize(ref.train_step, args)
    if not variant.startswith("kiwi@"):
        compiled = jax.jit(pure.fn, donate_argnums=0).lower(*pure.args).compile(
            compiler_options=compiler_options())
        state_out = carried_state(pure, jax.eval_shape(pure.fn, *pure.args))
        return compiled, pure.args, state_out, {}
    import kiwi_jax

    mesh = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step = kiwi_jax.optimize(ref.train_step, mesh=mesh, memory_budget=budget_bytes,
                             **{"recipes": False, **options})     # kiwi's own plan
    prepared = step.prepare(pure)
    plan = prepared.plan
    extra = {"plan_seconds": prepared.plan_seconds, "compile_seconds": prepared.compile_seconds,
             "cached": prepared.cached, "status": plan.status,
             "predicted_peak_bytes": int(plan.predicted_peak_bytes),
             "predicted_step_seconds": plan.predicted_step_seconds,
             "recomputed": len(plan.recomputed), "operators": len(plan.keep),
             "solver_budget_bytes": plan.solver_budget_bytes,
             "fit_compiles_spent": None if plan.fit is None else plan.fit.compiles,
             "fit_ratio": None if plan.fit is None else plan.fit.ratio,
             "fit": None if plan.fit is None else plan.fit.to_dict()}
    placed = jax.device_put(pure.args, prepared.in_shardings)
    return prepared.compiled, placed, prepared.state_out, extra


def _run_variant(variant: str, model: str, config: dict, budget_bytes: int | None,
                 options: dict, steps: int, warmup: int, workdir: pathlib.Path) -> dict:
    """Compile, check and time one variant in this process; its state after
    NUMERICS_STEPS steps goes to ``workdir/<variant>.npz``."""
    import jax
    import numpy as np

    from hlo_tools.compiled import device_memory
    from kiwi_jax.models import build

    remat = variant if variant in BASELINES[1:] else None
    ref = build(model, **config, remat=remat)
    start = time.perf_counter()
    compiled, placed, state_out, extra = _compiled_step(
        variant, ref, (*ref.init(0), ref.batch(0)), budget_bytes, options)
    seconds = time.perf_counter() - start
    args, losses = list(placed), []

    def one_step():
        outputs = compiled(*args)
        args[0] = outputs[state_out]
        return outputs

    for _ in range(NUMERICS_STEPS):
        losses.append(float(one_step()[1 - state_out]))
    leaves = [np.asarray(x) for x in jax.tree.leaves(args[0])]
    np.savez(workdir / f"{variant}.npz", *leaves)
    for _ in range(warmup):
        jax.block_until_ready(one_step())
    times = []
    for _ in range(steps):
        start_step = time.perf_counter()
        jax.block_until_ready(one_step())
        times.append(time.perf_counter() - start_step)
    memory = device_memory(compiled)
    stats = jax.devices()[0].memory_stats() or {}
    return {"variant": variant, "compiled_peak_bytes": memory.peak_bytes,
            "temp_bytes": memory.temp_bytes, "argument_bytes": memory.argument_bytes,
            "allocator_peak_bytes": stats.get("peak_bytes_in_use"),
            "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
            "step_ms_mean": 1e3 * statistics.fmean(times), "setup_seconds": seconds,
            "losses": losses, "budget_bytes": budget_bytes, **extra}


# --------------------------------------------------------------------------- the study
def _child(variant: str, args, workdir: pathlib.Path, budget_bytes: int | None) -> dict:
    """Run one variant in a fresh process and return its result line."""
    command = [sys.executable, "-m", "experiments.remat_baselines", "--variant", variant,
               "--workdir", str(workdir), *_forwarded(args)]
    if budget_bytes is not None:
        command += ["--budget-bytes", str(budget_bytes)]
    print(f"[remat_baselines] {variant} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} failed (exit {done.returncode}); its output:\n"
                           f"{done.stdout[-4000:]}")
    line = done.stdout.strip().splitlines()[-1]
    print(f"[remat_baselines] {line}", file=sys.stderr, flush=True)    # kept if the study stops
    return json.loads(line)


def _forwarded(args) -> list[str]:
    out = ["--model", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--cluster", args.cluster, "--time-limit", str(args.time_limit),
           "--matmul-precision", args.matmul_precision, "--memory-model", args.memory_model,
           "--fit-compiles", str(args.fit_compiles)]
    for name, value in _config(args).items():
        out += [f"--{name}", str(value)]
    return out


def _state_difference(workdir: pathlib.Path, variant: str) -> float:
    import numpy as np

    from kiwi_jax.verify import max_rel_diff

    def leaves(name):
        with np.load(workdir / f"{name}.npz") as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]

    return max_rel_diff(leaves(variant), leaves("plain"))


def study(args) -> dict:
    import jax

    with tempfile.TemporaryDirectory(prefix="remat_baselines_") as tmp:
        workdir = pathlib.Path(tmp)
        rows = {"plain": _child("plain", args, workdir, None)}
        plain = rows["plain"]
        budgets = {f"{f:g}": int(f * plain["compiled_peak_bytes"]) for f in args.budgets}
        for name in args.baselines:
            rows[name] = _child(name, args, workdir, None)
            if args.at_baselines:
                budgets[name] = rows[name]["compiled_peak_bytes"]
        for fraction, budget in budgets.items():
            rows[f"kiwi@{fraction}"] = _child(f"kiwi@{fraction}", args, workdir, budget)
        for name, row in rows.items():
            if "infeasible" in row:
                continue
            row["max_state_rel_diff"] = _state_difference(workdir, name)
            row["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in
                                           zip(row["losses"], plain["losses"]))
            row["step_time_vs_plain"] = row["step_ms_median"] / plain["step_ms_median"]
            row["fits"] = {f: row["compiled_peak_bytes"] <= b for f, b in budgets.items()}
    device = jax.devices()[0]
    return {"study": args.name, "quick": args.quick,
            "device": f"{device.platform}: {device.device_kind}", "jax": jax.__version__,
            "model": args.model, "config": _config(args), "cluster": args.cluster,
            "matmul_precision": args.matmul_precision, "memory_model": args.memory_model,
            "fit_compiles": args.fit_compiles,
            "steps": args.steps, "warmup": args.warmup, "budgets": budgets,
            "variants": rows}


def plot(result: dict, path) -> None:
    from experiments.common import byte_unit, pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = result["variants"]
    scale, unit = byte_unit(rows["plain"]["compiled_peak_bytes"])
    for name, row in rows.items():
        if "infeasible" in row:
            continue
        x, y = row["compiled_peak_bytes"] / scale, row["step_ms_median"]
        ax.scatter([x], [y], marker="*" if name.startswith("kiwi") else "o", s=60)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for fraction, budget in result["budgets"].items():
        ax.axvline(budget / scale, ls=":", color="grey")
        ax.annotate(f"budget {fraction}", (budget / scale, ax.get_ylim()[0]), rotation=90,
                    fontsize=7, color="grey", xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel(f"compiled memory per device ({unit})")
    ax.set_ylabel("step time, median (ms)")
    config = result["config"]
    save_figure(fig, f"{result['model']} {config['layers']} layers, hidden {config['hidden']}, "
                     f"seq {config['seq']}, batch {config['batch']} on {result['device']}", path)


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=("gpt", "bert"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.8, 0.6],
                        help="kiwi budgets as fractions of the plain step's compiled memory")
    parser.add_argument("--at-baselines", action="store_true",
                        help="also plan kiwi at each remat policy's compiled memory")
    parser.add_argument("--baselines", nargs="*", default=list(BASELINES[1:]),
                        choices=BASELINES[1:], help="remat policies to measure")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cluster", default="h100", help="cost-model preset for kiwi's plans")
    parser.add_argument("--time-limit", type=float, default=120.0, help="solver seconds")
    parser.add_argument("--memory-model", default="auto", choices=MEMORY_MODELS,
                        help="kiwi's memory model (see kiwi_jax.problem.MEMORY_MODELS)")
    parser.add_argument("--fit-compiles", type=int, default=FIT_COMPILES,
                        help="most compiles kiwi's search of the solver budget spends "
                             "(0: no search)")
    parser.add_argument("--matmul-precision", default="default",
                        help="jax_default_matmul_precision: 'default' (TF32 on recent GPUs) or "
                             "'highest' (full fp32, for the numerics)")
    parser.add_argument("--name", default="remat_baselines",
                        help="results/<name>.json and .png")
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT, two timed steps")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--budget-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.variant:
        import jax

        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
        import solvers

        workdir = pathlib.Path(args.workdir)
        options = dict(cluster=args.cluster, time_limit=args.time_limit,
                       memory_model=args.memory_model, fit_compiles=args.fit_compiles,
                       cache_dir=workdir / "plans")
        try:
            row = _run_variant(args.variant, args.model, _config(args), args.budget_bytes,
                               options, args.steps, args.warmup, workdir)
        except solvers.InfeasibleBudgetError as error:
            row = {"variant": args.variant, "budget_bytes": args.budget_bytes,
                   "infeasible": str(error), "min_feasible_bytes": error.min_feasible_bytes}
        print(json.dumps(row))
        return None
    from experiments.common import results_path, write_result

    result = study(args)
    plot(result, results_path(f"{args.name}.png"))
    write_result(args.name, result, print_json=args.json)
    for name, row in result["variants"].items():
        if "infeasible" in row:
            print(f"{name:18s} {row['infeasible']}", file=sys.stderr)
            continue
        search = "" if row.get("fit") is None else \
            f"  {row['fit_compiles_spent']} compiles, {row['fit_ratio']:.3f} of the budget"
        print(f"{name:18s} {row['compiled_peak_bytes'] / 2**20:10.1f} MiB "
              f"{row['step_ms_median']:9.2f} ms ({row['step_time_vs_plain']:.3f}x) "
              f"fits {row['fits']}  state diff {row['max_state_rel_diff']:.1e}{search}",
              file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
