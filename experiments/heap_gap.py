"""Where kiwi's predicted peak and the compiled one part: the live set, or XLA's heap packing.

For each zoo model, mesh and budget, kiwi's plan is solved (``kiwi_jax.optimize`` with no
search of the solver's budget, so the plan is the solver's first) and compiled, and its peak is
split three ways:

- ``predicted``: the simulator's peak (what the solver's memory rows bound);
- ``live``: the bytes XLA's buffers hold at the peak of its heap
  (:func:`hlo_tools.compiled.live_at_peak`: the buffer assignment's values over their live
  ranges): what the plan really holds at once;
- ``compiled``: ``memory_analysis``'s argument + output + temp - alias, where temp is the heap
  XLA's buffer assignment packs every temporary into.

``live / predicted`` is the error of the live-set model; ``compiled / live`` is what the
packing adds (holes between buffers of different lifetimes). For comparison, ``packed`` is
the simulator's own buffers (:func:`solvers.simulator.buffers`; the step's outputs left out,
as they alias the donated arguments) packed the way XLA's default heap does
(:func:`best_fit_heap`), plus the inputs: what the packing would add on the simulator's
stage-level lifetimes.

Usage: python -m experiments.heap_gap [--models llama vit ...] [--meshes 2x4]
       [--budgets 100% 80%] [--memory-model auto] [--order auto]
       [--time-limit 60] [--name heap_gap] [--json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kiwi_jax  # noqa: E402
from experiments import zoo  # noqa: E402
from experiments.common import write_result  # noqa: E402
from experiments.zoo_study import _mesh  # noqa: E402
from hlo_tools.compiled import live_at_peak  # noqa: E402
from kiwi_jax.apply import ORDERS  # noqa: E402
from kiwi_jax.compile import compiler_options  # noqa: E402
from kiwi_jax.problem import MEMORY_MODELS  # noqa: E402
from solvers.phase import Phase  # noqa: E402
from solvers.simulator import buffers  # noqa: E402

ALIGNMENT = 64
"""Bytes every heap offset is rounded up to (XLA's CPU buffer alignment)."""


def best_fit_heap(held, alignment: int = ALIGNMENT) -> int:
    """The size of a heap that packs ``held`` (``(bytes, first, last)`` buffers) the way XLA's
    ``GlobalDecreasingSizeBestFitHeap`` does: largest first (the longer-lived first among
    equal sizes), each at the smallest free gap, among the buffers placed that overlap its
    lifetime, that holds it, or above them all."""
    placed = []                         # (first, last, offset, size)
    heap = 0
    for nbytes, first, last in sorted(held, key=lambda b: (-b[0], b[1] - b[2])):
        size = -(-nbytes // alignment) * alignment
        taken = sorted((o, o + s) for f, la, o, s in placed if f <= last and first <= la)
        best, best_gap, top = None, None, 0
        for low, high in taken:
            gap = low - top
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = top, gap
            top = max(top, high)
        offset = top if best is None else best
        placed.append((first, last, offset, size))
        heap = max(heap, offset + size)
    return heap


def cell(name: str, mesh: str, budget: str, time_limit: float,
         memory_model: str = "auto", order: str = "auto") -> dict:
    """One model, mesh and budget: the plan's peak three ways."""
    row = {"model": name, "mesh": mesh, "budget": budget, "memory_model": memory_model,
           "order": order}
    step, args = zoo.make(name, abstract=False, seed=0)
    try:
        prepared = kiwi_jax.optimize(step, mesh=_mesh(mesh), memory_budget=budget,
                                     time_limit=time_limit, cache_dir=False, recipes=False,
                                     fit_compiles=0, memory_model=memory_model,
                                     order=order).lower(*args)
    except Exception as error:  # every failure is a row
        return row | {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    problem, plan = prepared.build.problem, prepared.plan
    memory = prepared.applied.memory
    live = sum(b.nbytes for b in live_at_peak(prepared.jitted.lower(*prepared.traced.pure.args),
                                              compiler_options()))
    inputs = int(problem.memory_of(plan.strategy)[problem.phase == Phase.PARAM].sum())
    outputs = set(np.flatnonzero(problem.is_output).tolist())
    held = [(nbytes, first, last)            # the outputs' own copies alias the arguments
            for nbytes, first, last in buffers(problem, plan.strategy, plan.recompute_at)
            if not (last >= problem.num_nodes and first in outputs)]
    packed = inputs + best_fit_heap(held)
    predicted, compiled = int(plan.predicted_peak_bytes), int(memory.peak_bytes)
    return row | {
        "budget_bytes": int(plan.budget_bytes), "status": plan.status,
        "recomputed_nodes": len(plan.recomputed), "predicted_bytes": predicted,
        "live_bytes": int(live), "compiled_bytes": compiled, "temp_bytes": int(memory.temp_bytes),
        "packed_bytes": int(packed), "live_over_predicted": round(live / predicted, 3),
        "compiled_over_live": round(compiled / live, 3),
        "compiled_over_predicted": round(compiled / predicted, 3),
        "packed_over_predicted": round(packed / predicted, 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "vit", "mixer", "moe", "resnet"],
                        choices=zoo.MODELS)
    parser.add_argument("--meshes", nargs="+", default=["2x4"])
    parser.add_argument("--budgets", nargs="+", default=["100%", "80%"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--memory-model", default="auto", choices=MEMORY_MODELS)
    parser.add_argument("--order", default="auto", choices=ORDERS)
    parser.add_argument("--name", default="heap_gap", help="results/<name>.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    start = time.perf_counter()
    result = {"study": "heap_gap", "jax": jax.__version__, "time_limit": args.time_limit,
              "rows": []}
    for mesh in args.meshes:
        for model in args.models:
            for budget in args.budgets:
                row = cell(model, mesh, budget, args.time_limit, args.memory_model,
                           args.order)
                result["rows"].append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)
                result["wall_seconds"] = round(time.perf_counter() - start, 1)
                write_result(args.name, result)
    write_result(args.name, result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
