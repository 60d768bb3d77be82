"""The operator graph of a train step: HLO instructions as nodes with phase and layer.

Nested ``call`` computations (what ``jax.jit`` inside a step lowers to) are inlined so that every
node is an array-valued instruction of the step; tuples and ``get-tuple-element`` are resolved
away. An instruction with several results (a variadic ``reduce`` such as argmax's reduction over
(value, index) pairs, ``topk``'s values and indices, a ``sort`` of several operands) becomes one
node per result, named ``<instruction>#<index>``, each reading all the instruction's operands;
results nothing reads are dropped with the other dead values. ``while`` and ``conditional``
(``lax.while_loop``, ``fori_loop`` with traced bounds, ``lax.cond``) are not supported: their
bodies run a data-dependent number of times or not at all and cannot be planned op by op.
Scans reach the graph unrolled when kiwi-jax traces the step (:mod:`kiwi_jax.interpret`); a
``lax.scan`` lowered directly is a ``while`` like the others.

References:
  KIWI (Liu et al.), sec. 3: the graph G = (V, E) in topological order, forward and backward
  operators; Alpa (Zheng et al., OSDI 2022), sec. 4: HLO-level operators.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import re
from collections.abc import Callable, Sequence

from hlo_tools.hlo_text import HloModule, HloParseError, Instruction, Shape, parse_module
from hlo_tools.layers import find_layers, path_components
from solvers.phase import Phase

__all__ = ["Phase", "Node", "OpGraph", "UnsupportedOpError", "build_graph", "graph_from_text",
           "op_flops", "conv_labels", "ZERO_FLOP_OPCODES", "RANDOM_BITS_TARGET"]

UNSUPPORTED_CONTROL_FLOW = frozenset({"while", "conditional", "async-start", "send", "recv"})
_SCANS = ("kiwi-jax plans scans (lax.scan, nnx.scan, nn.scan, fori_loop with static bounds) by "
          "unrolling them when it traces the step (kiwi_jax.optimize, kiwi_jax.frontend.trace)")
_ADVICE = {
    "while": "expected no loop other than a scan: " + _SCANS + "; a lax.while_loop or a "
             "fori_loop with traced bounds cannot be planned per operator: when its trip count "
             "is known at trace time, write it as lax.scan with that length (or fori_loop with "
             "static bounds, or a Python for loop); a loop whose trip count depends on the data "
             "has to run outside the train step",
    "conditional": "expected no conditional (lax.cond, lax.switch): its branches cannot be "
                   "planned per operator; compute both branches and select the result "
                   "(jnp.where), or take the condition out of the train step (" + _SCANS + ")",
    "async-start": "expected synchronous operators: compute this asynchronous operation "
                   "outside the train step",
}
_ADVICE["send"] = _ADVICE["recv"] = ("expected no host or peer transfer inside the train step: "
                                     "send and receive outside it")
ZERO_FLOP_OPCODES = frozenset({
    "parameter", "constant", "iota", "broadcast", "reshape", "transpose", "bitcast", "copy",
    "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "convert",
    "opt-barrier", "reverse", "gather",
})
_LAYER = re.compile(r"layer_(\d+)")
RANDOM_BITS_TARGET = "kiwi_threefry2x32_ffi"
"""The custom call the planner's lowering makes of each Threefry draw
(:func:`hlo_tools.lower.random_bits_as_one_operator`): elementwise over its four operands of
one shape (two key words broadcast, two counters), two words of bits as its results."""


class UnsupportedOpError(HloParseError):
    """The step contains an instruction the planner cannot model."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One operator of the train step."""

    id: int
    """Index in topological order (0 .. |V|-1)."""
    name: str
    """Stable id: the HLO instruction name, prefixed by the call path for inlined calls and
    suffixed by ``#<index>`` for one result of a multi-result instruction. The same step
    lowered twice gives the same names."""
    opcode: str
    """HLO opcode."""
    shape: Shape
    """Result shape (never a tuple: for a multi-result instruction, the shape of this node's
    result)."""
    operands: tuple[int, ...]
    """Ids of the operand nodes, in operand order."""
    attrs: dict
    """Raw HLO attributes (dimension numbers, dimensions, slice bounds, metadata ...)."""
    phase: Phase
    """Forward, backward, optimizer or parameter."""
    layer: int
    """Index of the repeated layer the node belongs to, or -1: from ``layer_<i>`` name scopes,
    else from the parameter tree (:mod:`hlo_tools.layers`)."""
    op_name: str
    """``op_name`` metadata: the JAX primitive path that produced the node."""
    is_output: bool = False
    """True if the node is returned by the step (it stays live to the end)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the full (unsharded) result."""
        return self.shape.nbytes

    @property
    def is_random_bits(self) -> bool:
        """One result of a Threefry draw lowered as one operator (:data:`RANDOM_BITS_TARGET`)."""
        return self.opcode == "custom-call" and \
            self.attrs.get("custom_call_target", "").strip('"') == RANDOM_BITS_TARGET

    @property
    def is_sharding_annotation(self) -> bool:
        """JAX's ``Sharding`` custom call: its one operand as it is, with a sharding for the
        partitioner (JAX puts one on each PRNG key array the step takes or returns)."""
        return self.opcode == "custom-call" and len(self.operands) == 1 and \
            self.attrs.get("custom_call_target", "").strip('"') == "Sharding"

    def int_list(self, key: str) -> tuple[int, ...]:
        raw = self.attrs.get(key, "").strip("{} ")
        return tuple(int(v) for v in raw.split(",") if v.strip())


