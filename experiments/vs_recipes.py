"""kiwi against the recipes users write by hand, compiled for the same step on one mesh.

The recipes (:mod:`kiwi_jax.recipes`): data parallel (``dp``), FSDP / ZeRO-3 (``fsdp``),
Megatron tensor parallel (``tp``) and both on the two mesh axes (``fsdp+tp``), each with every
block under no checkpoint, ``dots_saveable`` or ``nothing_saveable``: twelve compiled steps.
kiwi: ``kiwi_jax.optimize`` at a range of memory budgets (by default the recipes' own compiled
memories: can kiwi run faster in the memory a recipe takes?), each plan fitted to the compiled
step with at most ``--fit-compiles`` compiles. Per row: the compiled per-device memory
(argument + output + temp - alias), the estimated step of the compiled program
(``kiwi_jax.estimate.compiled_cost`` with the cluster's figures: the same prices for every
row) and, for kiwi's rows, whether the compiled step fits its budget. Everything is compiled
with abstract arguments (nothing runs).

Usage: python -m experiments.vs_recipes [--json] [--quick] [--zoo llama | --model gpt]
       [--layers 4 --dim 64 ... --size image_size=224] [--mesh 2x4] [--cluster v100-nvlink]
       [--recipes dp fsdp ...]
       [--budgets 2MiB 4MiB | --kiwi-points 4] [--fit-compiles 2] [--time-limit 60]
       [--memory-model auto] [--order auto] [--name vs_recipes]
       python -m experiments.vs_recipes --replot results/vs_recipes.json   # its PNG again
Writes results/<NAME>.json and results/<NAME>.png (compiled memory against estimated step:
recipes as labelled points, kiwi as a curve); prints the JSON as the last line with ``--json``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from experiments import zoo  # noqa: E402
from experiments.common import pyplot, results_path, save_figure, write_result  # noqa: E402
from kiwi_jax.apply import ORDERS  # noqa: E402
from kiwi_jax.cluster import MeshSpec, parse_bytes  # noqa: E402
from kiwi_jax.compare import Comparison, Row, compare, draw  # noqa: E402
from kiwi_jax.models import build  # noqa: E402
from kiwi_jax.problem import MEMORY_MODELS  # noqa: E402

SIZE_FLAGS = ("layers", "dim", "hidden", "heads", "kv_heads", "seq", "batch", "vocab", "width")
"""Size options passed to the model (those it takes: ``dim``/``kv_heads`` for the zoo
Llama, ``hidden`` for the reference GPT)."""

QUICK = {"model": "mlp", "sizes": {"layers": 5, "width": 16, "batch": 8},
         "recipes": ["dp", "fsdp/nothing_saveable"], "budgets": ["4MiB"], "fit_compiles": 1}
"""``--quick``: the reference MLP of width 16, two recipes and one kiwi budget (seconds)."""


def add_model_arguments(parser) -> None:
    """The model options: ``--zoo NAME`` or ``--model NAME``, and the sizes
    (:data:`SIZE_FLAGS`, read back by :func:`model_sizes`)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--zoo", default="llama", choices=zoo.MODELS, help="a zoo model")
    which.add_argument("--model", default=None, help="a reference model (gpt, bert, mlp)")
    for flag in SIZE_FLAGS:
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    parser.add_argument("--size", action="append", default=[], type=_size, metavar="NAME=N",
                        help="any other size the model takes, repeatable (the zoo ViT's "
                             "depth, mlp_dim, image_size, patch_size)")


def _size(item: str) -> tuple[str, int]:
    """One ``--size NAME=N`` as ``(NAME, N)``; the parser's error otherwise."""
    key, _, value = item.partition("=")
    if not key.isidentifier() or not value.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"--size {item!r}: expected NAME=N, an integer size "
                                         "such as image_size=224")
    return key, int(value)


def model_sizes(args) -> dict:
    """The sizes given on the command line (:func:`add_model_arguments`)."""
    return {**{f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f) is not None},
            **dict(args.size)}


def model_step(args, sizes: dict):
    """``(name, train_step, abstract args)`` of the chosen model."""
    if args.model:
        ref = build(args.model, **sizes)
        return args.model, ref.train_step, (*ref.abstract_init(), ref.abstract_batch())
    step, example = zoo.make(args.zoo, **sizes)
    return args.zoo, step, example


