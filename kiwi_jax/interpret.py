"""Run a train step's flat jaxpr equation by equation, enforcing a plan as it goes.

The step is traced once to a closed jaxpr (forward, backward and optimizer, after autodiff). The
interpreter evaluates it in order, inlining nested ``jit`` and custom-derivative calls, and runs
every equation inside a name scope ``k<path>`` so that each HLO instruction it lowers to carries
the equation's path in its ``op_name``: the operator graph built from the interpreted step maps
every node back to the equation that produced it. The original name stack (``jvp(...)``,
``transpose(...)``, ``layer_<i>``) is kept, so phases and layers are unchanged, and with no
plan the interpreted step computes exactly what the plain step computes.

Paths: ``12`` is the top-level equation 12; ``12_3`` equation 3 of the call inlined at 12;
``12s4_3`` equation 3 of the body of the ``scan`` at 12 in its iteration 4 (the ``s`` marks an
iteration, so no scan path can be read as a call path); they nest (``12s4_3_1``,
``12s4_3s0_2``).

Scans (``lax.scan``, ``nnx.scan``, ``nn.scan``, ``fori_loop`` with static bounds) are unrolled:
iteration i (the index into the scanned inputs, visited last to first for a reverse scan)
evaluates the body at paths ``<scan>s<i>_<j>`` on the constants, the carry and the i-th slice of
the scanned inputs; the stacked outputs are kept as per-iteration values and stacked (under the
scan's own scope ``k<scan>``) only when an equation other than a scan reads them, so the
residuals a forward scan hands to its backward scan pass one layer at a time and the program
never holds a concatenation of all layers' residuals. Each iteration of a scan of the forward or
backward pass that is not inside another scan runs inside a ``layer_<i>`` name scope: the
forward scan and its backward (transposed) scan give layer i the same number, and a second scan
of layers (an encoder's after a decoder's) continues the count, so the graph's layers and the
solvers' ties across layers see one layer per iteration. The planned step is therefore
unrolled: its program grows with the number of layers, unlike the user's scan.

A plan enters through ``constrain(path, index, value)`` after every equation (the sharding
constraint of a planned value), ``reshard(path, source, value)`` on every operand of a primitive
(the spec its reader's strategy reads it in, where the plan reshards it: ``source`` is the
``(path, index)`` of the equation that made the value, or ``("arg", i)`` for the step's i-th
argument leaf, None when unknown) and ``recompute`` (the paths of forward equations, at
top level or in an unrolled scan body, whose outputs are dropped after the forward pass and
recomputed right before their first backward reader, at top level or in an unrolled backward
scan, behind an optimization barrier tied to that reader's other inputs, as ``jax.checkpoint``
does internally; when none of them was reached by the cotangents, to the last value that was.
The values recomputed for one reader share the barrier, and only what the forward pass left
goes through it.
The backward pass reads the tied values out of the barrier from then on: XLA drops a barrier's
outputs that nothing reads, and the recomputation is then free to run as early as its inputs
allow). Dropped values are followed by identity through the scans' plumbing (a
forward body's output stacked as a residual is the same value its backward iteration reads).
With ``beside`` (Lynx), a dropped value is recomputed instead when the interpreter reaches a
given backward equation (one that issues a collective), behind a barrier tied to that
equation's inputs: the recomputation becomes ready together with the collective's operand and
depends on nothing the collective produces, so the scheduler can run it while the collective is
in flight. Those recomputations run under the name scope ``lynx_overlap`` so that they can be
found in the compiled HLO.
With ``regather``, a backward equation that reads a step argument or a value of the forward
pass in another spec than its own reads it out of an optimization barrier tied to its other
operands first: the resharded copy is made for it alone, as the plan prices it, where XLA would
otherwise merge it with the forward pass's copy of the same value and hold that from the
forward pass to the backward pass.
With ``reslice``, a scan of the backward pass slices its stacked inputs (a scanned model's
stacked weights) out of an optimization barrier tied to the iteration's carry: each iteration's
slice is made when the backward pass gets there. Sliced from the same array, XLA merges it with
the forward iteration's slice and holds that from the forward pass to the backward pass, a copy
of every layer's weights that the user's scan does not make (the zoo's scanned Llama at dim
1024, 8 layers, on 2x4: 1,347,124,244 B compiled for kiwi's keep-everything plan without it,
1,162,575,380 B with it).
With ``settle``, the gradients the backward pass hands to the optimizer are tied, through one
optimization barrier, to the cotangents the next backward equation reads, and read out of it
from then on (the optimizer too): each is reduced before the backward pass goes on, where XLA's
all-reduce combiner would otherwise merge every gradient's all-reduce into a few at the end of
the backward pass and hold the gradients unreduced until then.

A ``jax.checkpoint`` (``nnx.remat``, ``nn.remat``) the model applies, in a scan body or around a
scanned stack, is kept, not replaced: its equation (``remat2``, in the backward pass after
autodiff) is inlined the way JAX lowers it, its body behind an optimization barrier on its
inputs, so the model's recomputation still runs in the backward pass as written, its operators
are planned one by one like the rest, and a scan inside it is unrolled like any other (a scan
of the backward pass that runs the same way as a forward scan of its length recomputes it and
takes its layers). ``while`` loops that are not scans (``lax.while_loop``, ``fori_loop`` with
traced bounds) and ``cond`` run as one primitive and are rejected by the operator graph
(:mod:`hlo_tools.graph`).

References:
  KIWI (Liu et al.), sec. 3.2: a recomputed operator runs again just before its first backward
  user (X sets), from kept inputs (eq. 9), or from values of its layer recomputed first (a
  chain, as ``jax.checkpoint`` recomputes a block); Lynx (sec. 4): recomputation overlapped with
  communication.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from typing import Callable

import jax
from jax._src import core as jax_core
from jax._src import source_info_util

__all__ = ["Interpreter", "tag_of", "trace_flat", "inlined_call", "scan_body", "scan_layout",
           "is_unit", "unit_of", "path_key", "program_order", "INLINED_CALLS", "OVERLAP_SCOPE"]

OVERLAP_SCOPE = "lynx_overlap"

_TAG = re.compile(r"(?:^|[/(])k(\d+(?:[_s]\d+)*)(?=[/)]|$)")
_UNIT = re.compile(r"\d+(?:s\d+_\d+)*")
INLINED_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr",
                 "custom_vjp_call": "call_jaxpr", "closed_call": "call_jaxpr",
                 "core_call": "call_jaxpr", "remat2": "jaxpr", "eval_jaxpr": "call_jaxpr"}
"""Call-like primitives the interpreter inlines, each with the parameter holding its body: the
body's equations run one by one, at paths ``<call path>_<index>`` (``eval_jaxpr`` is where jax
0.12 puts the forward pass of a ``jax.checkpoint``, which jax 0.10 put in a ``closed_call``).
``remat2`` (``jax.checkpoint``) is inlined the way JAX lowers it: its differentiated form behind
an optimization barrier on the inputs it protects from CSE."""


def inlined_call(eqn) -> tuple[object, tuple] | None:
    """``(jaxpr, consts)`` of the body of an equation the interpreter inlines (see
    :data:`INLINED_CALLS`); None for any other equation."""
    param = INLINED_CALLS.get(eqn.primitive.name)
    if param is None or param not in eqn.params:
        return None
    body = eqn.params[param]
    return (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())


def scan_body(eqn) -> tuple[object, tuple, int] | None:
    """``(jaxpr, consts, length)`` of a ``scan`` equation's body, which the interpreter unrolls
    (iteration i at paths ``<scan path>s<i>_<index>``); None for any other equation. The body
    is a closed jaxpr up to jax 0.10, an open one (no consts of its own) from jax 0.11."""
    if eqn.primitive.name != "scan":
        return None
    body = eqn.params["jaxpr"]
    consts = body.consts if hasattr(body, "consts") else ()
    return getattr(body, "jaxpr", body), consts, int(eqn.params["length"])


def scan_layout(eqn) -> tuple[int, int]:
    """``(consts, carry)``: how many of a ``scan`` equation's operands are its constants and
    its carry (the rest are the scanned inputs; its outputs are the carry, then the stacks).
    Up to jax 0.10 they are the ``num_consts`` and ``num_carry`` parameters; from jax 0.11 the
    operands' groups (constants, carry, scanned) are the flat tree ``ft_in``."""
    if "num_consts" in eqn.params:
        return int(eqn.params["num_consts"]), int(eqn.params["num_carry"])
    consts, carry, _ = (len(list(group.vals)) for group in eqn.params["ft_in"].unpack())
    return consts, carry


