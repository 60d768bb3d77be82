"""Repeated layers of a train step found from its parameter tree, without name scopes.

Models written in ordinary Flax style carry no ``layer_<i>`` name scopes, but their parameter
trees name the repeats: ``['blocks'][3]`` (an ``nnx.List`` or Python list), ``layers_3`` (a
Linen list attribute), ``Block_3`` (a Linen ``@nn.compact`` loop), ``h_3``, ``encoder/layer/3``.
:func:`find_layers` takes the layers from there and carries them to the operators.

1. Parameters. A path component that is an index (an integer, a digit string, or a name ending
   in digits) makes its members a family of repeats: same path before it, same pattern
   (``layers_#``). Repeats are members that hold the same sub-tree (the same leaf paths below
   the index, with the same shapes and types): a family's longest run of at least two
   consecutive such members is a stack of layers (an MLP's hidden layers between input and
   output projections of other shapes); a ``conv_0``/``conv_1`` pair of different shapes is
   none. A run of blocks of modules takes in the consecutive members beside it that hold at
   least its leaf paths, in other shapes or with more (a ResNet's next stage: its first block
   adds a projection, its blocks are wider; an MLP's input and output ``Dense`` stay out).
   Stacks are runs of trainable weights (read by the forward pass and by the optimizer) that
   lie inside no member of another family with a run (a block's nested ``Dense_0``/``Dense_1``
   are none), taken by bytes while they share no leaf: an encoder's and a decoder's are two
   stacks (:func:`parameter_stacks`). A stack's members must run one after another in the
   forward pass (each block's weights read after the block before it: not experts held in a
   list). Layers are numbered stack after stack, in the order the forward pass runs the
   stacks (a decoder reading the encoder's output after the encoder), a member's layer by its
   position in the run. Optimizer state that mirrors a stack (Adam's ``mu`` and ``nu``: a
   family with the same pattern and name and the same sub-trees up to dtype, never read by
   the forward pass) takes the same layers.
2. Forward operators, from the layer parameters they depend on. ``down(v)``: the largest layer
   whose parameters are ancestors of v; ``up(v)``: the smallest layer whose parameters are read
   by v or by a forward descendant of v. A node with ``down = up = L`` lies between two reads of
   layer L's parameters: it is the core of layer L. The other nodes with ``down = L`` lie
   between layer L's last parameter read and layer L+1's first: the end of layer L and the start
   of layer L+1. They are split at the layer's output. Of the nodes on every path from layer
   L's core to layer L+1's core (post-dominators), it is the last one read more than once (the
   residual stream, read by the next norm and the next residual add), else the first (a block
   ending with a parameter read has its output in its core): the output and its ancestors end
   layer L, the nodes after it feeding layer L+1 start layer L+1, nodes feeding no later layer
   (a per-layer auxiliary loss) stay in layer L. The first layer's start and the last layer's
   end have no neighbouring layer to split against; they are found by structure: the start of
   layer 0 is what corresponds to the start of layer 1, operand slot by operand slot, walking
   back from the cores, and the end of the last layer is what corresponds to the end of the
   layer before it, walking forward. Two cores correspond node by node through structural
   labels (opcode, shape, and the labels of operands and readers, refined a few rounds),
   whatever order the program computes them in. Forward values the step computes only for the
   backward pass (no forward path leads to an output: the derivative factors of a norm, or a
   head whose loss the step does not return) belong where the values they read are read: a
   layer's input is read by that layer. In the last layer they are the counterparts of the
   layer before's; the others come after the layers. Everything else (embedding, final norm,
   head, loss) is outside layers. Between two stacks the split is by structure too: the end of
   a stack's last layer is what corresponds to the end of the layer before it (an encoder's
   final norm stays outside layers), the start of the next stack's first layer what
   corresponds to the start of that stack's second layer.
3. Backward operators. A node that only feeds the gradients of layer L's parameters (a weight
   or bias gradient) belongs to layer L. The others are cut into layers like the forward pass,
   in reverse layer order, with reads of forward values in place of parameter reads: a forward
   value (or weight) counts for the layer of its forward readers (a layer's input is read by
   that layer, so the backward of a layer's first norm stays in that layer; a value read by
   several layers, such as a mask, counts for none). The sum that completes the gradient of a
   layer's input ends that layer's backward pass.
4. Optimizer operators belong to the layer of the step inputs they and their optimizer
   descendants read (a weight and its state), when that is one layer; shared scalars (the step
   count, a global norm) are outside layers.
5. Operators that depend on no input (constants, iotas, masks and rotary tables built from
   them) take their readers' layer when all readers are in one layer.

Named scopes win: :func:`hlo_tools.graph.build_graph` calls this only for a step without
``layer_<i>`` scopes. Scanned layers are one of those: their parameters are stacked in one leaf
per weight with a leading layers axis, which this finder does not split, and kiwi-jax's
interpreter gives every scan iteration a ``layer_<i>`` scope instead (the stacked leaf, read by
every layer through its slice, stays outside layers). :func:`layer_report` checks the result:
nodes per layer and phase, and which layers have one structure.

References:
  Lynx (sec. 4.2, sec. 6 Model Profiler): one representative layer of identical layers; Alpa
  (Zheng et al., OSDI 2022): operators clustered into layers for inter-operator parallelism
  (there by balancing FLOPs, here from the parameter tree); Cooper, Harvey and Kennedy, "A
  Simple, Fast Dominance Algorithm" (2001): the data-flow equations of (post-)dominance;
  Shervashidze et al., "Weisfeiler-Lehman Graph Kernels" (JMLR 2011): label refinement.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
from collections.abc import Sequence

from solvers.phase import Phase

__all__ = ["path_components", "find_layers", "Stack", "parameter_stacks", "parameter_layers",
           "LayerReport", "layer_report"]

log = logging.getLogger(__name__)

Component = str | int
_TOKEN = re.compile(r"\[\s*'((?:[^'\\]|\\.)*)'\s*\]|\[\s*\"((?:[^\"\\]|\\.)*)\"\s*\]"
                    r"|\[\s*(-?\d+)\s*\]|\.([A-Za-z_]\w*)|([^/\[\].'\"]+)")
_NUMBERED = re.compile(r"^(.*?[A-Za-z])(_?)(\d+)$")
_INF = 1 << 30


def path_components(text: str) -> tuple[Component, ...]:
    """The components of a pytree path as ``jax.tree_util.keystr`` or an HLO parameter's
    ``op_name`` prints it: ``args[0]['blocks'][3]['w'].value`` -> ``('args', 0, 'blocks', 3,
    'w', 'value')``; ``encoder/layer/3/w`` -> ``('encoder', 'layer', '3', 'w')``."""
    text = text.replace("\\'", "'").replace('\\"', '"')
    out: list[Component] = []
    for match in _TOKEN.finditer(text):
        key, quoted, index, attr, bare = match.groups()
        if index is not None:
            out.append(int(index))
        else:
            out.append(next(v for v in (key, quoted, attr, bare) if v is not None).strip())
    return tuple(c for c in out if c != "")


def _index(component: Component) -> tuple[str, int] | None:
    """``(pattern, index)`` of a component that numbers a repeat, else None."""
    if isinstance(component, int):
        return "#", component
    if component.isdigit():
        return "#", int(component)
    match = _NUMBERED.match(component)
    return (f"{match[1]}{match[2]}#", int(match[3])) if match else None


@dataclasses.dataclass(frozen=True)
class _Family:
    prefix: tuple
    pattern: str
    members: dict            # index -> {suffix: input position}

    def signature(self, index: int, shapes, dims_only: bool = False) -> frozenset:
        return frozenset((suffix, shapes[leaf].dims if dims_only else shapes[leaf])
                         for suffix, leaf in self.members[index].items())

    @property
    def name(self) -> tuple:
        """What a mirror must share: the pattern, and the container's name for bare indices."""
        return (self.pattern, self.prefix[-1] if self.pattern == "#" and self.prefix else None)

    def leaves(self) -> list[int]:
        return [leaf for member in self.members.values() for leaf in member.values()]

    def only(self, indices) -> _Family:
        return _Family(self.prefix, self.pattern, {k: self.members[k] for k in indices})

    def repeats(self, shapes, dims_only: bool = False) -> list[int]:
        """The longest run of consecutive members with one structure (at least two; the first
        such run on a tie), else none: an MLP's hidden layers between input and output
        projections of other shapes."""
        order = sorted(self.members)
        best: list[int] = []
        run: list[int] = []
        for k in order:
            if run and self.signature(k, shapes, dims_only) != \
                    self.signature(run[0], shapes, dims_only):
                run = []
            run.append(k)
            if len(run) > len(best):
                best = list(run)
        return best if len(best) >= 2 else []

    def extended(self, run: list[int]) -> list[int]:
        """``run`` with the consecutive members on either side that hold at least its members'
        leaf paths, in other shapes or with more: a ResNet stage's first block (its
        projection added) and the blocks of the next stage (another width). Only a run of
        blocks of modules (every leaf two or more levels below the member, an NNX variable's
        ``value`` not counted) is extended: an MLP's input and output projections, single
        ``Dense`` layers with a kernel and a bias like its hidden layers, stay outside."""
        order = sorted(self.members)
        want = set(self.members[run[0]])
        if any(len(suffix) - (suffix[-1:] == ("value",)) < 2 for suffix in want):
            return run
        lo, hi = order.index(run[0]), order.index(run[-1])
        while lo > 0 and order[lo - 1] == order[lo] - 1 \
                and set(self.members[order[lo - 1]]) >= want:
            lo -= 1
        while hi + 1 < len(order) and order[hi + 1] == order[hi] + 1 \
                and set(self.members[order[hi + 1]]) >= want:
            hi += 1
        return order[lo:hi + 1]


