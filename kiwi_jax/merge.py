"""Follower merging: nodes that follow an operand share that operand's strategy variable.

An elementwise, convert, transpose or reshape node whose operand offers at least as many
strategies can take, for each strategy of the operand, a strategy with no resharding on the edge
between them. Merging it makes its strategy a function of the operand's: the solver then has one
variable for the pair instead of two and one resharding matrix less. Node-level costs, memory and
keep/recompute decisions are untouched; only ``leader`` and ``follow`` of the problem change.

The merge fixes layouts the solver then cannot choose: after an all-reduced gradient or a
replicated parameter the cheapest free strategy of a follower is the most split one (a slice
costs no resharding), so the weight gradients' transposes and Adam's update run split, and the
new state is gathered back at a price. A second rule, :func:`merge_followers` with ``pieces``,
leaves those layouts to the solver (docs/cost_model.md, "Update chains in their operand's
spec"); its program is larger, and the decorator solves it as a second program where memory
does not bind (:meth:`kiwi_jax.optimize.OptimizedStep._free_layouts`).

References:
  Alpa (Zheng et al., OSDI 2022), sec. 4.2 and ``CostGraph::Simplify`` in XLA's auto-sharding:
  merge a node into the node it follows and re-index the resharding costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kiwi_jax.strategies import ELEMENTWISE
from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["merge_followers", "FOLLOWER_OPCODES", "LAYOUT_OPCODES"]

FOLLOWER_OPCODES = ELEMENTWISE | {"transpose", "reshape", "bitcast"}
LAYOUT_OPCODES = frozenset({"transpose", "reshape", "bitcast", "convert"})
"""The operators that only lay a value out; in the backward pass, the rule with ``pieces``
leaves them unmerged."""


def merge_followers(problem: ShardingProblem,
                    pieces: Sequence[np.ndarray] | None = None) -> ShardingProblem:
    """Merge follower nodes into their leaders.

    For each candidate node (in topological order) the operand with the most strategies is the one
    it may follow. Node i follows operand j when, for every strategy ``a`` of j's leader, some
    strategy of i needs no resharding from j's strategy ``follow[j][a]``; among those the cheapest
    (c_i + d_i) is taken.

    Args:
      pieces: per node, the number of distinct shards of each strategy's output. Given, the
        layouts are left free: an optimizer node that reads a node outside the update (the
        head of an update chain: a gradient, a parameter or a moment) is not merged; one that
        follows another update node takes the least split of its free strategies (its
        operand's own spec), then the cheapest; and the backward pass's
        :data:`LAYOUT_OPCODES` are not merged.

    Returns:
      The problem with ``leader`` and ``follow`` filled in.
    """
    n = problem.num_nodes
    leader = np.arange(n)
    follow = [np.arange(len(c)) for c in problem.compute]
    incoming: dict[int, list[int]] = {}
    for e, (_src, dst, _slot) in enumerate(problem.edges):
        incoming.setdefault(int(dst), []).append(e)
    k = problem.num_strategies
    for i in range(n):
        if problem.opcodes[i] not in FOLLOWER_OPCODES or problem.phase[i] == Phase.PARAM:
            continue
        edges = incoming.get(i, [])
        if not edges:
            continue
        e = max(edges, key=lambda e: (k[problem.edges[e][0]], -e))
        j = int(problem.edges[e][0])
        update = pieces is not None and problem.phase[i] == Phase.OPTIMIZER
        if pieces is not None and (
                (update and problem.phase[j] != Phase.OPTIMIZER)
                or (problem.phase[i] == Phase.BACKWARD
                    and problem.opcodes[i] in LAYOUT_OPCODES)):
            continue
        lj = leader[j]
        if k[lj] < k[i]:
            continue
        reshard = problem.resharding[e][follow[j]]          # [leader strategy, strategy of i]
        free = reshard <= 0.0
        if update:
            split = np.where(free, np.asarray(pieces[i])[None, :], np.inf)
            free &= split <= split.min(axis=1, keepdims=True)
        cost = np.where(free, problem.node_cost(i)[None, :], np.inf)
        best = cost.argmin(axis=1)
        if not np.isfinite(cost[np.arange(len(best)), best]).all():
            continue
        leader[i], follow[i] = lj, best
    return dataclasses.replace(problem, leader=leader, follow=tuple(follow))
