"""Reuse across identical layers: map every operator of a repeated layer to its counterpart in a
reference layer, so the program takes one decision for both.

Tying is a restriction of the search space: every tied plan is a plan of the full program, its
memory is still checked over the whole step, and the tests measure what it costs in step time.

Counterparts are found in three passes:
1. Operators inside layers (``layer >= 0``): operators with the same phase, opcode, strategy
   count, name (digits removed: ``blocks[3]`` ~ ``blocks[0]``, equation tags ``k17`` ~ ``k5``)
   and memory, whose operands and readers in the layer are alike in the same way (structural
   labels, :func:`_structural_labels`), are paired in order with the reference layer's (see
   :func:`_pair_layers`): the first layer of the layer's structure (an encoder's layers copy
   the first encoder layer, a decoder's the first decoder layer). Operators without such a
   counterpart (a misplaced boundary) are not tied.
2. Inputs outside layers (optimizer state: ``mu['blocks'][3]``) are tied to the first input of
   the same name up to digits.
3. Everything else (the optimizer's per-parameter updates carry no layer scope): an operator
   is tied to the first one with the same opcode, strategy count, phase and memory whose
   operands and readers are, slot by slot, alike in the same way, the operators of passes 1
   and 2 standing for their roots (:func:`_outside_labels`). Readers tell apart what operands
   cannot: the bias corrections Adam broadcasts from one scalar to each parameter's shape.
A tie is kept only when both operators have the same strategies, costs and memory.

References:
  Lynx (sec. 4.2): one policy per layer, searched once and applied to every identical layer;
  KIWI (Liu et al.), sec. 4.4 (the solver time of the joint program grows with depth).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["layer_ties", "with_layer_ties", "has_ties", "inner_repeats", "tie_shares"]

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"\d+")


def _same(problem: ShardingProblem, i: int, j: int) -> bool:
    return (problem.strategy_names[i] == problem.strategy_names[j]
            and np.allclose(problem.node_cost(i), problem.node_cost(j), rtol=1e-9, atol=0)
            and np.array_equal(problem.memory[i], problem.memory[j]))


def _structural_labels(problem: ShardingProblem, key, rounds: int) -> list[dict[int, int]]:
    """Per refinement round (0 .. ``rounds``), per operator inside a layer, a label equal for
    structural counterparts. Round 0: its key and per-strategy memory; each further round adds
    the labels of its operands (by slot) and readers inside its layer (Weisfeiler-Lehman
    refinement; operands from outside the layer are all alike)."""
    layer = problem.layer
    inside = [int(i) for i in np.flatnonzero(layer >= 0)]
    operands: dict[int, list[tuple[int, int]]] = {}
    readers: dict[int, list[int]] = {}
    for src, dst, slot in problem.edges:
        operands.setdefault(int(dst), []).append((int(slot), int(src)))
        readers.setdefault(int(src), []).append(int(dst))
    table: dict = {}
    labels = [{i: table.setdefault((key(i), tuple(problem.memory[i].tolist())), len(table))
               for i in inside}]
    for _ in range(rounds):
        label, table = labels[-1], {}
        labels.append({i: table.setdefault((
            label[i],
            tuple(label[o] if layer[o] == layer[i] else -1
                  for _, o in sorted(operands.get(i, []))),
            tuple(sorted(label[u] for u in readers.get(i, []) if layer[u] == layer[i]))),
            len(table)) for i in inside})
    return labels


def _references(problem: ShardingProblem, labels: dict[int, int],
                members: dict[int, list[int]]) -> dict[int, int]:
    """Per layer, the layer it copies: the first earlier layer that shares at least
    ``REPEAT_SHARE`` of its operators' labels (``labels``: round 1 of
    :func:`_structural_labels`), else itself. An encoder's layers copy the first encoder
    layer and a decoder's the first decoder layer."""
    out: dict[int, int] = {}
    kinds: dict[int, collections.Counter] = {}
    for current in sorted(members):
        found = collections.Counter(labels[i] for i in members[current])
        out[current] = next((reference for reference, kind in kinds.items()
                             if sum((found & kind).values())
                             >= REPEAT_SHARE * max(found.total(), kind.total())), current)
        if out[current] == current:
            kinds[current] = found
    return out


