"""Keep/recompute rules of the baselines: each fixes the keep flags, then sharding is solved
under the budget with the flags fixed.

Outside layers, KIWI's model recomputes one operator at a time from kept inputs (eq. 9), so a
rule that asks to recompute a chain there is applied greedily in topological order: a node is
recomputed only when none of its recomputable inputs is. Inside a layer a chain is recomputed
whole, as ``jax.checkpoint`` around the block does (``ShardingProblem.chained``).

References:
  KIWI (Liu et al.), sec. 4.1 baselines: Checkpoint Dots + Alpa (JAX's ``checkpoint_dots``) and
  Megatron selective recomputation + Alpa (Korthikanti et al., 2022: recompute the attention
  core); full recomputation keeps only each layer's input (Chen et al., 2016).
"""

from __future__ import annotations

import logging

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["keep_all", "keep_dots", "keep_megatron", "keep_layer_inputs", "keep_block_dots",
           "attention_core", "RULES", "POLICY_RULES"]

log = logging.getLogger(__name__)

_VIEWS = frozenset({"reshape", "transpose", "convert", "bitcast", "copy", "broadcast"})


def keep_all(problem: ShardingProblem) -> np.ndarray:
    """Nothing recomputed (Alpa)."""
    return np.ones(problem.num_nodes, bool)


def _apply(problem: ShardingProblem, want_recompute: np.ndarray) -> np.ndarray:
    """Recompute the wanted recomputable nodes that eq. 9 allows (their recomputable inputs are
    kept, or dropped values of their own layer: a chain), in topological order."""
    droppable = problem.droppable
    keep = np.ones(problem.num_nodes, bool)
    operands = problem.operands()
    for j in np.flatnonzero(want_recompute & droppable):
        if all(keep[i] or problem.chained(i, j) for i in operands[j] if droppable[i]):
            keep[j] = False
    return keep


def keep_dots(problem: ShardingProblem) -> np.ndarray:
    """Keep matmul outputs, recompute the rest (``jax.checkpoint_policies.checkpoint_dots``)."""
    return _apply(problem, np.array([op != "dot" for op in problem.opcodes]))


def attention_core(problem: ShardingProblem) -> np.ndarray:
    """bool per node: the forward operators of attention cores found by structure.

    A product of two activations (a ``dot`` none of whose operands is a step input or a view
    of one: the scores ``Q K^T``, the weighted sum ``P V``) and the forward operators on a path
    from one such product to another that passes no other ``dot`` (scale, mask, softmax); with
    them the views of their results, the values computed from them for the backward pass only
    (softmax's derivative factors), and the mask built from no input that only they read. A
    path from one layer's ``P V`` to the next layer's scores passes the output projection, a
    product with a weight, so cores do not run into each other; a model without such pairs
    (an MLP) has none.
    """
    n = problem.num_nodes
    forward = problem.phase == Phase.FORWARD
    operands: list[list[int]] = [[] for _ in range(n)]
    users: list[list[int]] = [[] for _ in range(n)]
    for src, dst, _slot in problem.edges:
        operands[int(dst)].append(int(src))
        users[int(src)].append(int(dst))
    from_input = np.zeros(n, bool)
    for i in range(n):
        from_input[i] = problem.phase[i] == Phase.PARAM or (
            problem.opcodes[i] in _VIEWS and len(operands[i]) == 1 and from_input[operands[i][0]])
    product = np.array([forward[i] and problem.opcodes[i] == "dot" and bool(operands[i])
                        and not any(from_input[o] for o in operands[i]) for i in range(n)])
    between = forward & np.array([op != "dot" for op in problem.opcodes])
    after = np.zeros(n, bool)                 # reached from a product, through no other dot
    for i in range(n):
        after[i] = between[i] and any(product[o] or after[o] for o in operands[i])
    before = np.zeros(n, bool)                # reaching a product, through no other dot
    for i in range(n - 1, -1, -1):
        before[i] = between[i] and any(product[u] or before[u] for u in users[i])
    core = after & before
    for i in np.flatnonzero(product):
        core[i] = any(product[u] or before[u] for u in users[i]) or \
            any(product[o] or after[o] for o in operands[i])
    free = np.zeros(n, bool)                  # computed from no input (a causal mask)
    for i in range(n):
        free[i] = problem.phase[i] != Phase.PARAM and all(free[o] for o in operands[i])
    for_backward = np.zeros(n, bool)          # forward values only the backward pass needs
    for i in range(n - 1, -1, -1):
        for_backward[i] = forward[i] and all(for_backward[u] for u in users[i] if forward[u])
    for i in range(n):                        # views of the result; derivative factors
        if forward[i] and not core[i] and any(core[o] for o in operands[i]) \
                and all(core[o] or free[o] for o in operands[i]):
            core[i] = for_backward[i] or (problem.opcodes[i] in _VIEWS and len(operands[i]) == 1)
    for i in range(n - 1, -1, -1):            # the mask and constants only the core reads
        readers = [u for u in users[i] if forward[u]]
        if forward[i] and free[i] and readers and all(core[u] for u in readers):
            core[i] = True
    return core


def keep_megatron(problem: ShardingProblem) -> np.ndarray:
    """Recompute the attention core (scores, mask, softmax, weighted sum), keep the rest.

    The core is what the ``attention_core`` name scopes hold where the model has them, else
    what :func:`attention_core` finds by structure; a model without attention recomputes
    nothing (the rule is then ``alpa``)."""
    if any("attention_core" in name for name in problem.op_names):
        return _apply(problem, np.array(["attention_core" in name for name in problem.op_names]))
    core = attention_core(problem)
    log.info("alpa+megatron: %d operators in attention cores found by structure (no "
             "attention_core name scope)", int(core.sum()))
    return _apply(problem, core)


def _crossing(problem: ShardingProblem) -> np.ndarray:
    """bool per node: values read across a layer boundary (a layer's input or output)."""
    crossing = np.zeros(problem.num_nodes, bool)
    for src, dst in problem.uses:
        if problem.layer[src] != problem.layer[dst]:
            crossing[src] = True
    return crossing


def keep_layer_inputs(problem: ShardingProblem) -> np.ndarray:
    """Keep each layer's input (values read across a layer boundary), recompute the others."""
    return _apply(problem, (problem.layer >= 0) & ~_crossing(problem))


def keep_block_dots(problem: ShardingProblem) -> np.ndarray:
    """Inside layers, keep the matmul outputs and each layer's input, recompute the rest;
    outside layers, keep everything: ``jax.checkpoint(policy=dots_saveable)`` around each
    block (:func:`keep_dots` recomputes outside layers too, as KIWI's baseline does)."""
    dots = np.array([op == "dot" for op in problem.opcodes])
    return _apply(problem, (problem.layer >= 0) & ~_crossing(problem) & ~dots)


RULES = {"alpa": keep_all, "alpa+dots": keep_dots, "alpa+megatron": keep_megatron,
         "alpa+full": keep_layer_inputs}
POLICY_RULES = {"none": keep_all, "dots_saveable": keep_block_dots,
                "nothing_saveable": keep_layer_inputs}
"""The keep flags of the per-block ``jax.checkpoint`` policies of the hand-written recipes
(:data:`kiwi_jax.recipe_remat.POLICIES`), each block being a layer of the problem."""
