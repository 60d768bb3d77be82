"""Run a train step's flat jaxpr equation by equation, enforcing a plan as it goes.

The step is traced once to a closed jaxpr (forward, backward and optimizer, after autodiff). The
interpreter evaluates it in order, inlining nested ``jit`` and custom-derivative calls, and runs
every equation inside a name scope ``k<path>`` so that each HLO instruction it lowers to carries
the equation's path in its ``op_name``: the operator graph built from the interpreted step maps
every node back to the equation that produced it. The original name stack (``jvp(...)``,
``transpose(jvp(...))``, ``layer_<i>``) is kept, so phases and layers are unchanged, and with no
plan the interpreted step computes exactly what the plain step computes.

A plan enters through two callbacks: ``constrain(path, index, value)`` after every equation (the
sharding constraint of a planned value) and ``recompute`` (the paths of top-level forward
equations whose outputs are dropped after the forward pass and recomputed right before their
first backward reader, behind an optimization barrier tied to that reader's other inputs, as
``jax.checkpoint`` does internally). With ``beside`` (Lynx), a dropped value is recomputed
instead when the interpreter reaches a given backward equation (one that issues a collective),
behind a barrier tied to that equation's inputs: the recomputation becomes ready together with
the collective's operand and depends on nothing the collective produces, so the scheduler can
run it while the collective is in flight. Those recomputations run under the name scope
``lynx_overlap`` so that they can be found in the compiled HLO.

References:
  KIWI (Liu et al.), sec. 3.2: a recomputed operator runs again just before its first backward
  user (X sets), from kept inputs (eq. 9), or from values of its layer recomputed first (a
  chain, as ``jax.checkpoint`` recomputes a block); Lynx (sec. 4): recomputation overlapped with
  communication.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
from jax._src import core as jax_core
from jax._src import source_info_util

__all__ = ["Interpreter", "tag_of", "trace_flat", "inlined_call", "INLINED_CALLS",
           "OVERLAP_SCOPE"]

OVERLAP_SCOPE = "lynx_overlap"

_TAG = re.compile(r"(?:^|[/(])k(\d+(?:_\d+)*)(?=[/)]|$)")
INLINED_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr",
                 "custom_vjp_call": "call_jaxpr", "closed_call": "call_jaxpr",
                 "core_call": "call_jaxpr"}
"""Call-like primitives the interpreter inlines, each with the parameter holding its body: the
body's equations run one by one, at paths ``<call path>_<index>``."""


def inlined_call(eqn) -> tuple[object, tuple] | None:
    """``(jaxpr, consts)`` of the body of an equation the interpreter inlines (see
    :data:`INLINED_CALLS`); None for any other equation."""
    param = INLINED_CALLS.get(eqn.primitive.name)
    if param is None or param not in eqn.params:
        return None
    body = eqn.params[param]
    return (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())


def tag_of(op_name: str) -> str | None:
    """The innermost equation path in an HLO ``op_name`` (None when untagged). Where XLA merged
    the metadata of several sources (``a;b``) the first, the instruction's own, counts."""
    found = _TAG.findall(op_name.split(";")[0])
    return found[-1] if found else None


def trace_flat(fn, *args):
    """The closed jaxpr of ``fn`` at ``args`` (abstract or concrete)."""
    return jax.make_jaxpr(fn)(*args)


def _order(path: str) -> int:
    return int(path.split("_")[0])


def is_backward(name_stack: str) -> bool:
    """Backward equations carry ``transpose(`` in their name stack."""
    return "transpose(" in name_stack