@dataclasses.dataclass(frozen=True)
class OpGraph:
    """A train step's operators in topological order."""

    nodes: tuple[Node, ...]
    """Nodes; ``nodes[i].id == i``."""
    users: tuple[tuple[int, ...], ...]
    """``users[i]``: ids of the nodes that read node i (sorted, each once)."""
    outputs: tuple[int, ...]
    """Ids of the step's results, in output order (a node may appear more than once)."""
    parameters: tuple[int, ...]
    """Ids of the step's inputs, ordered by argument number."""

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def edges(self) -> tuple[tuple[int, int, int], ...]:
        """Every (source, destination, operand slot) data edge."""
        return tuple((src, node.id, slot) for node in self.nodes
                     for slot, src in enumerate(node.operands))

    def phase_counts(self) -> dict[str, int]:
        counts = collections.Counter(node.phase.name.lower() for node in self.nodes)
        return {phase.name.lower(): counts.get(phase.name.lower(), 0) for phase in Phase}

    def flops(self, node_id: int) -> float:
        """Floating point operations of a node (:func:`op_flops`)."""
        node = self.nodes[node_id]
        return op_flops(node.opcode, node.shape, [self.nodes[o].shape for o in node.operands],
                        node.int_list("lhs_contracting_dims"), node.attrs.get("dim_labels", ""))


def op_flops(opcode: str, shape: Shape, operand_shapes: Sequence[Shape],
             lhs_contracting_dims: Sequence[int] = (), dim_labels: str = "") -> float:
    """Floating point operations of one HLO operation, as the cost model counts them.

    ``dot``: 2 x output elements x contracted size; ``convolution``: 2 x output elements x
    the kernel's elements per output feature (its window times the input features of a
    group); ``reduce`` and ``reduce-window``: one per element of the first operand;
    ``scatter``: one per update element; data movement (:data:`ZERO_FLOP_OPCODES`): none;
    every other operation: one per output element.

    Args:
      opcode: the HLO opcode.
      shape: the result shape.
      operand_shapes: the operands' shapes, in operand order.
      lhs_contracting_dims: a ``dot``'s ``lhs_contracting_dims``.
      dim_labels: a ``convolution``'s ``dim_labels`` (``b01f_01io->b01f``).
    """
    if opcode == "dot":
        lhs = operand_shapes[0]
        return 2.0 * shape.size * math.prod(lhs.dims[d] for d in lhs_contracting_dims)
    if opcode == "convolution":
        kernel = operand_shapes[1]
        return 2.0 * shape.size * kernel.size / kernel.dims[conv_labels(dim_labels)[1].index("o")]
    if opcode in ZERO_FLOP_OPCODES:
        return 0.0
    if opcode in ("reduce", "reduce-window"):
        return float(operand_shapes[0].size)
    if opcode == "scatter":
        return float(operand_shapes[-1].size)
    return float(shape.size)


