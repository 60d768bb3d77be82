"""Keep/recompute rules of the baselines: each fixes the keep flags, then sharding is solved
under the budget with the flags fixed.

KIWI's model recomputes one operator at a time from kept inputs (eq. 9), so a rule that asks to
recompute a chain is applied greedily in topological order: a node is recomputed only when none
of its recomputable inputs is.

References:
  KIWI (Liu et al.), sec. 4.1 baselines: Checkpoint Dots + Alpa (JAX's ``checkpoint_dots``) and
  Megatron selective recomputation + Alpa (Korthikanti et al., 2022: recompute the attention
  core); full recomputation keeps only each layer's input (Chen et al., 2016).
"""

from __future__ import annotations

import numpy as np

from solvers.problem import ShardingProblem

__all__ = ["keep_all", "keep_dots", "keep_megatron", "keep_layer_inputs", "RULES"]


def keep_all(problem: ShardingProblem) -> np.ndarray:
    """Nothing recomputed (Alpa)."""
    return np.ones(problem.num_nodes, bool)


def _apply(problem: ShardingProblem, want_recompute: np.ndarray) -> np.ndarray:
    """Recompute the wanted recomputable nodes that eq. 9 allows, in topological order."""
    recomputable = problem.recomputable
    keep = np.ones(problem.num_nodes, bool)
    operands = problem.operands()
    for j in np.flatnonzero(want_recompute & recomputable):
        if all(keep[i] for i in operands[j] if recomputable[i]):
            keep[j] = False
    return keep


def keep_dots(problem: ShardingProblem) -> np.ndarray:
    """Keep matmul outputs, recompute the rest (``jax.checkpoint_policies.checkpoint_dots``)."""
    return _apply(problem, np.array([op != "dot" for op in problem.opcodes]))


def keep_megatron(problem: ShardingProblem) -> np.ndarray:
    """Recompute the attention core (scores, mask, softmax, weighted sum), keep the rest."""
    if not problem.op_names:
        raise ValueError("alpa+megatron needs the problem's op_names (name scopes) to find the "
                         "attention core; rebuild the problem with kiwi_jax.build_problem")
    return _apply(problem, np.array(["attention_core" in name for name in problem.op_names]))


def keep_layer_inputs(problem: ShardingProblem) -> np.ndarray:
    """Keep each layer's input (values read across a layer boundary), recompute the others."""
    crossing = np.zeros(problem.num_nodes, bool)
    for src, dst in problem.uses:
        if problem.layer[src] != problem.layer[dst]:
            crossing[src] = True
    return _apply(problem, (problem.layer >= 0) & ~crossing)


RULES = {"alpa": keep_all, "alpa+dots": keep_dots, "alpa+megatron": keep_megatron,
         "alpa+full": keep_layer_inputs}
