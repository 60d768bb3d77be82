"""A small MILP model builder and the backends that solve it.

Backends:
- ``highs`` (embedded default, MIT licence, via ``highspy``): branch and cut on the LP relaxation.
- ``cpsat`` (OR-Tools CP-SAT, Apache licence): the solver XLA's auto-sharding used. It works on
  integers only: every continuous variable carries a resolution (1 ns for seconds, 1 byte for
  memory) and every row is scaled to integer coefficients.
- ``gurobi`` (optional, needs ``gurobipy`` and a licence; the PyPI licence refuses models over
  2000 variables or constraints).

Every backend status maps to a :class:`~solvers.solution.Status`.
"""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import scipy.sparse as sp

from solvers.linexpr import Expr
from solvers.solution import SolverError, SolverUnavailableError, Status

__all__ = ["Model", "MilpResult", "BACKENDS", "DEFAULT_BACKEND"]

BACKENDS = ("highs", "cpsat", "gurobi")
DEFAULT_BACKEND = "highs"

TIME_SCALINGS = (4,)
"""The scaling the relaxation of a step-time program is solved with (max value). Its
coefficients span ten orders of magnitude (seconds and bytes in the program's units), and with
HiGHS's default scaling the relaxation of the 4-layer KIWI-config GPT's program took 2.6 s, of
the 20-layer one 5.9 s; with this one, 1.25 and 1.0 s, to the same optimum."""

PEAK_SCALINGS = (1, 4)
"""The scalings tried, in order, on the relaxation of a peak-minimising program (HiGHS's
default first, then max value). With max value alone the relaxation of the zoo MLP-mixer's on
2x4 took 14.8-16.7 s, of the Llama's over 20 s; with the default, 0.9-1.0 and 1.7 s. The
KIWI-config GPT's are the other way round (4 layers: 8.7 against 1.5 s). The reference plan's
lowest peak among the fastest plans keeps :data:`TIME_SCALINGS` (:func:`solvers.joint.build_joint`)."""


@dataclasses.dataclass(frozen=True)
class MilpResult:
    """Raw outcome of one MILP solve."""

    status: Status
    """Mapped outcome."""
    x: np.ndarray | None
    """Variable values (None without an incumbent)."""
    objective: float
    """Objective of the incumbent, constant included (nan without one)."""
    bound: float
    """Best proven lower bound on the objective (nan when unknown)."""
    seconds: float
    """Backend wall time."""

    @property
    def gap(self) -> float:
        """Relative gap between the incumbent and the bound (inf without either)."""
        if self.x is None or not np.isfinite(self.bound):
            return float("inf")
        return max(0.0, self.objective - self.bound) / max(abs(self.objective), 1e-12)


