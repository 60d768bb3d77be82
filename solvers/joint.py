"""KIWI's reduced joint program (sharding + keep/recompute) as a MILP, and its fixed-keep variants.

Variables and rows:
- ``s[l, a]`` binary: leader l (a node carrying a strategy variable) takes strategy a, one per
  leader (eq. 21); followers take ``follow[i][a]``.
- Edges between two leaders: the resharding matrix R_ji only depends on the producer's output
  spec and the consumer's operand spec, so strategies with equal rows (columns) form classes and
  the joint indicator e = s_j s_i^T (eq. 22-23) is kept per pair of classes, as continuous
  variables whose row and column sums equal the classes' strategy sums. That is the tightest
  linear description of the product of two one-hot vectors, and exact at integer s. Matrices that
  split as u[a] + v[b] need no e at all and go into the node costs.
- ``m_i`` binary for each forward node read by the backward pass (z_i = 1): 1 keeps it, 0 drops
  it after its last forward reader and recomputes it before its first backward reader, or, in a
  layer, before the first dropped value of the layer that is recomputed from it
  (``ShardingProblem.dropped_stages``; the memory rows count that stage exactly or over every
  stage it can take, see :func:`_memory_rows`).
- ``w_i >= cost_i(s, e) - M_i m_i``: the recomputation cost, the (1 - m_i) z_i factor of eq. 2.
- Memory: every value's lifetime is a union of intervals whose bytes are ``mem_i(s)`` or, for
  the windows a keep decision opens (kept value between its last forward and first backward use;
  operand held until a recomputed reader runs: h_i of eq. 10-11), ``mem_i(s)`` times a 0/1
  condition (big-M, exact on the <= side). The operand copy an edge's resharding makes lives
  in its reader's stage, its bytes in the same joint indicators as the edge's seconds. ``U_k``,
  the bytes alive at the k-th time where some lifetime ends (only there can the peak occur),
  stay under the budget (eq. 8): as variables following the recurrence of eq. 3 where
  strategies are chosen, as the sums of the terms alive there where none is (one device; see
  :meth:`Builder.limit_memory`).
- Eq. 9 (inputs of a recomputed node are kept): ``m_i + m_j >= 1`` on every edge i -> j between
  recomputable nodes (eq. 31 for binary m), except inside a layer: there a dropped value may be
  recomputed from other dropped values of the layer, as ``jax.checkpoint`` around a block does
  (a chain; ``ShardingProblem.chained``), so per-block policies such as ``dots_saveable`` and
  ``nothing_saveable`` are plans of the program. Other forward inputs are held by the memory
  terms.

References:
  KIWI (Liu et al.), eq. 2-11 and appendix eq. 21-31; Alpa (Zheng et al., OSDI 2022), sec. 4.2
  (one-hot strategies, resharding on edges); Sherali-Adams / local-polytope linearisation of
  products of one-hot vectors.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import scipy.sparse as sp

from solvers.backend import PEAK_SCALINGS, TIME_SCALINGS, Model
from solvers.linexpr import Expr, const, total, var
from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["JointModel", "build_joint", "Builder", "Units", "Alive"]



@dataclasses.dataclass(frozen=True)
class Units:
    """The units a model counts time and memory in, chosen per problem so that its largest
    coefficients are about a thousand: costs in seconds (1e-7 .. 1e-3) would sit at the
    backends' feasibility and optimality tolerances, and bytes (up to 1e10) far above them."""

    seconds: float
    """Seconds per model time unit."""
    bytes: float
    """Bytes per model memory unit (a power of two, at least 1)."""

    @classmethod
    def for_problem(cls, problem: ShardingProblem) -> "Units":
        cost = max(float(problem.node_cost(i).max()) for i in range(problem.num_nodes))
        cost = max([cost] + [float(r.max()) for _, _, r in problem.priced_pairs()])
        memory = max(float(m.max()) for m in problem.memory)
        return cls(seconds=2.0 ** math.floor(math.log2(max(cost, 1e-30) / 1e3)),
                   bytes=2.0 ** max(0, math.floor(math.log2(max(memory, 1.0) / 1e3))))

    @property
    def time_resolution(self) -> float:
        """The time step of integer-only backends: a millionth of the largest cost."""
        return 1e-3

    @property
    def memory_resolution(self) -> float:
        """1 byte in model units (for integer-only backends)."""
        return 1.0 / self.bytes


SUMS_MAX_NONZEROS = 2_000_000
"""The most nonzeros the memory rows are written with as sums (:meth:`Builder.limit_memory`):
the largest measured, the reference GPT on one device, had 1.76 M and solved as fast as through
the recurrence; beyond, unmeasured, the recurrence, linear in the graph's size, is kept."""


@dataclasses.dataclass(frozen=True)
class Alive:
    """The bytes alive at each time where some lifetime ends, ``U_k``, as an affine map of the
    program's variables: ``matrix @ x + constant``, in memory units."""

    matrix: sp.csr_matrix
    constant: np.ndarray

    @classmethod
    def none(cls) -> "Alive":
        """No memory rows."""
        return cls(sp.csr_matrix((0, 0)), np.zeros(0))

    @classmethod
    def of_vars(cls, u: np.ndarray, num_vars: int) -> "Alive":
        """``U_k`` held in variables ``u[k]``."""
        k = len(u)
        return cls(sp.csr_matrix((np.ones(k), (np.arange(k), u)), shape=(k, num_vars)),
                   np.zeros(k))

    def __len__(self) -> int:
        return self.matrix.shape[0]

    def at(self, x: np.ndarray) -> np.ndarray:
        """``U_k`` of a solution."""
        return self.matrix @ x[:self.matrix.shape[1]] + self.constant


