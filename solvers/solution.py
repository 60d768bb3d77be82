"""Typed solver results and the errors solvers raise."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

__all__ = ["Status", "Solution", "InfeasibleBudgetError", "SolverUnavailableError",
           "SolverTimeoutError", "SolverError", "gap_to", "status_within_gap"]

GIB = 2**30


class Status(enum.Enum):
    """Every backend outcome maps to one of these."""

    OPTIMAL = "optimal"
    """Proven optimal within the relative gap asked for."""
    FEASIBLE = "feasible"
    """A plan that fits, with a remaining optimality gap (stopped by gap or limits)."""
    TIMEOUT_WITH_INCUMBENT = "timeout_with_incumbent"
    """The time limit stopped the search; the best plan found is returned with its gap."""
    TIMEOUT_NO_INCUMBENT = "timeout_no_incumbent"
    """The time limit stopped the search before any plan was found."""
    INFEASIBLE = "infeasible"
    """No plan fits the budget."""
    ERROR = "error"
    """The backend failed."""


@dataclasses.dataclass(frozen=True)
class Solution:
    """A solver's answer for one problem and budget."""

    solver: str
    """Formulation: ``alpa``, ``kiwi``, ``alpa+dots`` ..."""
    backend: str
    """MILP backend that solved it (``highs``, ``gurobi`` ...)."""
    status: Status
    """Outcome."""
    objective: float
    """Objective value (predicted step seconds); nan without a plan."""
    gap: float
    """Relative optimality gap reported by the backend (0 when proven optimal)."""
    solve_seconds: float
    """Wall time of the backend solve (model building excluded)."""
    build_seconds: float
    """Wall time spent building the model."""
    num_vars: int
    """Variables in the model."""
    num_constraints: int
    """Constraints in the model."""
    budget_bytes: int | None
    """Per-device memory budget (None: no limit)."""
    strategy: np.ndarray | None
    """Strategy index of every node (followers resolved), or None without a plan."""
    keep: np.ndarray | None
    """Keep flag of every node: False only for forward values recomputed in the backward pass."""
    recompute_at: dict[int, tuple[int, ...]] | None = None
    """Per recomputed forward node, the stages where it is recomputed (reduced plans: the stage
    of its first backward reader); replayed by :func:`solvers.simulator.simulate`."""
    peak_bytes: int | None = None
    """Per-device peak of the plan, by the simulator."""
    claimed_peak_bytes: int | None = None
    """The peak the program itself claims (its largest U_k); None when it had no memory
    rows. Below :attr:`peak_bytes` where the program left out rows (a tied program's inner
    repeats) or the resharded operand copies (``build_joint(copies=False)``) and the plan
    fit without them."""
    hidden_under: dict[int, int] | None = None
    """Lynx plans: per recomputation hidden under a collective, the node whose collective hides
    it (its window); recomputations not listed run on demand."""
    overlapped_recompute_seconds: float | None = None
    """Lynx plans: recomputation hidden under collectives (simulated)."""
    on_demand_recompute_seconds: float | None = None
    """Lynx plans: recomputation on the critical path (simulated)."""

    @property
    def feasible(self) -> bool:
        return self.strategy is not None

    @property
    def bound(self) -> float | None:
        """The lower bound on the objective that the gap states (None: no bound)."""
        return self.objective * (1 - self.gap) if np.isfinite(self.gap) else None

    @property
    def recomputed(self) -> np.ndarray:
        """Ids of the nodes recomputed in the backward pass."""
        return np.array(sorted(self.recompute_at or ()), np.int64)

    def summary(self) -> dict:
        return {"solver": self.solver, "backend": self.backend, "status": self.status.value,
                "feasible": self.feasible, "objective": self.objective, "gap": self.gap,
                "solve_seconds": self.solve_seconds, "build_seconds": self.build_seconds,
                "num_vars": self.num_vars, "num_constraints": self.num_constraints,
                "budget_bytes": self.budget_bytes, "peak_bytes": self.peak_bytes,
                "claimed_peak_bytes": self.claimed_peak_bytes,
                "recomputed_nodes": int(len(self.recomputed)),
                **({} if self.hidden_under is None else {
                    "overlapped_recompute_seconds": self.overlapped_recompute_seconds,
                    "on_demand_recompute_seconds": self.on_demand_recompute_seconds,
                    "hidden_recomputations": len(self.hidden_under)})}


def gap_to(objective: float, bound: float | None) -> float:
    """The relative gap of ``objective`` above ``bound`` (at least 0; inf without a bound)."""
    if bound is None:
        return float("inf")
    return max(1 - bound / objective, 0.0) if objective > 0 else 0.0


def status_within_gap(status: Status, gap: float, mip_gap: float) -> Status:
    """A backend's status, held to the gap that was asked for: OPTIMAL with a relative gap above
    ``mip_gap`` (beyond a 0.1% tolerance, and at least 1e-9) is FEASIBLE. Backends call a search
    stopped by their own tolerances optimal; the status promises the gap the caller asked for.

    Args:
      status: the backend's mapped outcome.
      gap: the relative gap of its incumbent (see :attr:`solvers.backend.MilpResult.gap`).
      mip_gap: the relative gap the solve was asked to reach.
    """
    if status == Status.OPTIMAL and gap > max(mip_gap, 1e-9) * 1.001:
        return Status.FEASIBLE
    return status


class InfeasibleBudgetError(ValueError):
    """No plan of this solver fits the per-device memory budget."""

    def __init__(self, solver: str, budget_bytes: int, min_feasible_bytes: int | None,
                 lower_bound_bytes: int | None = None, searched: bool = True):
        self.solver, self.budget_bytes = solver, budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        """Smallest budget known to be feasible (None: none found)."""
        self.lower_bound_bytes = lower_bound_bytes
        """No budget under this is feasible (None: no such bound was proven)."""
        if not searched:
            smallest = "the smallest feasible budget was not searched for"
        elif min_feasible_bytes is None:
            smallest = "the search for a feasible budget found none in its time limit"
        elif lower_bound_bytes is not None and lower_bound_bytes < min_feasible_bytes:
            smallest = (f"the smallest feasible budget for {solver} lies between "
                        f"{lower_bound_bytes} and {min_feasible_bytes} bytes "
                        f"({min_feasible_bytes / GIB:.3f} GiB fits)")
        elif lower_bound_bytes is None:
            smallest = (f"the smallest feasible budget for {solver} was not proven; "
                        f"{min_feasible_bytes} bytes ({min_feasible_bytes / GIB:.3f} GiB) fits")
        else:
            smallest = (f"the smallest feasible budget for {solver} is {min_feasible_bytes} "
                        f"bytes ({min_feasible_bytes / GIB:.3f} GiB)")
        other = "" if solver.startswith("kiwi") else ", or a solver with recomputation (kiwi)"
        super().__init__(
            f"{solver}: no plan fits a per-device budget of {budget_bytes} bytes "
            f"({budget_bytes / GIB:.3f} GiB); {smallest}. Raise the budget to at least that, use "
            f"more devices{other}")


class SolverUnavailableError(RuntimeError):
    """The requested backend is not installed or refuses the model."""


class SolverTimeoutError(RuntimeError):
    """The time limit passed before any plan was found."""

    def __init__(self, message: str, budget_bytes: int | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The per-device budget the solve was under (None: no memory limit)."""


class SolverError(RuntimeError):
    """The backend failed for another reason."""