def _progress(row) -> None:
    state = row.error.splitlines()[0][:80] if row.error else \
        f"{row.compiled_bytes / 2**20:.3f} MiB, {row.step_seconds * 1e3:.4f} ms"
    print(f"  {row.name}: {state} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)


def _figure(result, title: str, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    draw(result, ax)
    save_figure(fig, title, path)


def replot(path) -> None:
    """Draw the PNG of a result file again (beside it)."""
    data = json.loads(pathlib.Path(path).read_text())
    fields = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in data["rows"]]
    result = Comparison(tuple(r for r in rows if r.kind == "recipe"),
                        tuple(r for r in rows if r.kind == "kiwi"), data["cluster"])
    _figure(result, f"{data['model']} on {data['mesh']}: recipes vs kiwi (compiled)",
            pathlib.Path(path).with_suffix(".png"))


def run(args, sizes: dict, recipes, budgets, fit_compiles: int, name: str,
        print_json: bool, max_budgets: int | None = None) -> dict:
    model, step, example = model_step(args, sizes)
    shape = MeshSpec.parse(args.mesh).shape
    mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:shape[0] * shape[1]],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    start = time.perf_counter()
    result = compare(step, example, mesh, recipes=recipes, budgets=budgets,
                     cluster=args.cluster, fit_compiles=fit_compiles,
                     time_limit=args.time_limit, progress=_progress,
                     max_budgets=max_budgets, memory_model=args.memory_model,
                     order=args.order)
    print(f"{model} {sizes} on a {args.mesh} mesh ({args.cluster}): compiled memory per device "
          "and estimated step of the compiled program")
    print(result.table())
    rows = [{**r.to_dict()} for r in (*result.recipes, *result.kiwi)]
    out = {"study": name, "model": model, "sizes": sizes, "mesh": args.mesh,
           "command": " ".join(["python -m experiments.vs_recipes", *sys.argv[1:]]),
           "cluster": args.cluster, "fit_compiles": fit_compiles,
           "memory_model": args.memory_model, "order": args.order, "rows": rows,
           "wall_seconds": round(time.perf_counter() - start, 1)}
    _figure(result, f"{model} on {args.mesh}: recipes vs kiwi (compiled)",
            results_path(f"{name}.png"))
    write_result(name, out, print_json=print_json)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--cluster", default="v100-nvlink")
    parser.add_argument("--recipes", nargs="+", default=None,
                        help="SHARDING[/POLICY] names (default all twelve)")
    parser.add_argument("--budgets", nargs="+", default=None,
                        help="kiwi's budgets as sizes (default the recipes' compiled memories)")
    parser.add_argument("--kiwi-points", type=int, default=None,
                        help="without --budgets: at most this many of the recipes' compiled "
                        "memories as kiwi's budgets, smallest to largest (0: no kiwi rows)")
    parser.add_argument("--fit-compiles", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    parser.add_argument("--memory-model", default="auto", choices=MEMORY_MODELS,
                        help="kiwi's memory model (kiwi_jax.optimize's memory_model)")
    parser.add_argument("--order", default="auto", choices=ORDERS,
                        help="the schedule kiwi plans in (kiwi_jax.optimize's order)")
    parser.add_argument("--name", default="vs_recipes", help="results/<name>.json and .png")
    parser.add_argument("--quick", action="store_true",
                        help="the reference MLP of width 16, two recipes, one budget")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--replot", metavar="JSON", help="draw a result file's PNG again")
    args = parser.parse_args(argv)
    if args.replot:
        replot(args.replot)
        return {}
    logging.basicConfig(level=logging.ERROR)
    if args.quick:
        args.model = QUICK["model"]
        return run(args, QUICK["sizes"], QUICK["recipes"],
                   [parse_bytes(b) for b in QUICK["budgets"]], QUICK["fit_compiles"],
                   args.name, args.json)
    sizes = model_sizes(args)
    budgets = [parse_bytes(b) for b in args.budgets] if args.budgets else None
    return run(args, sizes, args.recipes, budgets, args.fit_compiles, args.name, args.json,
               args.kiwi_points)


if __name__ == "__main__":
    main()