@dataclasses.dataclass
class Interpreter:
    """Evaluates a closed jaxpr, tagging equations and applying a plan.

    Attributes:
      closed: the step's closed jaxpr.
      constrain: ``constrain(path, output_index, value) -> value`` or None.
      recompute: paths of top-level forward equations to drop and recompute; non-backward
        readers (the optimizer) keep reading the original values.
      beside: ``{dropped path: anchor path}``: recompute these when the top-level backward
        equation at the anchor path is reached, tied to its inputs (see the module notes).
      chained: paths in ``recompute`` whose recomputation is read by other recomputations (a
        chain inside a layer): a recomputation reading one of them recomputes it first instead
        of reading the value of the forward pass.
    """

    closed: object
    constrain: Callable | None = None
    recompute: frozenset = frozenset()
    beside: dict = dataclasses.field(default_factory=dict)
    chained: frozenset = frozenset()

    def __call__(self, *args_flat) -> list:
        return self._eval(self.closed.jaxpr, self.closed.consts, list(args_flat), "", top=True)

    def _bind(self, eqn, invals, path: str, name_stack):
        """Run one equation (inlining calls) and constrain its outputs."""
        body = inlined_call(eqn)
        if body is not None:
            sub_jaxpr, sub_consts = body
            if len(invals) > len(sub_jaxpr.invars):          # custom_jvp_call's leading consts
                invals = invals[len(invals) - len(sub_jaxpr.invars):]
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=name_stack):
                outvals = self._eval(sub_jaxpr, sub_consts, invals, path, top=False)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            with source_info_util.user_context(
                    eqn.source_info.traceback, name_stack=name_stack.extend(f"k{path}")), \
                    eqn.ctx.manager:
                outvals = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outvals = [outvals]
        if self.constrain is not None:
            outvals = [self.constrain(path, k, v) for k, v in enumerate(outvals)]
        return list(outvals)

    def _eval(self, jaxpr, consts, args, prefix: str, top: bool) -> list:
        env: dict = {}
        producer: dict = {}          # var -> (eqn, path, name_stack) of recomputable eqns
        recomputed: dict = {}        # var -> value recomputed for the backward pass

        def read(v):
            return v.val if isinstance(v, jax_core.Literal) else env[v]

        anchored: dict[str, list[str]] = {}
        for dropped, anchor in (self.beside.items() if top else ()):
            anchored.setdefault(anchor, []).append(dropped)
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for index, eqn in enumerate(jaxpr.eqns):
            path = f"{prefix}_{index}" if prefix else str(index)
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            invals = [read(v) for v in eqn.invars]
            if top and is_backward(str(eqn.source_info.name_stack)):
                invals = self._substitute(eqn, invals, producer, recomputed, read)
                for dropped in sorted(anchored.get(path, ()), key=_order):
                    self._recompute(dropped, producer, recomputed, read, invals)
            outvals = self._bind(eqn, invals, path, name_stack)
            for var, val in zip(eqn.outvars, outvals):
                if not isinstance(var, jax_core.DropVar):
                    env[var] = val
                    if top and path in self.recompute:
                        producer[var] = (eqn, path, name_stack)
        return [read(v) for v in jaxpr.outvars]

    def _recompute(self, dropped: str, producer, recomputed, read, anchor_invals) -> None:
        """Recompute the equation at ``dropped`` now, tied to ``anchor_invals``."""
        found = [(var, entry) for var, entry in producer.items() if entry[1] == dropped]
        if found and found[0][0] not in recomputed:
            tie = [v for v in anchor_invals if hasattr(v, "shape")]
            self._rerun(found[0][1], tie, recomputed, {}, read, scope=OVERLAP_SCOPE)

    def _rerun(self, entry, tie, recomputed, producer, read, scope: str | None = None) -> None:
        """Run a producer equation again behind an optimization barrier tied to ``tie`` and
        record its outputs as recomputed. Inputs from :attr:`chained` equations that were not
        recomputed yet are recomputed first, tied to the same values; the others are read as
        they are (recomputed, or as the forward pass left them). Lynx's recomputations beside a
        collective pass no ``producer``: its plans recompute one level (KIWI's eq. 9)."""
        src_eqn, path, name_stack = entry
        for v in src_eqn.invars:
            if not isinstance(v, jax_core.Literal) and v in producer and v not in recomputed \
                    and producer[v][1] in self.chained:
                self._rerun(producer[v], tie, recomputed, producer, read, scope)
        current = [recomputed[v] if not isinstance(v, jax_core.Literal) and v in recomputed
                   else read(v) for v in src_eqn.invars]
        inputs, _ = jax.lax.optimization_barrier((current, tie))
        outs = self._bind(src_eqn, inputs, path,
                          name_stack if scope is None else name_stack.extend(scope))
        for out_var, out in zip(src_eqn.outvars, outs):
            recomputed[out_var] = out

    def _substitute(self, eqn, invals, producer, recomputed, read):
        """Replace reads of dropped forward values by their recomputation."""
        dropped = [i for i, v in enumerate(eqn.invars)
                   if not isinstance(v, jax_core.Literal) and v in producer]
        if not dropped:
            return invals
        anchor = [val for i, (v, val) in enumerate(zip(eqn.invars, invals)) if i not in dropped
                  and not isinstance(v, jax_core.Literal)]
        for i in dropped:
            var = eqn.invars[i]
            if var not in recomputed:
                self._rerun(producer[var], anchor or invals, recomputed, producer, read)
            invals[i] = recomputed[var]
        return invals