def is_unit(path: str) -> bool:
    """Whether ``path`` is a recompute unit: a top-level equation (``12``) or an equation of an
    unrolled scan body reached through scans only (``12s4_3``, ``12s4_3s0_2``), not one inside
    an inlined call (``12_3``)."""
    return _UNIT.fullmatch(path) is not None


def unit_of(path: str | None) -> str | None:
    """The recompute unit ``path`` is or is inside (``12_3_1`` -> ``12``, ``12s4_3_1`` ->
    ``12s4_3``); None when there is none."""
    while path and not is_unit(path):
        path = path.rpartition("_")[0]
    return path or None


def path_key(path: str) -> tuple[int, ...]:
    """A sort key of paths: their numbers, outermost first (``12s4_3`` -> ``(12, 4, 3)``)."""
    return tuple(int(n) for n in re.findall(r"\d+", path))


def tag_of(op_name: str) -> str | None:
    """The innermost equation path in an HLO ``op_name`` (None when untagged). Where XLA merged
    the metadata of several sources (``a;b``) the first, the instruction's own, counts."""
    found = _TAG.findall(op_name.split(";")[0])
    return found[-1] if found else None


def program_order(op_name: str) -> tuple[int, ...] | None:
    """Where an HLO instruction's equation runs in the interpreted step: the :func:`path_key`
    of its :func:`tag_of` (None when untagged). The graph is numbered in this order
    (``hlo_tools.graph.build_graph``'s ``order``), the order JAX traced the step in, not the
    post order XLA prints."""
    tag = tag_of(op_name)
    return None if tag is None else path_key(tag)


