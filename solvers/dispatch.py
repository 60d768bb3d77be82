"""One way into the solvers: every formulation by name in one table, and :func:`solve`.

Each entry of :data:`FORMULATIONS` takes ``(problem, budget_bytes, options)`` (and, by keyword,
``warm_start`` and ``search_min_feasible``) and returns a :class:`~solvers.solution.Solution`:
the MILP formulations (:func:`solvers.solve.solve_milp`) and Lynx (:func:`solve_lynx`), which
keeps the reference plan's sharding and hides recomputation under its collectives.

References:
  KIWI (Liu et al.), eq. 1-11 and sec. 4.1 (``kiwi``, ``kiwi-full``, the baselines); Lynx
  (sec. 4.1-4.2: Lynx-HEU and Lynx-OPT).
"""

from __future__ import annotations

import types
from typing import Protocol

import numpy as np

from solvers import lynx
from solvers.options import DEFAULTS, SolverOptions
from solvers.problem import ShardingProblem
from solvers.solution import Solution
from solvers.solve import MILP_SOLVERS, reference_plan, solve_milp

__all__ = ["Formulation", "FORMULATIONS", "SOLVERS", "LYNX_SOLVERS", "solve", "solve_lynx"]

LYNX_SOLVERS = ("lynx-heu", "lynx-opt")
"""Formulations that keep the reference plan's sharding and hide recomputation under its
collectives (:mod:`solvers.lynx`)."""


class Formulation(Protocol):
    """A formulation as the table holds it."""

    def __call__(self, problem: ShardingProblem, budget_bytes: int | None,
                 options: SolverOptions, *, warm_start: Solution | str | None = "auto",
                 search_min_feasible: bool = True) -> Solution: ...


def solve_lynx(problem: ShardingProblem, budget_bytes: int | None, options: SolverOptions, *,
               warm_start: Solution | str | None = "auto",
               search_min_feasible: bool = True) -> Solution:
    """Lynx-HEU, or Lynx-OPT, on the sharding of the reference plan (the fastest ``alpa`` plan
    with no memory limit, :func:`solvers.reference_plan`).

    How the options apply:

    - ``backend``, ``seed``, ``threads``: every program (the reference plan's, HEU's layer
      programs, OPT's).
    - ``time_limit``: the reference plan's solve, and Lynx-OPT's program. HEU's layer programs
      are small and keep their own limit (10 s each, :func:`solvers.lynx.heu_policy`).
    - ``mip_gap``: Lynx-OPT's program. HEU has no bound on the whole step to hold a gap to (its
      plan is a heuristic's, reported with gap 0); its layer programs are solved to 1e-6,
      since it compares their plans by simulation.
    - ``reuse_layers``: Lynx-HEU *is* layer reuse (one layer's policy applied to every
      identical layer through ``problem.ties``): it needs ``True``, and ``False`` is an error.
      Lynx-OPT's staged program has no tied form (like ``kiwi-full``'s): it decides every
      operator either way.
    - ``warm_start``: ``"auto"`` starts Lynx-OPT from Lynx-HEU's plan; a Solution (with the
      reference plan's sharding) starts it from that plan; None starts it cold. Lynx-HEU starts
      from nothing: a Solution is an error.
    - ``search_min_feasible``: no further search is run. Lynx-HEU's
      :class:`~solvers.solution.InfeasibleBudgetError` names the smallest peak its own search
      met, at no extra cost; Lynx-OPT's names none (with ``"auto"`` HEU runs first, and an
      infeasible budget is its error).

    Raises:
      ValueError: an option the formulation cannot honour (see above), or a problem without
        repeated layers (Lynx-HEU).
      InfeasibleBudgetError: no plan fits.
      SolverError: the backend failed, or Lynx-OPT found no plan in time without a warm start.
    """
    solver = options.solver
    if solver not in LYNX_SOLVERS:
        raise ValueError(f"{solver!r} is not a Lynx formulation; expected one of "
                         f"{', '.join(LYNX_SOLVERS)}")
    if isinstance(warm_start, str) and warm_start != "auto":
        raise ValueError(f"warm_start: expected a Solution, 'auto' or None, got {warm_start!r}")
    if solver == "lynx-heu" and not options.reuse_layers:
        raise ValueError("lynx-heu solves one layer and applies its policy to every identical "
                         "layer: it cannot give each layer its own decisions (reuse_layers="
                         "False). Use lynx-opt for per-operator decisions over the whole graph")
    if solver == "lynx-heu" and isinstance(warm_start, Solution):
        raise ValueError("lynx-heu starts from no plan: pass warm_start='auto' or None, or use "
                         "lynx-opt to start from a plan")
    backend = {"backend": options.backend, "seed": options.seed, "threads": options.threads}
    strategy = reference_plan(problem, time_limit=options.time_limit,
                              reuse_layers=options.reuse_layers, **backend).strategy
    if isinstance(warm_start, Solution) and not np.array_equal(warm_start.strategy, strategy):
        raise ValueError("lynx-opt keeps the reference plan's sharding, but the warm start has "
                         "another: pass a Lynx plan of this problem, 'auto' (Lynx-HEU's plan) "
                         "or None")
    if solver == "lynx-heu" or warm_start == "auto":
        heu = lynx.lynx_heu(problem, budget_bytes, strategy, **backend)
        if solver == "lynx-heu":
            return heu
        warm_start = heu
    return lynx.lynx_opt(problem, budget_bytes, strategy, time_limit=options.time_limit,
                         mip_gap=options.mip_gap, warm_start=warm_start, **backend)


