"""Where in a train step an operator runs."""

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