def _pair_layers(problem: ShardingProblem, labels, reference: int, tie: np.ndarray) -> None:
    """Tie each layer's operators to its reference layer's (:func:`_references`; the first
    layer of its structure, ``reference`` for that layer's) with the same label, finest labels
    first: a label held by as many operators in both layers pairs them in order; operators
    left over are tried again with the coarser labels of the round before, down to round 1 (an
    operator's key, memory and operands' keys by slot). Round 0 alone (the key) would pair the
    k-th operators of a kind in order, which pairs different operators when a boundary node
    moved from one layer's end to the next one's start."""
    layer = problem.layer
    members: dict[int, list[int]] = {}
    for i in np.flatnonzero(layer >= 0):
        members.setdefault(int(layer[i]), []).append(int(i))
    references = _references(problem, labels[1], members)
    if reference in members:
        references = {k: reference if r == references[reference] else r
                      for k, r in references.items()}
    for current, nodes in members.items():
        if current == references[current]:
            continue
        left, twins_left = list(nodes), list(members[references[current]])
        for label in reversed(labels[1:]):
            groups: dict[int, list[int]] = {}
            for i in left:
                groups.setdefault(label[i], []).append(i)
            twins: dict[int, list[int]] = {}
            for j in twins_left:
                twins.setdefault(label[j], []).append(j)
            paired = set()
            for group, ids in groups.items():
                if len(twins.get(group, ())) == len(ids):
                    for i, j in zip(ids, twins[group]):
                        if _same(problem, i, j):
                            tie[i] = j
                            paired.update((i, j))
            left = [i for i in left if i not in paired]
            twins_left = [j for j in twins_left if j not in paired]
        if left:
            log.info("layer %d: %d of %d operators have no structural counterpart in layer %d; "
                     "they are not tied", current, len(left), len(nodes), references[current])


def _outside_labels(problem: ShardingProblem, tie: np.ndarray) -> np.ndarray:
    """Per node, a label equal for structural counterparts among the operators that passes 1
    and 2 leave alone (outside layers, not inputs: the optimizer's updates, the constants and
    their broadcasts). The others are labelled by their tie's root, so q's kernel and k's are
    different and layer 3's q kernel is layer 0's. The rest start from opcode, strategy count,
    phase and memory and are refined, round by round, by the labels of their operands (by
    slot) and of their readers (with the slot they read at) until no class splits
    (Weisfeiler-Lehman). With the readers, the bias correction Adam broadcasts to a kernel's
    shape is told from the one it broadcasts to another kernel of that shape, and tied to the
    one of the same kernel in the reference layer, whatever its shape. An operator of a layer
    that pass 1 found no counterpart for is one of the rest."""
    n = problem.num_nodes
    untied = tie == np.arange(n)
    untied[tie[~untied]] = False                # the roots of ties are not free
    free = np.flatnonzero(untied & (problem.phase != Phase.PARAM))
    operands: dict[int, list[tuple[int, int]]] = {}
    readers: dict[int, list[tuple[int, int]]] = {}
    for src, dst, slot in problem.edges.tolist():
        operands.setdefault(dst, []).append((slot, src))
        readers.setdefault(src, []).append((dst, slot))
    inputs = {i: [o for _, o in sorted(operands.get(i, []))] for i in free.tolist()}
    label = tie.tolist()                # fixed nodes: their root; the free ones: n + class
    table: dict = {}
    strategies = problem.num_strategies
    for i in inputs:
        label[i] = n + table.setdefault((problem.opcodes[i], int(strategies[i]),
                                         int(problem.phase[i]),
                                         tuple(problem.memory[i].tolist())), len(table))
    classes = len(table)
    while True:
        table, refined = {}, list(label)
        for i, ins in inputs.items():
            refined[i] = n + table.setdefault((
                label[i], tuple(label[o] for o in ins),
                tuple(sorted((label[r], slot) for r, slot in readers.get(i, [])))), len(table))
        label = refined
        if len(table) == classes:
            return np.array(label)
        classes = len(table)


