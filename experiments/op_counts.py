"""Operators per encoder depth: the analogue of KIWI's Table 2.

Counts the HLO operators of the BERT-style encoder train step (KIWI's layer config: hidden 5120,
40 heads, batch 16, fp32, sequence 1024; abstract shapes, nothing allocated) at depths 1, 4, 8,
12, 16 and 20, in three ways: forward + backward operators (KIWI's count), the same plus the
optimizer update, and every node including the step's inputs.

Usage: python -m experiments.op_counts [--json] [--depths 1 4 8] [--quick]
"""

from __future__ import annotations

import argparse
import time

from experiments.common import KIWI_TABLE2, write_result
from kiwi_jax.frontend import trace_step
from kiwi_jax.models import build

DEFINITION = ("forward_backward: HLO instructions of the forward and backward pass after "
              "inlining calls and dropping dead code (tuples and get-tuple-element resolved away); "
              "with_optimizer: plus the optax Adam update; all_nodes: plus the step's inputs "
              "(parameters, optimizer state, batch)")


def count(depth: int) -> dict:
    ref = build("bert", preset="kiwi", layers=depth)
    start = time.perf_counter()
    _, graph = trace_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch())
    phases = graph.phase_counts()
    fb = phases["forward"] + phases["backward"]
    return {"layers": depth, "forward_backward": fb,
            "with_optimizer": fb + phases["optimizer"], "all_nodes": len(graph),
            "forward": phases["forward"], "backward": phases["backward"],
            "optimizer": phases["optimizer"], "inputs": phases["param"],
            "kiwi_table2": KIWI_TABLE2.get(depth), "lower_seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="*", default=[1, 4, 8, 12, 16, 20])
    parser.add_argument("--quick", action="store_true", help="depths 1 and 4 only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    depths = [1, 4] if args.quick else args.depths
    rows = []
    for depth in depths:
        row = count(depth)
        rows.append(row)
        print(f"{depth:3d} layers: {row['forward_backward']:6d} fwd+bwd, "
              f"{row['with_optimizer']:6d} with optimizer, {row['all_nodes']:6d} nodes "
              f"(KIWI: {row['kiwi_table2']})")
    per_layer = None
    if len(rows) >= 2:
        per_layer = (rows[-1]["forward_backward"] - rows[0]["forward_backward"]) / (
            rows[-1]["layers"] - rows[0]["layers"])
    result = {"study": "op_counts", "definition": DEFINITION, "rows": rows,
              "forward_backward_per_layer": per_layer}
    write_result("op_counts", result, print_json=args.json)
    return result


if __name__ == "__main__":
    main()
