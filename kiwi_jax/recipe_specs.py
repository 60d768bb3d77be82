"""The sharding rules of the hand-written recipes: a PartitionSpec per argument leaf of a train
step, derived from its parameter tree and its traced program, never from per-model rules.

- The train state is the step's first argument (after :func:`kiwi_jax.step.functionalize`: the
  NNX modules' state; a Linen ``TrainState``). Its parameters are the NNX ``nnx.Param``
  variables, or the leaves under the Linen state's ``params``; every other leaf of the state
  whose tree path ends with a parameter's path and has its shape (Adam's ``mu`` and ``nu``)
  follows that parameter; the rest (step counters) is replicated.
- Data (every argument after the first): the leading (batch) dimension over the data axes.
- ``dp``: parameters replicated, the batch over all devices.
- ``fsdp`` (ZeRO-3): each parameter's largest dimension divisible by the device count over
  both mesh axes; when none divides, the largest dimension divisible by one axis (the larger
  first); else replicated. The batch over all devices.
- ``tp`` (Megatron): the second mesh axis splits each kernel as its data flow says
  (:func:`data_flow`); the batch over the first axis.
- ``fsdp+tp``: the ``tp`` split on the second axis, and FSDP on the first axis over the
  largest remaining dimension divisible by its size; the batch over the first axis.

References:
  Shoeybi et al., "Megatron-LM" (2019), sec. 3: column-parallel first and row-parallel second
  GEMM of the MLP and attention, vocab-parallel embedding; Rajbhandari et al., "ZeRO" (SC
  2020), sec. 5 (stage 3: parameters, gradients and optimizer state partitioned); Xu et al.,
  "GSPMD" (2021), sec. 3.5: sharding propagated through elementwise operations.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.extend.core as jex
from flax import nnx
from jax.sharding import PartitionSpec as P

from hlo_tools.lower import argument_paths
from kiwi_jax.step import PureStep

__all__ = ["SHARDINGS", "StateLeaves", "state_leaves", "DataFlow", "data_flow",
           "parameters", "batch_axes",
           "recipe_specs"]

log = logging.getLogger(__name__)

SHARDINGS = ("dp", "fsdp", "tp", "fsdp+tp")
"""The recipes' sharding rules."""

_ALIASING = {"convert_element_type", "copy", "copy_p", "pvary", "reduce_precision"}
"""Primitives whose output is their operand with the same dimensions (a parameter read through
them is still that parameter)."""

_OPAQUE = {"scan", "while", "cond", "switch"}
"""Primitives whose sub-programs are not followed (a loop body's inputs are not its
operands one to one)."""


@dataclasses.dataclass(frozen=True)
class StateLeaves:
    """The train state's leaves, as the recipes see them."""

    paths: tuple
    """Per leaf of the step's arguments (all of them, HLO parameter order), its path
    components without the leading ``'args'``."""
    count: int
    """Leaves of the first argument (the train state); the rest are data."""
    param_key: tuple
    """Per state leaf, its path relative to the parameter root (the model for NNX, the Linen
    state's ``params``) when it is a parameter, else None."""
    follows: tuple
    """Per state leaf, the index of the parameter it mirrors (itself for a parameter; an
    optimizer moment's parameter), else None."""


def _variable_types(state) -> list:
    leaves = jax.tree_util.tree_flatten(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return [type(v) if isinstance(v, nnx.Variable) else None for v in leaves]


def state_leaves(pure: PureStep) -> StateLeaves:
    """Which leaves of the step's train state are parameters and which follow one."""
    paths = tuple(p[1:] for p in argument_paths(*pure.args))
    shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(pure.args)]
    count = len(jax.tree.leaves(pure.args[0])) if pure.args else 0
    keys: list = [None] * count
    if pure.style == "nnx":
        types = _variable_types(pure.args[0])
        if len(types) != count:
            raise ValueError(f"expected one leaf per NNX variable in the train state, found "
                             f"{count} leaves and {len(types)} variables")
        for i, kind in enumerate(types):
            if kind is not None and issubclass(kind, nnx.Param):
                keys[i] = paths[i][2:]            # drop (argument 0, object position)
    elif hasattr(pure.args[0], "params"):
        for i in range(count):
            if paths[i][1:2] == ("params",):
                keys[i] = paths[i][2:]
    by_key = {(k, shapes[i]): i for i, k in enumerate(keys) if k is not None}
    follows: list = [None] * count
    for i in range(count):
        if keys[i] is not None:
            follows[i] = i
            continue
        for start in range(1, len(paths[i])):
            found = by_key.get((paths[i][start:], shapes[i]))
            if found is not None:
                follows[i] = found
                break
    return StateLeaves(paths, count, tuple(keys), tuple(follows))


