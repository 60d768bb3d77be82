"""Apply a plan to a train step: sharding constraints on every planned value and on every operand
the plan reshards for its reader, recomputation of the dropped ones, input and output shardings
from the plan.

The plan is made on the operator graph of the *interpreted* step (see :mod:`kiwi_jax.interpret`),
whose HLO instructions carry the path of the jaxpr equation that produced them. Each equation
output is enforced at one node, its representative: the last node of that equation (or of the
call it inlines) with the output's dimensions (and, for an equation of several outputs such as
``top_k``'s values and indices, its element type). A forward recompute unit (a top-level
equation or one of an unrolled scan body, :func:`kiwi_jax.interpret.is_unit`) is recomputed when
the plan recomputes one of its representatives. A scan's own outputs are represented by the
stacks of its per-iteration outputs (nodes tagged with the scan's path exactly), never by a
node of its body.

References:
  KIWI (Liu et al.), sec. 3: the plan picks a strategy s_i per operator and a keep flag m_i per
  forward operator; this module makes the compiled step follow both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import jax
import numpy as np
from jax.sharding import NamedSharding

from hlo_tools.graph import OpGraph, Phase, graph_from_text
from hlo_tools.lower import argument_paths, lower_to_hlo
from kiwi_jax.interpret import (Interpreter, inlined_call, is_unit, program_order, scan_body,
                                scan_layout, tag_of, trace_flat, unit_of)
from kiwi_jax.sharding import of_value, to_partition_spec
from kiwi_jax.step import PureStep, carried_state

__all__ = ["TracedStep", "trace_for_planning", "in_program_order", "ORDERS", "check_order",
           "applied_function", "fingerprint", "carried_pairs", "recomputed_values",
           "fused_followers", "fused_leaders"]


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A train step traced for planning: its jaxpr, the graph of its interpreted form and the
    map from equation outputs to graph nodes."""

    pure: PureStep
    """The functionalized step."""
    closed: object
    """Closed jaxpr of ``pure.fn``."""
    graph: OpGraph
    """Operator graph of the interpreted (tagged) step."""
    representative: dict
    """``(equation path, output index) -> node id`` where that output is enforced."""
    out_tree: object
    """Pytree structure of the step's outputs."""
    fingerprint: str
    """SHA-256 of the step's HLO without its metadata (source lines, op names): equal for the
    same computation on the same shapes."""
    state_out: int | None
    """Position of the updated train state among the outputs
    (:func:`kiwi_jax.step.carried_state`; None: the step carries no state)."""

    def node_paths(self) -> dict[int, tuple[str, int]]:
        """Inverse of ``representative``."""
        return {node: key for key, node in self.representative.items()}


def carried_pairs(traced: TracedStep) -> tuple[tuple[int, int], ...]:
    """``(updated value, parameter)`` graph nodes of the train state the step returns (at
    output ``traced.state_out``; none when it carries no state): the k-th leaf of the returned
    state is the next value of the k-th parameter (the state is the first argument)."""
    state_out = traced.state_out
    if state_out is None:
        return ()
    graph, tree = traced.graph, traced.out_tree
    # the outputs' arrays, output by output (a step that returns None besides the state has
    # an output with none)
    counts = [len(jax.tree.leaves(sub)) for sub in jax.tree.unflatten(tree, [0] * tree.num_leaves)]
    first = sum(counts[:state_out])
    return tuple((graph.outputs[first + k], graph.parameters[k])
                 for k in range(counts[state_out]))


