"""Lower a function with abstract arguments to pre-optimisation HLO text.

Nothing is allocated: arguments may be ``jax.ShapeDtypeStruct`` leaves.
"""

from __future__ import annotations

import contextlib
import functools

import jax

from hlo_tools.graph import OpGraph, graph_from_text

__all__ = ["lower_to_hlo", "lower_to_graph", "argument_paths", "unrolled_random_bits"]


def lower_to_hlo(fn, *args) -> str:
    """HLO text of ``jax.jit(fn)`` at ``args``, with op_name metadata (``debug_info=True``).

    Unused arguments are kept (``keep_unused=True``) so that HLO parameter i is the i-th leaf of
    ``args``: the planner maps parameter nodes back to argument leaves by position.
    """
    # a fresh function (its name kept for the op_names): JAX keeps lowerings by function, and
    # one lowered before with its own Threefry rule would come back with the loop
    fresh = functools.wraps(fn)(lambda *a: fn(*a))
    with unrolled_random_bits():
        lowered = jax.jit(fresh, keep_unused=True).lower(*args)
    return lowered.as_text(dialect="hlo", debug_info=True)


@contextlib.contextmanager
def unrolled_random_bits():
    """Lower Threefry (the random bits of ``jax.random`` and ``nnx.Rngs``: dropout, random
    splits) as its rounds, unrolled, on the CPU too. JAX lowers it there to a five-iteration
    ``while`` (a smaller program), which the operator graph cannot plan; elsewhere (GPU, TPU)
    it lowers it unrolled already. The bits are the same. Without the lowering rules where
    JAX 0.10-0.12 keep them, nothing changes."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random.threefry2x32 import threefry2x32_p
        cpu = mlir._platform_specific_lowerings["cpu"]
        unrolled = mlir._lowerings[threefry2x32_p]
    except (ImportError, AttributeError, KeyError):
        yield
        return
    rolled = cpu.get(threefry2x32_p)
    cpu[threefry2x32_p] = unrolled
    try:
        yield
    finally:
        if rolled is None:
            del cpu[threefry2x32_p]
        else:
            cpu[threefry2x32_p] = rolled


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