def parameters(leaves: StateLeaves) -> set:
    """Indices of the parameter leaves."""
    return {i for i, k in enumerate(leaves.param_key) if k is not None}


# --------------------------------------------------------------------------- tensor parallel
@dataclasses.dataclass(frozen=True)
class _Value:
    param: int | None = None        # the parameter this value is (through aliasing ops)
    split: bool = False             # its features are split by a column-parallel kernel


def _sub_jaxprs(eqn) -> list:
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                found.append(jaxpr)
    return found


@dataclasses.dataclass(frozen=True)
class DataFlow:
    """What the step's program does with its parameters."""

    roles: dict
    """Per parameter leaf read first by a matrix product or a gather, its Megatron role and the
    dimensions it may be split on: ``{leaf: (role, dims)}`` (see :func:`data_flow`)."""
    scanned: frozenset
    """Parameter leaves a scan slices, one slice a trip (its scanned inputs, not its
    constants): layers stacked for a scan. A loop over micro-batches reads the parameters as
    constants."""


def data_flow(pure: PureStep, params: set) -> DataFlow:
    """The Megatron roles of the step's parameters, from the data flow of its program.

    Roles: ``"column"`` (the kernel's output features: a free dimension of the product),
    ``"row"`` (its input features: a contracted dimension) or ``"vocab"`` (an embedding
    table's rows, read by a gather). They are found as GSPMD propagates a sharding: a kernel
    whose product reads a value with unsplit features (the residual stream, through a norm) is
    column-split and splits its output's features; the split carries through elementwise
    operations, reshapes and products of two activations (attention's scores and weighted
    sum, per head); a kernel whose product reads split features is row-split, and its output
    (after the all-reduce) is unsplit again. A gather's output is unsplit. Only a parameter's
    first reader counts (the forward pass runs before the backward pass). Calls (``jit``,
    ``checkpoint``, ``custom_jvp``) are followed; loops are not (their parameters get no role).

    Args:
      params: indices (among the leaves of ``pure.args``) of the parameters to classify.
    """
    closed = jax.make_jaxpr(pure.fn)(*pure.args)
    roles: dict = {}
    scanned: set = set()
    env: dict = {}
    for i, var in enumerate(closed.jaxpr.invars):
        env[var] = _Value(param=i if i in params else None)
    _walk(closed.jaxpr, env, roles, scanned)
    return DataFlow(roles, frozenset(scanned))


def _read(env, var) -> _Value:
    return env.get(var, _Value()) if isinstance(var, jex.Var) else _Value()


def _walk(jaxpr, env: dict, roles: dict, scanned: set) -> None:
    for eqn in jaxpr.eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        subs = _sub_jaxprs(eqn)
        if name not in _OPAQUE and len(subs) == 1 and len(subs[0].invars) == len(eqn.invars) \
                and len(subs[0].outvars) == len(eqn.outvars):
            inner = dict(zip(subs[0].invars, ins))
            _walk(subs[0], inner, roles, scanned)
            for out, var in zip(eqn.outvars, subs[0].outvars):
                env[out] = _read(inner, var)
            continue
        if name == "scan":
            first = eqn.params["num_consts"] + eqn.params["num_carry"]
            scanned.update(v.param for v in ins[first:] if v.param is not None)
        if name in _ALIASING and len(ins) == 1:
            env[eqn.outvars[0]] = ins[0]
            continue
        split = any(v.split for v in ins)
        if name == "dot_general":
            kernels = [k for k, v in enumerate(ins) if v.param is not None]
            if len(kernels) == 1:
                k = kernels[0]
                param, other = ins[k].param, ins[1 - k]
                (contract, batch) = eqn.params["dimension_numbers"]
                contracted, batched = contract[k], batch[k]
                if param not in roles:
                    rank = len(eqn.invars[k].aval.shape)
                    if other.split:
                        roles[param] = ("row", tuple(contracted))
                    else:
                        free = tuple(d for d in range(rank)
                                     if d not in contracted and d not in batched)
                        roles[param] = ("column", free)
                split = not other.split
        elif name == "gather" and ins and ins[0].param is not None:
            roles.setdefault(ins[0].param, ("vocab", (0,)))
            split = False
        for out in eqn.outvars:
            env[out] = _Value(split=split)


