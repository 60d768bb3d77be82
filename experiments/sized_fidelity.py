"""The memory models at sizes where activations dominate: each model's keep-everything plan,
predicted against compiled.

The fidelity study (:mod:`experiments.fidelity`) runs the zoo at its default sizes, where a
block's weights, the layout copies of small tensors and the heap's alignment are a large part
of the peak. A user's model is larger, and there the attention scores, the MLP's activations
and the elementwise chains between them decide the peak. This study plans the reference GPT
(hidden 1024, sequence 1024) and the zoo at comparable sizes (:data:`SIZES`) on a mesh and
compiles each memory model's reference plan (the fastest plan, lowest peak among those:
:func:`solvers.reference_plan`, everything kept), as the decorator applies it:

- ``operator``: every operator's output charged (what ``memory_model="auto"`` uses on a mesh);
- ``fused``: the values XLA's fusion rules fuse into their readers hold nothing, and what the
  compiled reference stores is charged (:func:`kiwi_jax.problem.with_stored`; what ``auto``
  uses on one device).

Each cell: ``predicted / compiled - 1``, compiled = argument + output + temp - alias per
device. Abstract arrays only: nothing is allocated, each compile takes 5-60 s on 2 cores.

Usage: python -m experiments.sized_fidelity [--models gpt llama ...] [--meshes 2x4]
       [--memory-models operator fused] [--small] [--name sized_fidelity] [--json]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

import kiwi_jax.problem  # noqa: E402
import solvers  # noqa: E402
from experiments import zoo  # noqa: E402
from experiments.common import PlanCompiler, write_result  # noqa: E402
from experiments.fidelity import REFERENCE  # noqa: E402

SIZES = {
    "gpt": {"layers": 2, "hidden": 1024, "heads": 16, "seq": 1024, "batch": 8, "vocab": 8192},
    "llama": {"layers": 4, "dim": 1024, "heads": 16, "kv_heads": 4, "batch": 8, "seq": 512,
              "vocab": 8192},
    "vit": {"depth": 4, "dim": 768, "heads": 12, "mlp_dim": 3072, "batch": 16,
            "image_size": 224, "patch_size": 16},
    "mixer": {"blocks": 4, "hidden_dim": 512, "tokens_mlp_dim": 256, "channels_mlp_dim": 2048,
              "batch": 16, "image_size": 224, "patch_size": 16},
    "moe": {"layers": 2, "dim": 512, "heads": 8, "hidden": 2048, "experts": 4, "batch": 8,
            "seq": 512, "vocab": 8192},
    "encdec": {"layers": 2, "emb_dim": 512, "heads": 8, "mlp_dim": 2048, "batch": 8,
               "seq": 256, "vocab": 8192},
    "llama_scan": {"layers": 4, "dim": 1024, "heads": 16, "kv_heads": 4, "batch": 8,
                   "seq": 512, "vocab": 8192},
    "linen_scan": {"layers": 4, "dim": 1024, "heads": 16, "mlp_dim": 4096, "batch": 8,
                   "seq": 512, "vocab": 8192},
}
"""Per model, sizes at which activations dominate its peak (``gpt``: the reference GPT of
:mod:`kiwi_jax.models`; the others: the zoo's)."""

MEMORY_MODELS = tuple(m for m in kiwi_jax.problem.MEMORY_MODELS if m != "auto")
"""The memory models compared: ``auto`` is one of them on each mesh."""


def _sizes(model: str, large: bool = True) -> dict:
    """``model``'s sizes: :data:`SIZES`, or with ``large=False`` the fidelity study's (the
    reference GPT's of :mod:`experiments.fidelity`, the zoo's defaults)."""
    if large:
        return SIZES[model]
    return dict(REFERENCE["gpt"]) if model == "gpt" else {}


def _step(model: str, large: bool = True):
    """``(train_step, abstract args)`` of ``model`` at :func:`_sizes`."""
    if model == "gpt":
        from kiwi_jax.models import build

        ref = build("gpt", **_sizes(model, large))
        return ref.train_step, (*ref.abstract_init(), ref.abstract_batch())
    return zoo.make(model, abstract=True, **_sizes(model, large))


def cell(model: str, mesh: str, memory_model: str, large: bool = True) -> dict:
    """One model, mesh and memory model: its reference plan predicted and compiled."""
    from kiwi_jax.plan import plan_from_solution

    start = time.perf_counter()
    step, args = _step(model, large)
    compiler = PlanCompiler.for_step(step, args, mesh, memory_model=memory_model)
    compiler.charge_stored()
    reference = solvers.reference_plan(compiler.build.problem)
    applied = compiler.compile(plan_from_solution(compiler.build, reference,
                                                  reference.peak_bytes))
    compiled = int(applied.memory.peak_bytes)
    return {"model": model, "mesh": mesh, "memory_model": memory_model,
            "predicted_bytes": int(reference.peak_bytes), "compiled_bytes": compiled,
            "memory_error": round(reference.peak_bytes / compiled - 1, 4),
            "program": applied.program, "seconds": round(time.perf_counter() - start, 1)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--meshes", nargs="+", default=["2x4"])
    parser.add_argument("--memory-models", nargs="+", default=list(MEMORY_MODELS),
                        choices=MEMORY_MODELS)
    parser.add_argument("--small", action="store_true",
                        help="the fidelity study's sizes instead of SIZES (the zoo's defaults)")
    parser.add_argument("--name", default="sized_fidelity", help="results/<name>.json")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result = {"study": "sized_fidelity", "jax": jax.__version__,
              "sizes": {m: _sizes(m, not args.small) for m in args.models}, "rows": []}
    print(f"{'model':<11} {'mesh':<5} " + " ".join(f"{m:>9}" for m in args.memory_models),
          file=sys.stderr)
    for mesh in args.meshes:
        for model in args.models:
            errors = []
            for memory_model in args.memory_models:
                row = cell(model, mesh, memory_model, not args.small)
                result["rows"].append(row)
                errors.append(f"{100 * row['memory_error']:+8.1f}%")
                result["wall_seconds"] = round(time.perf_counter() - start, 1)
                write_result(args.name, result)
            print(f"{model:<11} {mesh:<5} " + " ".join(errors), file=sys.stderr, flush=True)
    write_result(args.name, result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