def _tie_alike(problem: ShardingProblem, tie: np.ndarray, label: np.ndarray) -> None:
    """Tie each operator left untied to the first of its label (:func:`_outside_labels`) that
    has the same strategies, costs and memory; the roots of earlier ties stay roots."""
    targets = set(tie[tie != np.arange(len(tie))].tolist())      # no chains of ties
    roots: dict[int, list[int]] = {}
    for i in range(len(tie)):
        if tie[i] != i or i in targets:
            continue
        alike = roots.setdefault(int(label[i]), [])
        twin = next((j for j in alike if _same(problem, i, j)), None)
        if twin is None:
            alike.append(i)
        else:
            tie[i] = twin


def layer_ties(problem: ShardingProblem, reference: int | None = None) -> np.ndarray:
    """Per node, the node whose decisions it copies (itself when untied).

    Args:
      problem: the sharding problem.
      reference: layer whose operators the layers of its structure copy (default: the first
        layer of each structure).
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

    _pair_layers(problem, _structural_labels(problem, key, rounds=3), reference, tie)

    first_of: dict[tuple, int] = {}          # inputs outside layers (optimizer state)
    for i in np.flatnonzero((problem.layer < 0) & (problem.phase == Phase.PARAM)):
        twin = first_of.setdefault(key(i), int(i))
        if twin != i and _same(problem, int(i), twin):
            tie[i] = twin

    _tie_alike(problem, tie, _outside_labels(problem, tie))
    assert (tie[tie] == tie).all()
    return tie


def with_layer_ties(problem: ShardingProblem) -> ShardingProblem:
    """The problem with :attr:`~solvers.problem.ShardingProblem.ties` filled by
    :func:`layer_ties` (what every problem builder returns)."""
    return dataclasses.replace(problem, ties=layer_ties(problem))


def has_ties(tie: np.ndarray) -> bool:
    """Whether a tie map ties anything (the graph has repeated layers)."""
    return bool((tie != np.arange(len(tie))).any())


def inner_repeats(problem: ShardingProblem, tie: np.ndarray) -> np.ndarray:
    """Per node, whether it lies in a repeated layer at least two repeats away from both ends
    of its run (the layers at least ``REPEAT_SHARE`` of whose operators are tied to one
    reference layer).

    Under ties, the bytes alive at a time inside layer k are those of the same time in the
    reference layer, plus what earlier layers keep for the backward pass and what later layers'
    gradients hold (linear in k), plus what the rest of the step holds across the layers. The
    last is the same for every layer but the two ends: the first layer's backward pass frees
    what the embedding left for it, the last's starts beside the head's (on the 4-layer GPT the
    end layers' backward peaks were 0.89 and 0.98 of a budget the second and third reached at
    0.98 and 1.003). So the peak of a run's inner layers is at its second or its second-to-last
    layer, and the tied program needs memory rows only at the two layers of each end. The
    solver checks that claim by replaying every plan, and restores the rows of the layer's
    part (forward, backward or update) the replay finds over the budget.
    """
    layer = problem.layer
    inner = np.zeros(problem.num_nodes, bool)
    runs: dict[int, list[int]] = {}
    for current, shares in tie_shares(problem, tie).items():
        best = max(shares, key=shares.get)
        if shares[best] >= REPEAT_SHARE:
            runs.setdefault(best, []).append(current)
    for members in runs.values():
        for current in sorted(members)[2:-2]:
            inner[layer == current] = True
    return inner


def tie_shares(problem: ShardingProblem, tie: np.ndarray | None = None
               ) -> dict[int, dict[int, float]]:
    """Per layer, in layer order, the share of its operators tied to each layer (``tie``,
    default :attr:`~solvers.problem.ShardingProblem.ties`; to itself: untied), larger shares
    first, the lower layer first among equals."""
    layer = problem.layer
    tie = problem.ties if tie is None else tie
    out: dict[int, dict[int, float]] = {}
    for current in np.unique(layer[layer >= 0]):
        nodes = np.flatnonzero(layer == current)
        twins, count = np.unique(layer[tie[nodes]], return_counts=True)
        order = np.argsort(-count, kind="stable")
        out[int(current)] = {int(twins[k]): float(count[k]) / len(nodes) for k in order}
    return out


REPEAT_SHARE = 0.9
"""Share of a layer's operators tied to a reference layer that makes it a repeat of it."""