@dataclasses.dataclass
class JointModel:
    """The MILP and what is needed to read a plan back from its solution."""

    model: Model
    """The MILP."""
    s_vars: dict[int, np.ndarray]
    """Leader node -> indices of its strategy binaries (absent: a single strategy). Tied leaders
    share one array."""
    m_vars: dict[int, int]
    """Recomputable node -> index of its keep binary (empty when keep flags are fixed)."""
    peak_var: int | None
    """Index of the peak variable when minimising the peak."""
    build_seconds: float
    """Time spent building."""
    units: Units
    """The units of the model's time and memory."""
    alive: Alive = dataclasses.field(default_factory=Alive.none)
    """The U_k (bytes alive where a lifetime ends); none without memory rows."""

    def claimed_peak(self, x: np.ndarray) -> int | None:
        """The peak the program claims for a solution (None without memory rows)."""
        if not len(self.alive):
            return None
        return int(round(float(self.alive.at(x).max()) * self.units.bytes))

    def decode(self, problem: ShardingProblem, x: np.ndarray, fixed_keep=None):
        """``(strategy per node, keep per node)`` from a MILP solution."""
        choice = np.zeros(problem.num_nodes, np.int64)
        for leader in problem.leaders:
            idx = self.s_vars.get(int(leader))
            choice[leader] = 0 if idx is None else int(np.argmax(x[idx]))
        strategy = np.array([problem.follow[i][choice[problem.leader[i]]]
                             for i in range(problem.num_nodes)], np.int64)
        if fixed_keep is not None:
            return strategy, np.asarray(fixed_keep, bool).copy()
        keep = np.ones(problem.num_nodes, bool)
        for node, index in self.m_vars.items():
            keep[node] = x[index] > 0.5
        return strategy, keep

    def hint(self, problem: ShardingProblem, strategy, keep=None) -> dict[int, float]:
        """Values of the strategy (and keep) binaries that encode a plan: a warm start.

        Leaders whose strategy index does not map back (a follower-only choice) are left out.
        """
        values: dict[int, float] = {}
        for leader, idx in self.s_vars.items():
            for a, index in enumerate(idx):
                values[int(index)] = float(a == strategy[leader])
        if keep is not None:
            for node, index in self.m_vars.items():
                values[index] = float(keep[node])
        return values


