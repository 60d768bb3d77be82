"""A per-block ``jax.checkpoint`` policy put on a train step without editing its model.

The blocks are found from the parameter tree (:func:`hlo_tools.layers.parameter_stacks`: the
stacks of repeated sub-trees such as ``blocks/3``, ``layers_3``, ``Block_3``, an encoder's and
a decoder's); while the step is traced, each block module's ``__call__`` runs under the policy:

- Flax NNX: the block classes' ``__call__`` is replaced, for the trace only, by one that runs
  the original under ``nnx.remat(policy=...)`` for the block instances (other instances of the
  class run as before); a model that calls ``Block.__call__(block, x)`` itself is covered too.
- Flax Linen: ``flax.linen.intercept_methods`` runs the block modules' ``__call__`` (found by
  their scope path) under ``nn.checkpoint(policy=...)``.

Layers stacked for a scan (``nn.scan``, ``nnx.scan`` over ``nnx.vmap``-made layers, a
``jax.lax.scan`` over stacked weights) are not separate modules: :func:`with_scan_policy` puts
the scan's body under the policy instead, as ``nn.remat`` / ``nnx.remat`` inside the scanned
body does. While the step is traced, ``jax.lax.scan`` (which ``nn.scan`` and ``nnx.scan`` call)
runs the body of each scan over the stacked layers (a scanned input of a stacked parameter's
shape, stacked along the scan) under ``jax.checkpoint(policy=..., prevent_cse=False)``; scans
inside that body, and scans over other inputs (micro-batches), run as written.

A step decorated with ``jax.jit`` is traced through its Python function (``__wrapped__``):
jit's cache would otherwise reuse a trace made without the policy. A model whose block modules
(or scans over stacked layers) are never called raises :class:`BlockPolicyError`.

References:
  Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), sec. 4 (per-segment
  recomputation); JAX's ``jax.checkpoint`` policies (``dots_saveable``, ``nothing_saveable``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from hlo_tools.layers import parameter_stacks
from kiwi_jax.recipe_specs import StateLeaves, data_flow, parameters, state_leaves
from kiwi_jax.step import PureStep

__all__ = ["POLICIES", "BlockPolicyError", "block_paths", "with_block_policy",
           "stacked_layers", "with_scan_policy"]

log = logging.getLogger(__name__)

POLICIES = ("none", "dots_saveable", "nothing_saveable")
"""The recipes' per-block policies (``none``: no ``jax.checkpoint``)."""


class BlockPolicyError(ValueError):
    """The step's blocks cannot be put under a ``jax.checkpoint`` policy from outside."""


@dataclasses.dataclass(frozen=True)
class _Shape:
    dims: tuple
    dtype: str
    nbytes: int


def block_paths(leaves: StateLeaves, args) -> list[tuple]:
    """The block modules' paths relative to the parameter root (``('layers', 3)``,
    ``('Block_3',)``, ``('encoder', 'EncoderLayer_1')``), stack after stack in the parameter
    tree's order; empty when the parameter tree has no stack of repeats."""
    flat = jax.tree.leaves(args)
    params = [i for i, k in enumerate(leaves.param_key) if k is not None]
    keys = [leaves.param_key[i] for i in params]
    shapes = [_Shape(tuple(flat[i].shape), str(flat[i].dtype),
                     int(jnp.dtype(flat[i].dtype).itemsize) * int(max(1, _size(flat[i].shape))))
              for i in params]
    stacks = parameter_stacks(keys, shapes, [True] * len(keys), [True] * len(keys))
    return [tuple(member) for stack in stacks for member in stack.members]