class Model:
    """Variables with bounds and integrality; rows ``lo <= a @ x <= hi``; a linear objective."""

    def __init__(self):
        self._lb, self._ub, self._integer, self._resolution = [], [], [], []
        self._rows: list[tuple[np.ndarray, np.ndarray, float, float]] = []
        self.objective: Expr | None = None
        self.scalings = TIME_SCALINGS
        self.num_vars = 0

    def add_vars(self, count: int, lb=0.0, ub=1.0, integer=True,
                 resolution: float = 1.0) -> np.ndarray:
        """Add ``count`` variables; returns their indices.

        Args:
          resolution: for continuous variables, the unit an integer-only backend (CP-SAT)
            counts them in, e.g. 1e-9 for seconds or 1 for bytes.
        """
        self._lb.append(np.broadcast_to(np.asarray(lb, float), (count,)))
        self._ub.append(np.broadcast_to(np.asarray(ub, float), (count,)))
        self._integer.append(np.full(count, bool(integer)))
        self._resolution.append(np.full(count, 1.0 if integer else float(resolution)))
        start = self.num_vars
        self.num_vars += count
        return np.arange(start, start + count)

    def add_var(self, **kwargs) -> int:
        """One variable (see :meth:`add_vars`)."""
        return int(self.add_vars(1, **kwargs)[0])

    def add_row(self, expr: Expr, lo: float = -np.inf, hi: float = np.inf) -> None:
        """``lo <= expr <= hi``."""
        self._rows.append((expr.indices, expr.coefs, lo - expr.constant, hi - expr.constant))

    def add_terms(self, indices: list[int], coefs: list[float], lo: float = -np.inf,
                  hi: float = np.inf) -> None:
        """``lo <= sum(coefs[k] * x[indices[k]]) <= hi``: :meth:`add_row` without building an
        :class:`Expr` (for programs with hundreds of thousands of rows)."""
        self._rows.append((np.array(indices, np.int64), np.array(coefs, float), lo, hi))

    def minimize(self, expr: Expr, scalings: tuple[int, ...] = TIME_SCALINGS) -> None:
        """Minimise ``expr``; ``scalings``: those :func:`_rounded_start` tries its relaxation
        with, in order (:data:`PEAK_SCALINGS` for a peak)."""
        self.objective = expr
        self.scalings = scalings

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def arrays(self):
        """``(A (csr), lo, hi, lb, ub, cost, integer, resolution, offset)``."""
        n = self.num_vars
        if self._rows:
            rows = np.concatenate([np.full(len(r[0]), k) for k, r in enumerate(self._rows)])
            cols = np.concatenate([r[0] for r in self._rows]).astype(np.int64)
            vals = np.concatenate([r[1] for r in self._rows]).astype(float)
        else:
            rows = cols = np.zeros(0, np.int64)
            vals = np.zeros(0)
        matrix = sp.csr_matrix((vals, (rows, cols)), shape=(len(self._rows), n))
        matrix.sum_duplicates()
        lo = np.array([r[2] for r in self._rows], float)
        hi = np.array([r[3] for r in self._rows], float)
        cost = np.zeros(n)
        offset = 0.0
        if self.objective is not None:
            np.add.at(cost, self.objective.indices, self.objective.coefs)
            offset = self.objective.constant

        def columns(parts, dtype):
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return (matrix, lo, hi, columns(self._lb, float), columns(self._ub, float), cost,
                columns(self._integer, bool), columns(self._resolution, float), offset)

    def solve(self, backend: str = DEFAULT_BACKEND, time_limit: float = 60.0,
              mip_gap: float = 1e-4, seed: int = 0, threads: int = 1,
              hint: dict[int, float] | None = None,
              cancel: threading.Event | None = None,
              on_incumbent: Callable[[np.ndarray], None] | None = None) -> MilpResult:
        """Minimise the objective.

        Args:
          hint: values of some variables (a warm start, e.g. the strategy binaries of another
            plan); backends complete or repair it.
          cancel: once set, the solve stops at the backend's next check (``highs`` only, in
            its simplex iterations and branch and bound; its status is then a time-out's).
          on_incumbent: called with each better solution branch and bound finds, all of its
            variables (``highs`` only); it may set ``cancel``.
        """
        solvers = {"highs": _solve_highs, "cpsat": _solve_cpsat, "gurobi": _solve_gurobi}
        if backend not in solvers:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if cancel is not None and backend != "highs":
            raise ValueError(f"cancel: backend {backend!r} cannot be stopped; 'highs' can")
        if on_incumbent is not None and backend != "highs":
            raise ValueError(f"on_incumbent: backend {backend!r} does not report its "
                             f"solutions as it finds them; 'highs' does")
        if self.num_vars == 0:
            return self._solve_empty()
        if backend == "highs":
            return _solve_highs(self, time_limit, mip_gap, seed, threads, hint or {}, cancel,
                                on_incumbent)
        return solvers[backend](self, time_limit, mip_gap, seed, threads, hint or {})

    def _solve_empty(self) -> MilpResult:
        """A program with nothing to decide (one device: every operator has one strategy, and
        no recomputation choice is open): its rows are constants, met or not."""
        _, lo, hi, *_, offset = self.arrays()
        if np.all(lo <= 0.0) and np.all(hi >= 0.0):
            return MilpResult(Status.OPTIMAL, np.zeros(0), offset, offset, 0.0)
        return MilpResult(Status.INFEASIBLE, None, float("nan"), float("nan"), 0.0)


def _highs_lp(arrays):
    """A model's :meth:`Model.arrays` as HiGHS's LP, without their integrality."""
    import highspy

    matrix, lo, hi, lb, ub, cost, _, _, offset = arrays
    csc = matrix.tocsc()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(lo)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lb, ub
    lp.row_lower_, lp.row_upper_ = lo, hi
    lp.offset_ = offset
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = \
        csc.indptr, csc.indices, csc.data
    return lp


