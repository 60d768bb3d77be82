"""The phase of a train step an operator runs in: one enum for the graph, the problem arrays and
the solvers.

:attr:`ShardingProblem.phase <solvers.problem.ShardingProblem.phase>` stores the integer values
(int8 per node), so stored problems and plans keep their meaning; compare with the members
(``problem.phase == Phase.FORWARD``). Where a name is needed (summaries, JSON), use
``phase.name.lower()``: ``param``, ``forward``, ``backward``, ``optimizer``.

References:
  KIWI (Liu et al.), sec. 3: forward and backward operators of the graph G = (V, E).
"""

from __future__ import annotations

import enum

__all__ = ["Phase"]


class Phase(enum.IntEnum):
    """Where in the train step a node runs."""

    PARAM = 0
    """An input of the step: parameter, optimizer state or batch."""
    FORWARD = 1
    """The forward pass (``jvp`` in the op name)."""
    BACKWARD = 2
    """The backward pass (``transpose(jvp(...))`` in the op name)."""
    OPTIMIZER = 3
    """Everything that consumes gradients: the optimizer update."""