FORMULATIONS: types.MappingProxyType[str, Formulation] = types.MappingProxyType({
    **{name: solve_milp for name in MILP_SOLVERS},
    **{name: solve_lynx for name in LYNX_SOLVERS},
})
"""Every formulation by name (read-only)."""

SOLVERS = tuple(FORMULATIONS)
"""Every formulation's name: ``alpa``, ``alpa+dots``, ``alpa+megatron``, ``alpa+full``,
``kiwi``, ``kiwi-full``, ``lynx-heu``, ``lynx-opt``."""


def solve(problem: ShardingProblem, budget_bytes: int | None, solver: str = DEFAULTS.solver,
          backend: str = DEFAULTS.backend, time_limit: float = DEFAULTS.time_limit,
          mip_gap: float = DEFAULTS.mip_gap, seed: int = DEFAULTS.seed,
          threads: int = DEFAULTS.threads, reuse_layers: bool = DEFAULTS.reuse_layers,
          warm_start: Solution | str | None = "auto",
          search_min_feasible: bool = True) -> Solution:
    """Plan ``problem`` under a per-device budget (None: no memory limit) with any formulation.

    The defaults are :data:`solvers.options.DEFAULTS`, which the ``kiwi_jax.optimize``
    decorator and the ``kiwi-jax`` command line share.

    Args:
      problem: the costed problem.
      budget_bytes: per-device memory budget, or None.
      solver: one of :data:`SOLVERS`.
      backend, time_limit, mip_gap, seed, threads, reuse_layers: see
        :class:`~solvers.options.SolverOptions`; how each formulation uses them:
        :func:`solvers.solve.solve_milp`, :func:`solve_lynx`.
      warm_start: a plan to start the search from; ``"auto"`` (default): the formulation's own
        warm-start stages; None: none.
      search_min_feasible: when no plan fits, search the smallest feasible budget for the
        error (several more solves); False: raise at once.

    Raises:
      ValueError: an unknown solver (the message lists :data:`SOLVERS`) or an option out of
        range or not open to the formulation.
      InfeasibleBudgetError: no plan fits; carries the smallest feasible budget when searched.
      SolverTimeoutError: the time limit passed before any plan was found.
      SolverError: the backend failed.
    """
    if solver not in FORMULATIONS:
        raise ValueError(f"unknown solver {solver!r}; expected one of {', '.join(SOLVERS)}")
    options = SolverOptions(solver=solver, backend=backend, time_limit=time_limit,
                            mip_gap=mip_gap, reuse_layers=reuse_layers, seed=seed,
                            threads=threads)
    return FORMULATIONS[solver](problem, budget_bytes, options, warm_start=warm_start,
                                search_min_feasible=search_min_feasible)