def _representatives(closed, graph: OpGraph) -> dict:
    by_tag: dict[str, list[int]] = {}
    exact: dict[str, list[int]] = {}
    for node in graph.nodes:
        tag = tag_of(node.op_name)
        if tag is None:
            continue
        exact.setdefault(tag, []).append(node.id)
        parts = tag.split("_")
        for depth in range(1, len(parts) + 1):            # a node belongs to every enclosing call
            by_tag.setdefault("_".join(parts[:depth]), []).append(node.id)
    result = {}

    def visit(jaxpr, prefix):
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}_{index}" if prefix else str(index)
            scan = scan_body(eqn)
            # a scan's own nodes are the stacks of its outputs; its body's have their paths
            nodes = exact.get(path, []) if scan is not None else by_tag.get(path, [])
            carried = scan_layout(eqn)[1] if scan is not None else 0
            for k, var in enumerate(eqn.outvars):
                aval = var.aval
                if not hasattr(aval, "shape") or k < carried:    # a final carry: the body's
                    continue
                match = [n for n in nodes if graph.nodes[n].shape.dims == tuple(aval.shape)
                         and graph.nodes[n].opcode != "parameter"]
                if len(eqn.outvars) > 1:      # e.g. top_k's values and indices: same dims
                    typed = [n for n in match if graph.nodes[n].shape.dtype == _hlo_dtype(aval)]
                    match = typed or match
                if match:
                    result[(path, k)] = match[-1]
            body = inlined_call(eqn)          # the interpreter's paths inside inlined calls
            if body is not None:
                visit(body[0], path)
            if scan is not None:              # and in every iteration of an unrolled scan
                for i in range(scan[2]):
                    visit(scan[0], f"{path}s{i}")
    visit(closed.jaxpr, "")
    return result


def _hlo_dtype(aval) -> str:
    """The element type of ``aval`` as HLO spells it (``float32`` -> ``f32``, ``int32`` ->
    ``s32``, ``bool`` -> ``pred``, ``float8_e4m3fn`` -> ``f8e4m3fn``)."""
    name = np.dtype(aval.dtype).name
    if name == "bool":
        return "pred"
    for numpy, hlo in (("uint", "u"), ("int", "s"), ("bfloat", "bf"), ("float8_", "f8"),
                       ("float4_", "f4"), ("float", "f"), ("complex", "c")):
        if name.startswith(numpy):
            return hlo + name[len(numpy):]
    return name


ORDERS = ("auto", "program", "printed")
"""The planner's schedule (:func:`in_program_order`): ``auto`` (the program's order on one
device, the printed order on a mesh), ``program`` or ``printed``."""


