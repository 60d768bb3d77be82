"""Alpa-style sharding strategies of every operator, with compute, communication and memory.

A strategy fixes the spec of a node's output and the spec each operand must arrive in; its costs
are per device: compute seconds (roofline of FLOPs and bytes moved; a value XLA fuses into its
readers' loops is neither written nor read through memory), communication seconds of the
collectives the operator itself performs (the all-reduce of a dot whose contracting dimension is
split, the all-reduce of a reduction over a split dimension) and the bytes of its output shard.

XLA's all-reduce combiner merges all-reduces that do not depend on one another into one
collective: the gradients' all-reduces (and the loss's) leave a data-parallel step as a single
tuple all-reduce. The operators whose all-reduces no other possible all-reduce depends on
(:func:`combined_all_reduces`: nothing downstream of them can all-reduce) pay that collective's
latency in shares, one each, instead of a latency each.

References:
  Alpa (Zheng et al., OSDI 2022), sec. 4.1 and Table 3 (dot strategies on a 2-D mesh: SS = SR x RS,
  SR = SS x SR with an all-reduce, RS = RS x SS with an all-reduce, batch splits); XLA's
  auto-sharding strategy generation (followers of elementwise operands); KIWI eq. 2 (c_i, d_i,
  mem_i per strategy); XLA's ``AllReduceCombiner`` (independent all-reduces become one).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np

from hlo_tools.graph import Node, OpGraph, conv_labels
from hlo_tools.liveness import ELEMENTWISE
from kiwi_jax.cluster import Cluster, MeshSpec
from kiwi_jax.sharding import (Comm, Spec, comm_seconds, enumerate_specs, local_bytes,
                               replicated, shard_count, spec_from_assignment, spec_str)

__all__ = ["Strategy", "node_strategies", "combined_all_reduces", "latency_shares",
           "operator_comm_seconds", "may_all_reduce", "ELEMENTWISE", "FREE_OPCODES",
           "ALL_REDUCING_OPCODES"]

FREE_OPCODES = frozenset({"parameter", "constant", "iota", "broadcast", "reshape", "bitcast"})
"""Operators that XLA turns into bitcasts or fuses into their users: no compute time."""
ALL_REDUCING_OPCODES = frozenset({"dot", "convolution", "reduce", "scatter"})
"""Operators with strategies that all-reduce partial results (split contracting, reduced or
scatter dimensions); a variadic reduce has none (:func:`may_all_reduce`)."""
_SLICE = re.compile(r"\[(-?\d+):(-?\d+)(?::(-?\d+))?\]")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to shard one operator."""

    name: str
    """Human-readable: operand specs -> output spec, and the collectives."""
    out: Spec
    """Spec of the output."""
    operands: tuple[Spec, ...]
    """Spec each operand must be in (resharding on the edge makes it so)."""
    compute_s: float
    """Per-device compute time (KIWI's c_i)."""
    comm_s: float
    """Per-device time of the operator's own collectives (KIWI's d_i)."""
    memory: int
    """Per-device bytes of the output (KIWI's mem_i)."""
    comms: tuple[Comm, ...] = ()
    """The operator's own collectives."""