# --------------------------------------------------------------------------- specs
def _largest_divisible(shape, size: int, skip=()) -> int | None:
    dims = [d for d in range(len(shape)) if d not in skip and shape[d] % size == 0 and
            shape[d] >= size]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def _fsdp_spec(shape, mesh, axes, skip=()) -> list:
    """Entries of a spec sharding one dimension of ``shape`` over ``axes`` (all of them when a
    dimension divides, else the largest single axis that divides one)."""
    entries = [None] * len(shape)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    total = 1
    for a in axes:
        total *= sizes[a]
    dim = _largest_divisible(shape, total, skip)
    if dim is not None and total > 1:
        entries[dim] = tuple(axes) if len(axes) > 1 else axes[0]
        return entries
    for a in sorted(axes, key=lambda a: -sizes[a]):
        dim = _largest_divisible(shape, sizes[a], skip)
        if dim is not None and sizes[a] > 1:
            entries[dim] = a
            return entries
    return entries


def _tp_entries(shape, role, size: int, axis) -> list:
    entries = [None] * len(shape)
    if role is None:
        return entries
    _, dims = role
    for d in dims:
        if shape[d] % size == 0 and shape[d] >= size:
            entries[d] = axis
            break
    return entries


def recipe_specs(pure: PureStep, mesh, sharding: str, leaves: StateLeaves | None = None,
                 roles: dict | None = None) -> list:
    """A PartitionSpec per leaf of ``pure.args`` (HLO parameter order) for one sharding rule
    (see the module docstring).

    Args:
      mesh: a 2-axis ``jax.sharding.Mesh``: its first axis is the data axis, its second the
        tensor-parallel one.
      leaves: :func:`state_leaves` of ``pure`` (computed when None).
      roles: :attr:`DataFlow.roles` of ``pure`` (computed when needed and None).

    Raises:
      ValueError: an unknown sharding, or a mesh without two axes.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}: expected one of "
                         f"{', '.join(SHARDINGS)}")
    if len(mesh.axis_names) != 2:
        raise ValueError(f"expected a 2-axis mesh (data, model), got axes {mesh.axis_names}; "
                         "build it with jax.make_mesh((2, 4), ('data', 'model'))")
    leaves = leaves or state_leaves(pure)
    data_axis, model_axis = mesh.axis_names
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(pure.args)]
    tp = sharding in ("tp", "fsdp+tp")
    if tp and roles is None:
        roles = data_flow(pure, parameters(leaves)).roles
    data_axes = batch_axes(mesh, sharding)
    specs: list = []
    for i, shape in enumerate(shapes):
        if i >= leaves.count:                                   # data
            entries = [None] * len(shape)
            total = 1
            for a in data_axes:
                total *= sizes[a]
            if shape and shape[0] % total == 0:
                entries[0] = data_axes if len(data_axes) > 1 else data_axes[0]
            elif shape and shape[0] % sizes[data_axis] == 0:
                entries[0] = data_axis
            specs.append(P(*entries))
            continue
        owner = leaves.follows[i]
        if owner is None or shape != shapes[owner]:
            specs.append(P())                                   # step counters
            continue
        if sharding == "dp":
            entries = [None] * len(shape)
        elif sharding == "fsdp":
            entries = _fsdp_spec(shape, mesh, (data_axis, model_axis))
        else:
            entries = _tp_entries(shape, _role(owner, leaves, roles, shapes),
                                  sizes[model_axis], model_axis)
            if sharding == "fsdp+tp":
                used = [d for d, e in enumerate(entries) if e is not None]
                fsdp = _fsdp_spec(shape, mesh, (data_axis,), skip=used)
                entries = [e if e is not None else f for e, f in zip(entries, fsdp)]
        specs.append(P(*entries))
    return specs


def batch_axes(mesh, sharding: str) -> tuple:
    """The mesh axes a recipe splits the batch over: both for ``dp`` and ``fsdp``, the first
    (data) axis for ``tp`` and ``fsdp+tp``."""
    return tuple(mesh.axis_names) if sharding in ("dp", "fsdp") else (mesh.axis_names[0],)


def _role(owner: int, leaves: StateLeaves, roles: dict, shapes) -> tuple | None:
    """A parameter's role; a bias (a 1-D sibling of a column-split kernel, of its output
    features' size) follows its kernel; norms and the rest are replicated."""
    if owner in roles:
        return roles[owner]
    key, shape = leaves.param_key[owner], shapes[owner]
    if key is None or len(shape) != 1:
        return None
    for kernel, (role, dims) in roles.items():
        other = leaves.param_key[kernel]
        if role == "column" and other is not None and len(other) == len(key) \
                and _siblings(other, key) and len(dims) == 1 \
                and shapes[kernel][dims[0]] == shape[0]:
            return ("column", (0,))
    return None


def _siblings(a: tuple, b: tuple) -> bool:
    """Paths that differ in one component (``q/kernel/value`` and ``q/bias/value``)."""
    return sum(x != y for x, y in zip(a, b)) == 1
