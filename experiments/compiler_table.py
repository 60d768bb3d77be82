"""Predicted vs compiled collectives for whole train steps under one fixed strategy assignment.

The assignment is data parallelism found by propagation: every input that is a model parameter
or optimizer state is replicated, every batch input is split along its first dimension over all
devices, and each other operator (in topological order) takes the strategy that minimises its
own cost plus the resharding from its operands' chosen strategies (then refined by three rounds
that also count the resharding to its users). The plan is applied (a sharding constraint on
every planned value, input and output shardings) and compiled on 8 simulated CPU devices (2x4
mesh), and the
partitioned HLO's collectives are compared, by kind, with the ones the enumerator predicts
(the operators' own collectives plus the resharding on every edge).

Usage: python -m experiments.compiler_table [--json] [--markdown docs/compiler_proof.md]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import write_result  # noqa: E402
from hlo_tools.compiled import collectives  # noqa: E402
from hlo_tools.graph import Phase  # noqa: E402
from kiwi_jax.apply import (applied_function, in_program_order, node_specs,  # noqa: E402
                            trace_for_planning)
from kiwi_jax.models import build  # noqa: E402
from kiwi_jax.plan import by_kind, predicted_comms  # noqa: E402
from kiwi_jax.problem import build_problem  # noqa: E402
from kiwi_jax.step import functionalize  # noqa: E402

MODELS = {
    "mlp": dict(layers=7, width=256, in_dim=256, out_dim=256, batch=64),
    "gpt-1layer": dict(layers=1, hidden=128, heads=4, seq=64, batch=16, vocab=512),
}


def data_parallel_assignment(built, batch_leaves: set[int]) -> list[int]:
    """Greedy propagation from replicated parameters and batch-split inputs, then three rounds of
    iterated conditional modes (each node re-picks given its operands and users)."""
    graph, strategies, problem = built.graph, built.strategies, built.problem
    incoming = collections.defaultdict(list)
    for e, (src, dst, _slot) in enumerate(problem.edges):
        incoming[int(dst)].append((e, int(src)))
    choice: list[int] = []
    outgoing = collections.defaultdict(list)
    for e, (src, dst, _slot) in enumerate(problem.edges):
        outgoing[int(src)].append((e, int(dst)))
    for node in graph.nodes:
        options = strategies[node.id]
        if node.phase == Phase.PARAM:
            position = graph.parameters.index(node.id)
            want = ((0, 1),) + ((),) * (node.shape.rank - 1) if position in batch_leaves and \
                node.shape.rank and node.shape.dims[0] % 8 == 0 else ((),) * node.shape.rank
            choice.append(next(i for i, s in enumerate(options) if s.out == want))
            continue
        cost = problem.node_cost(node.id).copy()
        for e, src in incoming[node.id]:
            cost += problem.resharding[e][choice[src]]
        choice.append(int(np.argmin(cost)))
    for _ in range(3):  # iterated conditional modes: also count the edges to the users
        for node in graph.nodes:
            if node.phase == Phase.PARAM:
                continue
            cost = problem.node_cost(node.id).copy()
            for e, src in incoming[node.id]:
                cost += problem.resharding[e][choice[src]]
            for e, dst in outgoing[node.id]:
                cost += problem.resharding[e][:, choice[dst]]
            choice[node.id] = int(np.argmin(cost))
    return choice


def compare(name: str, overrides: dict) -> dict:
    ref = build(name.split("-")[0], **overrides)
    pure = functionalize(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()))
    traced = trace_for_planning(pure, traced_order=in_program_order(8))
    built = build_problem(traced.graph, "2x4", "v100-nvlink", merge=False)
    batch_start = len(jax.tree.leaves(pure.args[:-1]))
    choice = data_parallel_assignment(
        built, set(range(batch_start, len(jax.tree.leaves(pure.args)))))
    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    fn, in_shardings, out_shardings = applied_function(
        traced, node_specs(built.strategies, choice), (), mesh)
    compiled = jax.jit(fn, in_shardings=in_shardings,
                       out_shardings=out_shardings).lower(*pure.args).compile()
    found = collectives(compiled.as_text(), np.arange(8).reshape(2, 4))
    return {"model": name, "config": overrides, "operators": len(traced.graph),
            "predicted": by_kind(predicted_comms(built, choice)),
            "compiled": by_kind(found)}


def markdown(rows) -> str:
    lines = ["| model | kind | predicted count | compiled count | predicted bytes | "
             "compiled bytes |", "|---|---|---|---|---|---|"]
    for row in rows:
        for kind in sorted(set(row["predicted"]) | set(row["compiled"])):
            p = row["predicted"].get(kind, {"count": 0, "bytes": 0})
            c = row["compiled"].get(kind, {"count": 0, "bytes": 0})
            lines.append(f"| {row['model']} | {kind} | {p['count']} | {c['count']} | "
                         f"{p['bytes']:,} | {c['bytes']:,} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = [compare(name, overrides) for name, overrides in MODELS.items()]
    table = markdown(rows)
    print(table)
    result = {"study": "compiler_table", "rows": rows}
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    write_result("compiler_table", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
