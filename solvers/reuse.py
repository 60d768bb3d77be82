"""Reuse across identical layers: map every operator of a repeated layer to its counterpart in a
reference layer, so the program takes one decision for both.

Tying is a restriction of the search space: every tied plan is a plan of the full program, its
memory is still checked over the whole step, and the tests measure what it costs in step time.

Counterparts are found in two passes:
1. Operators inside layers (``layer >= 0``): the k-th operator of a layer with a given phase,
   opcode, strategy count and name (digits removed: ``blocks[3]`` ~ ``blocks[0]``, equation
   tags ``k17`` ~ ``k5``) is tied to the k-th such operator of the reference layer.
2. Inputs outside layers (optimizer state: ``mu['blocks'][3]``) are tied to the first input of
   the same name up to digits.
3. Everything else (the optimizer's per-parameter updates carry no layer scope), in topological
   order: an operator is tied to an earlier one with the same opcode and strategy count whose
   operands are, slot by slot, the counterparts of its own (hash-consing modulo ties; constants
   and their broadcasts, which have no operands to compare, tie by shape).
A tie is kept only when both operators have the same strategies, costs and memory.

References:
  Lynx (sec. 4.2): one policy per layer, searched once and applied to every identical layer;
  KIWI (Liu et al.), sec. 4.4 (the solver time of the joint program grows with depth).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["layer_ties", "with_layer_ties", "has_ties"]

_DIGITS = re.compile(r"\d+")


def _same(problem: ShardingProblem, i: int, j: int) -> bool:
    return (problem.strategy_names[i] == problem.strategy_names[j]
            and np.allclose(problem.node_cost(i), problem.node_cost(j), rtol=1e-9, atol=0)
            and np.array_equal(problem.memory[i], problem.memory[j]))


def layer_ties(problem: ShardingProblem, reference: int | None = None) -> np.ndarray:
    """Per node, the node whose decisions it copies (itself when untied).

    Args:
      problem: the sharding problem.
      reference: layer whose operators the others copy (default: the first layer).
    """
    n = problem.num_nodes
    tie = np.arange(n)
    k = problem.num_strategies
    names = problem.op_names if problem.op_names else problem.names
    layers = np.unique(problem.layer[problem.layer >= 0])
    if len(layers) < 2:
        return tie
    reference = int(layers[0]) if reference is None else int(reference)

    def key(i):
        return (int(problem.phase[i]), problem.opcodes[i], int(k[i]), _DIGITS.sub("#", names[i]))

    by_layer: dict[int, dict[tuple, list[int]]] = {}
    for i in np.flatnonzero(problem.layer >= 0):
        by_layer.setdefault(int(problem.layer[i]), {}).setdefault(key(i), []).append(int(i))
    ref_groups = by_layer.get(reference, {})
    for layer, groups in by_layer.items():
        if layer == reference:
            continue
        for group_key, nodes in groups.items():
            twins = ref_groups.get(group_key, [])
            if len(twins) != len(nodes):
                continue
            for i, j in zip(nodes, twins):
                if _same(problem, i, j):
                    tie[i] = j

    first_of: dict[tuple, int] = {}          # inputs outside layers (optimizer state)
    for i in np.flatnonzero((problem.layer < 0) & (problem.phase == Phase.PARAM)):
        twin = first_of.setdefault(key(i), int(i))
        if twin != i and _same(problem, int(i), twin):
            tie[i] = twin

    targets = set(tie[tie != np.arange(n)].tolist())       # stay roots: no chains of ties
    operands: dict[int, list[tuple[int, int]]] = {}
    for src, dst, slot in problem.edges:
        operands.setdefault(int(dst), []).append((int(slot), int(src)))
    seen: dict[tuple, int] = {}
    for i in range(n):
        ins = tuple(int(tie[src]) for _, src in sorted(operands.get(i, [])))
        signature = (problem.opcodes[i], int(k[i]), int(problem.phase[i]), ins)
        if tie[i] != i or i in targets:
            continue
        twin = seen.get(signature)
        if twin is not None and _same(problem, i, twin):
            tie[i] = twin
        else:
            seen.setdefault(signature, i)
    assert (tie[tie] == tie).all()
    return tie


def with_layer_ties(problem: ShardingProblem) -> ShardingProblem:
    """The problem with :attr:`~solvers.problem.ShardingProblem.ties` filled by
    :func:`layer_ties` (what every problem builder returns)."""
    return dataclasses.replace(problem, ties=layer_ties(problem))


def has_ties(tie: np.ndarray) -> bool:
    """Whether a tie map ties anything (the graph has repeated layers)."""
    return bool((tie != np.arange(len(tie))).any())