class Builder:
    """State shared by the parts of the formulation."""

    def __init__(self, problem: ShardingProblem, tie: np.ndarray | None, copies: bool = True):
        self.p = problem
        # count the operand copies resharding makes (their matrices then refine the joint
        # class indicators of a pair of leaders, which the resharding seconds share)
        self.copies = copies
        self.model = Model()
        self.units = Units.for_problem(problem)
        self.alive = Alive.none()
        self.tie = np.arange(problem.num_nodes) if tie is None else np.asarray(tie)
        self.s_vars: dict[int, np.ndarray] = {}
        self.e_cache: dict = {}
        self.class_cache: dict = {}
        self.g_cache: dict = {}
        self._mem: list[Expr | None] = [None] * problem.num_nodes
        self._pairs: list[Expr] | None = None
        k = problem.num_strategies
        leaders = [int(leader) for leader in problem.leaders if k[leader] > 1]
        twin = {leader: int(self.tie[leader]) for leader in leaders}
        shared = {leader for leader in leaders if twin[leader] != leader
                  and problem.leader[twin[leader]] == twin[leader]
                  and k[twin[leader]] == k[leader] and twin[twin[leader]] == twin[leader]}
        for leader in leaders:                  # representatives first: twins may come later
            if leader not in shared:
                idx = self.model.add_vars(int(k[leader]))
                self.s_vars[leader] = idx
                self.model.add_row(Expr(idx, np.ones(len(idx))), 1.0, 1.0)
        for leader in shared:
            self.s_vars[leader] = self.s_vars[twin[leader]]

    def pin(self, node: int, choice: int) -> None:
        """Make node ``node`` take its strategy ``choice``: its leader's strategies that give
        it another are ruled out.

        Raises:
          ValueError: no strategy of the leader gives the node that one.
        """
        leader = int(self.p.leader[node])
        other = np.asarray(self.p.follow[node]) != choice
        if other.all():
            raise ValueError(f"{self.p.names[node]} cannot take its strategy {choice}: no "
                             f"strategy of {self.p.names[leader]}, which decides it, gives it")
        idx = self.s_vars.get(leader)
        if idx is not None and other.any():
            self.model.add_row(Expr(idx[other], np.ones(int(other.sum()))), 0.0, 0.0)

    def leader_expr(self, leader: int, values: np.ndarray) -> Expr:
        """``values`` over a leader's strategies as an expression in its binaries."""
        values = np.asarray(values, float)
        idx = self.s_vars.get(int(leader))
        if idx is None:
            return const(values[0])
        low = float(values.min())                    # sum(s) = 1: the minimum is a constant
        keep = values > low
        return Expr(idx[keep], values[keep] - low, low)

    def node_expr(self, i: int, values: np.ndarray) -> Expr:
        """``values`` over node i's strategies, through its leader."""
        return self.leader_expr(int(self.p.leader[i]), np.asarray(values, float)[self.p.follow[i]])

    def mem(self, i: int) -> Expr:
        """Per-device bytes of node i's output under its strategy."""
        if self._mem[i] is None:
            self._mem[i] = self.node_expr(i, self.p.memory[i] / self.units.bytes)
        return self._mem[i]

    def conditional(self, i: int, condition: Expr, signed: bool = False) -> Expr:
        """An expression >= mem_i(s) * condition for a 0/1 ``condition`` (big-M; exact where it
        only bounds memory from above). ``signed``: the condition is a difference of two 0/1
        expressions, and the bound is on mem_i(s) times its positive part."""
        mem = self.mem(i)
        if condition.is_constant:
            return mem * (max(condition.constant, 0.0) if signed else condition.constant)
        if mem.is_constant and not signed:
            return condition * mem.constant
        big = float(self.p.memory[i].max()) / self.units.bytes
        key = (mem.key, condition.key, big)       # tied layers ask for the same product
        if key not in self.g_cache:
            g = self.model.add_var(lb=0.0, ub=big, integer=False,
                                   resolution=self.units.memory_resolution)
            self.model.add_row(var(g) - mem - condition * big, -big, np.inf)
            self.g_cache[key] = g
        return var(self.g_cache[key])

    def limit_memory(self, terms, budget, minimize_peak: bool,
                     skip: np.ndarray | None = None) -> int | None:
        """Rows that keep the bytes alive at every time under ``budget``.

        Args:
          terms: ``(bytes expression, first time, last time)`` of every lifetime interval.
          budget: the per-device budget in bytes (ignored when minimising the peak).
          minimize_peak: add and return a variable >= every U_k.
          skip: per time, True where no row is kept (see ``skip_times`` of
            :func:`build_joint`); None: rows at every time.

        The peak can only occur where some interval ends, so ``U_k`` is kept for those times
        only. An integer time is a stage, and an interval from one holds over the stage's
        recomputations too; a fractional time is the recomputation of a node in a stage
        (:func:`recomputation_time`), where a chain's intermediate lives.

        Where strategies are chosen, ``U_k`` are variables following the recurrence
        ``U_k = U_{k-1} + entering - leaving`` (KIWI eq. 3, 8): a parameter's bytes, alive
        at every time, then enter one row, not thousands. Where none is (one device), each
        ``U_k`` is the sum of the terms alive at k, a knapsack row over the keep flags whose
        cuts the backend finds at once; through the recurrence it must aggregate along the
        chain for them. On the zoo Llama on one device at 57% (its 68 keep flags) HiGHS
        proves the plans in 3.6, 4.5 and 1.8 s against 9.3, 5.7 and 27.2 s through the
        recurrence; on a mesh the sums' strategy terms make the rows 3-15x denser and the
        solves slower (docs/solvers.md). Sums with more than :data:`SUMS_MAX_NONZEROS`
        nonzeros are written as the recurrence too.
        """
        terms = [t for t in terms if not t[0].is_constant or t[0].constant]
        # a whole stage (integer times) spans its recomputations (sub-stage times, below)
        terms = [(e, a - 1 + 0.5 / (self.p.num_nodes + 1) if float(a).is_integer() else a, z)
                 for e, a, z in terms]
        ends = np.unique([z for _, _, z in terms])
        if skip is not None:                      # a recomputation's time: its stage's
            ends = ends[~skip[np.ceil(ends).astype(np.int64)]]
        first_k = np.searchsorted(ends, [a for _, a, _ in terms])
        last_k = np.searchsorted(ends, [z for _, _, z in terms], side="right") - 1
        spans = [(expr, int(fk), int(lk)) for (expr, _, _), fk, lk in zip(terms, first_k, last_k)
                 if fk <= lk]
        most = sum(float(m.max()) for m in (*self.p.memory, *self.p.gathered)) / self.units.bytes
        limit = most if minimize_peak else min(most, budget / self.units.bytes)
        # the sums' size is counted only where they may be written (no strategy binaries)
        sums = not self.s_vars and sum(len(expr.indices) * (lk - fk + 1)
                                       for expr, fk, lk in spans) <= SUMS_MAX_NONZEROS
        u = None if sums else self._recurrence(spans, len(ends), limit)
        peak = None
        if minimize_peak:
            peak = self.model.add_var(lb=0.0, ub=most, integer=False,
                                      resolution=self.units.memory_resolution)
        if sums:
            self._sums(spans, len(ends), limit, peak)
        elif peak is not None:
            for u_k in u:
                self.model.add_row(var(int(u_k)) - var(peak), -np.inf, 0.0)
        return peak

    def _recurrence(self, spans, count: int, limit: float) -> np.ndarray:
        """``U_k`` as variables, ``U_k = U_{k-1} + entering - leaving``, each at most the
        limit; returns their indices."""
        model = self.model
        u = model.add_vars(count, lb=0.0, integer=False, resolution=self.units.memory_resolution,
                           ub=limit)
        enter: list[list[Expr]] = [[] for _ in range(count)]
        leave: list[list[Expr]] = [[] for _ in range(count)]
        for expr, fk, lk in spans:
            enter[fk].append(expr)
            if lk + 1 < count:
                leave[lk + 1].append(expr)
        for k in range(count):
            row = var(int(u[k])) - total(enter[k]) + total(leave[k])
            if k:
                row = row - var(int(u[k - 1]))
            model.add_row(row, 0.0, 0.0)
        self.alive = Alive.of_vars(u, model.num_vars)
        return u

    def _sums(self, spans, count: int, limit: float, peak: int | None) -> None:
        """``U_k`` as the sum of the terms alive at k, each sum at most the limit (at most
        ``peak`` when minimising it)."""
        model = self.model
        size = [len(expr.indices) for expr, _, _ in spans]
        length = [lk - fk + 1 for _, fk, lk in spans]
        rows = np.concatenate([np.zeros(0, np.int64)] + [
            np.repeat(np.arange(fk, lk + 1), n) for (_, fk, lk), n in zip(spans, size)])
        cols = np.concatenate([np.zeros(0, np.int64)] + [
            np.tile(expr.indices, m) for (expr, _, _), m in zip(spans, length)])
        vals = np.concatenate([np.zeros(0)] + [
            np.tile(expr.coefs, m) for (expr, _, _), m in zip(spans, length)])
        change = np.zeros(count + 1)
        for expr, fk, lk in spans:
            change[fk] += expr.constant
            change[lk + 1] -= expr.constant
        constant = np.cumsum(change[:-1])
        matrix = sp.csr_matrix((vals, (rows, cols)), shape=(count, model.num_vars))
        matrix.sum_duplicates()
        for k in range(count):
            lo, hi = matrix.indptr[k], matrix.indptr[k + 1]
            indices, coefs = matrix.indices[lo:hi], matrix.data[lo:hi]
            if peak is None:
                model.add_terms(indices, coefs, -np.inf, limit - constant[k])
            else:
                model.add_terms(np.append(indices, peak), np.append(coefs, -1.0), -np.inf,
                                -constant[k])
        self.alive = Alive(matrix, constant)

    def exact_and(self, x: Expr, y: Expr) -> Expr:
        """The conjunction of two 0/1 expressions, exact at integer values of what they are
        built from (rows on both sides; a new variable unless one is constant)."""
        for a, other in ((x, y), (y, x)):
            if a.is_constant:
                return const(0.0) if a.constant <= 0 else other
        key = ("and", x.key, y.key)
        if key not in self.g_cache:
            v = self.model.add_var(lb=0.0, ub=1.0, integer=False)
            self.model.add_row(var(v) - x, -np.inf, 0.0)
            self.model.add_row(var(v) - y, -np.inf, 0.0)
            self.model.add_row(var(v) - x - y, -1.0, np.inf)
            self.g_cache[key] = v
        return var(self.g_cache[key])

    def either(self, conditions: list[Expr], exact: bool = False) -> Expr:
        """An expression at least every condition (each at most 1), at most 1: their
        disjunction where the rows push it down (a new variable for two or more that are not
        constant); with ``exact``, at most their sum too, so it is their disjunction at
        integer values of what they are built from."""
        live = [c for c in conditions if not c.is_constant or c.constant > 0]
        if any(c.is_constant and c.constant >= 1 for c in live):
            return const(1.0)
        if len(live) <= 1:
            return live[0] if live else const(0.0)
        key = ("xor" if exact else "or", *sorted(c.key for c in live))
        if key not in self.g_cache:
            v = self.model.add_var(lb=0.0, ub=1.0, integer=False)
            for c in live:
                self.model.add_row(var(v) - c, 0.0, np.inf)
            if exact:
                self.model.add_row(var(v) - total(live), -np.inf, 0.0)
            self.g_cache[key] = v
        return var(self.g_cache[key])

    def held(self, i: int, condition: Expr) -> Expr:
        """mem_i(s) times a condition at most 1, which may be negative (0 there)."""
        low = condition.constant + float(np.minimum(condition.coefs, 0).sum())
        return self.conditional(i, condition, signed=low < 0)

    def gathered_terms(self) -> list[tuple[Expr, int, int]]:
        """Lifetime terms of the operand copies resharding makes: each alive in the stage of
        its reader (the simulator's semantics)."""
        return [(expr, int(dst), int(dst))
                for (_, dst, _), expr in zip(self.p.edges, self.gathered_exprs())]

    def node_costs(self) -> list[Expr]:
        """Per node, the bracket of eq. 2: c_i + d_i of its strategy plus the resharding on its
        incoming edges."""
        cost = [self.node_expr(i, self.p.node_cost(i) / self.units.seconds)
                for i in range(self.p.num_nodes)]
        for (_, dst, _), expr in zip(self.p.priced_pairs(), self.edge_exprs()):
            cost[dst] = cost[dst] + expr
        return cost

    def edge_exprs(self) -> list[Expr]:
        """Resharding seconds of every edge, then of every carried state value
        (:meth:`ShardingProblem.priced_pairs`), as an expression."""
        return self._pair_exprs()[:len(self.p.priced_pairs())]

    def gathered_exprs(self) -> list[Expr]:
        """Per edge, the bytes of the operand copy its resharding makes
        (:attr:`ShardingProblem.gathered`), as an expression; empty without them or when the
        builder does not count them."""
        return self._pair_exprs()[len(self.p.priced_pairs()):]

    def _pair_exprs(self) -> list[Expr]:
        """:meth:`edge_exprs` then :meth:`gathered_exprs`, built once: the matrices of a pair
        of leaders share their joint class indicators."""
        if self._pairs is not None:
            return self._pairs
        p = self.p
        matrices = [(int(src), int(dst), r / self.units.seconds)
                    for src, dst, r in p.priced_pairs()]
        if self.copies:
            matrices += [(int(src), int(dst), g / self.units.bytes)
                         for (src, dst, _), g in zip(p.edges, p.gathered)]
        out: list[Expr | None] = [None] * len(matrices)
        pairs: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
        for e, (src, dst, full) in enumerate(matrices):
            ls, ld = int(p.leader[src]), int(p.leader[dst])
            matrix = full[np.ix_(p.follow[src], p.follow[dst])]
            if not matrix.any():
                out[e] = const(0.0)
            elif ls == ld:
                out[e] = self.leader_expr(ls, np.diagonal(matrix))
            elif ls not in self.s_vars or ld not in self.s_vars:
                out[e] = self.leader_expr(ld, matrix[0]) if ls not in self.s_vars \
                    else self.leader_expr(ls, matrix[:, 0])
            else:
                pairs.setdefault((ls, ld), []).append((e, matrix))
        for (ls, ld), members in pairs.items():
            edges, mats = [e for e, _ in members], [m for _, m in members]
            if all(_separable(m) for m in mats):
                for e, m in zip(edges, mats):
                    out[e] = self.leader_expr(ls, m[:, 0] - m[0, 0]) + self.leader_expr(ld, m[0])
                continue
            rows, first_a = self._classes(np.hstack(mats))
            cols, first_b = self._classes(np.vstack(mats).T)
            evars = self._pair_vars(ls, ld, rows, cols)
            for e, m in zip(edges, mats):
                block = m[np.ix_(first_a, first_b)].ravel()
                nz = block != 0
                out[e] = Expr(evars.ravel()[nz], block[nz])
        self._pairs = out
        return out

    def _classes(self, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(class of every row, first row of every class)``, memoised: repeated layers
        present the same matrices once per layer."""
        key = (matrix.shape, matrix.tobytes())
        if key not in self.class_cache:
            classes = _classes(matrix)
            self.class_cache[key] = classes, _first_of_class(classes)
        return self.class_cache[key]

    def _pair_vars(self, ls: int, ld: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Joint class indicators of two leaders (shared by pairs with the same binaries and
        classes, as tied layers have)."""
        src, dst = self.s_vars[ls], self.s_vars[ld]
        key = (int(src[0]), int(dst[0]), rows.tobytes(), cols.tobytes())
        if key in self.e_cache:
            return self.e_cache[key]
        nr, nc = int(rows.max()) + 1, int(cols.max()) + 1
        evars = self.model.add_vars(nr * nc, lb=0.0, ub=1.0, integer=False).reshape(nr, nc)
        for a in range(nr):
            self.model.add_row(Expr(evars[a], np.ones(nc)) - Expr(src[rows == a],
                                                                  np.ones((rows == a).sum())),
                               0.0, 0.0)
        for b in range(nc):
            self.model.add_row(Expr(evars[:, b], np.ones(nr)) - Expr(dst[cols == b],
                                                                     np.ones((cols == b).sum())),
                               0.0, 0.0)
        self.e_cache[key] = evars
        return evars


def _separable(matrix: np.ndarray) -> bool:
    rest = matrix - matrix[:, :1] - matrix[:1, :] + matrix[0, 0]
    return bool(np.all(np.abs(rest) <= 1e-9 * max(1e-30, float(np.abs(matrix).max()))))


def _classes(matrix: np.ndarray) -> np.ndarray:
    """Class id of every row (equal rows, equal class), numbered by first appearance."""
    _, first, inverse = np.unique(matrix, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse.ravel()]


def _first_of_class(classes: np.ndarray) -> np.ndarray:
    return np.array([int(np.flatnonzero(classes == c)[0]) for c in range(classes.max() + 1)])


def build_joint(problem: ShardingProblem, budget_bytes: int | None, fixed_keep=None,
                minimize_peak: bool = False, tie: np.ndarray | None = None,
                max_seconds: float | None = None,
                skip_times: np.ndarray | None = None, copies: bool = True,
                pinned: dict[int, int] | None = None, exact_chains: bool = False) -> JointModel:
    """Build the joint program.

    Args:
      problem: the sharding problem.
      budget_bytes: per-device memory limit (None: no memory rows unless minimising the peak).
      fixed_keep: keep flag per node to impose (alpa: all True; the heuristics), or None to let
        the program choose (kiwi).
      minimize_peak: minimise the peak memory instead of the step time (the smallest feasible
        budget).
      tie: per node, a node whose decisions it copies (layer reuse, see
        :func:`solvers.reuse.layer_ties`), or None.
      max_seconds: an upper bound on the step time (with ``minimize_peak``: the smallest peak
        among the plans at most this slow).
      skip_times: per time, True where the memory rows may be left out (for a tied program,
        the inner repeats of its layers and the optimizer's updates: ``solvers.solve.
        _skipped_times``); the caller checks the plan's replay against the budget. None: rows
        at every time.
      pinned: node -> the strategy it must take (a recipe's parameter layout,
        :func:`kiwi_jax.recipe_plan.recipe_pins`); a tied node's pin holds for its twins.
      exact_chains: count a recomputed chain's lifetimes as the plan holds them where its
        keep flags are free (see :func:`_memory_rows`); with fixed keep flags they always are.
      copies: count the operand copies resharding makes (:attr:`ShardingProblem.gathered`).
        Without, the program is a relaxation (fewer bytes per time): its plan, when its replay
        is within the budget, is the program's optimum with them, and is found faster (on
        the 4-layer GPT at 80% on 2x4, 8 s against 12-14 s to the same plan).
    """
    start = time.perf_counter()
    p, b = problem, Builder(problem, tie, copies)
    model, n = b.model, problem.num_nodes
    for node, choice in (pinned or {}).items():
        b.pin(int(node), int(choice))
    cost = b.node_costs()

    droppable = p.droppable                  # KIWI's z_i values, and the chains' (see below)
    m_vars: dict[int, int] = {}
    if fixed_keep is None:
        candidates = [int(i) for i in np.flatnonzero(droppable)]
        for i in sorted(candidates, key=lambda i: b.tie[i] != i):     # representatives first
            twin = int(b.tie[i])
            m_vars[i] = m_vars[twin] if twin in m_vars else model.add_var()
        keep_expr = [var(m_vars[i]) if i in m_vars else const(1.0) for i in range(n)]
    else:
        fixed = np.asarray(fixed_keep, bool)
        keep_expr = [const(1.0 if fixed[i] or not droppable[i] else 0.0) for i in range(n)]

    ub = np.full(model.num_vars, 1.0)
    objective = list(cost)
    w_vars: dict[tuple, int] = {}            # tied layers' twins share their w
    for i in np.flatnonzero(droppable):
        i = int(i)
        if i in m_vars:
            key = (m_vars[i], cost[i].key)
            if key not in w_vars:
                big = cost[i].upper(ub)
                w_vars[key] = model.add_var(lb=0.0, ub=big, integer=False,
                                            resolution=b.units.time_resolution)
                model.add_row(var(w_vars[key]) - cost[i] + var(m_vars[i], big), 0.0, np.inf)
            objective.append(var(w_vars[key]))
        elif keep_expr[i].constant == 0.0:
            objective.append(cost[i])
    _recompute_inputs_kept(p, model, m_vars, keep_expr, droppable)

    if max_seconds is not None:
        model.add_row(total(objective), -np.inf, max_seconds / b.units.seconds)
    peak_var = None
    if budget_bytes is not None or minimize_peak:
        peak_var = _memory_rows(p, b, keep_expr, droppable, budget_bytes, minimize_peak,
                                skip_times, exact_chains or fixed_keep is not None)
    if minimize_peak:
        # the lowest peak among the fastest plans (under a step time: the reference plan's)
        # keeps the step-time programs' scaling: its relaxation solved alike with either
        # (0.7 / 0.7, 3.6 / 2.8, 1.8 / 4.3 s default / max value on the zoo mixer and Llama
        # and the 4-layer KIWI-config GPT on 2x4), and its answer among plans alike in step
        # and peak stays the one it was
        model.minimize(var(peak_var), PEAK_SCALINGS if max_seconds is None else TIME_SCALINGS)
    else:
        model.minimize(total(objective))
    return JointModel(model, b.s_vars, m_vars, peak_var, time.perf_counter() - start, b.units,
                      b.alive)


def _recompute_inputs_kept(p, model, m_vars, keep_expr, droppable) -> None:
    """KIWI eq. 9 / 31: m_i + m_j >= 1 on edges between droppable nodes, but for the edges
    inside a layer, where a recomputed value may read another (``p.chained``)."""
    seen = set()
    for src, dst in p.uses:
        src, dst = int(src), int(dst)
        if not (droppable[src] and droppable[dst]) or p.chained(src, dst):
            continue
        if src in m_vars and dst in m_vars:
            pair = tuple(sorted((m_vars[src], m_vars[dst])))
            if pair not in seen and pair[0] != pair[1]:
                seen.add(pair)
                model.add_row(var(pair[0]) + var(pair[1]), 1.0, np.inf)
            elif pair[0] == pair[1]:
                model.add_row(var(pair[0]), 1.0, 1.0)     # tied to itself: must be kept
        elif keep_expr[src].constant + keep_expr[dst].constant < 1.0:
            raise ValueError(f"fixed keep flags violate KIWI eq. 9: {p.names[dst]} is "
                             f"recomputed but its input {p.names[src]} is not kept")


def _memory_rows(p, b: Builder, keep_expr, droppable, budget, minimize_peak,
                 skip, exact: bool) -> int | None:
    """Lifetime terms of every value under KIWI's semantics, limited by the budget.

    A dropped value is recomputed at a stage its keep flags and those of its layer decide
    (``ShardingProblem.dropped_stages``): its first backward reader's, or earlier for a chain;
    the stage lies between its earliest (``recompute_stage``) and latest
    (``latest_recompute_stage``) possible ones. A value read back is held from its
    recomputation to its last reader; one the backward pass does not read lives through the
    forward pass and, dropped, from its recomputation to its last chained reader's (within its
    stage, from its own recomputation to that reader's, when all its readers are recomputed
    there: an intermediate of the chain); an operand is held for its dropped readers until the
    latest of their recomputations.

    ``exact``: the stages are the keep flags' own (:class:`_Stages`), so the bytes counted are
    those the simulator replays, for fixed keep flags (baselines, recipes) as for free ones.
    Without (the program whose keep flags are free solves first in that form, 3-4x faster on
    the 4-layer KIWI-config GPT on 2x4 at 80%): a dropped value is held over all of its
    possible stages and each reader's window counts on its own; the bytes counted are then
    never fewer, often more for a recomputed chain."""
    n = p.num_nodes
    last = np.minimum(p.live, n - 1)
    read_back = p.recomputable            # read by the backward pass
    readers = p.readers()
    stages = _Stages(p, b, keep_expr, readers) if exact else None
    terms: list[tuple[Expr, float, float]] = []
    param = (p.phase == Phase.PARAM).tolist()
    for i in range(n):
        if param[i]:
            terms.append((b.mem(i), 0, n - 1))
        elif read_back[i]:
            first = int(p.first_bwd_use[i])
            terms.append((b.mem(i), run_time(n, i), int(p.fwd_last_use[i])))
            terms += stages.read_back_terms(i, int(last[i])) if exact else \
                _bounded_read_back_terms(p, b, keep_expr, i, int(last[i]))
            if first - 1 > p.fwd_last_use[i]:
                terms.append((b.conditional(i, keep_expr[i]), int(p.fwd_last_use[i]) + 1,
                              first - 1))
        else:
            terms.append((b.mem(i), run_time(n, i), int(last[i])))
        if droppable[i]:               # its recomputed copy
            terms += stages.chain_terms(i) if exact else \
                _bounded_chain_terms(p, b, keep_expr, readers, i)
    held = _held_operands(p, keep_expr, droppable, last)
    if exact:
        terms += [term for src, pairs in held.items()
                  for term in stages.operand_terms(src, pairs, int(last[src]) + 1)]
    else:
        late = p.latest_recompute_stage
        for src, pairs in held.items():     # held once, until its latest dropped reader
            alive = b.either([(keep_expr[src] if chained else const(1.0)) - keep_expr[d]
                              for d, chained in pairs])
            end = max(recomputation_time(n, int(late[d]), d) for d, _ in pairs)
            terms.append((b.held(src, alive), int(last[src]) + 1, end))
    terms += b.gathered_terms()
    return b.limit_memory(terms, budget, minimize_peak, skip)


def _held_operands(p, keep_expr, droppable, last) -> dict[int, list[tuple[int, bool]]]:
    """Per forward value, its readers that may be recomputed after its last reader (h_i of
    eq. 10-11): ``(reader, chained)``. A dropped reader reads the value's forward copy or,
    for a value read back and dropped, its recomputed copy, which then lives as long; but a
    value the backward pass does not read that is dropped too is recomputed for the reader and
    counted with its chain (``chained``: held here only where it is kept). ``last``: per
    value, its last reader's stage."""
    late = p.latest_recompute_stage
    held: dict[int, list[tuple[int, bool]]] = {}
    forward = (p.phase == Phase.FORWARD).tolist()
    for src, dst in p.uses:
        src, dst = int(src), int(dst)
        if not droppable[dst] or not forward[src] or late[dst] <= last[src]:
            continue
        if keep_expr[dst].is_constant and keep_expr[dst].constant == 1.0:
            continue
        held.setdefault(src, []).append((dst, p.chained(src, dst) and not p.recomputable[src]))
    return held


def _bounded_chain_terms(p, b: Builder, keep_expr, readers, i: int
                         ) -> list[tuple[Expr, float, float]]:
    """The recomputed copy of droppable value i, dropped, held over all of its possible stages
    (an upper bound of :meth:`_Stages.chain_terms`): read back, from each dropped chained
    reader's earliest stage; else from its recomputation in its earliest stage to its last
    chained reader's in the latest."""
    early, late, n = p.recompute_stage, p.latest_recompute_stage, p.num_nodes
    if not p.recomputable[i]:        # to its last chained reader's recomputation, at the latest
        end = max(recomputation_time(n, int(late[j]), j) for j in readers[i]
                  if p.chained(i, j))
        return [(b.conditional(i, const(1.0) - keep_expr[i]),
                 recomputation_time(n, int(early[i]), i), end)]
    first = int(p.first_bwd_use[i])
    return [(b.held(i, const(1.0) - keep_expr[i] - keep_expr[j]),
             recomputation_time(n, int(early[j]), i), first - 1)
            for j in readers[i] if p.chained(i, j) and early[j] < first]


def _bounded_read_back_terms(p, b: Builder, keep_expr, i: int, last: int) -> list:
    """Value i, read back, from its first backward reader's stage to its last reader's, as
    :meth:`_Stages.read_back_terms` counts it where it cannot be recomputed earlier (kept,
    over the whole stage; dropped, from its recomputation); where it can, over the whole
    stage (an upper bound)."""
    first = int(p.first_bwd_use[i])
    before = keep_expr[i] if p.recompute_stage[i] >= first else const(1.0)
    return _from_recomputation(b, i, first, const(1.0), before) + \
        [(b.mem(i), first + 1, last)]


def _from_recomputation(b: Builder, i: int, t: int, alive: Expr, before: Expr) -> list:
    """Value i in stage ``t``: where ``alive``, from its recomputation there; where
    ``before`` (it is carried into the stage), from the stage's start."""
    at = recomputation_time(b.p.num_nodes, t, i)
    return [(b.held(i, alive), at, t), (b.held(i, before), t, just_before(b.p.num_nodes, at))]


class _Stages:
    """Where each dropped value is recomputed, as exact 0/1 expressions of the keep flags:
    :meth:`by` (``ShardingProblem.dropped_stages`` for any keep flags), and the lifetime terms
    that follow from it. A value's possible stages are its own first backward reader's and
    those of its chained readers; with free keep flags each (value, stage) pair is a variable
    (shared by tied layers), constants with fixed ones."""

    def __init__(self, p, b: Builder, keep_expr, readers):
        self.p, self.b = p, b
        self.dropped = [const(1.0) - k for k in keep_expr]
        self.chained = {i: [j for j in readers[i] if p.chained(i, j)]
                        for i in np.flatnonzero(p.droppable).tolist()}
        self.stages: dict[int, list[int]] = {}
        self._by: dict[tuple[int, int], Expr] = {}
        for i in sorted(self.chained, reverse=True):     # readers first: no deep recursion
            own = {int(p.first_bwd_use[i])} if p.recomputable[i] else set()
            below = own | {t for j in self.chained[i] for t in self.stages[j]}
            self.stages[i] = sorted(t for t in below if not own or t <= min(own))
            for t in self.stages[i]:
                self.by(i, t)

    def by(self, i: int, t: float) -> Expr:
        """1 where value i is dropped and recomputed in stage ``t`` or before."""
        stages = self.stages.get(i, [])
        k = int(np.searchsorted(stages, t, side="right")) - 1
        if k < 0:
            return const(0.0)
        t = stages[k]
        if (i, t) not in self._by:
            if self.p.recomputable[i] and self.p.first_bwd_use[i] <= t:
                self._by[i, t] = self.dropped[i]
            else:
                read = self.b.either([self.by(j, t) for j in self.chained[i]], exact=True)
                self._by[i, t] = self.b.exact_and(self.dropped[i], read)
        return self._by[i, t]

    def at(self, i: int, t: int) -> Expr:
        """1 where value i is dropped and recomputed in stage ``t``."""
        return self.by(i, t) - self.by(i, t - 1)

    def after(self, i: int, t: float) -> Expr:
        """1 where value i is dropped and recomputed after stage ``t`` (a value dropped for
        nothing, with no dropped chained reader, is recomputed nowhere)."""
        stages = self.stages.get(i, [])
        if not stages or stages[-1] <= t:
            return const(0.0)
        return self.by(i, np.inf) - self.by(i, t)

    def read_after(self, i: int, t: int) -> Expr:
        """1 where a chained reader of value i is recomputed after stage ``t``."""
        return self.b.either([self.after(j, t) for j in self.chained[i]], exact=True)

    def chain_terms(self, i: int) -> list[tuple[Expr, float, float]]:
        """The recomputed copy of droppable value i."""
        return self._read_back_terms(i) if self.p.recomputable[i] else \
            self._chain_only_terms(i)

    def _read_back_terms(self, i: int) -> list:
        """A value read back, recomputed before its first backward reader for a dropped chained
        reader: held from its recomputation (its terms from the first backward reader's stage
        on are :meth:`read_back_terms`)."""
        first = int(self.p.first_bwd_use[i])
        early = [t for t in self.stages[i] if t < first]
        terms = []
        for k, (t, end) in enumerate(zip(early, early[1:] + [first])):
            terms += _from_recomputation(self.b, i, t, self.by(i, t),
                                              self.by(i, early[k - 1]) if k else const(0.0))
            terms.append((self.b.held(i, self.by(i, t)), t + 1, end - 1))
        return terms

    def read_back_terms(self, i: int, last: int) -> list:
        """Value i, read back, from its first backward reader's stage to its last reader's:
        there, kept or recomputed before, over the whole stage; recomputed in it, from its
        recomputation."""
        first = int(self.p.first_bwd_use[i])
        before = self.by(i, first - 1) + (const(1.0) - self.dropped[i])
        return _from_recomputation(self.b, i, first, const(1.0), before) + \
            [(self.b.mem(i), first + 1, last)]

    def _chain_only_terms(self, i: int) -> list:
        """A value the backward pass does not read: alive from its recomputation to its last
        chained reader's recomputation (the simulator's ``copy_spans``). In each of its
        possible stages: carried in from an earlier one, from the stage's start; recomputed
        there, from its recomputation; read by a later stage, to the stage's end, else to the
        last of its readers recomputed there."""
        b, n, stages = self.b, self.p.num_nodes, self.stages[i]
        spans = [b.exact_and(self.by(i, t), self.read_after(i, t)) for t in stages]
        terms = []
        for k, t in enumerate(stages):
            carried = spans[k - 1] if k else const(0.0)
            at = recomputation_time(n, t, i)
            terms += _from_recomputation(b, i, t, spans[k], carried + spans[k] - const(1.0))
            if k + 1 < len(stages) and t + 1 <= stages[k + 1] - 1:
                terms.append((b.held(i, spans[k]), t + 1, stages[k + 1] - 1))
            ends_here = carried - spans[k]           # carried in, read in this stage last
            only_here = self.at(i, t) - self.read_after(i, t)
            readers = sorted(j for j in self.chained[i] if t in self.stages[j])
            for q, j in enumerate(readers):
                later = b.either([self.at(r, t) for r in readers[q:]])
                # carried in, from the stage's start; made here, from its recomputation; from
                # the second reader on, both from just after the reader before
                carried_from, made_from = (t, at) if q == 0 else \
                    (just_after(n, recomputation_time(n, t, readers[q - 1])),) * 2
                terms.append((b.held(i, ends_here + later - const(1.0)), carried_from,
                              recomputation_time(n, t, j)))
                terms.append((b.held(i, only_here + later - const(1.0)), made_from,
                              recomputation_time(n, t, j)))
        return terms

    def operand_terms(self, src: int, pairs: list[tuple[int, bool]], start: int) -> list:
        """Value ``src`` held from stage ``start`` for its ``(reader, chained)`` pairs
        (:func:`_held_operands`) until the last of the dropped readers' recomputations: over
        a reader's stage whole where another reader is recomputed later, else to the last of
        the readers recomputed there."""
        b, n = self.b, self.p.num_nodes
        cuts = sorted({start} | {t + 1 for d, _ in pairs for t in self.stages.get(d, [])
                                 if t >= start})
        kept = const(1.0) - self.dropped[src]
        adjust = [kept - const(1.0) if chained else const(0.0) for _, chained in pairs]
        terms = []
        for lo, hi in zip(cuts, cuts[1:]):
            t = hi - 1                                  # a dropped reader's stage
            if lo < t:
                alive = [self.after(d, lo - 1) + a for (d, _), a in zip(pairs, adjust)]
                terms.append((b.held(src, b.either(alive)), lo, t - 1))
            later = [self.after(d, t) + a for (d, _), a in zip(pairs, adjust)]
            here = sorted(((d, a) for (d, _), a in zip(pairs, adjust)
                           if t in self.stages.get(d, [])), key=lambda pair: pair[0])
            begin = t
            for q, (d, _) in enumerate(here):      # up to each reader's recomputation
                read = b.either([self.at(r, t) + a for r, a in here[q:]] + later)
                terms.append((b.held(src, read), begin, recomputation_time(n, t, d)))
                begin = just_after(n, recomputation_time(n, t, d))
            terms.append((b.held(src, b.either(later)), begin, t))     # the stage's rest
        return terms


def run_time(n: int, stage: int) -> float:
    """The time of the stage's own node on the memory rows' axis (of a problem of ``n``
    nodes): after the stage's recomputations (:func:`recomputation_time`), before its end;
    a value the node makes is alive from here."""
    return just_before(n, stage)


def just_before(n: int, time: float) -> float:
    """A time after the recomputation or stage before ``time`` (of a problem of ``n`` nodes)
    and before ``time``: where a value alive until just before ``time`` ends."""
    return time - 0.25 / (n + 1)


def just_after(n: int, time: float) -> float:
    """A time after the recomputation at ``time`` and before the next one (of a problem of
    ``n`` nodes): where a value alive from just after it starts."""
    return time + 0.5 / (n + 1)


def recomputation_time(n: int, stage: int, node: int) -> float:
    """The time of ``node``'s recomputation in ``stage`` on the memory rows' axis (of a
    problem of ``n`` nodes): after stage ``stage - 1``, before the stage's own node, in node
    order (the points of the simulator's :func:`~solvers.simulator.copy_spans`)."""
    return stage - 1 + (node + 1) / (n + 1)