def _families(paths: Sequence[tuple], shapes) -> list[_Family]:
    groups: dict[tuple, dict[int, dict]] = {}
    for leaf, components in enumerate(paths):
        for j, component in enumerate(components):
            found = _index(component)
            if found is not None:
                pattern, index = found
                member = groups.setdefault((tuple(components[:j]), pattern), {})
                member.setdefault(index, {})[tuple(components[j + 1:])] = leaf
    return [_Family(prefix, pattern, members) for (prefix, pattern), members in groups.items()
            if len(members) >= 2]


@dataclasses.dataclass(frozen=True)
class Stack:
    """A run of repeated blocks in the parameter tree."""

    members: tuple[tuple, ...]
    """Per position, the block's path (``('params', 'encoder', 'EncoderLayer_1')``)."""
    leaves: tuple[tuple[int, ...], ...]
    """Per position, the inputs under the block and its optimizer state's mirrors."""


def parameter_stacks(paths: Sequence[tuple], shapes, trainable: Sequence[bool],
                     forward_read: Sequence[bool]) -> list[Stack]:
    """The stacks of repeated blocks in the parameter tree, in the tree's order of their
    first leaves: an encoder's and a decoder's, say.

    A stack is a family's run of identical members (:meth:`_Family.repeats`) of weights (read
    by the forward pass and by the optimizer) that lies inside no member of a family with such
    a run: a block's ``Dense_0``/``Dense_1`` are no stack, nor are the ``Conv_0``/``Conv_1``
    of a ResNet block that repeats no other (``ResNetBlock_3``) when other blocks of its family
    repeat. The run with the most bytes comes first, then every other run that shares no leaf
    with those taken. Optimizer state that mirrors a stack (Adam's ``mu`` and ``nu``: a family
    with the same pattern and name and the same sub-trees up to dtype, never read by the
    forward pass) joins the stack whose path it ends alike with the most components
    (``mu/encoder`` the ``encoder``'s).

    Args:
      paths: per input, its path components (:func:`path_components`).
      shapes: per input, its shape (``dims``, ``nbytes``; compared with ``==``).
      trainable: per input, whether it is a weight: read by the forward pass and updated by
        the optimizer.
      forward_read: per input, whether the forward pass reads it.
    """
    families = _families(paths, shapes)
    runs = [f.only(f.extended(run)) for f in families if (run := f.repeats(shapes))]
    runs = [f for f in runs if all(trainable[leaf] for leaf in f.leaves())]
    repeated = {(f.prefix, f.pattern) for f in runs}
    runs = [f for f in runs if not any((f.prefix[:j], found[0]) in repeated
                                       for j, c in enumerate(f.prefix)
                                       if (found := _index(c)) is not None)]
    runs.sort(key=lambda f: (-sum(shapes[leaf].nbytes for leaf in f.leaves()), len(f.prefix)))
    taken: set[int] = set()
    chosen: list[_Family] = []
    for family in runs:
        if taken.isdisjoint(family.leaves()):
            chosen.append(family)
            taken.update(family.leaves())
    mirrored: dict[int, list[_Family]] = {k: [] for k in range(len(chosen))}
    for family in families:
        fits = [k for k, stack in enumerate(chosen) if _mirrors(family, stack, shapes,
                                                                forward_read)]
        if fits:
            best = max(fits, key=lambda k: _common_suffix(family.prefix, chosen[k].prefix))
            mirrored[best].append(family)
    stacks = []
    for k, stack in enumerate(chosen):
        order = sorted(stack.members)
        depth = len(stack.prefix)
        stacks.append(Stack(
            tuple((*stack.prefix, paths[next(iter(stack.members[i].values()))][depth])
                  for i in order),
            tuple(tuple(leaf for family in (stack, *mirrored[k])
                        for leaf in family.members[i].values()) for i in order)))
        log.info("a stack in the parameter tree: %d members of %s/%s, %d mirrored families",
                 len(order), "/".join(map(str, stack.prefix)), stack.pattern, len(mirrored[k]))
    return sorted(stacks, key=lambda s: min(s.leaves[0]))


