"""Lower a function with abstract arguments to pre-optimisation HLO text.

Nothing is allocated: arguments may be ``jax.ShapeDtypeStruct`` leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax

from hlo_tools.graph import RANDOM_BITS_TARGET, OpGraph, graph_from_text

__all__ = ["lower_to_hlo", "lower_to_graph", "argument_paths", "random_bits_as_one_operator"]


def lower_to_hlo(fn, *args) -> str:
    """HLO text of ``jax.jit(fn)`` at ``args``, with op_name metadata (``debug_info=True``).

    Unused arguments are kept (``keep_unused=True``) so that HLO parameter i is the i-th leaf of
    ``args``: the planner maps parameter nodes back to argument leaves by position.
    """
    # a fresh function (its name kept for the op_names): JAX keeps lowerings by function, and
    # one lowered before with its own Threefry rule would come back with that rule
    fresh = functools.wraps(fn)(lambda *a: fn(*a))
    with random_bits_as_one_operator():
        lowered = jax.jit(fresh, keep_unused=True).lower(*args)
    return lowered.as_text(dialect="hlo", debug_info=True)


@contextlib.contextmanager
def random_bits_as_one_operator():
    """Lower Threefry (the random bits of ``jax.random`` and ``nnx.Rngs``: dropout, random
    splits) as one operator: a custom call (:data:`~hlo_tools.graph.RANDOM_BITS_TARGET`) of
    the four counter and key operands with the two words of bits as its results, as JAX
    lowers it for the GPU kernel. The planner's graph then has one node per result where the
    CPU's rule has a five-iteration ``while`` (which the graph cannot plan) and the rule used
    elsewhere twenty rounds of elementwise operators, about 150 nodes per draw (a 2-block
    Linen Transformer with six dropouts on 2x4: 4,215 operators and 104,483 variables in
    kiwi's program with the rounds, 2,266 and 90,276 so, 1,938 and 72,125 without dropout).
    The module is read, never run: the applied step draws its bits with JAX's own rule.
    Without the lowering rules where JAX 0.10-0.12 keep them, nothing changes."""
    try:
        from jax._src import config
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as threefry
        cpu = mlir._platform_specific_lowerings["cpu"]
        kernel = mlir._platform_specific_lowerings["cuda"][threefry.threefry2x32_p]
        prefix = RANDOM_BITS_TARGET.removesuffix("_threefry2x32_ffi")
        one = dataclasses.replace(kernel, rule=functools.partial(
            threefry._threefry2x32_gpu_lowering_rule, target_name_prefix=prefix))
        as_kernel = config.threefry_gpu_kernel_lowering(True)
    except (ImportError, AttributeError, KeyError, TypeError):
        yield
        return
    own = cpu.get(threefry.threefry2x32_p)
    cpu[threefry.threefry2x32_p] = one
    try:
        with as_kernel:
            yield
    finally:
        if own is None:
            del cpu[threefry.threefry2x32_p]
        else:
            cpu[threefry.threefry2x32_p] = own


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
