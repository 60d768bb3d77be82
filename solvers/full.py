"""KIWI's full joint program (eq. 1): stages, recomputation events and residency, with sharding.

Stage t runs node t (eq. 14: A_tt = 1, nothing later is computed yet) and may first recompute
forward values. Compared with the reduced program (solvers.joint) it drops KIWI's three
simplifications: a recomputed node's inputs may themselves be recomputed (chains), a value may
be recomputed several times and freed between its backward uses, and residency is decided per
stage rather than by the liveness sets.

Variables (for forward value i; stages past its last forward use only, since before that it is
resident by construction):
- ``A[t, i]`` binary: i is recomputed in stage t (eq. 1's A_ti for t > i). Only stages that
  read a forward value can consume a recomputation, so only those carry A.
- ``P[t, i]`` binary: i is resident in stage t, carried over from stage t - 1 (Checkmate's and
  eq. 13's B_ti): ``P[t, i] <= P[t-1, i] + A[t-1, i]`` (eq. 13).
- Dependencies (eq. 12): a backward reader t of i needs ``P[t, i] + A[t, i] >= 1``; a
  recomputation of j in stage t needs each forward operand i: ``P[t, i] + A[t, i] >= A[t, j]``.
- Cost: ``w[t, i] >= cost_i(s, e) - M (1 - A[t, i])``: each recomputation pays the operator's
  sharding and resharding cost again (eq. 1).
- Memory: in stage t, i occupies ``mem_i(s) (P[t, i] + A[t, i])`` (eq. 16-19 with every value
  of a stage counted together: no freeing inside a stage, as in the reduced program and the
  simulator); other values live from their stage to their last reader.

Scope: eq. 1 lets any node be recomputed in any stage. Here only forward values are recomputed,
and only in stages that read forward values, which is where KIWI ever drops anything. Every
plan of the reduced program is a plan of this one, so its optimum is never worse.

References:
  KIWI (Liu et al.), eq. 1 and appendix eq. 12-23; Checkmate (Jain et al., MLSys 2020),
  sec. 4 (frontier-advancing stages, R, S and free variables).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from solvers.backend import PEAK_SCALINGS
from solvers.joint import Builder, JointModel
from solvers.linexpr import Expr, total, var
from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["FullModel", "build_full"]



@dataclasses.dataclass
class FullModel(JointModel):
    """The staged program; decodes to recomputation stages."""

    a_vars: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    """(stage, forward node) -> index of its recompute binary."""

    def schedule(self, x: np.ndarray) -> dict[int, tuple[int, ...]]:
        """Per recomputed forward node, the stages where it is recomputed."""
        out: dict[int, list[int]] = {}
        for (t, i), index in sorted(self.a_vars.items()):
            if x[index] > 0.5:
                out.setdefault(i, []).append(t)
        return {i: tuple(ts) for i, ts in out.items()}

    pres_vars: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    """(stage, forward node) -> index of its residency binary."""

    def hint(self, problem: ShardingProblem, strategy, keep=None, recompute_at=None):
        """Strategy binaries and, for a recomputation schedule (a reduced plan's, say), the
        recompute and residency binaries: each copy resident until its last use."""
        values = super().hint(problem, strategy)
        if recompute_at is None:
            return values
        readers, operands = problem.readers(), problem.operands()
        uses: dict[int, list[int]] = {}           # recomputations read their operands too
        for i, stages in recompute_at.items():
            for src in operands[i]:
                uses.setdefault(src, []).extend(stages)
        for (t, i), index in self.a_vars.items():
            values[index] = float(t in recompute_at.get(i, ()))
        for (t, i), index in self.pres_vars.items():
            copies = sorted({i, *recompute_at.get(i, ())})
            needed = sorted(readers[i] + uses.get(i, []))
            copy = max(c for c in copies if c <= t)
            later = [u for u in needed if u >= t and u >= copy]
            served = [u for u in later if max(c for c in copies if c <= u) == copy]
            values[index] = float(bool(served) and copy < t)
        return values

    def decode(self, problem: ShardingProblem, x: np.ndarray, fixed_keep=None):
        strategy, _ = super().decode(problem, x, None)
        keep = np.ones(problem.num_nodes, bool)
        keep[list(self.schedule(x))] = False
        return strategy, keep


def _horizons(p: ShardingProblem, forward: np.ndarray) -> np.ndarray:
    """Last stage at which each forward value can be needed: its last reader, or the horizon of
    a forward reader (which may be recomputed that late)."""
    n = p.num_nodes
    horizon = np.minimum(p.live, n - 1).astype(np.int64)
    readers = p.readers()
    for i in reversed(range(n)):
        if forward[i]:
            for j in readers[i]:
                if forward[j]:
                    horizon[i] = max(horizon[i], horizon[j])
    return horizon


def build_full(problem: ShardingProblem, budget_bytes: int | None,
               minimize_peak: bool = False, recompute_stages=None) -> FullModel:
    """Build the staged program (see the module docstring).

    Args:
      problem: the sharding problem (small: the model has O(|forward| x |stages|) binaries).
      budget_bytes: per-device memory limit (None: no memory rows unless minimising the peak).
      minimize_peak: minimise the peak memory instead of the step time.
      recompute_stages: bool per node, extra stages that may host recomputations besides those
        that read forward values (Lynx-OPT: the stages of nodes with collectives).
    """
    start = time.perf_counter()
    p, b = problem, Builder(problem, None)
    model, n = b.model, problem.num_nodes
    cost = b.node_costs()
    forward = p.phase == Phase.FORWARD
    horizon = _horizons(p, forward)
    operands = p.operands()
    reads_forward = np.zeros(n, bool)
    for src, dst in p.uses:
        if forward[src] and not forward[dst]:
            reads_forward[dst] = True
    if recompute_stages is not None:
        reads_forward |= np.asarray(recompute_stages, bool) & ~forward

    droppable = forward & ~p.is_output
    keys = [(t, int(i)) for i in np.flatnonzero(droppable)
            for t in range(int(p.fwd_last_use[i]) + 1, int(horizon[i]) + 1)]
    recomputing = [key for key in keys if reads_forward[key[0]]]
    pres = dict(zip(keys, model.add_vars(len(keys)).tolist()))   # in one call: 643k on a GPT
    a = dict(zip(recomputing, model.add_vars(len(recomputing)).tolist()))

    def held(t: int, i: int) -> tuple[list[int], float]:
        """1 when i is resident or recomputed in stage t, as ``(variables, constant)``: the sum
        of the variables plus the constant (rows are added from these without Exprs)."""
        if not droppable[i] or t <= p.fwd_last_use[i]:
            return [], 1.0
        if (t, i) not in pres:
            return [], 0.0
        return [pres[t, i]] + ([a[t, i]] if (t, i) in a else []), 0.0

    def available(t: int, i: int) -> Expr:
        """:func:`held` as an expression."""
        indices, constant = held(t, i)
        return Expr(np.array(indices, np.int64), np.ones(len(indices)), constant)

    for (t, i), index in pres.items():                                   # eq. 13
        if t - 1 > p.fwd_last_use[i]:
            before, constant = held(t - 1, i)
            model.add_terms([index] + before, [1.0] + [-1.0] * len(before), -np.inf, constant)
        if (t, i) in a:
            model.add_terms([index, a[t, i]], [1.0, 1.0], -np.inf, 1.0)
    for t in np.flatnonzero(~forward & (p.phase != Phase.PARAM)):               # eq. 12
        for i in operands[int(t)]:
            if droppable[i]:
                now, constant = held(int(t), i)
                model.add_terms(now, [1.0] * len(now), 1.0 - constant, np.inf)
    for (t, j), index in a.items():
        for i in operands[j]:
            if droppable[i]:
                now, constant = held(t, i)
                model.add_terms(now + [index], [1.0] * len(now) + [-1.0], -constant, np.inf)

    objective = [] if minimize_peak else list(cost)
    ub = np.ones(model.num_vars)
    for (_t, i), index in a.items():
        if minimize_peak:
            break
        big = cost[i].upper(ub)
        w = model.add_var(lb=0.0, ub=big, integer=False, resolution=b.units.time_resolution)
        model.add_row(var(w) - cost[i] - var(index, big), -big, np.inf)
        objective.append(var(w))

    peak_var = None
    if budget_bytes is not None or minimize_peak:
        terms = []
        for i in range(n):
            if p.phase[i] == Phase.PARAM:
                terms.append((b.mem(i), 0, n - 1))
            elif droppable[i]:
                terms.append((b.mem(i), i, int(p.fwd_last_use[i])))
            else:
                terms.append((b.mem(i), i, int(min(p.live[i], n - 1))))
        for (t, i) in pres:
            terms.append((b.conditional(i, available(t, i)), t, t))
        terms += b.gathered_terms()
        peak_var = b.limit_memory(terms, budget_bytes, minimize_peak)
    if minimize_peak:
        model.minimize(var(peak_var), PEAK_SCALINGS)
    else:
        model.minimize(total(objective))
    return FullModel(model, b.s_vars, {}, peak_var, time.perf_counter() - start, b.units,
                     b.alive, a_vars=a, pres_vars=pres)