def _mirrors(family: _Family, stack: _Family, shapes, forward_read) -> bool:
    order = sorted(stack.members)
    return (family.name == stack.name and family.prefix != stack.prefix
            and set(order) <= set(family.members)
            and all(family.signature(k, shapes, True) == stack.signature(k, shapes, True)
                    for k in order)
            and not any(forward_read[leaf] for leaf in family.only(order).leaves()))


def _common_suffix(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def parameter_layers(paths: Sequence[tuple], shapes, trainable: Sequence[bool],
                     forward_read: Sequence[bool]) -> list[int]:
    """Per step input, its layer from the parameter tree alone (-1 outside the stacks): the
    :func:`parameter_stacks`' members numbered stack after stack, in the tree's order (the
    graph's :func:`find_layers` numbers them in the order the forward pass runs them)."""
    layers = [-1] * len(paths)
    stacks = parameter_stacks(paths, shapes, trainable, forward_read)
    for first, stack in zip(_firsts(stacks), stacks):
        for position, leaves in enumerate(stack.leaves):
            for leaf in leaves:
                layers[leaf] = first + position
    return layers


def _firsts(stacks: Sequence[Stack]) -> list[int]:
    """Per stack, the number of its first layer when layers are numbered stack after stack."""
    out, total = [], 0
    for stack in stacks:
        out.append(total)
        total += len(stack.members)
    return out


def find_layers(nodes: Sequence, users: Sequence[Sequence[int]], parameters: Sequence[int],
                paths: Sequence[tuple]) -> list[int]:
    """Per node, the layer found from the parameter tree (see the module notes); all -1 when
    the parameter tree has no stack of identical layers.

    Args:
      nodes: the graph's nodes in topological order (``opcode``, ``shape``, ``operands``,
        ``phase``; ``nodes[i]`` has id i).
      users: per node, the ids of its readers.
      parameters: ids of the step's inputs, in argument order.
      paths: per input (same order), its path components.
    """
    return _Finder(nodes, users, parameters, paths).run()


class _Finder:
    """The passes of :func:`find_layers`, over plain per-node lists."""

    def __init__(self, nodes, users, parameters, paths):
        self.nodes, self.users = nodes, users
        self.n = len(nodes)
        self.phase = [node.phase for node in nodes]
        self.layer = [-1] * self.n
        self.free = [False] * self.n               # depends on no input
        for i, node in enumerate(nodes):
            self.free[i] = node.phase != Phase.PARAM and all(self.free[o] for o in node.operands)
        self.parameters = list(parameters)
        self.paths = [tuple(p) for p in paths]
        self.count = 0
        self.stacks: list[Stack] = []

    def is_(self, i: int, phase: Phase) -> bool:
        return self.phase[i] == phase and not self.free[i]

    def run(self) -> list[int]:
        if len(self.paths) != len(self.parameters):
            raise ValueError(f"{len(self.paths)} parameter paths for {len(self.parameters)} "
                             "inputs of the step")
        shapes = [self.nodes[p].shape for p in self.parameters]
        read_by = [{self.phase[u] for u in self.users[p]} for p in self.parameters]
        forward_read = [Phase.FORWARD in r for r in read_by]
        trainable = [Phase.FORWARD in r and Phase.OPTIMIZER in r for r in read_by]
        stacks = [s for s in parameter_stacks(self.paths, shapes, trainable, forward_read)
                  if self._chain(s)]
        self.stacks = self._in_forward_order(stacks)
        for first, stack in zip(_firsts(self.stacks), self.stacks):
            for position, leaves in enumerate(stack.leaves):
                for leaf in leaves:
                    self.layer[self.parameters[leaf]] = first + position
        self.count = max(self.layer, default=-1) + 1
        if self.count < 2:
            return self.layer
        self._forward()
        self._optimizer()
        self._backward()
        self._constants()
        return self.layer

    def _weights(self, stack: Stack, position: int) -> list[int]:
        return [self.parameters[leaf] for leaf in stack.leaves[position]
                if any(self.is_(u, Phase.FORWARD) for u in self.users[self.parameters[leaf]])]

    def _in_forward_order(self, stacks: list[Stack]) -> list[Stack]:
        """The stacks in the order the forward pass runs them: a stack whose first block reads
        what another stack computed (a decoder reading the encoder's output) comes after it
        (the node order need not say: XLA prints a module from its root)."""
        depends = [0] * self.n          # per node, a bit per stack its value depends on
        for k, stack in enumerate(stacks):
            for position in range(len(stack.members)):
                for p in self._weights(stack, position):
                    depends[p] |= 1 << k
        for i in range(self.n):
            if self.is_(i, Phase.FORWARD):
                for o in self.nodes[i].operands:
                    depends[i] |= depends[o]
        after = []
        for k, stack in enumerate(stacks):
            mask = 0
            for p in self._weights(stack, 0):
                for u in self.users[p]:
                    if self.is_(u, Phase.FORWARD):
                        for o in self.nodes[u].operands:
                            mask |= depends[o]
            after.append(bin(mask & ~(1 << k)).count("1"))
        return [stacks[k] for k in sorted(range(len(stacks)), key=lambda k: after[k])]

    def _chain(self, stack: Stack) -> bool:
        """Whether the forward pass reads each block's weights after the block before it (a
        reader of block k's weights depends on block k-1's): consecutive layers, not parallel
        branches such as experts held in a list, or a token and a position embedding."""
        position = {p: k for k in range(len(stack.members)) for p in self._weights(stack, k)}
        after = [-1] * self.n          # the latest block a forward node depends on
        fed = set()
        for i in range(self.n):
            if not self.is_(i, Phase.FORWARD):
                continue
            operands = self.nodes[i].operands
            prior = max((after[o] for o in operands), default=-1)
            read = [position[o] for o in operands if o in position]
            fed.update(k for k in read if 1 <= k <= prior + 1)
            after[i] = max([prior, *read])
        chained = fed >= set(range(1, len(stack.members)))
        if not chained:
            log.info("the blocks under %s do not run one after another in the forward pass: "
                     "no layers", "/".join(map(str, stack.members[0][:-1])))
        return chained

    def _forward(self) -> None:
        member = [self.is_(i, Phase.FORWARD) for i in range(self.n)]
        reads = [{self.layer[o] for o in node.operands
                  if self.phase[o] == Phase.PARAM and self.layer[o] >= 0} if member[i] else set()
                 for i, node in enumerate(self.nodes)]
        keys = _Segments(self.nodes, self.users, member, reads, self.count, forward=True,
                         starts=_firsts(self.stacks)).run()
        for i in range(self.n):
            if member[i]:
                self.layer[i] = keys[i]

    def _optimizer(self) -> None:
        """Optimizer nodes: the layer of the inputs read by them and their optimizer
        descendants (weights read by the forward pass count outside layers too; optimizer
        state that mirrors no layer, and the step count, do not)."""
        reads: list[set] = [set() for _ in range(self.n)]
        for i in range(self.n - 1, -1, -1):
            if not self.is_(i, Phase.OPTIMIZER):
                continue
            for o in self.nodes[i].operands:
                if self.phase[o] == Phase.PARAM and (self.layer[o] >= 0 or any(
                        self.phase[u] == Phase.FORWARD for u in self.users[o])):
                    reads[i].add(self.layer[o])
            for u in self.users[i]:
                if self.is_(u, Phase.OPTIMIZER):
                    reads[i] |= reads[u]
            if len(reads[i]) == 1:
                self.layer[i] = max(next(iter(reads[i])), -1)

    def _backward(self) -> None:
        """Gradients of one layer's parameters go to that layer; the rest of the backward pass
        is segmented like the forward pass, in reverse layer order, from the forward values
        its nodes read (a value counts for the layer of its forward readers)."""
        grads: list[set] = [set() for _ in range(self.n)]       # layers of the gradients fed
        for i in range(self.n - 1, -1, -1):
            if self.is_(i, Phase.BACKWARD):
                for u in self.users[i]:
                    if self.is_(u, Phase.BACKWARD):
                        grads[i] |= grads[u]
                    elif self.is_(u, Phase.OPTIMIZER):
                        grads[i].add(self.layer[u])
        member = [False] * self.n
        for i in range(self.n):
            if self.is_(i, Phase.BACKWARD):
                if len(grads[i]) == 1 and min(grads[i]) >= 0:
                    self.layer[i] = min(grads[i])
                else:
                    member[i] = True
        counts_for: dict[int, int | None] = {}

        def layer_read(v: int) -> int | None:
            if v not in counts_for:
                found = {self.layer[u] for u in self.users[v] if self.is_(u, Phase.FORWARD)}
                found = found or {self.layer[v]}
                counts_for[v] = found.pop() if len(found) == 1 else None
            return counts_for[v]

        last = self.count - 1
        reads = [set() for _ in range(self.n)]
        for i in range(self.n):
            if member[i]:
                for o in self.nodes[i].operands:
                    if self.phase[o] in (Phase.PARAM, Phase.FORWARD) and not self.free[o]:
                        layer = layer_read(o)
                        if layer is not None and layer >= 0:
                            reads[i].add(last - layer)
        ends = [first + len(stack.members) - 1
                for first, stack in zip(_firsts(self.stacks), self.stacks)]
        keys = _Segments(self.nodes, self.users, member, reads, self.count, forward=False,
                         starts=[last - end for end in ends]).run()
        for i in range(self.n):
            if member[i]:
                self.layer[i] = last - keys[i] if keys[i] >= 0 else -1

    def _constants(self) -> None:
        for i in range(self.n - 1, -1, -1):
            if self.free[i] and self.layer[i] < 0:
                found = {self.layer[u] for u in self.users[i]}
                if len(found) == 1 and min(found) >= 0:
                    self.layer[i] = min(found)


class _Segments:
    """One pass of the step (its forward or its backward operators, ``member``) cut into
    ``count`` consecutive segments, from the segment keys each node reads directly (``reads``:
    the layers of the parameters a forward node reads; segment k runs before k+1), ``starts``
    the first segment of each stack of blocks. Returns per node its segment, -1 outside (see
    the module notes, step 2)."""

    def __init__(self, nodes, users, member, reads, count: int, forward: bool,
                 starts: Sequence[int] = (0,)):
        self.nodes, self.users, self.member, self.count = nodes, users, member, count
        self.starts = sorted(starts)
        self.n = len(nodes)
        self.key = [-1] * self.n
        down, up = [-1] * self.n, [_INF] * self.n
        for i in range(self.n):
            if member[i]:
                down[i] = max([*reads[i], *(down[o] for o in nodes[i].operands if member[o])],
                              default=-1)
        for i in range(self.n - 1, -1, -1):
            if member[i]:
                up[i] = min([*reads[i], *(up[u] for u in users[i] if member[u])], default=_INF)
        self.down, self.up = down, up
        to_output = [False] * self.n                  # a path in the pass leads to an output
        for i in range(self.n - 1, -1, -1):
            to_output[i] = member[i] and (nodes[i].is_output
                                          or any(to_output[u] for u in users[i]))
        # forward values computed for the backward pass only
        self.saved = [forward and member[i] and up[i] == _INF and not to_output[i]
                      for i in range(self.n)]

    def run(self) -> list[int]:
        key, down, up = self.key, self.down, self.up
        core: list[list[int]] = [[] for _ in range(self.count)]
        gap: list[list[int]] = [[] for _ in range(self.count)]
        for i in range(self.n):
            if self.member[i] and down[i] >= 0 and not self.saved[i]:
                (core if up[i] <= down[i] else gap)[down[i]].append(i)
        for ids in core:
            for i in ids:
                key[i] = down[i]
        self.core, self.ends = core, [set() for _ in range(self.count)]
        between = {first - 1 for first in self.starts if first > 0}    # a stack's last segment
        for k in range(self.count - 1):
            if k in between:            # split by structure below, against the stacks' own
                continue
            output = self._output(k)
            tail = self._ancestors_in(output, set(gap[k])) if output is not None else set()
            for i in gap[k]:
                start_of_next = i not in tail and up[i] == k + 1
                key[i] = k + 1 if start_of_next else k
                if not start_of_next:
                    self.ends[k].add(i)
        for first in self.starts:
            self._first_start(first)
        for end in sorted(between):
            pairs = self._core_pairs(end - 1, end)
            if pairs is not None:
                self._match_forward(end, sorted(self.ends[end - 1]),
                                    {i for i in gap[end] if key[i] < 0},
                                    self._starts_of(end, pairs))
        last = self.count - 1
        pairs = self._core_pairs(last - 1, last)
        mapped = self._starts_of(last, pairs) if pairs is not None else None
        if mapped is not None:
            self._match_forward(last, sorted(self.ends[last - 1]), set(gap[last]) | {
                i for i in range(self.n) if self.saved[i] and down[i] == last}, mapped)
        # forward values computed for the backward pass only: the place of what they read; the
        # last layer's are the counterparts of the layer before's (the rest, such as a head
        # whose loss the step does not return, comes after the layers)
        later = set()
        for i in range(self.n):
            if not self.saved[i] or key[i] >= 0:
                continue
            # (place, known from the readers): a layer's input is read by that layer
            places = [(self._rank(o), False) if self.saved[o] else self._read_rank(o)
                      for o in self.nodes[i].operands if self.member[o]]
            rank = max((place for place, _ in places), default=-1)
            if rank < last or any(p == last and sure for p, sure in places):
                key[i] = rank if rank < self.count else -1
            else:
                later.add(i)
        if mapped is not None:
            self._match_forward(
                last, [i for i in range(self.n) if self.saved[i] and key[i] == last - 1],
                later | {i for i in range(self.n) if self.saved[i] and key[i] == last}, mapped)
        return key

    def _read_rank(self, i: int) -> tuple[int, bool]:
        """Where a value is read: ``(place of its readers in the pass, True)`` when they agree
        (a layer's input is read by that layer), else ``(its own place, False)``."""
        found = {self._rank(u) for u in self.users[i] if self.member[u] and not self.saved[u]}
        return (found.pop(), True) if len(found) == 1 else (self._rank(i), False)

    def _rank(self, i: int) -> int:
        """A node's place in the pass: its segment; before the first (-1) or after the last
        (``count``) outside segments."""
        if self.key[i] >= 0:
            return self.key[i]
        return self.count if self.down[i] >= 0 else -1

    def _output(self, k: int) -> int | None:
        """Segment k's output: of the nodes on every path from its core to segment k+1's core
        (common post-dominators, over the nodes with down = k), the last one read more than
        once in the pass (the value the next segment starts from, as a residual stream that
        feeds both a norm and the next residual add), else the first one."""
        region = [i for i in range(self.n) if self.member[i] and self.down[i] == k]
        sink = set(self.core[k + 1])
        pdom: dict[int, set] = {}
        for v in reversed(region):
            succ = [u for u in self.users[v] if self.member[u]]
            if any(u in sink for u in succ):
                pdom[v] = {v}
                continue
            inner = [pdom[u] for u in succ if u in pdom]
            if inner:
                pdom[v] = {v} | set.intersection(*inner)
        reaching = [pdom[c] for c in self.core[k] if c in pdom]
        if not reaching:
            return None
        common = set.intersection(*reaching)
        fanning = [c for c in common
                   if sum(self.member[u] and not self.saved[u] for u in self.users[c]) >= 2]
        return max(fanning) if fanning else min(common, default=None)

    def _ancestors_in(self, node: int, within: set) -> set:
        found, stack = set(), [node]
        while stack:
            v = stack.pop()
            if v in within and v not in found:
                found.add(v)
                stack.extend(self.nodes[v].operands)
        return found

    def _core_pairs(self, a: int, b: int) -> list[tuple[int, int]] | None:
        """Segment a's core paired with segment b's: nodes with the same structural label
        (opcode, shape, and the labels of their operands by slot and of their readers inside
        the core, refined a few rounds as in Weisfeiler-Lehman hashing), in order within a
        label. None when the cores are not alike."""
        cores = (self.core[a], self.core[b])
        inside = [set(c) for c in cores]
        first: dict = {}
        labels = [{i: first.setdefault((self.nodes[i].opcode, self.nodes[i].shape), len(first))
                   for i in c} for c in cores]
        for _ in range(4):
            table: dict = {}
            refined = []
            for side, core in enumerate(cores):
                old = labels[side]
                refined.append({i: table.setdefault((
                    old[i],
                    tuple(old[o] if o in inside[side] else self.nodes[o].shape
                          for o in self.nodes[i].operands),
                    tuple(sorted(old[u] for u in self.users[i] if u in inside[side]))),
                    len(table)) for i in core})
            labels = refined
        groups = [collections.defaultdict(list) for _ in cores]
        for side, core in enumerate(cores):
            for i in core:
                groups[side][labels[side][i]].append(i)
        if {k: len(v) for k, v in groups[0].items()} != {k: len(v) for k, v in groups[1].items()}:
            log.info("segments %d and %d have different cores (%d vs %d nodes): their starts "
                     "and ends are not matched", a, b, *map(len, cores))
            return None
        return [pair for label, nodes in groups[0].items()
                for pair in zip(nodes, groups[1][label])]

    def _like(self, i: int, j: int) -> bool:
        a, b = self.nodes[i], self.nodes[j]
        return a.opcode == b.opcode and a.shape == b.shape and len(a.operands) == len(b.operands)

    def _first_start(self, first: int) -> None:
        """The start of a stack's first segment ``first``: the counterparts of the next
        segment's start, walking back from the cores, among the nodes no segment took."""
        pairs = self._core_pairs(first + 1, first)
        if pairs is None:
            return
        start = {i for i in range(self.n) if self.member[i] and self.key[i] == first + 1
                 and self.down[i] == first}
        taken: set[int] = set()
        queue = list(pairs)
        while queue:
            a, b = queue.pop()
            for x, y in zip(self.nodes[a].operands, self.nodes[b].operands):
                if x in start and x not in taken and self.member[y] and self.down[y] < first \
                        and self.key[y] < 0 and self._like(x, y):
                    taken.add(x)
                    self.key[y] = first
                    queue.append((x, y))

    def _starts_of(self, end: int, pairs) -> dict[int, int]:
        """Counterparts in a stack's last segment ``end`` of the previous segment's core and
        start, walking back from the cores (both starts are known: the map for
        :meth:`_match_forward`)."""
        mapped = dict(pairs)
        queue = list(pairs)
        while queue:
            a, b = queue.pop()
            for x, y in zip(self.nodes[a].operands, self.nodes[b].operands):
                if x not in mapped and self.member[x] and self.key[x] == end - 1 \
                        and self.down[x] < end - 1 and self.key[y] == end \
                        and self.down[y] < end and self._like(x, y):
                    mapped[x] = y
                    queue.append((x, y))
        return mapped

    def _match_forward(self, end: int, sources: list[int], candidates: set,
                       mapped: dict) -> None:
        """Put into a stack's last segment ``end`` the counterparts (among ``candidates``) of
        ``sources``, nodes of the segment before, in order: a counterpart reads, slot by slot,
        the counterparts of their operands, or for an operand from outside the segment any
        node of its shape outside segment ``end``."""
        for t in sources:
            anchors = [mapped[o] for o in self.nodes[t].operands if o in mapped]
            if not anchors:
                continue
            for u in sorted(self.users[anchors[0]]):
                if u in candidates and self._like(t, u) and all(
                        mapped[o] == p if o in mapped else
                        self.key[p] != end and self.nodes[p].shape == self.nodes[o].shape
                        for o, p in zip(self.nodes[t].operands, self.nodes[u].operands)):
                    mapped[t] = u
                    candidates.discard(u)
                    self.key[u] = end
                    break


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """How a graph's nodes fall into layers, and which layers repeat one structure."""

    nodes: dict[int, dict[str, int]]
    """Per layer (-1: outside layers), nodes per phase name."""
    structure: dict[int, int]
    """Per layer, its structure: the structure of the first layer that has its operators (per
    phase, the same opcodes and shapes, each reading, slot by slot, operands of the same
    opcode and shape inside the layer or of the same shape outside it, compared as multisets:
    the backward pass may order the layers' gradient operators differently), numbered from 0
    in layer order. An encoder's layers and a decoder's are two structures."""
    fraction_in_layers: float
    """Share of the graph's nodes that belong to a layer."""

    @property
    def layers(self) -> int:
        return sum(1 for layer in self.nodes if layer >= 0)

    @property
    def structures(self) -> int:
        """How many structures the layers have."""
        return len(set(self.structure.values()))

    @property
    def uniform(self) -> bool:
        """Every layer has layer 0's structure."""
        return self.structures <= 1


def layer_report(graph) -> LayerReport:
    """Nodes per layer and phase, and each layer's structure.

    Args:
      graph: an :class:`~hlo_tools.graph.OpGraph`.
    """
    counts: dict[int, collections.Counter] = {}
    structure: dict[int, collections.Counter] = {}
    for node in graph.nodes:
        counts.setdefault(node.layer, collections.Counter())[node.phase.name.lower()] += 1
        if node.layer >= 0:
            operands = tuple((graph.nodes[o].opcode if graph.nodes[o].layer == node.layer
                              else None, graph.nodes[o].shape) for o in node.operands)
            structure.setdefault(node.layer, collections.Counter())[
                (int(node.phase), node.opcode, node.shape, operands)] += 1
    kinds: list[collections.Counter] = []
    numbered = {}
    for layer, found in sorted(structure.items()):
        if found not in kinds:
            kinds.append(found)
        numbered[layer] = kinds.index(found)
    inside = sum(sum(c.values()) for layer, c in counts.items() if layer >= 0)
    return LayerReport(nodes={layer: dict(c) for layer, c in sorted(counts.items())},
                       structure=numbered,
                       fraction_in_layers=inside / max(len(graph.nodes), 1))
