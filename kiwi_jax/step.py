"""Make a Flax train step a pure function of arrays.

Flax NNX steps (``train_step(model, optimizer, batch)``) update their modules in place; Linen
steps (``train_step(state, batch) -> (state, metrics)``) are already pure. ``functionalize``
returns a pure function of pytrees of arrays and the arguments to call it with, so the step can
be lowered, planned and applied like any jitted function.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

__all__ = ["PureStep", "functionalize", "carried_state", "step_arguments", "abstract_arrays"]


@dataclasses.dataclass(frozen=True)
class PureStep:
    """A train step as a pure function."""

    fn: Callable
    """``fn(*args) -> outputs``; for NNX steps the outputs are ``(result, new_state)``."""
    args: tuple
    """Arguments for ``fn`` (pytrees of arrays or ShapeDtypeStructs)."""
    style: str
    """``"nnx"`` or ``"linen"`` (any pure function)."""
    graphdef: Any = None
    """NNX graph definition of the module arguments (None for pure steps)."""
    module_positions: tuple[int, ...] = ()
    """Positions of the NNX objects among the original arguments."""


def functionalize(train_step: Callable, args: tuple) -> PureStep:
    """Split NNX modules/optimizers out of ``args`` into a state pytree.

    Returns:
      A :class:`PureStep`; for NNX its ``fn(state, *other_args)`` returns
      ``(train_step result, updated state)``.
    """
    positions = tuple(i for i, a in enumerate(args) if nnx.graph.is_graph_node(a))
    if not positions:
        return PureStep(train_step, tuple(args), "linen")
    others = tuple(a for i, a in enumerate(args) if i not in positions)
    graphdef, state = nnx.split(tuple(args[i] for i in positions))

    def pure(state, *rest):
        objects = nnx.merge(graphdef, state)
        full, it_obj, it_rest = [], iter(objects), iter(rest)
        for i in range(len(args)):
            full.append(next(it_obj) if i in positions else next(it_rest))
        result = train_step(*full)
        return result, nnx.state(objects)

    return PureStep(pure, (state, *others), "nnx", graphdef, positions)


def carried_state(pure: PureStep, outputs) -> int | None:
    """Position, among the step's outputs, of the updated first argument (the train state), or
    None when no output has its structure.

    NNX steps return ``(result, new_state)``: position 1. Linen steps ``(state, metrics)``:
    position 0 when that output has the state's tree structure and shapes.
    """
    if pure.style == "nnx":
        return 1
    if not isinstance(outputs, (tuple, list)) or not pure.args:
        return None
    signature = lambda tree: (jax.tree.structure(tree),  # noqa: E731
                              [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(tree)])
    want = signature(pure.args[0])
    for position, value in enumerate(outputs):
        if signature(value) == want:
            return position
    return None


def step_arguments(pure: PureStep) -> tuple:
    """The arguments of the original step that :func:`functionalize` made ``pure`` from: the
    NNX objects merged again from ``pure.args[0]`` (abstract arrays stay abstract) and put back
    at their positions; a pure step's own arguments."""
    if pure.style != "nnx":
        return tuple(pure.args)
    objects, rest = iter(nnx.merge(pure.graphdef, pure.args[0])), iter(pure.args[1:])
    count = len(pure.module_positions) + len(pure.args) - 1
    return tuple(next(objects) if i in pure.module_positions else next(rest)
                 for i in range(count))


def abstract_arrays(args):
    """``args`` with every array replaced by its ``jax.ShapeDtypeStruct`` (to lower a step
    without committing to where concrete arguments live)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
                        if hasattr(x, "shape") else x, args)