def check_order(order: str) -> None:
    """A clear error for a name that is not one of :data:`ORDERS`."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {ORDERS}")


def in_program_order(num_devices: int, order: str = "auto") -> bool:
    """Whether the graph of a step planned for ``num_devices`` devices is numbered in the
    traced program's order (``auto``: on one device) or in the order XLA prints the lowered
    module (``auto``: on a mesh); the node order is the planner's schedule
    (``hlo_tools.graph.build_graph``). ``order`` is one of :data:`ORDERS`.

    The printed order is a post order from the new state: each weight's gradient contraction
    sits beside its optimizer update, after the backward pass of the layers below, and the
    forward values it reads look alive until there; on the zoo mixer they could not be
    dropped at all (docs/cost_model.md, "The replay order"). On one device the program's
    order is kept. On a mesh the printed order also puts each gradient's collective where
    XLA's all-reduce combiner runs it, at the end of the backward pass; in the program's order
    Lynx's plans hid recomputations under gradient all-reduces that the combiner then ran up
    to 296 instructions later (tests/kiwi_jax/test_overlap.py), and the 2x4 fidelity
    study was no better (1 of 8 plans within 10% either way), so a mesh keeps the printed
    order until the model places combined collectives. With the fused memory model, on the
    reference GPT at hidden 1024 on 2x4, the program's order predicted the recipes better
    and kiwi's plans ran faster (docs/recipes.md, "Memory model and order"); on the zoo on
    2x4 at 80% the same six of eight plans fit in either order, and neither was faster on
    every model (the Llama 10% faster in the program's order, the MoE 23% slower:
    docs/benchmarks.md, "2x4 at 80% with the relaxation's start"). ``order="program"`` plans
    in it on any mesh."""
    check_order(order)
    return order == "program" or (order == "auto" and num_devices == 1)


def trace_for_planning(pure: PureStep, traced_order: bool = True) -> TracedStep:
    """Trace a functionalized step and build the graph of its interpreted form, numbered in
    the traced program's order (``traced_order``, see :func:`in_program_order`) or in the
    order XLA prints it."""
    closed = trace_flat(pure.fn, *pure.args)
    outputs = jax.eval_shape(pure.fn, *pure.args)
    out_tree = jax.tree.structure(outputs)
    interpreter = Interpreter(closed)

    def tagged(*args):
        return jax.tree.unflatten(out_tree, interpreter(*jax.tree.leaves(args)))

    text = lower_to_hlo(tagged, *pure.args)
    graph = graph_from_text(text, argument_paths(*pure.args),
                            program_order if traced_order else None)
    return TracedStep(pure, closed, graph, _representatives(closed, graph), out_tree,
                      fingerprint(text), carried_state(pure, outputs))


_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


_SOURCE_TABLES = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)$"
                            r"(?:\n\s*\d+ .*$)*", re.MULTILINE)


def fingerprint(hlo_text: str) -> str:
    """SHA-256 of HLO text without its metadata and source tables (file names, lines, stack
    frames): the same computation called from elsewhere has the same fingerprint."""
    text = _SOURCE_TABLES.sub("", _METADATA.sub("", hlo_text))
    return hashlib.sha256(text.encode()).hexdigest()


def applied_function(traced: TracedStep, specs: list, recompute_nodes, mesh: jax.sharding.Mesh,
                     beside: dict[int, int] | None = None, chains: bool = True,
                     operand_specs: list | None = None, fused: np.ndarray | None = None,
                     regather: bool = False, settle: bool = False, settle_bytes: int = 0):
    """The step with the plan applied, and its input/output shardings. Its backward scans
    slice their stacked inputs anew in each iteration, as the plan's graph has them
    (:attr:`~kiwi_jax.interpret.Interpreter.reslice`).

    Args:
      traced: the traced step.
      specs: per graph node, the output spec the plan gives it.
      recompute_nodes: ids of forward nodes the plan recomputes.
      mesh: the jax mesh (its two axis names are the plan's mesh axes).
      beside: ``{recomputed node: node issuing a collective}`` (Lynx): recompute those values
        beside that collective instead of before their first backward reader.
      chains: recompute a dropped value's dropped inputs of its layer first (the reduced
        program's chains, ``ShardingProblem.chained``); False (Lynx's schedules, which recompute
        one level in their windows): read them as the forward pass left them.
      operand_specs: per graph node, the specs its strategy reads its operands in (by HLO
        operand slot). Where a reader reads a value in another spec than the value's own, the
        operand is constrained to it at that reader: given only the produced specs, XLA's
        partitioner may compute the reader another way (a batch-sharded weight gradient summed
        by an all-reduce where the plan gathers its operands). None: outputs only.
      fused: bool per graph node, the values the plan's memory model counts as fused into
        their readers (:func:`hlo_tools.liveness.fused_values`); those that read a recomputed
        value are recomputed with it (:func:`fused_followers`). None: the plan's model counts
        every value (``operator``).
      regather: a backward reader that reads a step argument or a forward value in another
        spec than its own reshards it from that value again, behind a barrier tied to its
        other operands (:attr:`~kiwi_jax.interpret.Interpreter.regather`), as the plan prices
        it: a copy made for that reader alone. False: XLA may merge it with the forward pass's
        copy and hold that until the backward pass.
      settle: each gradient the backward pass hands to the optimizer is tied into the backward
        pass's next step (:attr:`~kiwi_jax.interpret.Interpreter.settle`), so it is reduced
        where it is made, as the plan prices it. False: XLA's all-reduce combiner may merge
        every gradient's all-reduce into a few at the end of the backward pass and hold the
        gradients unreduced until then.
      settle_bytes: with ``settle``, the gradients are tied in by buckets of at most this many
        bytes (their whole size), each reduced by one combined all-reduce
        (:attr:`~kiwi_jax.interpret.Interpreter.settle_bytes`); 0: one by one.

    Returns:
      ``(fn, in_shardings, out_shardings)`` for ``jax.jit``; ``fn`` takes the same arguments as
      ``traced.pure.fn``.
    """
    graph = traced.graph
    names = tuple(mesh.axis_names)
    sharding = lambda spec: NamedSharding(mesh, to_partition_spec(spec, names))  # noqa: E731
    recompute_nodes = recomputed_values(graph, recompute_nodes, fused)
    constraints, recompute = {}, set()
    for (path, k), node in traced.representative.items():
        constraints[(path, k)] = sharding(specs[node])
        if is_unit(path) and node in recompute_nodes and \
                graph.nodes[node].phase == Phase.FORWARD:
            recompute.add(path)

    def constrain(path, k, value):
        target = constraints.get((path, k))
        if target is None or not hasattr(value, "shape"):
            return value
        return jax.lax.with_sharding_constraint(value, _for_value(target, value))

    def target(path, source):
        """The spec the reader at ``path`` reads ``source`` in, where it is not the value's own
        (None: no resharding)."""
        node = traced.representative.get((path, 0))
        if node is None or source is None:
            return None
        src = graph.parameters[source[1]] if source[0] == "arg" \
            else traced.representative.get(source)
        targets = {operand_specs[node][slot] for slot, o in enumerate(graph.nodes[node].operands)
                   if o == src}
        if len(targets) != 1:
            return None
        (spec,) = targets
        return None if spec == specs[src] else spec

    def reshard(path, source, value):
        spec = target(path, source)
        return value if spec is None else jax.lax.with_sharding_constraint(
            value, _for_value(sharding(spec), value))

    def resharded_for_itself(path, source) -> bool:
        return target(path, source) is not None

    anchors = _anchors(traced, beside or {}, recompute)
    interpreter = Interpreter(traced.closed, constrain=constrain,
                              reshard=None if operand_specs is None else reshard,
                              regather=resharded_for_itself if regather and operand_specs
                              is not None else None,
                              recompute=frozenset(recompute),
                              settle=_gradient_outputs(traced) if settle else {},
                              settle_bytes=settle_bytes,
                              beside=anchors,
                              chained=_chained_paths(traced, recompute_nodes) if chains
                              else frozenset(),
                              reslice=True)

    def fn(*args):
        return jax.tree.unflatten(traced.out_tree, interpreter(*jax.tree.leaves(args)))

    arg_tree = jax.tree.structure(traced.pure.args)
    in_shardings = jax.tree.unflatten(arg_tree, [
        _for_value(sharding(specs[p]), aval)
        for p, aval in zip(graph.parameters, traced.closed.in_avals)])
    out_shardings = jax.tree.unflatten(traced.out_tree, [
        _for_value(sharding(specs[o]), aval)
        for o, aval in zip(graph.outputs, traced.closed.out_avals)])
    return fn, in_shardings, out_shardings


def _for_value(sharding: NamedSharding, like) -> NamedSharding:
    """``sharding`` for the array ``like`` (:func:`kiwi_jax.sharding.of_value`: a PRNG key
    array's spec covers its own dimensions only)."""
    spec = of_value(sharding.spec, like)
    return sharding if spec is sharding.spec else NamedSharding(sharding.mesh, spec)


def recomputed_values(graph, recompute_nodes, fused: np.ndarray | None = None) -> set[int]:
    """The values the applied step recomputes: the plan's (``recompute_nodes``) and, with the
    fused model's flags ``fused``, the fused values recomputed with them: their
    :func:`fused_followers` and :func:`fused_leaders`.

    Not the leaders of the followers: a follower is recomputed only where a backward reader
    reads it, and its leaders would hold what they read to there. On the reference GPT at
    hidden 1024 planned on 2x4 for 462.3 MiB, whose plan recomputes the causal mask's
    broadcast, the masked scores follow it and the scaled scores lead them; recomputed too,
    both layers' score products (64 MiB each) stayed alive into the backward pass, and the
    step compiled to 675,266,396 B against 622,385,756 B without them."""
    out = {int(n) for n in recompute_nodes}
    if fused is None:
        return out
    return out | fused_followers(graph, fused, out) | fused_leaders(graph, fused, out)


def fused_followers(graph, fused: np.ndarray, recompute_nodes: set[int]) -> set[int]:
    """The forward values counted as fused into their readers (``fused``) that read a
    recomputed value, directly or through other such values: they are recomputed with it.

    The fused memory model stores none of them: a backward reader of one holds what it reads
    (:func:`hlo_tools.liveness.held_operands`), recomputed where the plan recomputes it. Read
    as the forward pass left it instead, XLA fuses its elementwise chain into the backward
    reader, which then reads the chain's forward inputs, the values the plan dropped: on the
    one-device zoo ViT, GELU's ``1 - tanh`` was read so, and every layer's MLP product and
    tanh stayed alive to the backward pass (``alpa+full``, which keeps only what crosses a
    layer boundary, compiled to 1,844,716 B; with its fused values recomputed, 1,688,492 B).
    """
    out: set[int] = set()
    for node in graph.nodes:                         # topological: operands come first
        if fused[node.id] and node.phase == Phase.FORWARD and node.id not in recompute_nodes \
                and any(o in recompute_nodes or o in out for o in node.operands):
            out.add(node.id)
    return out


def fused_leaders(graph, fused: np.ndarray, recompute_nodes: set[int]) -> set[int]:
    """The forward values counted as fused into their readers (``fused``) that a recomputed
    value reads, directly or through other such values: they are recomputed for it.

    The fused memory model stores none of them: a recomputation holds the stored values they
    read (:func:`hlo_tools.liveness.held_operands`). Read as the forward pass left them, XLA
    stores them from the forward pass to the recomputation instead: on the reference GPT
    (2 layers, hidden 512, seq 512, batch 8, vocab 2048) planned for 60% on 2x4 with the fused
    model in the program's order, GELU's bias add and the argument of its ``tanh`` in each
    layer, read by the recomputed ``tanh``, stayed alive, and the step compiled to
    114,275,604 B; with them recomputed, 104,949,652 B, its kernels estimated at 2.55 ms
    against 2.59 ms."""
    out: set[int] = set()
    for node in reversed(graph.nodes):                 # readers come first
        if fused[node.id] and node.phase == Phase.FORWARD and node.id not in recompute_nodes \
                and any(u in recompute_nodes or u in out for u in graph.users[node.id]):
            out.add(node.id)
    return out


def _gradient_outputs(traced: TracedStep) -> dict:
    """``{(path, output index): bytes}`` of the backward equations whose values no other
    backward equation reads: the gradients as the backward pass hands them to the optimizer,
    with their whole size (an all-reduce holds the whole partial sum, whatever the spec the
    gradient is handed on in)."""
    graph = traced.graph
    return {key: graph.nodes[node].nbytes for key, node in traced.representative.items()
            if is_unit(key[0]) and graph.nodes[node].phase == Phase.BACKWARD
            and all(graph.nodes[u].phase != Phase.BACKWARD for u in graph.users[node])}


def _anchors(traced: TracedStep, beside: dict[int, int], recompute) -> dict[str, str]:
    """Lynx's placements as the interpreter takes them: ``{recomputed unit: anchor unit}`` of
    ``beside`` (``{hidden node: node whose collective hides it}``), each node named by the
    recompute unit its value is made in (:func:`~kiwi_jax.interpret.unit_of`: a value made
    inside an inlined call, ``jnp.where``'s select at ``49_5``, is rerun as the call ``49``).
    Nodes the step's equations do not make (XLA's own broadcasts) and values of units not in
    ``recompute`` are left out."""
    paths = traced.node_paths()
    units = {node: unit_of(paths[node][0]) for node in (*beside, *beside.values())
             if node in paths}
    return {units[node]: units[anchor] for node, anchor in beside.items()
            if units.get(node) in recompute and units.get(anchor) is not None}


def _chained_paths(traced: TracedStep, recompute_nodes: set[int]) -> frozenset:
    """Paths of the recomputed units (:func:`~kiwi_jax.interpret.unit_of`) another recomputed
    value of the same layer reads (a chain, as ``ShardingProblem.chained`` allows).

    A value made inside an inlined call is chained as the call, the unit the interpreter
    reruns: ``jnp.where``'s ``select_n`` in the call ``51`` is the node of path ``51_2``. Taken
    by that path, the causal mask's select was not chained; each layer's softmax recomputation
    read the select as the forward pass left it, and XLA held it (512 MiB per layer) from the
    forward pass to the backward pass: on the reference GPT at hidden 1024 on one device,
    recipe ``dp/dots_saveable`` as kiwi's plan compiled to 4,868,140,628 B, the recipe itself
    to 3,788,891,516 B."""
    graph, paths = traced.graph, traced.node_paths()
    out = set()
    for j in recompute_nodes:
        for i in graph.nodes[j].operands:
            if i in recompute_nodes and i in paths and graph.nodes[i].layer >= 0 \
                    and graph.nodes[i].layer == graph.nodes[j].layer:
                unit = unit_of(paths[i][0])
                if unit is not None:
                    out.add(unit)
    return frozenset(out)


def operand_specs_of(strategies, choice) -> list:
    """Per node, the operand specs of its chosen strategy (by HLO operand slot)."""
    return [strategies[i][int(c)].operands for i, c in enumerate(np.asarray(choice))]


def node_specs(strategies, choice) -> list:
    """Per node, the output spec of its chosen strategy."""
    return [strategies[i][int(c)].out for i, c in enumerate(np.asarray(choice))]