def conv_labels(dim_labels: str) -> tuple[str, str, str]:
    """A convolution's ``dim_labels`` (``b01f_01io->b01f``) split into the labels of the input
    (``b`` batch, ``f`` feature, digits spatial), the kernel (``i``/``o`` input/output
    feature) and the output, the character at position d naming dimension d.

    Raises:
      HloParseError: ``dim_labels`` is not of that form.
    """
    lhs_rhs, _, out = dim_labels.partition("->")
    lhs, _, rhs = lhs_rhs.partition("_")
    if not (lhs and rhs and out):
        raise HloParseError(f"expected a convolution's dim_labels such as 'b01f_01io->b01f', "
                            f"found {dim_labels!r}")
    return lhs, rhs, out


class _Builder:
    """Inlines calls of an HLO module into a flat list of nodes."""

    def __init__(self, module: HloModule):
        self.module = module
        self.records: list[dict] = []

    def run(self):
        entry = self.module.entry
        params = {}
        for instr in entry.instructions:
            if instr.opcode == "parameter":
                params[int(instr.attrs["number"])] = self._add(instr, (), "", "")
        root_value = self._inline(entry, params, "", "")
        return root_value, [params[k] for k in sorted(params)]

    def _add(self, instr: Instruction, operands: tuple[int, ...], prefix: str,
             scope: str, index: int | None = None) -> int:
        """Record one node: the instruction's result, or its result ``index`` when it has
        several."""
        op_name = f"{scope}/{instr.op_name}" if scope else instr.op_name
        name, shape = prefix + instr.name, instr.shape
        if index is not None:
            name, shape = f"{name}#{index}", shape.elements[index]
        self.records.append(dict(name=name, instr=instr, shape=shape, operands=operands,
                                 op_name=op_name))
        return len(self.records) - 1

    def _inline(self, comp, args: dict, prefix: str, scope: str):
        """Inline ``comp``; ``scope`` is the op_name of the enclosing call (callee metadata is
        relative to it)."""
        env: dict[str, object] = {}
        for instr in comp.instructions:
            if instr.opcode == "parameter":
                env[instr.name] = args[int(instr.attrs["number"])]
                continue
            values = [env[name] for name in instr.operands]
            if instr.opcode in UNSUPPORTED_CONTROL_FLOW:
                raise UnsupportedOpError(
                    f"unsupported HLO opcode {instr.opcode!r} ({instr.name}, op_name "
                    f"{instr.op_name!r}): {_ADVICE.get(instr.opcode, _ADVICE['while'])}")
            if instr.opcode == "call":
                callee = self.module.computations[instr.attrs["to_apply"]]
                env[instr.name] = self._inline(
                    callee, dict(enumerate(values)), f"{prefix}{instr.name}/",
                    f"{scope}/{instr.op_name}" if scope else instr.op_name)
            elif instr.opcode in ("tuple", "opt-barrier"):
                env[instr.name] = tuple(values) if instr.opcode == "tuple" else values[0]
            elif instr.opcode == "get-tuple-element":
                source = values[0]
                if not isinstance(source, tuple):
                    raise HloParseError(
                        f"expected get-tuple-element {instr.name} to read a tuple, found the "
                        f"array-valued {self.records[source]['instr'].opcode!r} "
                        f"{instr.operands[0]}")
                env[instr.name] = source[int(instr.attrs["index"])]
            else:
                op_name = f"{scope}/{instr.op_name}" if scope else instr.op_name
                where = f"HLO opcode {instr.opcode!r} ({prefix}{instr.name}, op_name {op_name!r})"
                if any(isinstance(v, tuple) for v in values):
                    raise UnsupportedOpError(
                        f"{where} reads a whole tuple; expected operators to read arrays (the "
                        f"planner shards arrays): compute this {instr.opcode!r} outside the "
                        "train step")
                if not instr.shape.is_tuple:
                    env[instr.name] = self._add(instr, tuple(values), prefix, scope)
                elif any(e.is_tuple for e in instr.shape.elements):
                    raise UnsupportedOpError(
                        f"{where} returns nested tuples {instr.shape}; expected an array or a "
                        f"tuple of arrays: compute this {instr.opcode!r} outside the train step")
                else:                                   # one node per result
                    env[instr.name] = tuple(
                        self._add(instr, tuple(values), prefix, scope, index)
                        for index in range(len(instr.shape.elements)))
        return env[comp.root.name]