class _Ctx:
    """What every strategy builder needs: the graph, the node, the mesh and the cluster."""

    def __init__(self, graph: OpGraph, node: Node, mesh: MeshSpec, cluster: Cluster,
                 latency_share: float = 1.0, fused=None):
        self.graph, self.node, self.mesh, self.cluster = graph, node, mesh, cluster
        self.latency_share = latency_share
        self.flops = graph.flops(node.id)
        self.operand_shapes = [graph.nodes[o].shape for o in node.operands]
        in_memory = (lambda v: True) if fused is None else (lambda v: not fused[v])
        self.writes = in_memory(node.id)
        self.reads = [in_memory(o) for o in node.operands]

    def make(self, out: Spec, operands: list[Spec], comms=(), work_split: int | None = None,
             ) -> Strategy:
        mesh, node = self.mesh, self.node
        memory = local_bytes(node.nbytes, out, mesh)
        if node.opcode in FREE_OPCODES:
            compute = 0.0
        else:
            split = work_split if work_split is not None else shard_count(out, mesh)
            moved = memory * self.writes + sum(
                local_bytes(s.nbytes, spec, mesh)
                for s, spec, read in zip(self.operand_shapes, operands, self.reads) if read)
            device = self.cluster.device
            compute = max(self.flops / split / device.flops, moved / device.memory_bandwidth)
        comm = sum(self.comm_seconds(c) for c in comms)
        name = f"{' , '.join(spec_str(s) for s in operands)} -> {spec_str(out)}"
        if comms:
            name += " [" + " ".join(f"{c.kind}@{''.join(map(str, c.axes))}" for c in comms) + "]"
        return Strategy(name, out, tuple(operands), compute, comm, memory, tuple(comms))

    def comm_seconds(self, comm: Comm) -> float:
        return operator_comm_seconds(comm, self.mesh, self.cluster, self.latency_share)

    def specs(self, dims=None, allowed=None) -> tuple[Spec, ...]:
        dims = self.node.shape.dims if dims is None else dims
        return enumerate_specs(tuple(dims), self.mesh,
                               None if allowed is None else tuple(allowed))

    def divides(self, dims, spec: Spec) -> bool:
        return all(dims[d] % self.mesh.axis_size(axes) == 0 for d, axes in enumerate(spec))


def _same_rank_operands(ctx: _Ctx, out: Spec) -> list[Spec]:
    return [out if s.rank == len(out) else replicated(s.rank) for s in ctx.operand_shapes]


def _elementwise(ctx: _Ctx) -> list[Strategy]:
    return [ctx.make(out, _same_rank_operands(ctx, out)) for out in ctx.specs()]


def _source(ctx: _Ctx) -> list[Strategy]:
    return [ctx.make(out, []) for out in ctx.specs()]


def _broadcast(ctx: _Ctx) -> list[Strategy]:
    dims = ctx.node.int_list("dimensions")
    return [ctx.make(out, [tuple(out[d] for d in dims)]) for out in ctx.specs()]


def _transpose(ctx: _Ctx) -> list[Strategy]:
    perm = ctx.node.int_list("dimensions")
    result = []
    for out in ctx.specs():
        operand = [()] * len(perm)
        for j, p in enumerate(perm):
            operand[p] = out[j]
        result.append(ctx.make(out, [tuple(operand)]))
    return result


def _reduce(ctx: _Ctx) -> list[Strategy]:
    """A reduction of n inputs of one shape with n scalar inits. With one input, a split
    reduced dimension leaves partial results that are all-reduced. With several (a variadic
    reduce, e.g. argmax's over values and indices; the node is one of its results) the inputs
    share a spec and the reduced dimensions stay whole: such a combiner is no all-reduce."""
    reduced = set(ctx.node.int_list("dimensions"))
    inputs = len(ctx.operand_shapes) // 2
    in_shape = ctx.operand_shapes[0]
    allowed = None if inputs == 1 else [d not in reduced for d in range(in_shape.rank)]
    result = []
    for spec in ctx.specs(in_shape.dims, allowed):
        out = tuple(axes for d, axes in enumerate(spec) if d not in reduced)
        partial = tuple(sorted(a for d in reduced for a in spec[d]))
        comms = [Comm("all-reduce", partial, local_bytes(ctx.node.nbytes, out, ctx.mesh))] \
            if partial else []
        operands = [spec] * inputs + [()] * (len(ctx.operand_shapes) - inputs)
        result.append(ctx.make(out, operands, comms, shard_count(spec, ctx.mesh)))
    return result


def may_all_reduce(node: Node) -> bool:
    """Whether some strategy of ``node`` all-reduces partial results (an operator of
    :data:`ALL_REDUCING_OPCODES`, except a variadic reduce: :func:`_reduce`)."""
    return node.opcode in ALL_REDUCING_OPCODES and not (
        node.opcode == "reduce" and len(node.operands) > 2)