def _size(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _norm(path) -> tuple:
    return tuple(str(c) for c in path)


def with_block_policy(train_step, args, style: str, paths: list[tuple], policy,
                      constrain=None):
    """``train_step`` with every block at ``paths`` under ``jax.checkpoint(policy=...)`` while
    it is traced (see the module docstring); ``policy="none"`` without ``constrain`` returns
    the step unchanged.

    Args:
      args: the step's original arguments (NNX objects or Linen pytrees).
      style: ``"nnx"`` or ``"linen"`` (:attr:`kiwi_jax.step.PureStep.style`).
      paths: :func:`block_paths`.
      policy: one of :data:`POLICIES` for every block, or a sequence with a
        ``jax.checkpoint`` policy (a callable) per path (an exported plan's, see
        :mod:`kiwi_jax.export`).
      constrain: applied to each block's first argument and to every array of its output
        (a sharding constraint on the activations at block boundaries, as hand-written
        recipes put one), or a sequence of those (or None) per path; None: none.

    Raises:
      BlockPolicyError: no blocks in the parameter tree; the traced step then raises it too
        when no block module was called.
    """
    if isinstance(policy, str):
        named = _named(policy)
        if named is None and (constrain is None or not paths):
            return train_step
        policies = [named] * len(paths)
    else:
        policies = list(policy)
        if len(policies) != len(paths):
            raise ValueError(f"expected one policy per block, got {len(policies)} for "
                             f"{len(paths)} blocks")
    if not paths:
        raise BlockPolicyError(
            "found no repeated blocks in the parameter tree (expected two or more consecutive "
            "sub-trees of one structure, such as 'blocks/3', 'layers_3' or 'Block_3'), so "
            "there is nothing to put under a per-block policy; use the recipe's policy 'none', "
            "or put jax.checkpoint(policy=...) (nn.remat / nnx.remat) in the model where it "
            "should apply")
    while hasattr(train_step, "__wrapped__"):      # a jitted step: trace its Python function
        train_step = train_step.__wrapped__        # (jit's cache would skip the policy)
    constraints = list(constrain) if isinstance(constrain, (list, tuple)) \
        else [constrain] * len(paths)
    wanted = {_norm(p): (chosen, c) for p, chosen, c in zip(paths, policies, constraints)}
    positions = [i for i, a in enumerate(args) if nnx.graph.is_graph_node(a)]

    def step(*call_args):
        calls: list = []
        if style == "nnx":
            context = _nnx_blocks([call_args[i] for i in positions], wanted, calls)
        else:
            context = nn.intercept_methods(_linen_interceptor(wanted, calls))
        with context:
            result = train_step(*call_args)
        if not calls:
            raise BlockPolicyError(
                f"the blocks {sorted(wanted)[:3]}... of the parameter tree were never called "
                "as modules while the step was traced, so their policy could not be applied; "
                "call each block module (block(x)) in the model, or use the policy 'none'")
        return result

    return step


_MARK = "_recipe_block"
"""Attribute that marks a block instance while the step is traced: NNX transforms inside the
step (``nnx.value_and_grad``) split and merge the model into new objects, which keep static
attributes but not identities."""


@contextlib.contextmanager
def _nnx_blocks(objects, wanted: dict, calls: list):
    """NNX: the block classes' ``__call__`` under ``nnx.remat`` with each block's policy
    (``wanted``: block path -> (policy or None, constrain or None)) for the block instances
    (the trace's own objects, merged from the state, are marked with their path; the user's
    are not touched)."""
    classes = set()
    for root in objects:
        for path, node in nnx.iter_graph(root):
            if _norm(path) in wanted and isinstance(node, nnx.Module):
                setattr(node, _MARK, _norm(path))
                classes.add(type(node))
    saved = {cls: cls.__dict__.get("__call__") for cls in classes}

    def patched(original):
        def call(self, *a, **k):
            block = getattr(self, _MARK, None)
            if block is None or block not in wanted:
                return original(self, *a, **k)
            calls.append(type(self).__name__)
            policy, constrain = wanted[block]
            rematted = _arrays_through(lambda f: nnx.remat(f, policy=policy), original) \
                if policy is not None else original
            return _constrained(rematted, constrain)(self, *a, **k)
        return call

    try:
        for cls in classes:
            cls.__call__ = patched(cls.__call__)
        yield
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__call__
            else:
                cls.__call__ = original


def _arrays_through(remat, fn):
    """``fn(module, *a, **k)`` under ``remat`` (a function transform of ``f(module, *arrays)``)
    with only the arrays (and NNX objects) of ``a`` and ``k`` passed through it; the rest
    (keyword arguments' Python values, a ``train`` or ``deterministic`` flag) is closed over.
    ``nnx.remat`` refuses keywords it cannot put in positions (a keyword-only
    ``deterministic=True``), and a flag passed through ``jax.checkpoint`` arrives traced, so
    Python cannot branch on it."""
    def call(module, *a, **k):
        leaves, tree = jax.tree.flatten((a, k), is_leaf=nnx.graph.is_graph_node)
        arrays = [i for i, leaf in enumerate(leaves)
                  if isinstance(leaf, (jax.Array, np.ndarray)) or nnx.graph.is_graph_node(leaf)]

        def body(mdl, *given):
            filled = list(leaves)
            for i, leaf in zip(arrays, given):
                filled[i] = leaf
            args, kwargs = jax.tree.unflatten(tree, filled)
            return fn(mdl, *args, **kwargs)
        return remat(body)(module, *(leaves[i] for i in arrays))
    return call


def _constrained(fn, constrain):
    """``fn(module, x, ...)`` with ``constrain`` on ``x`` and on the output's arrays."""
    if constrain is None:
        return fn

    def call(module, *a, **k):
        if a:
            a = (constrain(a[0]), *a[1:])
        return jax.tree.map(constrain, fn(module, *a, **k))
    return call


def _linen_interceptor(wanted: dict, calls: list):
    """Linen: the block modules' ``__call__`` (by scope path) under ``nn.checkpoint`` with each
    block's policy (``wanted``: block path -> (policy or None, constrain or None))."""
    active: list = []

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        scope = getattr(module, "scope", None)
        path = _norm(scope.path) if scope is not None else None
        block = None if context.method_name != "__call__" or path is None else next(
            (w for w in wanted if len(path) <= len(w) and w[-len(path):] == path), None)
        if block is None or (active and active[-1] == path):
            return next_fun(*args, **kwargs)
        policy, constrain = wanted[block]
        calls.append(path)
        active.append(path)
        try:
            def body(mdl, *a, **k):
                return type(mdl).__call__(mdl, *a, **k)
            if policy is None:
                return _constrained(lambda _, *a, **k: next_fun(*a, **k), constrain)(
                    module, *args, **kwargs)
            return _constrained(_arrays_through(
                lambda f: nn.checkpoint(f, policy=policy), body), constrain)(
                module, *args, **kwargs)
        finally:
            active.pop()

    return interceptor


def _named(policy: str):
    """The ``jax.checkpoint`` policy of one of :data:`POLICIES` (None for ``none``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return getattr(jax.checkpoint_policies, policy) if policy != "none" else None


def stacked_layers(pure: PureStep, scanned=None) -> frozenset:
    """``(shape, dtype)`` of the parameters a scan of the step slices: layers stacked for a
    scan. Empty when it has none.

    Args:
      scanned: those parameters' leaf indices, where known
        (:attr:`kiwi_jax.recipe_specs.DataFlow.scanned`); else they are found
        (:func:`kiwi_jax.recipe_specs.data_flow`, a trace of the step).
    """
    if scanned is None:
        scanned = data_flow(pure, parameters(state_leaves(pure))).scanned
    flat = jax.tree.leaves(pure.args)
    return frozenset((tuple(flat[i].shape), str(flat[i].dtype)) for i in scanned)


def with_scan_policy(train_step, stacked: frozenset, policy, constrain=None):
    """``train_step`` with the body of each scan over stacked layers under
    ``jax.checkpoint(policy=...)`` while it is traced (see the module docstring).

    Args:
      stacked: :func:`stacked_layers`: a scan whose scanned inputs hold an array of one of
        these shapes and dtypes, stacked along the scan (its leading dimension the scan's
        length), is a scan over the layers.
      policy: one of :data:`POLICIES`, or a ``jax.checkpoint`` policy (a callable, an exported
        plan's: :mod:`kiwi_jax.export`).
      constrain: applied to every array of the body's carry, on the way in and out (the
        activations at the layers' boundaries), or None.

    Raises:
      BlockPolicyError: no stacked layers; the traced step then raises it too when it called
        no scan over them through ``jax.lax.scan`` and a policy was asked for (a constraint
        alone is then left out).
    """
    chosen = _named(policy) if isinstance(policy, str) else policy
    if chosen is None and constrain is None:
        return train_step
    if not stacked:
        raise BlockPolicyError("the step reads no parameters inside a scan, so there is no "
                               "scanned body to put under a policy")
    while hasattr(train_step, "__wrapped__"):      # a jitted step: trace its Python function
        train_step = train_step.__wrapped__

    def step(*call_args):
        calls: list = []
        with _scanned_layers(stacked, chosen, constrain, calls):
            result = train_step(*call_args)
        if not calls and chosen is not None:
            raise BlockPolicyError(
                "the step's stacked layers were not scanned through jax.lax.scan while it was "
                "traced (nn.scan and nnx.scan call it), so their policy could not be applied; "
                "put jax.checkpoint(policy=...) (nn.remat / nnx.remat) around the scanned body "
                "in the model, or use the policy 'none'")
        return result

    return step


@contextlib.contextmanager
def _scanned_layers(stacked: frozenset, policy, constrain, calls: list):
    """``jax.lax.scan`` running the body of each outermost scan over ``stacked`` layers under
    ``policy`` and ``constrain`` (:func:`with_scan_policy`); each such scan's length is
    appended to ``calls``."""
    original = jax.lax.scan
    inside = []

    def layered(xs, length) -> bool:
        for x in jax.tree.leaves(xs):
            shape = tuple(getattr(x, "shape", ()))
            if shape and (shape, str(getattr(x, "dtype", ""))) in stacked and \
                    (length is None or shape[0] == length):
                return True
        return False

    def scan(f, init, xs=None, length=None, *rest, **kwargs):
        if inside or not layered(xs, length):
            return original(f, init, xs, length, *rest, **kwargs)
        calls.append(length)
        inside.append(True)
        try:
            return original(_layer_body(f, policy, constrain), init, xs, length, *rest,
                            **kwargs)
        finally:
            inside.pop()

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


def _layer_body(f, policy, constrain):
    """The scan body ``f(carry, x) -> (carry, y)`` under ``jax.checkpoint(policy=policy)``
    (``prevent_cse=False``: a scan keeps its iterations apart already), ``constrain`` on the
    carry's arrays on the way in and out."""
    rematted = f if policy is None else jax.checkpoint(f, policy=policy, prevent_cse=False)
    if constrain is None:
        return rematted

    def body(carry, x):
        carry, y = rematted(jax.tree.map(constrain, carry), x)
        return jax.tree.map(constrain, carry), y
    return body
