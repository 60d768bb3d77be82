"""Solvers for the joint sharding + rematerialisation problem (numpy, scipy and the MILP
backends only: this package never imports jax)."""

from solvers.backend import BACKENDS, DEFAULT_BACKEND
from solvers.options import SolverOptions
from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.reuse import layer_ties, with_layer_ties
from solvers.simulator import SimResult, reduced_schedule, simulate
from solvers.solution import (InfeasibleBudgetError, Solution, SolverError, SolverTimeoutError,
                              SolverUnavailableError, Status)
from solvers.solve import min_feasible_budget, min_peak_plan, reference_plan
from solvers.dispatch import FORMULATIONS, LYNX_SOLVERS, SOLVERS, solve

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "SolverOptions", "Phase", "ShardingProblem", "layer_ties",
    "with_layer_ties", "SimResult", "reduced_schedule", "simulate", "InfeasibleBudgetError",
    "Solution", "SolverError", "SolverTimeoutError", "SolverUnavailableError", "Status",
    "min_feasible_budget", "min_peak_plan", "reference_plan", "FORMULATIONS", "LYNX_SOLVERS",
    "SOLVERS", "solve",
]