def _solve_highs(model: Model, time_limit, mip_gap, seed, threads, hint,
                 cancel: threading.Event | None = None,
                 on_incumbent: Callable[[np.ndarray], None] | None = None) -> MilpResult:
    import highspy

    arrays = model.arrays()
    integer, lp = arrays[6], _highs_lp(arrays)
    start = time.perf_counter()
    if not hint and integer.any():
        hint, relaxation = _rounded_start(lp, integer, ROUNDING_SHARE * time_limit, threads,
                                          model.scalings, cancel)
        proven = _integral_relaxation(lp, integer, relaxation, mip_gap,
                                      time_limit - (time.perf_counter() - start), threads,
                                      cancel)
        if proven is not None:
            x, objective, bound = proven
            return MilpResult(Status.OPTIMAL, x, objective, bound, time.perf_counter() - start)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                       for i in integer]
    h = _highs(time_limit - (time.perf_counter() - start), threads, cancel)
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", int(seed))
    if on_incumbent is not None:      # the solution in the original program's variables
        h.cbMipImprovingSolution += \
            lambda event: on_incumbent(np.array(event.data_out.mip_solution))
    h.passModel(lp)
    if hint:
        index = np.fromiter(hint.keys(), np.int32)
        h.setSolution(len(index), index, np.fromiter(hint.values(), float))
    h.run()
    seconds = time.perf_counter() - start
    info = h.getInfo()
    has = info.primal_solution_status == 2                       # kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if has else None
    name = h.modelStatusToString(h.getModelStatus()).lower()
    objective = float(info.objective_function_value) if has else float("nan")
    bound = float(info.mip_dual_bound) if integer.any() else objective
    if "optimal" in name:
        status = Status.OPTIMAL
    elif "infeasible" in name:
        status = Status.INFEASIBLE
    elif "limit" in name or "interrupt" in name:
        status = Status.TIMEOUT_WITH_INCUMBENT if has else Status.TIMEOUT_NO_INCUMBENT
    else:
        status = Status.FEASIBLE if has else Status.ERROR
    return MilpResult(status, x, objective, bound, seconds)


def _highs(time_limit: float, threads: int, cancel: threading.Event | None = None):
    """A quiet HiGHS instance with a time limit and a thread count; with ``cancel``, it stops
    at its next simplex iteration or branch-and-bound check once that is set (no time left
    when it already is)."""
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", 0.0 if cancel is not None and cancel.is_set()
                     else max(float(time_limit), 0.0))
    h.setOptionValue("threads", int(threads))
    if cancel is not None:
        def stop(event):
            if cancel.is_set():
                event.interrupt()
        h.cbSimplexInterrupt += stop
        h.cbMipInterrupt += stop
    return h


def _rounded_start(lp, integer: np.ndarray, time_limit: float, threads: int,
                   scalings: tuple[int, ...] = TIME_SCALINGS,
                   cancel: threading.Event | None = None
                   ) -> tuple[dict[int, float], tuple[np.ndarray, float] | None]:
    """A partial start for a MILP without one: the integer variables its LP relaxation puts
    above one half, set to one (a strategy an operator mostly takes, a value mostly kept);
    HiGHS completes the rest with a small search. Empty when the relaxation is not solved in
    ``time_limit``. With it, the relaxation's solution and objective (None when not solved).

    HiGHS's own heuristics find a plan late on these programs: on the tied 4-layer KIWI-config
    GPT on 2x4 at 80% (47,155 columns), its root LP bound is 0.04% under the optimum, yet it
    spent 23 s in rounds of cuts (which moved the bound by 0.004%) before its sub-MIP found a
    plan, its first within 17% of the bound. From this start it had a plan 0.1% from the bound
    at once and stopped 5.5 s from the start, the relaxation's 2.7 s included.

    The relaxation is solved with each of ``scalings`` (HiGHS's ``simplex_scale_strategy``)
    in turn until one solves it, each given an equal part of the time left.
    """
    import highspy

    start = time.perf_counter()
    for tried, scaling in enumerate(scalings):
        left = time_limit - (time.perf_counter() - start)
        h = _highs(left / (len(scalings) - tried), threads, cancel)
        h.setOptionValue("simplex_scale_strategy", int(scaling))
        h.passModel(lp)
        h.run()
        if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
            break
    else:
        return {}, None
    x = np.asarray(h.getSolution().col_value)
    chosen = np.flatnonzero(integer & (x > 0.5))
    return dict.fromkeys(chosen.tolist(), 1.0), (x, float(h.getInfo().objective_function_value))


def _integral_relaxation(lp, integer: np.ndarray, relaxation, mip_gap: float, time_limit: float,
                         threads: int, cancel: threading.Event | None = None
                         ) -> tuple[np.ndarray, float, float] | None:
    """The MILP's optimum, proven by its LP relaxation, when the relaxation's solution is
    integral up to :data:`INTEGRAL_TOLERANCE`: its integer variables rounded and fixed, the
    rest solved for again (an LP that presolve all but empties), and the objective within
    ``mip_gap`` of the relaxation's, which bounds it from below. ``(x, objective, bound)``;
    None otherwise, and the backend's search runs.

    The programs without a memory limit are often integral there: the reference plan's
    (``alpa`` with no budget) and its peak-minimising solve on the zoo Llama, MoE and Linen
    scan on 4x2 and 2x4. HiGHS took the relaxation's rounding as its start and then spent
    2.6-3.8 s solving the same relaxation again at its root to prove it (of a 6.3-7.7 s solve).
    """
    import highspy

    if relaxation is None:
        return None
    x, bound = relaxation
    values = np.round(x[integer])
    if np.abs(x[integer] - values).max() > INTEGRAL_TOLERANCE or time_limit <= 0:
        return None
    columns = np.flatnonzero(integer).astype(np.int32)
    h = _highs(time_limit, threads, cancel)
    h.passModel(lp)
    h.changeColsBounds(len(columns), columns, values, values)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    objective = float(h.getInfo().objective_function_value)
    if objective - bound > mip_gap * max(abs(objective), 1e-12):
        return None
    return np.asarray(h.getSolution().col_value), objective, bound