def reshape_groups(in_dims, out_dims):
    """Pair up runs of input and output dims with equal element counts."""
    groups, i, j = [], 0, 0
    while i < len(in_dims) or j < len(out_dims):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(in_dims):
            gi.append(i), (pi := pi * in_dims[i])
            i += 1
        if j < len(out_dims):
            gj.append(j), (pj := pj * out_dims[j])
            j += 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= in_dims[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_dims[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _reshape(ctx: _Ctx) -> list[Strategy]:
    in_dims, out_dims = ctx.operand_shapes[0].dims, ctx.node.shape.dims
    groups = reshape_groups(in_dims, out_dims)
    result = []
    for out in ctx.specs():
        operand = [()] * len(in_dims)
        ok = True
        for gi, gj in groups:
            sharded = [j for j in gj if out[j]]
            if not sharded:
                continue
            major_out = next((j for j in gj if out_dims[j] > 1), None)
            major_in = next((i for i in gi if in_dims[i] > 1), None)
            if len(sharded) > 1 or sharded[0] != major_out or major_in is None:
                ok = False
                break
            operand[major_in] = out[major_out]
        if ok and ctx.divides(in_dims, tuple(operand)):
            result.append(ctx.make(out, [tuple(operand)]))
    return result


def _windowed(ctx: _Ctx, fixed_dims) -> list[Strategy]:
    """Slice, pad, concatenate, dynamic slices: ``fixed_dims`` stay whole; operands of the
    output's rank share its spec, scalar operands are replicated."""
    allowed = [d not in fixed_dims for d in range(ctx.node.shape.rank)]
    return [ctx.make(out, _same_rank_operands(ctx, out)) for out in ctx.specs(allowed=allowed)]


def _fixed_dims(ctx: _Ctx) -> set[int]:
    node, in_shape = ctx.node, ctx.operand_shapes[0]
    if node.opcode == "slice":
        bounds = _SLICE.findall(node.attrs.get("slice", ""))
        return {d for d, (lo, hi, st) in enumerate(bounds)
                if int(lo) != 0 or int(hi) != in_shape.dims[d] or (st and int(st) != 1)}
    if node.opcode == "concatenate":
        return set(node.int_list("dimensions"))
    if node.opcode == "pad":
        parts = node.attrs.get("padding", "").split("x")
        return {d for d, p in enumerate(parts) if set(p.split("_")) != {"0"}}
    if node.opcode == "dynamic-slice":
        return {d for d, s in enumerate(node.int_list("dynamic_slice_sizes"))
                if s != in_shape.dims[d]}
    if node.opcode == "dynamic-update-slice":
        update = ctx.operand_shapes[1]
        return {d for d in range(in_shape.rank) if update.dims[d] != in_shape.dims[d]}
    raise AssertionError(node.opcode)


def _dot(ctx: _Ctx) -> list[Strategy]:
    node, mesh = ctx.node, ctx.mesh
    lhs, rhs = ctx.operand_shapes
    lb, rb = node.int_list("lhs_batch_dims"), node.int_list("rhs_batch_dims")
    lc, rc = node.int_list("lhs_contracting_dims"), node.int_list("rhs_contracting_dims")
    lf = [d for d in range(lhs.rank) if d not in lb and d not in lc]
    rf = [d for d in range(rhs.rank) if d not in rb and d not in rc]
    out_rank = node.shape.rank
    axes = [a for a in range(2) if mesh.shape[a] > 1]
    result, seen = [], set()
    # Each mesh axis goes to an output dim (batch, lhs free, rhs free), a contracting dim, or none.
    for roles in itertools.product(range(-1, out_rank + len(lc)), repeat=len(axes)):
        role = dict(zip(axes, roles))
        out = spec_from_assignment(out_rank, {a: r if r < out_rank else -1
                                              for a, r in role.items()})
        contracting = [tuple(a for a in axes if role[a] == out_rank + k) for k in range(len(lc))]
        lhs_spec, rhs_spec = [()] * lhs.rank, [()] * rhs.rank
        for i, (ld, rd) in enumerate(zip(lb, rb)):
            lhs_spec[ld] = rhs_spec[rd] = out[i]
        for j, ld in enumerate(lf):
            lhs_spec[ld] = out[len(lb) + j]
        for j, rd in enumerate(rf):
            rhs_spec[rd] = out[len(lb) + len(lf) + j]
        for k, (ld, rd) in enumerate(zip(lc, rc)):
            lhs_spec[ld] = rhs_spec[rd] = contracting[k]
        lhs_spec, rhs_spec = tuple(lhs_spec), tuple(rhs_spec)
        key = (out, lhs_spec, rhs_spec)
        if key in seen or not (ctx.divides(node.shape.dims, out) and
                               ctx.divides(lhs.dims, lhs_spec) and ctx.divides(rhs.dims, rhs_spec)):
            continue
        seen.add(key)
        partial = tuple(sorted(a for group in contracting for a in group))
        comms = [Comm("all-reduce", partial, local_bytes(node.nbytes, out, mesh))] \
            if partial else []
        split = mesh.axis_size(tuple(a for a in axes if role[a] >= 0))
        result.append(ctx.make(out, [lhs_spec, rhs_spec], comms, split))
    return result


def _convolution(ctx: _Ctx) -> list[Strategy]:
    """Each mesh axis splits the batch (input and output), the output feature (kernel and
    output), the contracted input feature (input and kernel; partial outputs all-reduced) or
    nothing, as a dot's would; spatial dimensions stay whole (a split one would need halo
    exchanges). The kernel gradient is a convolution too, contracting the batch (its ``f``
    label): split, it is data parallelism's all-reduce. Grouped convolutions split only the
    batch (feature groups) or nothing (batch groups)."""
    node, mesh = ctx.node, ctx.mesh
    lhs, rhs = ctx.operand_shapes
    lhs_labels, rhs_labels, out_labels = conv_labels(node.attrs.get("dim_labels", ""))
    roles = ["batch", "feature", "contracting"]
    if int(node.attrs.get("batch_group_count", 1)) != 1:
        roles = []
    elif int(node.attrs.get("feature_group_count", 1)) != 1:
        roles = ["batch"]
    dims = {"batch": ((lhs_labels.index("b"), None), out_labels.index("b")),
            "feature": ((None, rhs_labels.index("o")), out_labels.index("f")),
            "contracting": ((lhs_labels.index("f"), rhs_labels.index("i")), None)}
    axes = [a for a in range(2) if mesh.shape[a] > 1]
    result, seen = [], set()
    for assignment in itertools.product([None, *roles], repeat=len(axes)):
        role = dict(zip(axes, assignment))
        specs = [[()] * lhs.rank, [()] * rhs.rank, [()] * node.shape.rank]
        for name, ((in_dim, kernel_dim), out_dim) in dims.items():
            split = tuple(a for a in axes if role[a] == name)
            for spec, d in zip(specs, (in_dim, kernel_dim, out_dim)):
                if d is not None:
                    spec[d] = split
        lhs_spec, rhs_spec, out = map(tuple, specs)
        if (out, lhs_spec, rhs_spec) in seen or not (
                ctx.divides(node.shape.dims, out) and ctx.divides(lhs.dims, lhs_spec)
                and ctx.divides(rhs.dims, rhs_spec)):
            continue
        seen.add((out, lhs_spec, rhs_spec))
        partial = tuple(a for a in axes if role[a] == "contracting")
        comms = [Comm("all-reduce", partial, local_bytes(node.nbytes, out, mesh))] \
            if partial else []
        split = mesh.axis_size(tuple(a for a in axes if role[a] is not None))
        result.append(ctx.make(out, [lhs_spec, rhs_spec], comms, split))
    return result


def _window_dims(ctx: _Ctx) -> set[int]:
    """Dimensions a ``window={size=.. stride=.. pad=..}`` attribute (reduce-window,
    select-and-scatter) moves along: any but size 1, stride 1, no padding, no dilation."""
    trivial = {"size": "1", "stride": "1", "pad": "0_0", "lhs_dilate": "1", "rhs_dilate": "1"}
    fixed = set()
    for field in ctx.node.attrs.get("window", "").strip("{} ").split():
        key, _, values = field.partition("=")
        fixed |= {d for d, v in enumerate(values.split("x")) if v != trivial.get(key)}
    return fixed


def _gather(ctx: _Ctx) -> list[Strategy]:
    node = ctx.node
    operand, indices = ctx.operand_shapes
    offset = node.int_list("offset_dims")
    collapsed = set(node.int_list("collapsed_slice_dims"))
    op_batch = node.int_list("operand_batching_dims")
    idx_batch = node.int_list("start_indices_batching_dims")
    index_vector_dim = int(node.attrs.get("index_vector_dim", indices.rank))
    slice_sizes = node.int_list("slice_sizes")
    batch_out = [d for d in range(node.shape.rank) if d not in offset]
    idx_dims = [d for d in range(indices.rank) if d != index_vector_dim]
    window = [d for d in range(operand.rank) if d not in collapsed and d not in op_batch]
    allowed = [True] * node.shape.rank
    for j, o in enumerate(offset):
        allowed[o] = slice_sizes[window[j]] == operand.dims[window[j]]
    result = []
    for out in ctx.specs(allowed=allowed):
        op_spec, idx_spec = [()] * operand.rank, [()] * indices.rank
        for j, o in enumerate(offset):
            op_spec[window[j]] = out[o]
        for j, b in enumerate(batch_out):
            idx_spec[idx_dims[j]] = out[b]
            if idx_dims[j] in idx_batch:
                op_spec[op_batch[idx_batch.index(idx_dims[j])]] = out[b]
        if ctx.divides(operand.dims, tuple(op_spec)):
            result.append(ctx.make(out, [tuple(op_spec), tuple(idx_spec)]))
    return result


def _scatter(ctx: _Ctx) -> list[Strategy]:
    """Scatter(-add): the output follows the operand; window dims of the updates follow the
    output; split scatter dims of the updates make partial results that are all-reduced."""
    node, mesh = ctx.node, ctx.mesh
    operand, indices, updates = ctx.operand_shapes[:3]
    window_dims = node.int_list("update_window_dims")
    inserted = set(node.int_list("inserted_window_dims"))
    in_batch = node.int_list("input_batching_dims")
    idx_batch = node.int_list("scatter_indices_batching_dims")
    index_vector_dim = int(node.attrs.get("index_vector_dim", indices.rank))
    op_window = [d for d in range(operand.rank) if d not in inserted and d not in in_batch]
    scatter_dims = [d for d in range(updates.rank) if d not in window_dims]
    idx_dims = [d for d in range(indices.rank) if d != index_vector_dim]
    allowed = [True] * operand.rank
    for j, w in enumerate(window_dims):
        allowed[op_window[j]] = updates.dims[w] == operand.dims[op_window[j]]
    for d in range(operand.rank):
        if d in inserted:
            allowed[d] = False
    result = []
    for out in ctx.specs(allowed=allowed):
        upd, idx = [()] * updates.rank, [()] * indices.rank
        for j, w in enumerate(window_dims):
            upd[w] = out[op_window[j]]
        for j, s in enumerate(scatter_dims):
            if idx_dims[j] in idx_batch:
                upd[s] = idx[idx_dims[j]] = out[in_batch[idx_batch.index(idx_dims[j])]]
        free_axes = tuple(a for a in range(2) if mesh.shape[a] > 1
                          and not any(a in x for x in out))
        variants = [()]
        if scatter_dims and not idx_batch:
            variants += [(a,) for a in free_axes] + ([free_axes] if len(free_axes) > 1 else [])
        for partial in variants:
            u, i = list(upd), list(idx)
            if partial:
                u[scatter_dims[0]] = i[idx_dims[0]] = partial
            if not (ctx.divides(updates.dims, tuple(u)) and ctx.divides(indices.dims, tuple(i))):
                continue
            comms = [Comm("all-reduce", partial, local_bytes(node.nbytes, out, mesh))] \
                if partial else []
            operands = [out, tuple(i), tuple(u)] + [()] * (len(ctx.operand_shapes) - 3)
            result.append(ctx.make(out, operands, comms,
                                   shard_count(out, mesh) * mesh.axis_size(partial)))
    return result


_BUILDERS = {
    "dot": _dot, "reduce": _reduce, "broadcast": _broadcast, "transpose": _transpose,
    "reshape": _reshape, "bitcast": _reshape, "gather": _gather, "scatter": _scatter,
    "parameter": _source, "constant": _source, "iota": _source, "convolution": _convolution,
    "reverse": lambda ctx: _windowed(ctx, set(ctx.node.int_list("dimensions"))),
    **{op: (lambda ctx: _windowed(ctx, _window_dims(ctx)))
       for op in ("reduce-window", "select-and-scatter")},
    "topk": lambda ctx: _windowed(ctx, {ctx.node.shape.rank - 1}),   # last dimension whole
    **{op: (lambda ctx: _windowed(ctx, _fixed_dims(ctx))) for op in
       ("slice", "concatenate", "pad", "dynamic-slice", "dynamic-update-slice")},
    **{op: _elementwise for op in ELEMENTWISE},
}


def operator_comm_seconds(comm: Comm, mesh: MeshSpec, cluster: Cluster,
                          latency_share: float = 1.0) -> float:
    """Alpha-beta seconds of one of an operator's own collectives: an all-reduce that XLA
    combines with others pays ``latency_share`` of the combined collective's latency
    (:func:`latency_shares`)."""
    seconds = comm_seconds(comm, mesh, cluster)
    if comm.kind == "all-reduce" and seconds > 0 and latency_share != 1.0:
        seconds -= (1.0 - latency_share) * cluster.axis_link(mesh, comm.axes).latency_s
    return seconds


def latency_shares(graph: OpGraph) -> np.ndarray:
    """Per node, the part of its all-reduce's latency it pays: 1 / k for each of the k
    operators of :func:`combined_all_reduces`, 1 for the others."""
    combined = combined_all_reduces(graph)
    return np.where(combined, 1.0 / max(int(combined.sum()), 1), 1.0)


def combined_all_reduces(graph: OpGraph) -> np.ndarray:
    """bool per node: an operator that may all-reduce (:func:`may_all_reduce`) from which
    no other such operator is reachable. No all-reduce of one of them depends on another's, so
    XLA's combiner can merge all of them into one collective (per set of replica groups, up to
    its size threshold): in a train step, the weight and bias gradients and the loss.

    References:
      XLA ``AllReduceCombiner``: combines all-reduces with no data dependence between them.
    """
    n = len(graph)
    reducing = np.array([may_all_reduce(node) for node in graph.nodes], bool)
    reaches = np.zeros(n, bool)                      # some reader, transitively, may all-reduce
    for i in reversed(range(n)):                     # topological order: readers come later
        reaches[i] = any(reducing[u] or reaches[u] for u in graph.users[i])
    return reducing & ~reaches


def node_strategies(graph: OpGraph, node: Node, mesh: MeshSpec, cluster: Cluster,
                    latency_share: float = 1.0, fused=None) -> tuple[list[Strategy], bool]:
    """Strategies of one node.

    Args:
      latency_share: the part of an all-reduce's latency the node pays
        (:func:`latency_shares`).
      fused: bool per node, the values XLA computes inside their readers' loops
        (:func:`hlo_tools.liveness.fused_values`): the node's compute moves no bytes for its
        own value if it is one, nor for an operand that is one (None: every value is
        written and read through memory).

    Returns:
      (strategies, supported): unsupported opcodes get the single replicated strategy and
      ``supported=False`` so the caller can warn once, naming them.
    """
    ctx = _Ctx(graph, node, mesh, cluster, latency_share, fused)
    builder = _elementwise if node.is_random_bits or node.is_sharding_annotation \
        else _BUILDERS.get(node.opcode)
    if builder is not None:
        strategies = builder(ctx)
        if strategies:
            return strategies, True
    out = replicated(node.shape.rank)
    fallback = ctx.make(out, [replicated(s.rank) for s in ctx.operand_shapes],
                        work_split=1)
    return [fallback], builder is not None
