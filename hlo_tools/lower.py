"""Lower a function with abstract arguments to pre-optimisation HLO text.

Nothing is allocated: arguments may be ``jax.ShapeDtypeStruct`` leaves.
"""

from __future__ import annotations

import jax

from hlo_tools.graph import OpGraph, graph_from_text

__all__ = ["lower_to_hlo", "lower_to_graph", "argument_paths"]


def lower_to_hlo(fn, *args) -> str:
    """HLO text of ``jax.jit(fn)`` at ``args``, with op_name metadata (``debug_info=True``).

    Unused arguments are kept (``keep_unused=True``) so that HLO parameter i is the i-th leaf of
    ``args``: the planner maps parameter nodes back to argument leaves by position.
    """
    return jax.jit(fn, keep_unused=True).lower(*args).as_text(dialect="hlo", debug_info=True)


def _component(key) -> str | int:
    for attr in ("key", "idx", "name"):           # DictKey, SequenceKey / FlattenedIndexKey,
        if hasattr(key, attr):                     # GetAttrKey
            return getattr(key, attr)
    return str(key)


def argument_paths(*args) -> list[tuple]:
    """Per leaf of ``args`` (HLO parameter order), its pytree path as components:
    ``('args', 0, 'blocks', 3, 'kernel', 'value')``; the layer finder reads them
    (:mod:`hlo_tools.layers`)."""
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    return [("args", *(_component(key) for key in path)) for path, _ in leaves]


def lower_to_graph(fn, *args) -> OpGraph:
    """The operator graph of ``jax.jit(fn)`` at ``args``."""
    return graph_from_text(lower_to_hlo(fn, *args), argument_paths(*args))