def _flatten(value) -> list[int]:
    if isinstance(value, tuple):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def _tagged_phase(op_name: str) -> Phase | None:
    if "transpose(" in op_name:
        return Phase.BACKWARD
    if "jvp(" in op_name:
        return Phase.FORWARD
    return None


def _program_order(kept: list[int], records: list[dict], param_ids: Sequence[int],
                   order: Callable[[str], tuple | None]) -> list[int]:
    """``kept`` (record ids in the module's printed order) re-sequenced in program order: a
    topological order that takes, among the instructions whose operands are done, the one
    with the smallest ``order(op_name)`` (ties in printed order). An instruction without a key
    takes its first reader's (the smallest among its readers'); the inputs come first.

    XLA prints a computation in post order from its root, and a train step's root is the new
    state: an instruction is printed where the walk from the first output that needs it
    reaches it. A weight's gradient is then printed beside that weight's optimizer update,
    after the backward pass of the layers below it (the zoo mixer's layer 1: its gradient
    dots at 1,287 of 1,790 nodes where its backward pass ends at 722), and the forward values
    it reads look alive until there."""
    position = {rid: i for i, rid in enumerate(kept)}
    users: list[list[int]] = [[] for _ in kept]
    waiting = [0] * len(kept)
    for i, rid in enumerate(kept):
        operands = {position[o] for o in records[rid]["operands"]}
        waiting[i] = len(operands)
        for o in operands:
            users[o].append(i)
    inputs = set(param_ids)
    keys: list[tuple | None] = [(-1,) if rid in inputs else order(records[rid]["op_name"])
                                for rid in kept]
    for i in reversed(range(len(kept))):
        if keys[i] is None:
            found = [keys[u] for u in users[i] if keys[u] is not None]
            keys[i] = min(found) if found else ()
    ready = [(keys[i], i) for i in range(len(kept)) if not waiting[i]]
    heapq.heapify(ready)
    out = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(kept[i])
        for u in users[i]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (keys[u], u))
    return out