INTEGRAL_TOLERANCE = 1e-4
"""How far from an integer a relaxation's integer variable may be for
:func:`_integral_relaxation` to try its rounding (the peak-minimising relaxations of the zoo's
reference plans were at most 2.6e-6 from one)."""


ROUNDING_SHARE = 0.25
"""Share of a solve's time limit the LP relaxation of :func:`_rounded_start` may take."""


def _solve_cpsat(model: Model, time_limit, mip_gap, seed, threads, hint) -> MilpResult:
    """CP-SAT in a child process (:mod:`solvers.cpsat_worker`): OR-Tools ships its own copy of
    HiGHS, whose symbols clash with highspy's when both are loaded into one process."""
    arrays = model.arrays()
    request = pickle.dumps((arrays, float(time_limit), float(mip_gap), int(seed), int(threads),
                            hint))
    done = subprocess.run([sys.executable, "-m", "solvers.cpsat_worker"], input=request,
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise SolverError(f"the CP-SAT worker failed: {done.stderr.decode()[-2000:]}")
    code, x, bound, seconds = pickle.loads(done.stdout)
    if code == "IMPORT_ERROR":
        raise SolverUnavailableError(
            "backend 'cpsat' needs OR-Tools (pip install ortools); the embedded backend "
            "'highs' needs nothing more")
    cost, offset = arrays[5], arrays[8]
    has = x is not None
    status = {"OPTIMAL": Status.OPTIMAL, "INFEASIBLE": Status.INFEASIBLE,
              "UNKNOWN": Status.TIMEOUT_NO_INCUMBENT}.get(code, Status.ERROR)
    if code == "FEASIBLE":
        status = Status.TIMEOUT_WITH_INCUMBENT if seconds >= 0.99 * time_limit \
            else Status.FEASIBLE
    return MilpResult(status, x, float(cost @ x + offset) if has else float("nan"),
                      bound + offset if has else float("nan"), seconds)


def _solve_gurobi(model: Model, time_limit, mip_gap, seed, threads, hint) -> MilpResult:
    try:
        import gurobipy as gp
    except ImportError as err:
        raise SolverUnavailableError(
            "backend 'gurobi' needs gurobipy (pip install gurobipy) and a licence; the "
            "embedded backend 'highs' needs neither") from err
    matrix, lo, hi, lb, ub, cost, integer, _, offset = model.arrays()
    try:
        env = gp.Env(params={"OutputFlag": 0})
        grb = gp.Model(env=env)
        x = grb.addMVar(len(cost), lb=lb, ub=ub, obj=cost,
                        vtype=np.where(integer, gp.GRB.INTEGER, gp.GRB.CONTINUOUS))
        grb.ObjCon = offset
        for keep, sense, rhs in ((np.isfinite(hi), "<", hi), (np.isfinite(lo), ">", lo)):
            if keep.any():
                grb.addMConstr(matrix[keep], x, sense, rhs[keep])
        grb.Params.TimeLimit, grb.Params.MIPGap = time_limit, mip_gap
        grb.Params.Threads, grb.Params.Seed = threads, seed
        for j, value in hint.items():
            x[j].Start = value
        start = time.perf_counter()
        grb.optimize()
    except gp.GurobiError as err:
        raise SolverUnavailableError(
            f"gurobi refused the model ({len(cost)} variables, {len(lo)} constraints): {err}. "
            "The PyPI licence is limited to 2000 of each; use backend='highs' (embedded) or "
            "'cpsat'") from err
    seconds = time.perf_counter() - start
    has = grb.SolCount > 0
    if grb.Status == gp.GRB.OPTIMAL:
        status = Status.OPTIMAL
    elif grb.Status in (gp.GRB.INFEASIBLE, gp.GRB.INF_OR_UNBD):
        status = Status.INFEASIBLE
    elif grb.Status == gp.GRB.TIME_LIMIT:
        status = Status.TIMEOUT_WITH_INCUMBENT if has else Status.TIMEOUT_NO_INCUMBENT
    else:
        status = Status.FEASIBLE if has else Status.ERROR
    return MilpResult(status, np.array(x.X) if has else None,
                      float(grb.ObjVal) if has else float("nan"),
                      float(grb.ObjBound) if has else float("nan"), seconds)
