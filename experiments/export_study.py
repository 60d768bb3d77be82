"""A plan exported to a hand-written step against the decorator's step of the same plan.

For every zoo model, mesh and budget: the decorator plans, applies and compiles the step
(``kiwi_jax.optimize``, as a user would); its plan is exported (``OptimizedStep.export``:
the arguments' PartitionSpecs by path, a ``jax.checkpoint`` policy per layer) and put on the
step from outside (``PlanExport.apply``: each block under its layer's policy, its boundary
constrained), jitted with the exported input shardings, the state donated, and compiled
(``kiwi_jax.export.compile_exported``, as the decorator compiles it to compare). Per cell:
both compiled peaks
(argument + output + temp - alias), their ratio and each against the budget, the plan's
predicted peak, both compiled-cost estimates (``kiwi_jax.compiled_cost``: XLA's FLOPs and bytes,
collectives priced with the cluster's figures), what the policies save and recompute, and the
exported step's loss at its third step against the plain jitted step's. Models whose layers run
in a scan get the policy on the scan's body (one for every layer), and their exported step
keeps the scan.

Both steps are compiled with the decorator's compiler options (on the CPU backend, CSE would
otherwise merge a recomputation with its original; see DESIGN.md).

Usage: python -m experiments.export_study [--json] [--models vit llama ...]
       [--meshes 1x1 2x4] [--budgets 100% 90% 80%] [--name export_study]
Writes results/<NAME>.json after every cell and prints the JSON as the last line with --json.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kiwi_jax  # noqa: E402
from experiments import zoo  # noqa: E402
from experiments.common import write_result  # noqa: E402
from experiments.zoo_study import _error, _mesh  # noqa: E402
from hlo_tools.compiled import device_memory  # noqa: E402
from kiwi_jax.export import compile_exported  # noqa: E402
from kiwi_jax.step import functionalize  # noqa: E402

CLUSTER = "v100-nvlink"
MODELS = ("llama", "vit", "mixer", "resnet", "encdec", "moe", "llama_scan", "linen_scan")
"""The zoo's models."""


def _loss(result) -> float:
    """The loss of a step's result (NNX: ``(metrics or loss, state)``; Linen: ``(state,
    metrics)``)."""
    for part in (result if isinstance(result, (tuple, list)) else (result,)):
        if isinstance(part, dict) and "loss" in part:
            return float(part["loss"])
        if hasattr(part, "shape") and part.shape == ():
            return float(part)
    raise ValueError("no loss among the step's outputs")


def _last_loss(step, args, state_out: int, steps: int = 3) -> float:
    """The loss of the last of ``steps`` steps from ``args`` (the first's is the forward pass
    alone, which a checkpoint policy does not change; some zoo schedules warm up from a zero
    learning rate, so the second's is too)."""
    state = args[0]
    for _ in range(steps):
        result = step(state, *args[1:])
        state = result[state_out]
    return _loss(result)


def cell(name: str, mesh_text: str, budget: str) -> dict:
    row = {"model": name, "mesh": mesh_text, "budget": budget}
    start = time.perf_counter()
    mesh = _mesh(mesh_text)
    try:
        step, args = zoo.make(name)
        optimized = kiwi_jax.optimize(step, mesh=mesh, memory_budget=budget, cache_dir=False,
                                      recipes=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = optimized.lower(*args)
        export = optimized.export()
    except Exception as error:  # every failure is a row
        row.update(error=_error("plan", error))
        return row
    plan = prepared.plan
    decorator = prepared.applied.compiled
    row.update(
        budget_bytes=int(plan.budget_bytes), predicted_peak_bytes=int(plan.predicted_peak_bytes),
        decorator_peak_bytes=int(device_memory(decorator).peak_bytes),
        decorator_step_seconds=kiwi_jax.compiled_cost(decorator, mesh, CLUSTER).step_seconds,
        layers=len(export.layers),
        saved_names=sum(len(p.names) for p in export.layers),
        saved_operations=sum(len(p.operations) for p in export.layers),
        recomputed=sum(p.recomputed for p in export.layers),
        ambiguous=sum(len(p.ambiguous) for p in export.layers))
    try:
        step, concrete = zoo.make(name, abstract=False)
        applied = compile_exported(step, concrete, mesh, export)
        compiled, exported = applied.compiled, int(applied.memory.peak_bytes)
        row.update(
            export_peak_bytes=exported,
            export_over_decorator=exported / row["decorator_peak_bytes"],
            export_over_budget=exported / row["budget_bytes"],
            decorator_over_budget=row["decorator_peak_bytes"] / row["budget_bytes"],
            export_step_seconds=kiwi_jax.compiled_cost(compiled, mesh, CLUSTER).step_seconds)
        plain_step, plain_args = zoo.make(name, abstract=False)
        plain = functionalize(plain_step, plain_args)
        expected = _last_loss(jax.jit(plain.fn), plain.args, applied.state_out)
        got = _last_loss(compiled, functionalize(step, concrete).args, applied.state_out)
        row["loss_rel_diff"] = abs(got - expected) / max(abs(expected), 1e-30)
    except Exception as error:  # every failure is a row
        row.update(error=_error("export", error))
    row["wall_seconds"] = round(time.perf_counter() - start, 2)
    return row


def _progress(row: dict) -> str:
    where = f"  {row['model']:8s} {row['mesh']:4s} {row['budget']:>5s}"
    if "export_peak_bytes" not in row:
        return f"{where} FAILED ({row['error']['type']}: {row['error']['message'][:90]})"
    return (f"{where} decorator {row['decorator_peak_bytes']:,} B "
            f"({row['decorator_over_budget']:.3f} x budget), export "
            f"{row['export_peak_bytes']:,} B ({row['export_over_budget']:.3f}; "
            f"{row['export_over_decorator']:.3f} x decorator); step estimate "
            f"{row['export_step_seconds'] / row['decorator_step_seconds']:.3f} x; "
            f"{row['ambiguous']} ambiguous; loss diff {row['loss_rel_diff']:.1e} "
            f"[{row['wall_seconds']:.0f} s]")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--meshes", nargs="+", default=["1x1", "2x4"])
    parser.add_argument("--budgets", nargs="+", default=["100%", "90%", "80%"])
    parser.add_argument("--name", default="export_study")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"study": "export_study", "models": options.models, "meshes": options.meshes,
              "budgets": options.budgets, "cluster": CLUSTER, "jax": jax.__version__,
              "rows": []}
    for mesh in options.meshes:
        for model in options.models:
            for budget in options.budgets:
                row = cell(model, mesh, budget)
                result["rows"].append(row)
                print(_progress(row), file=sys.stderr, flush=True)
                result["wall_seconds"] = round(time.perf_counter() - start, 1)
                write_result(options.name, result)
    ratios = [r["export_over_decorator"] for r in result["rows"] if "export_over_decorator" in r]
    result["within_2_percent"] = int(sum(abs(r - 1) <= 0.02 for r in ratios))
    result["median_export_over_decorator"] = float(np.median(ratios)) if ratios else None
    write_result(options.name, result, print_json=options.json)
    return result


if __name__ == "__main__":
    main()