def build_graph(module: HloModule, param_paths: Sequence[Sequence] | None = None,
                order: Callable[[str], tuple | None] | None = None) -> OpGraph:
    """Build the operator graph of a module's entry computation.

    Dead instructions (not reachable backwards from the outputs) are dropped. Phases come from
    the ``op_name`` metadata (lower with ``debug_info=True``); untagged nodes that depend on a
    backward node belong to the optimizer, the others take the phase of their first user.

    Layers come from ``layer_<i>`` name scopes where the step has them (inputs and untagged
    forward nodes read by one layer only join it); otherwise from the parameter tree
    (:func:`hlo_tools.layers.find_layers`).

    Args:
      module: the parsed HLO module.
      param_paths: per entry parameter (by number), its pytree path as components
        (``('args', 0, 'blocks', 3, 'w')``); default: parsed from the parameters' ``op_name``,
        which jax sets to the argument's path.
      order: a sort key of program order from an instruction's ``op_name`` (None where it has
        none): the nodes are numbered in that order (:func:`_program_order`) instead of the
        order XLA prints them in. The node order is the planner's schedule.

    Raises:
      UnsupportedOpError: the step contains loops, conditionals, or operators returning
        nested tuples or reading whole tuples.
    """
    builder = _Builder(module)
    root_value, param_ids = builder.run()
    records = builder.records
    outputs_raw = _flatten(root_value)
    live = set(outputs_raw) | set(param_ids)
    for rid in range(len(records) - 1, -1, -1):
        if rid in live:
            live.update(records[rid]["operands"])
    kept = [rid for rid in range(len(records)) if rid in live]
    if order is not None:
        kept = _program_order(kept, records, param_ids, order)
    new_id = {rid: idx for idx, rid in enumerate(kept)}
    operands = [tuple(new_id[o] for o in records[rid]["operands"]) for rid in kept]
    users: list[set] = [set() for _ in kept]
    for idx, ops in enumerate(operands):
        for op in ops:
            users[op].add(idx)

    phases: list[Phase | None] = []
    for idx, rid in enumerate(kept):
        instr = records[rid]["instr"]
        phase = Phase.PARAM if instr.opcode == "parameter" and rid in param_ids else \
            _tagged_phase(records[rid]["op_name"])
        if phase is None and any(phases[o] in (Phase.BACKWARD, Phase.OPTIMIZER)
                                 for o in operands[idx]):
            phase = Phase.OPTIMIZER
        phases.append(phase)
    for idx in range(len(kept) - 1, -1, -1):
        if phases[idx] is None:
            user_phases = [phases[u] for u in sorted(users[idx]) if phases[u] is not None]
            phases[idx] = user_phases[0] if user_phases else Phase.OPTIMIZER
            if phases[idx] == Phase.PARAM:
                phases[idx] = Phase.FORWARD

    layers = [_layer_of(records[rid]["op_name"]) for rid in kept]
    for idx in range(len(kept)):  # inputs and untagged nodes take their users' layer
        if layers[idx] < 0:
            user_layers = {layers[u] for u in users[idx] if layers[u] >= 0}
            if len(user_layers) == 1 and phases[idx] in (Phase.PARAM, Phase.FORWARD):
                layers[idx] = user_layers.pop()
    output_set = set(new_id[o] for o in outputs_raw)
    nodes = tuple(
        Node(id=idx, name=records[rid]["name"], opcode=records[rid]["instr"].opcode,
             shape=records[rid]["shape"], operands=operands[idx],
             attrs=records[rid]["instr"].attrs, phase=phases[idx], layer=layers[idx],
             op_name=records[rid]["op_name"], is_output=idx in output_set)
        for idx, rid in enumerate(kept))
    user_ids = tuple(tuple(sorted(u)) for u in users)
    parameters = tuple(new_id[p] for p in param_ids)
    if not any(layer >= 0 for layer in layers):
        if param_paths is None:
            param_paths = [path_components(records[p]["op_name"]) for p in param_ids]
        found = find_layers(nodes, user_ids, parameters, param_paths)
        nodes = tuple(dataclasses.replace(node, layer=layer) if layer != node.layer else node
                      for node, layer in zip(nodes, found))
    return OpGraph(nodes=nodes, users=user_ids, outputs=tuple(new_id[o] for o in outputs_raw),
                   parameters=parameters)


def _layer_of(op_name: str) -> int:
    found = _LAYER.findall(op_name)
    return int(found[-1]) if found else -1


def graph_from_text(text: str, param_paths: Sequence[Sequence] | None = None,
                    order: Callable[[str], tuple | None] | None = None) -> OpGraph:
    """Parse HLO module text and build its operator graph (see :func:`build_graph`)."""
    return build_graph(parse_module(text), param_paths, order)
