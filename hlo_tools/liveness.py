"""KIWI's liveness quantities of a train-step graph, and which values XLA never stores.

XLA fuses elementwise operators, broadcasts and reshapes into the loops of their readers: such a
value is computed inside every reader and holds no buffer; what stays alive instead are the
values it reads, until its last reader runs. :func:`fused_values` predicts those values from the
graph with the rules of XLA's loop fusion (an elementwise-like producer whose readers are all
loop-fusible is fused into them; an expensive one only when it has a single reader, since fusing
it would duplicate it), and :func:`held_operands` resolves them: per node, the stored values it
needs alive. KIWI's liveness quantities are computed on those held operands.

References:
  KIWI (Liu et al.), sec. 3.2: z_i (eq. 2), live_i (eq. 10), X_i (eq. 5), L_i (eq. 6), Y_i (eq. 7).
  XLA: ``InstructionFusion`` (``IsExpensive``: no duplication of expensive producers) and the
  CPU backend's ``CpuInstructionFusion`` (loop fusion of elementwise-like producers).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hlo_tools.graph import OpGraph, Phase

__all__ = ["Liveness", "liveness", "fused_values", "held_operands", "ELEMENTWISE"]

ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder", "and",
    "or", "xor", "not", "negate", "abs", "exponential", "exponential-minus-one", "log",
    "log-plus-one", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sign", "floor", "ceil",
    "round-nearest-even", "round-nearest-afz", "compare", "select", "clamp", "convert", "copy",
    "is-finite", "atan2", "cosine", "sine", "tan", "erf", "bitcast-convert", "popcnt",
    "shift-left", "shift-right-logical", "shift-right-arithmetic", "reduce-precision", "real",
    "imag", "expm1", "log1p",
})
EXPENSIVE = frozenset({
    "divide", "remainder", "power", "exponential", "exponential-minus-one", "expm1", "log",
    "log-plus-one", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "erf", "atan2",
    "cosine", "sine", "tan",
})
"""Elementwise operators XLA does not duplicate into several readers."""
FUSED_PRODUCERS = ELEMENTWISE | {"broadcast", "reshape", "bitcast", "iota", "constant"}
"""Operators whose values XLA can compute inside their readers' loops."""
LOOP_READERS = ELEMENTWISE | {"broadcast", "reshape", "bitcast", "transpose", "reduce",
                              "concatenate", "slice", "pad"}
"""Readers that XLA emits as loops, into which a producer can be fused."""


@dataclasses.dataclass(frozen=True)
class Liveness:
    """Per-node liveness arrays, indexed by node id (topological order). KIWI's sets X_t, L_t
    and Y_t keyed by these arrays are :meth:`solvers.problem.ShardingProblem.sets`."""

    z: np.ndarray
    """bool: forward node read by at least one backward (or optimizer) node (KIWI's z_i)."""
    live: np.ndarray
    """int: index of the last reader (KIWI's live_i); |V| for step outputs; the node itself when
    it has no reader."""
    fwd_last_use: np.ndarray
    """int: for forward nodes, the last forward reader (or the node itself): the node belongs to
    L_t for t = fwd_last_use; -1 for other nodes."""
    first_bwd_use: np.ndarray
    """int: for forward nodes with z, the first backward reader: the node belongs to X_t for that
    t; -1 otherwise."""


def fused_values(graph: OpGraph) -> np.ndarray:
    """bool per node: a value XLA fuses into all its readers and never stores (see the module
    notes). Inputs, step outputs and values without readers are stored."""
    fused = np.zeros(len(graph), bool)
    for node in graph.nodes:
        users = graph.users[node.id]
        if (node.phase == Phase.PARAM or node.is_output or not users
                or node.opcode not in FUSED_PRODUCERS
                or any(graph.nodes[u].opcode not in LOOP_READERS for u in users)):
            continue
        fused[node.id] = len(users) == 1 or node.opcode not in EXPENSIVE
    return fused


def held_operands(graph: OpGraph, fused: np.ndarray) -> list[list[int]]:
    """Per node, the stored values that must be alive when it runs: its operands, each fused
    one (``fused``, see :func:`fused_values`) replaced, transitively, by the values it reads."""
    held: list[list[int]] = []
    for node in graph.nodes:                         # topological: operands come first
        out: list[int] = []
        for op in node.operands:
            out.extend(held[op] if fused[op] else [op])
        held.append(list(dict.fromkeys(out)))
    return held


def liveness(graph: OpGraph, held: list[list[int]] | None = None) -> Liveness:
    """Compute KIWI's liveness arrays for a graph; ``held``: per node the values it reads
    (:func:`held_operands`; None: its operands)."""
    n = len(graph)
    if held is not None:
        readers: list[list[int]] = [[] for _ in range(n)]
        for node, values in enumerate(held):
            for v in values:
                readers[v].append(node)
        users = [tuple(sorted(set(r))) for r in readers]
    else:
        users = graph.users
    z = np.zeros(n, bool)
    live = np.arange(n)
    fwd_last = np.full(n, -1)
    first_bwd = np.full(n, -1)
    for node in graph.nodes:
        node_users = users[node.id]
        if node_users:
            live[node.id] = node_users[-1]
        if node.is_output:
            live[node.id] = n
        if node.phase != Phase.FORWARD:
            continue
        later = [u for u in node_users
                 if graph.nodes[u].phase in (Phase.BACKWARD, Phase.OPTIMIZER)]
        forward = [u for u in node_users if graph.nodes[u].phase == Phase.FORWARD]
        fwd_last[node.id] = forward[-1] if forward else node.id
        if later:
            z[node.id] = True
            first_bwd[node.id] = later[0]
    return Liveness(z=z, live=live, fwd_last_use=fwd_last, first_bwd_use=first_bwd)