def trace_flat(fn, *args):
    """The closed jaxpr of ``fn`` at ``args`` (abstract or concrete), with a step that is one
    ``jit`` call (``@jax.jit``, ``@nnx.jit`` on the train step) replaced by the call's body.

    Only top-level equations (and those of unrolled scans) are recompute units
    (:func:`is_unit`): in a jitted step none would be, and the plan's recomputations would not
    be applied. The decorator compiles the step itself, so the user's ``jit`` adds nothing.
    """
    closed = jax.make_jaxpr(fn)(*args)
    while len(closed.jaxpr.eqns) == 1 and closed.jaxpr.eqns[0].primitive.name in ("jit", "pjit"):
        closed = _inline_call(closed)
    return closed


def _inline_call(closed):
    """``closed``, whose one equation is a call, with the call's body in its place (the
    body's equations keep their name stacks, so phases and layers are unchanged)."""
    eqn = closed.jaxpr.eqns[0]
    body = eqn.params["jaxpr"]

    def inlined(*args):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]  # noqa: E731
        outs = jax_core.eval_jaxpr(body.jaxpr, body.consts, *[read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
        return [read(v) for v in closed.jaxpr.outvars]

    return jax.make_jaxpr(inlined)(*[v.aval for v in closed.jaxpr.invars])


def is_backward(name_stack: str) -> bool:
    """Backward equations carry ``transpose(`` in their name stack."""
    return "transpose(" in name_stack


def _is_forward(name_stack: str) -> bool:
    return "jvp(" in name_stack and not is_backward(name_stack)


def _follow_cotangents(run: _Run, invals, outvals) -> None:
    """Mark a backward equation's outputs as reached by the cotangents (:attr:`_Run.late`)
    when it reads a value they reached, or combines a constant of the backward pass (the
    loss's seed, made from literals alone: :attr:`_Run.seeds`) with a value of the forward
    pass. Such a value exists only once the backward pass has got that far, so a
    recomputation tied to the last one made (:attr:`_Run.frontier`) cannot be scheduled
    earlier."""
    arrays = [v for v in invals if _is_array(v) and id(v) in run.made]
    seeds = [id(v) in run.seeds for v in arrays]
    if any(id(v) in run.late for v in arrays) or (any(seeds) and not all(seeds)):
        marks = run.late
    elif all(seeds):
        marks = run.seeds
    else:
        return
    arrays_out = [v for v in outvals if _is_array(v)]
    marks.update(id(v) for v in arrays_out)
    if marks is run.late and arrays_out:
        run.frontier = arrays_out[-1]


def _held_back(run: _Run, tie: list) -> list:
    """``tie`` with the last value the cotangents reached added when none of ``tie`` was
    reached by them (see :func:`_follow_cotangents`): a recomputation tied to it runs where the
    backward pass is, not as soon as the forward pass ends. A reader's other operands alone do
    not hold it there when they are values of the forward pass (the softmax's gradient reads
    its output and nothing else of the backward pass): XLA then ran every layer's
    recomputation at the end of the forward pass, where it saved nothing (the zoo ViT on one
    device)."""
    if run.frontier is None or any(id(v) in run.late for v in tie):
        return tie
    return [*tie, run.frontier]


def _is_array(value) -> bool:
    return hasattr(value, "shape") and not isinstance(value, _Stacked)


@dataclasses.dataclass(eq=False)
class _Stacked:
    """A scan's stacked output kept as its per-iteration values (index order); stacked once,
    under the scan's scope, when an equation other than a scan reads it."""

    items: list
    path: str
    index: int
    name_stack: object
    traceback: object
    stacked: object = None


@dataclasses.dataclass(frozen=True)
class _Unit:
    """A dropped forward equation as it ran: what rerunning it needs."""

    eqn: object
    path: str
    name_stack: object
    invals: tuple
    outvals: tuple


@dataclasses.dataclass
class _Run:
    """State of one evaluation of the step."""

    producer: dict = dataclasses.field(default_factory=dict)    # id(value) -> _Unit
    made: dict = dataclasses.field(default_factory=dict)  # id(value) -> (value, (path, index))
    by_path: dict = dataclasses.field(default_factory=dict)     # path -> _Unit
    recomputed: dict = dataclasses.field(default_factory=dict)  # id(value) -> recomputed value
    forward_scans: list = dataclasses.field(default_factory=list)  # (length, reverse, first)
    next_layer: int = 0
    late: set = dataclasses.field(default_factory=set)     # ids of values the cotangents reach
    seeds: set = dataclasses.field(default_factory=set)    # ids of the backward's constants
    renamed: dict = dataclasses.field(default_factory=dict)  # id(value) -> (value, tied copy)
    frontier: object = None                 # the last value made that the cotangents reach
    settling: list = dataclasses.field(default_factory=list)  # gradients not yet tied in
    settling_bytes: int = 0                                     # their bytes

    def named(self, value):
        """``value`` as the backward pass reads it from now on: its copy out of the last
        optimization barrier it was tied through (itself if none)."""
        while _is_array(value):
            entry = self.renamed.get(id(value))
            if entry is None or entry[0] is not value:
                return value
            value = entry[1]
        return value

    def read_out(self, value, copy) -> None:
        """From now on ``value`` is read as ``copy``, its copy out of an optimization barrier
        (:meth:`named`); the copy is what ``value`` was (made by the same equation, reached by
        the cotangents when it was, the frontier when it was)."""
        self.renamed[id(value)] = (value, copy)
        self.made[id(copy)] = (copy, self.source(value))
        if id(value) in self.late:
            self.late.add(id(copy))
            if self.frontier is value:
                self.frontier = copy

    def source(self, value) -> tuple | None:
        """``(path, output index)`` of the equation that made ``value`` (``("arg", i)``: the
        step's i-th argument leaf); None when it was made elsewhere."""
        entry = self.made.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None


@dataclasses.dataclass
class Interpreter:
    """Evaluates a closed jaxpr, tagging equations, unrolling scans and applying a plan.

    Attributes:
      closed: the step's closed jaxpr.
      constrain: ``constrain(path, output_index, value) -> value`` or None.
      reshard: ``reshard(path, source, value) -> value`` on each operand of a primitive, or
        None (see the module notes).
      recompute: paths of forward recompute units (:func:`is_unit`) to drop and recompute;
        non-backward readers (the optimizer) keep reading the original values.
      beside: ``{dropped path: anchor path}``: recompute these when the backward unit at the
        anchor path is reached, tied to its inputs (see the module notes).
      chained: paths in ``recompute`` whose recomputation is read by other recomputations (a
        chain inside a layer): a recomputation reading one of them recomputes it first instead
        of reading the value of the forward pass.
      regather: ``regather(path, source) -> bool``: whether the backward equation at ``path``
        reshards the value made at ``source`` (a step argument or an equation's output) for
        itself alone; such values go through an optimization barrier tied to the equation's
        other operands first, so the copy is made when the backward pass gets there and is not
        merged with the forward pass's copy of the same value (which XLA otherwise holds from
        the forward pass to the backward pass, as a kept activation). None: never.
      settle: ``{(path, output index): bytes}`` of the backward equations whose
        outputs are gradients handed to the optimizer: each is tied into the backward pass's
        next equation that reads a cotangent (see the module notes), by buckets of at most
        ``settle_bytes``.
      settle_bytes: the most bytes of gradients tied in together (a bucket: XLA's
        combiner merges their all-reduces into one, and holds them unreduced until then): the
        gradients made so far are tied in at the first equation reading a cotangent once the
        next gradient to be made (in the equations' order) would not fit the bucket with
        them; 0: each as soon as the backward pass goes on. A gradient larger than the bucket
        is a bucket of its own; those made after the last bucket are left to the combiner.
      reslice: a scan of the backward pass slices its stacked inputs anew in each iteration,
        behind an optimization barrier tied to the iteration's carry (see the module notes).
    """

    closed: object
    constrain: Callable | None = None
    reshard: Callable | None = None
    recompute: frozenset = frozenset()
    beside: dict = dataclasses.field(default_factory=dict)
    chained: frozenset = frozenset()
    regather: Callable | None = None
    settle: dict = dataclasses.field(default_factory=dict)
    settle_bytes: int = 0
    reslice: bool = False
    _gradients: list | None = dataclasses.field(default=None, init=False, repr=False,
                                                compare=False)

    def __call__(self, *args_flat) -> list:
        run = _Run()
        anchored: dict[str, list[str]] = {}
        for dropped, anchor in self.beside.items():
            anchored.setdefault(anchor, []).append(dropped)
        for i, v in enumerate(args_flat):
            run.made[id(v)] = (v, ("arg", i))
        outs = self._eval(run, anchored, self.closed.jaxpr, self.closed.consts, list(args_flat),
                          "", units=True, in_scan=False)
        return [self._materialise(run.named(v) if self.settle else v) for v in outs]

    def _bind(self, run, anchored, eqn, invals, path: str, name_stack, units: bool,
              in_scan: bool):
        """Run one equation (inlining calls, unrolling scans) and constrain its outputs."""
        body = inlined_call(eqn)
        if scan_body(eqn) is not None:
            outvals = self._scan(run, anchored, eqn, invals, path, name_stack, units, in_scan)
        elif body is not None:
            sub_jaxpr, sub_consts = body
            if len(invals) > len(sub_jaxpr.invars):          # custom_jvp_call's leading consts
                invals = invals[len(invals) - len(sub_jaxpr.invars):]
            if eqn.primitive.name == "remat2":
                invals = self._checkpoint_barrier(eqn, invals, path, name_stack)
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=name_stack):
                outvals = self._eval(run, anchored, sub_jaxpr, sub_consts, invals, path,
                                     units=False, in_scan=in_scan)
        else:
            invals = [self._materialise(v) for v in invals]
            params = eqn.primitive.get_bind_params(eqn.params)
            with source_info_util.user_context(
                    eqn.source_info.traceback, name_stack=name_stack.extend(f"k{path}")), \
                    eqn.ctx.manager:
                if self.regather is not None and is_backward(str(name_stack)):
                    invals = self._regathered(run, invals, path)
                if self.reshard is not None:        # tagged as the reader's, as planned
                    invals = [self.reshard(path, run.source(v), v) if _is_array(v) else v
                              for v in invals]
                outvals = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outvals = [outvals]
        if self.constrain is not None:
            outvals = [v if isinstance(v, _Stacked) else self.constrain(path, k, v)
                       for k, v in enumerate(outvals)]
        for k, v in enumerate(outvals):
            if _is_array(v):
                run.made[id(v)] = (v, (path, k))
        return list(outvals)

    def _regathered(self, run, invals, path: str) -> list:
        """``invals`` with the values the equation at ``path`` reshards for itself
        (:attr:`regather`) read out of one optimization barrier tied to its other operands."""
        own = [i for i, v in enumerate(invals) if _is_array(v)
               and self.regather(path, run.source(v))]
        if not own:
            return invals
        tie = _held_back(run, [v for i, v in enumerate(invals) if _is_array(v) and i not in own])
        if not tie:
            return invals
        copies, _ = jax.lax.optimization_barrier(([invals[i] for i in own], tie))
        invals = list(invals)
        for i, copy in zip(own, copies):
            run.made[id(copy)] = (copy, run.source(invals[i]))
            invals[i] = copy
        return invals

    def _next_gradient(self, path: str) -> int:
        """Bytes of the gradients made by the first equation, at ``path`` or after it, that
        makes any (0: none is left)."""
        if self._gradients is None:
            sizes: dict[tuple, int] = {}
            for (where, _), size in self.settle.items():
                sizes[path_key(where)] = sizes.get(path_key(where), 0) + size
            self._gradients = sorted(sizes.items())
        at = bisect.bisect_left(self._gradients, (path_key(path),))
        return self._gradients[at][1] if at < len(self._gradients) else 0

    def _settled(self, run, invals) -> list:
        """``invals`` with the cotangents among them (:attr:`_Run.late`) tied through one
        optimization barrier to the gradients made so far (:attr:`settle`), which are read out of
        it from now on: the backward pass goes on only once those are reduced, so XLA's
        all-reduce combiner cannot merge their collectives with later ones, and the scheduler
        cannot hold them unreduced to the end of the backward pass."""
        late = [v for v in invals if _is_array(v) and id(v) in run.late]
        if not late:
            return invals
        settling, run.settling, run.settling_bytes = run.settling, [], 0
        made, tied = jax.lax.optimization_barrier((settling, late))
        for value, copy in zip([*settling, *late], [*made, *tied]):
            run.read_out(value, copy)
        return [run.named(v) for v in invals]

    def _checkpoint_barrier(self, eqn, invals, path: str, name_stack) -> list:
        """The inputs of a ``jax.checkpoint`` body as its lowering passes them: once
        differentiated, the ones it prevents CSE on go through one optimization barrier, so
        the model's recomputation is not merged with the forward pass's values."""
        prevent = eqn.params.get("prevent_cse", True)
        prevent = (prevent,) * len(invals) if isinstance(prevent, bool) else tuple(prevent)
        guarded = [i for i, flag in enumerate(prevent) if flag]
        if not eqn.params.get("differentiated") or not guarded:
            return invals
        invals = [self._materialise(v) for v in invals]
        with source_info_util.user_context(eqn.source_info.traceback,
                                           name_stack=name_stack.extend(f"k{path}")):
            kept = jax.lax.optimization_barrier([invals[i] for i in guarded])
        for i, value in zip(guarded, kept):
            invals[i] = value
        return invals

    def _scan(self, run, anchored, eqn, invals, path, name_stack, units, in_scan) -> list:
        """Unroll a ``scan`` equation; its stacked outputs stay per iteration (:class:`_Stacked`)."""
        jaxpr, consts, length = scan_body(eqn)
        n_consts, n_carry = scan_layout(eqn)
        fixed = [self._materialise(v) for v in invals[:n_consts]]
        carry = [self._materialise(v) for v in invals[n_consts:n_consts + n_carry]]
        xs = invals[n_consts + n_carry:]
        first_layer = None if in_scan else self._first_layer(
            run, length, bool(eqn.params["reverse"]), str(name_stack))
        ys = [[None] * length for _ in eqn.outvars[n_carry:]]
        for i in (reversed(range(length)) if eqn.params["reverse"] else range(length)):
            stack = name_stack if first_layer is None else \
                name_stack.extend(f"layer_{first_layer + i}")
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
                sliced = [x.items[i] if isinstance(x, _Stacked) else
                          jax.lax.index_in_dim(x, i, axis=0, keepdims=False)
                          for x in self._resliced(run, xs, carry, name_stack)]
                outs = self._eval(run, anchored, jaxpr, consts, fixed + carry + sliced,
                                  f"{path}s{i}", units=units, in_scan=True)
            carry = [self._materialise(v) for v in outs[:n_carry]]
            for k, y in enumerate(outs[n_carry:]):
                ys[k][i] = self._materialise(y)
        stacked = []
        for k, (items, var) in enumerate(zip(ys, eqn.outvars[n_carry:])):
            if length == 0:
                stacked.append(jax.numpy.zeros(var.aval.shape, var.aval.dtype))
            else:
                stacked.append(_Stacked(items, path, n_carry + k, name_stack,
                                        eqn.source_info.traceback))
        return carry + stacked

    def _resliced(self, run, xs: list, carry: list, name_stack) -> list:
        """A scan's stacked inputs as one iteration slices them: in a scan of the backward
        pass (with :attr:`reslice`), the whole arrays read out of an optimization barrier tied
        to the iteration's carry, so each iteration's slice is made when the backward pass gets
        there, as the forward pass's was. Otherwise XLA merges it with the forward pass's
        slice of the same array and holds that from the forward pass to the backward pass: a
        copy of every layer's weights that the user's scan does not make."""
        whole = [k for k, x in enumerate(xs) if _is_array(x)]
        if not (self.reslice and whole and is_backward(str(name_stack))):
            return xs
        tie = _held_back(run, [c for c in carry if _is_array(c)])
        if not tie:
            return xs
        tied, _ = jax.lax.optimization_barrier(([xs[k] for k in whole], tie))
        xs = list(xs)
        for k, x in zip(whole, tied):
            xs[k] = x
        return xs

    @staticmethod
    def _first_layer(run: _Run, length: int, reverse: bool, name_stack: str) -> int | None:
        """The layer number of iteration 0 of an outermost scan. Forward scans count layers in
        order. A scan of the backward pass that runs the other way is the transpose of the
        latest forward scan of its length not yet paired (transposed scans come in reverse
        order) and takes its numbers; one that runs the same way recomputes that forward scan
        (a ``jax.checkpoint`` around the scan) and takes them too. None for scans of
        neither pass (the optimizer's)."""
        if _is_forward(name_stack):
            run.forward_scans.append((length, reverse, run.next_layer))
            run.next_layer += length
            return run.next_layer - length
        if is_backward(name_stack):
            for position in range(len(run.forward_scans) - 1, -1, -1):
                found_length, found_reverse, first = run.forward_scans[position]
                if found_length == length:
                    if found_reverse != reverse:
                        run.forward_scans.pop(position)
                    return first
            run.next_layer += length
            return run.next_layer - length
        return None

    def _materialise(self, value):
        """A stacked scan output as one array (stacked once, constrained as the scan's)."""
        if not isinstance(value, _Stacked):
            return value
        if value.stacked is None:
            with source_info_util.user_context(
                    value.traceback, name_stack=value.name_stack.extend(f"k{value.path}")):
                stacked = jax.lax.concatenate(
                    [jax.lax.expand_dims(item, (0,)) for item in value.items], 0)
            if self.constrain is not None:
                stacked = self.constrain(value.path, value.index, stacked)
            value.stacked = stacked
        return value.stacked

    def _eval(self, run, anchored, jaxpr, consts, args, prefix: str, units: bool,
              in_scan: bool) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jax_core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}_{index}" if prefix else str(index)
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            invals = [read(v) for v in eqn.invars]
            backward = is_backward(str(name_stack)) and scan_body(eqn) is None
            if units and backward:
                invals = self._substitute(run, invals)
                for dropped in sorted(anchored.get(path, ()), key=path_key):
                    self._recompute(run, dropped, invals)
                invals = [run.named(v) for v in invals]     # the copies out of the barriers
                if run.settling and run.settling_bytes + self._next_gradient(path) \
                        > self.settle_bytes:
                    invals = self._settled(run, invals)
            elif units and self.settle and not _is_forward(str(name_stack)):
                invals = [run.named(v) for v in invals]     # the optimizer's gradients
            outvals = self._bind(run, anchored, eqn, invals, path, name_stack, units, in_scan)
            if backward:
                _follow_cotangents(run, invals, outvals)
                if units:
                    made = [(v, self.settle[(path, k)]) for k, v in enumerate(outvals)
                            if (path, k) in self.settle and _is_array(v)]
                    run.settling += [v for v, _ in made]
                    run.settling_bytes += sum(size for _, size in made)
            if units and path in self.recompute and scan_body(eqn) is None:
                unit = _Unit(eqn, path, name_stack, tuple(invals), tuple(outvals))
                run.by_path[path] = unit
                for out in outvals:
                    if _is_array(out) and not any(out is v for v in invals):
                        run.producer[id(out)] = unit
            for var, val in zip(eqn.outvars, outvals):
                if not isinstance(var, jax_core.DropVar):
                    env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def _current(self, run, value):
        """A value as the backward pass sees it: recomputed when it was."""
        return run.recomputed.get(id(value), value) if _is_array(value) else value

    def _recompute(self, run, dropped: str, anchor_invals) -> None:
        """Recompute the unit at ``dropped`` now, tied to ``anchor_invals``."""
        unit = run.by_path.get(dropped)
        if unit is not None and not any(id(v) in run.recomputed for v in unit.outvals):
            tie = _held_back(run, [v for v in anchor_invals if _is_array(v)])
            self._rerun(run, [unit], tie, scope=OVERLAP_SCOPE, chain=False)

    def _rerun(self, run, units, tie, scope: str | None = None, chain: bool = True) -> None:
        """Run dropped units again behind one optimization barrier tied to ``tie`` and record
        their outputs as recomputed. With ``chain``, the :attr:`chained` units they read that
        were not recomputed yet are recomputed first, together with them (Lynx's
        recomputations beside a collective recompute one level, KIWI's eq. 9).

        Only what the forward pass left goes through the barrier, once, as ``jax.checkpoint``
        puts a block's residuals: a value recomputed here or before is already apart from its
        original. Each unit behind a barrier of its own, XLA stored every link of a chain: the
        reference GPT (2 layers, hidden 512, seq 512) planned for 60% on 2x4 with the fused
        model in the program's order compiled to 118,452,884 B, its kernels estimated at
        2.65 ms; with one barrier, 114,275,604 B and 2.59 ms."""
        order: list[_Unit] = []

        def visit(unit: _Unit) -> None:
            if any(unit is u for u in order):
                return
            for value in unit.invals:
                source = run.producer.get(id(value)) if chain and _is_array(value) else None
                if source is not None and source.path in self.chained \
                        and id(value) not in run.recomputed:
                    visit(source)
            order.append(unit)

        for unit in units:
            visit(unit)
        made = {id(out) for unit in order for out in unit.outvals if _is_array(out)}
        left = {id(v): v for unit in order for v in unit.invals
                if _is_array(v) and id(v) not in made and id(v) not in run.recomputed}
        tie = [run.named(v) for v in tie]
        guarded, tied = jax.lax.optimization_barrier((list(left.values()), tie))
        guarded = dict(zip(left, guarded))
        for value, copy in zip(tie, tied):       # read from here on: XLA drops unused ties
            run.read_out(value, copy)
        for unit in order:
            inputs = [guarded[id(v)] if id(v) in guarded else self._current(run, v)
                      for v in unit.invals]
            outs = self._bind(run, {}, unit.eqn, inputs, unit.path,
                              unit.name_stack if scope is None
                              else unit.name_stack.extend(scope),
                              units=False, in_scan=True)
            for original, out in zip(unit.outvals, outs):
                if _is_array(original):
                    run.recomputed[id(original)] = out

    def _substitute(self, run, invals):
        """Replace reads of dropped forward values by their recomputation."""
        dropped = [i for i, v in enumerate(invals) if _is_array(v) and id(v) in run.producer]
        if not dropped:
            return invals
        anchor = _held_back(run, [v for i, v in enumerate(invals)
                                  if i not in dropped and _is_array(v)])
        units = [run.producer[id(invals[i])] for i in dropped
                 if id(invals[i]) not in run.recomputed]
        if units:
            self._rerun(run, units, anchor or [v for v in invals if _is_array(v)])
        return [run.recomputed[id(v)] if i in dropped else v for i, v in enumerate(invals)]
