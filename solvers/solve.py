"""Solve a sharding problem with one of the MILP formulations, and find the smallest feasible
budget. :func:`solvers.solve` dispatches here (:mod:`solvers.dispatch`).

References:
  KIWI (Liu et al.), eq. 2-11 (``kiwi``), eq. 1 with appendix eq. 12-23 (``kiwi-full``);
  Alpa (Zheng et al.) intra-operator ILP (``alpa``); KIWI sec. 4.1 baselines (``alpa+dots``,
  ``alpa+megatron``, ``alpa+full``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import numpy as np

from solvers.full import FullModel, build_full
from solvers.heuristics import RULES
from solvers.joint import build_joint
from solvers.linexpr import var
from solvers.options import DEFAULTS, SolverOptions
from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.reuse import has_ties, inner_repeats
from solvers.simulator import reduced_schedule, simulate
from solvers.solution import (InfeasibleBudgetError, Solution, SolverError, SolverTimeoutError,
                              Status, gap_to, status_within_gap)

__all__ = ["MILP_SOLVERS", "solve_milp", "min_feasible_budget", "min_peak_plan",
           "reference_plan", "pinned_plan", "least_memory_plan", "program_peak"]

MILP_SOLVERS = (*RULES, "kiwi", "kiwi-full")
"""The formulations solved here, each as one MILP (the heuristic baselines with their keep
flags fixed)."""
REFERENCE_GAP = 1e-4
"""Relative gap of the reference plan's solves: it is the 100% of percentage budgets, so it is
held tighter than the plans solved under a budget (:data:`solvers.options.DEFAULTS`)."""
REFERENCE_PEAK_SHARE = 0.25
"""Share of the reference plan's time limit its peak-minimising solve may take (per program)."""
log = logging.getLogger(__name__)


def _formulation(problem: ShardingProblem, solver: str, budget, minimize_peak, reuse_layers,
                 skip: np.ndarray | None = None, copies: bool = True, exact: bool = False):
    if solver not in MILP_SOLVERS:
        raise ValueError(f"{solver!r} is not one of the MILP formulations "
                         f"({', '.join(MILP_SOLVERS)})")
    if solver == "kiwi-full":
        return build_full(problem, budget, minimize_peak=minimize_peak), None
    fixed = None if solver == "kiwi" else RULES[solver](problem)
    tie = problem.ties if reuse_layers else None
    return build_joint(problem, budget, fixed_keep=fixed, minimize_peak=minimize_peak,
                       tie=tie, skip_times=skip, copies=copies, exact_chains=exact), fixed


def _skipped_times(problem: ShardingProblem, solver: str, reuse_layers: bool):
    """The times whose memory rows the tied program leaves out, None for rows everywhere: the
    inner repeats of its layers (:func:`solvers.reuse.inner_repeats`) and the optimizer's
    updates, which run once the activations are gone (on the 4-layer GPT at 80% on 2x4 they
    peak at 0.79 of the budget; without their rows the solve took 15.3 CPU seconds, not 19.3,
    to the same plan). The solve replays every plan and puts rows back where it is over."""
    if solver == "kiwi-full" or not reuse_layers or not has_ties(problem.ties):
        return None
    return inner_repeats(problem, problem.ties) | (problem.phase == Phase.OPTIMIZER)


def _restored(problem: ShardingProblem, skip, over: np.ndarray):
    """``skip`` with the rows put back in every region (a layer's forward, backward or update;
    the rest of the step's) where the replay is over the budget (``over``, per time) and rows
    were left out; None when no such row was left out."""
    if skip is None or not (over & skip).any():
        return None
    region = problem.layer.astype(np.int64) * len(Phase) + problem.phase
    return skip & ~np.isin(region, np.unique(region[over & skip]))


class _Watch:
    """The solve of the program without the resharded operand copies past its share of the
    time (``relaxed``, :data:`RELAXED_SHARE`): it goes on towards the deadline while its best
    plan so far fits ``budget_bytes`` with its copies, as the simulator replays it, and stops
    there otherwise (no plan yet, or one over the budget with them), as a time limit at that
    share did.

    A solve stopped at its share with a plan that fits was started again from that plan by the
    final solve, which then did the root's work again: on the 3-block named decoder of the
    tests on 2x4 at 80%, the direct solve had its plan after 8 s and a 4.8% gap when it
    stopped at 18.4 s; the final solve, from that plan, spent 14 s getting back to the same
    bound and proved the plan 22 s after its start (41.7 s in all)."""

    def __init__(self, problem, joint, fixed, budget_bytes: int, relaxed: float):
        self.cancel = threading.Event()
        self.hooks = {"cancel": self.cancel, "on_incumbent": self._found}
        self._program = problem, joint, fixed, budget_bytes
        self.share_ends, self._latest = relaxed, None
        self._timer = threading.Timer(max(relaxed - time.perf_counter(), 0.0), self._check)
        self._timer.daemon = True
        self._timer.start()

    def _found(self, x: np.ndarray):
        self._latest = x
        if time.perf_counter() >= self.share_ends:
            self._check()

    def _check(self):
        """Stop the solve unless its latest plan fits with its copies (replayed once, when the
        share ends, and once for each better plan after it)."""
        problem, joint, fixed, budget_bytes = self._program
        x = self._latest
        try:
            fits = x is not None and _decode(joint, problem, x, fixed)[3].peak_bytes \
                <= budget_bytes
        except Exception:                 # in the backend's callback: stop as at the share
            log.exception("replaying the solve's plan so far")
            fits = False
        if not fits:
            self.cancel.set()

    def close(self):
        self._timer.cancel()


def _decode(joint, problem: ShardingProblem, x: np.ndarray, fixed):
    """``(strategy, keep, recomputation schedule, simulated result)`` of a MILP solution."""
    strategy, keep = joint.decode(problem, x, fixed)
    schedule = joint.schedule(x) if isinstance(joint, FullModel) \
        else reduced_schedule(problem, keep)
    return strategy, keep, schedule, simulate(problem, strategy, recompute_at=schedule)


def solve_milp(problem: ShardingProblem, budget_bytes: int | None, options: SolverOptions, *,
               warm_start: Solution | str | None = "auto",
               search_min_feasible: bool = True) -> Solution:
    """Plan ``problem`` under a per-device budget (None: no memory limit) with one of
    :data:`MILP_SOLVERS` (``options.solver``).

    How the options apply: ``time_limit`` bounds the warm-start stages and the final solve
    together (the search for the smallest feasible budget after an infeasible one gets its
    own); ``mip_gap``, ``seed`` and ``threads`` are the final solve's (the warm-start stages
    stop at :data:`STAGE_GAP`, with seed 0 on one thread); ``reuse_layers`` solves the tied
    program (``kiwi-full``, whose staged program has no tied form, uses it for its warm-start
    stages only).

    Args:
      problem: the costed problem.
      budget_bytes: per-device memory budget, or None.
      options: formulation, backend and limits (see :class:`~solvers.options.SolverOptions`).
      warm_start: a plan (e.g. the ``alpa`` solution, or a hand-written recipe's,
        :func:`kiwi_jax.recipe_plan.recipe_solution`) to start the search from; one of
        ``solver``'s plans that fits the budget as the simulator replays it is the answer when
        the backend ends with a slower plan or none, even where the program counts it over
        the budget (its lifetimes bound the replay's from above); ``"auto"``
        (default): under a budget, the tied program of a model with repeated layers is first
        solved directly for :data:`DIRECT_SHARE` of the time (:func:`_direct_first`); its plan
        is the answer when proven, else the start of a final solve in the time left. Without
        a plan from it, or without ties, a plan that fits is first found (the backends' own
        heuristics often find none on large untied graphs) from the tied program or from the
        peak-minimising program (see :func:`_warm_start`). None: no warm start.
      search_min_feasible: when no plan fits, search the smallest feasible budget for the
        error (several more solves); False: raise at once.

    Raises:
      InfeasibleBudgetError: no plan fits; carries the smallest feasible budget.
      SolverTimeoutError: the time limit passed before any plan was found.
      SolverError: the backend failed.
    """
    if isinstance(warm_start, str) and warm_start != "auto":
        raise ValueError(f"warm_start: expected a Solution, 'auto' or None, got {warm_start!r}")
    solver, backend, time_limit = options.solver, options.backend, options.time_limit
    reuse_layers = options.reuse_layers
    if solver not in MILP_SOLVERS:
        raise ValueError(f"{solver!r} is not one of the MILP formulations "
                         f"({', '.join(MILP_SOLVERS)}); solvers.solve takes every formulation")
    deadline = time.perf_counter() + time_limit
    settings = {"backend": backend, "mip_gap": options.mip_gap, "seed": options.seed,
                "threads": options.threads, "reuse_layers": reuse_layers,
                "programs": _Programs()}
    staged = warm_start == "auto"
    first = _NO_PLAN
    if staged:
        warm_start = None
        if budget_bytes is not None and _direct_first(problem, solver, reuse_layers):
            first = _first_solve(problem, budget_bytes, solver,
                                 time.perf_counter() + DIRECT_SHARE * time_limit, settings)
            proven = first is not _NO_PLAN and (
                first is None or (first.status == Status.OPTIMAL
                                  and not settings["programs"].unrefined))
            if proven:
                return _answer(problem, solver, budget_bytes, first, search_min_feasible,
                               backend, time_limit, reuse_layers)
            if first is not _NO_PLAN:
                warm_start = first                   # improved on with the time left
        if warm_start is None and budget_bytes is not None:
            warm_start = _warm_start(problem, solver, budget_bytes, backend,
                                     max(deadline - time.perf_counter(), 1.0), reuse_layers)
    fallback = warm_start if staged else _given_start(problem, solver, budget_bytes,
                                                          warm_start)
    try:
        solution = _solve(problem, budget_bytes, solver, warm_start, deadline, **settings)
    except SolverTimeoutError:
        if fallback is None:
            raise
        log.warning("%s: the backend found no plan in the time left; returning its warm "
                    "start", solver)
        solution = _incumbent(fallback, solver, None)
    if fallback is not None and solution is None:
        log.warning("%s: the program has no plan under the budget, where its warm start fits "
                    "as replayed; returning the warm start", solver)
        solution = dataclasses.replace(_incumbent(fallback, solver, None),
                                       status=Status.FEASIBLE)
    elif fallback is not None and fallback.objective < solution.objective * (1 - 1e-9):
        log.warning("%s: the backend stopped at a plan %.2g%% slower than its warm start's "
                    "(%.9g s > %.9g s); returning the warm start", solver,
                    100 * (solution.objective / fallback.objective - 1), solution.objective,
                    fallback.objective)
        solution = _incumbent(fallback, solver, solution)
    return _answer(problem, solver, budget_bytes, solution, search_min_feasible, backend,
                   time_limit, reuse_layers)


def _given_start(problem: ShardingProblem, solver: str, budget_bytes: int | None,
                 warm_start: Solution | None) -> Solution | None:
    """The caller's warm start, replayed, when it is a plan of ``solver`` (any keep flags for
    ``kiwi`` and ``kiwi-full``, the rule's for a baseline) that fits the budget; else None."""
    if warm_start is None:
        return None
    keep = np.asarray(warm_start.keep, bool)
    if solver in RULES and not np.array_equal(keep, RULES[solver](problem)):
        return None
    sim = simulate(problem, warm_start.strategy, recompute_at=warm_start.recompute_at)
    if budget_bytes is not None and sim.peak_bytes > budget_bytes:
        return None
    return dataclasses.replace(warm_start, objective=sim.step_seconds, peak_bytes=sim.peak_bytes,
                               budget_bytes=budget_bytes)


def _answer(problem, solver, budget_bytes, solution, search_min_feasible, backend, time_limit,
            reuse_layers) -> Solution:
    """``solution``, or the error for a budget no plan fits (``solution`` None)."""
    if solution is None and not search_min_feasible:
        raise InfeasibleBudgetError(solver, int(budget_bytes), None, searched=False)
    if solution is None:
        low, high = min_feasible_budget(problem, solver, backend=backend,
                                        time_limit=time_limit, reuse_layers=reuse_layers)
        raise InfeasibleBudgetError(solver, int(budget_bytes), high, low)
    return solution


DIRECT_SHARE = 0.8
"""Share of the time limit the tied program is solved in directly, before any warm-start
stage (:func:`_direct_first`)."""
_NO_PLAN = object()
"""The direct solve ran out of time without a plan."""


def _direct_first(problem: ShardingProblem, solver: str, reuse_layers: bool) -> bool:
    """Whether the program is solved directly before any warm-start stage: the tied program
    of a model with repeated layers, where the backend finds its plans itself. The stages
    cost more than they save there: the 4-layer KIWI-config GPT on 2x4 at 80% took 38.9 CPU
    seconds staged and 20 direct, to the same plan; the 20-layer one 50 CPU seconds direct
    (``experiments.solve_time``)."""
    return solver != "kiwi-full" and reuse_layers and has_ties(problem.ties)


def _first_solve(problem, budget, solver, deadline, settings):
    """The direct solve until ``deadline``: its plan, None for an infeasible budget, or
    :data:`_NO_PLAN` when it ran out of time without one (the warm-start stages get the rest).
    A final solve follows it unless its plan is proven, so a plan of the restriction under
    less memory is not refined in the exact form here (:func:`_solve`'s ``final_follows``)."""
    try:
        return _solve(problem, budget, solver, None, deadline, final_follows=True, **settings)
    except SolverTimeoutError:
        log.info("%s: no plan from the direct solve in %.0f%% of the time limit; warm-start "
                 "stages next", solver, 100 * DIRECT_SHARE)
        return _NO_PLAN


def _incumbent(warm_start: Solution, solver: str, final: Solution | None) -> Solution:
    """The staged warm start as ``solver``'s answer, when the final backend call ended without a
    plan (``final`` None) or with a slower one. It is a plan of ``solver``'s program (an
    ``alpa`` plan is a ``kiwi`` plan that keeps everything); HiGHS completes a start only after
    presolve and may stop before it takes it up. Its status is the final call's, its gap is
    against the final call's bound (inf without one), its sizes and seconds the final call's."""
    if final is None:
        return dataclasses.replace(warm_start, solver=solver,
                                   status=Status.TIMEOUT_WITH_INCUMBENT, gap=float("inf"))
    return dataclasses.replace(
        warm_start, solver=solver, status=final.status,
        gap=0.0 if final.status == Status.OPTIMAL else gap_to(warm_start.objective, final.bound),
        solve_seconds=final.solve_seconds, build_seconds=final.build_seconds,
        num_vars=final.num_vars, num_constraints=final.num_constraints)


@dataclasses.dataclass
class _Programs:
    """What a solve of one problem under one budget leaves the next one (the direct solve the
    final one, :func:`solve_milp`), so that it does not build or solve again what the first
    already did: the programs built, by their arguments (the 96-layer GPT's takes 8 s on 2x4);
    the form the first one ended in (the resharded operand copies counted, the chains'
    lifetimes exact, memory rows put back); per program the best bound proven on it; and
    whether the first one left its plan unrefined for the next (``unrefined``: a final solve
    runs even where that plan is proven within the gap)."""

    built: dict = dataclasses.field(default_factory=dict)
    bounds: dict = dataclasses.field(default_factory=dict)
    copies: bool = False
    exact: bool = False
    skip: np.ndarray | None = None
    unrefined: bool = False
    beside: _Beside | None = None
    """The program with the copies, while it is solved on a second core."""

    def solved_beside(self, key: tuple):
        """``(joint, fixed, result, started)`` of program ``key`` as solved on the second
        core, once that solve ends; None when it was not solved there (a solve of another
        program there is stopped)."""
        beside, self.beside = self.beside, None
        return None if beside is None else beside.take(key)

    def stop_beside(self):
        """Stop the second core's solve, if any."""
        beside, self.beside = self.beside, None
        if beside is not None:
            beside.take(None)

    def bound(self, key: tuple, relaxation: tuple | None, result, mip_gap: float):
        """``result`` with the best bound proven on its program, by any solve of it or of
        ``relaxation`` (a program whose plans include its plans: the same one without the
        resharded operand copies, under the same budget), kept for the next; optimal when that
        bound puts its plan within ``mip_gap``."""
        known = [b for b in (result.bound, self.bounds.get(key), self.bounds.get(relaxation))
                 if b is not None and np.isfinite(b)]
        if not known:
            return result
        self.bounds[key] = bound = max(known)
        if bound == result.bound:
            return result
        if result.status == Status.TIMEOUT_WITH_INCUMBENT and \
                gap_to(result.objective, bound) <= mip_gap:
            result = dataclasses.replace(result, status=Status.OPTIMAL)
        return dataclasses.replace(result, bound=bound)


def solver_cores() -> int:
    """The cores a solve may use: ``KIWI_JAX_SOLVER_CORES`` where it is set, else the cores
    this process may run on. With two or more, :func:`_solve` solves two programs at once."""
    given = os.environ.get("KIWI_JAX_SOLVER_CORES")
    if given is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"KIWI_JAX_SOLVER_CORES: expected a whole number of cores, 1 or "
                         f"more, got {given!r}")
    return int(given)


class _Beside:
    """The program with the resharded operand copies (``key``, :func:`_formulation`'s
    arguments in :func:`_solve`'s key) built and solved in a thread until ``deadline``, while
    the solve goes on with the one without them: the backend releases the interpreter while
    it runs. It starts after :data:`BESIDE_DELAY`, or at once when it is asked for, so a
    program solved in less costs no second core.

    On the zoo MoE at 80%, the one without them runs its 19 s share to a plan over the budget
    with its copies; the one with them, solved from then, had not proven its plan when the
    direct solve's 28 s ran out, and the final solve ran to the time limit: the cell planned in
    77.4 s on 2x4 and 76.3 s on 4x2 on one core (timeout_with_incumbent). On two, where it is
    solved beside, it proves its plan in 31-34 s from its start, and the cell plans in 54.9 and
    53.0 s (docs/solvers.md, "Two programs at once")."""

    def __init__(self, problem, key: tuple, skip, deadline: float, settings: dict):
        self.key, self.started = key, time.perf_counter()
        self.cancel, self.wanted = threading.Event(), threading.Event()
        self.built = self.result = self.error = None
        self.thread = threading.Thread(
            target=self._run, args=(problem, skip, deadline, settings), daemon=True,
            name="kiwi-solve-beside")
        self.thread.start()

    def _run(self, problem, skip, deadline, settings):
        self.wanted.wait(BESIDE_DELAY)
        if self.cancel.is_set():
            return
        solver, limit, reuse_layers, _, copies, exact = self.key
        try:
            self.started = time.perf_counter()
            self.built = _formulation(problem, solver, limit, False, reuse_layers, skip,
                                      copies, exact)
            if self.cancel.is_set():
                return
            self.result = self.built[0].model.solve(
                "highs", time_limit=max(deadline - time.perf_counter(), 1.0),
                cancel=self.cancel, **settings)
        except Exception as error:        # raised where the result is taken
            self.error = error

    def take(self, key: tuple | None):
        """``(joint, fixed, result, started)`` once the solve ends, when it is of ``key``; else
        None, and the thread is told to stop: it ends at the backend's next check, or once its
        build is done (not waited for: the 96-layer GPT's takes 8 s)."""
        self.wanted.set()
        if key != self.key:
            self.cancel.set()
            return None
        self.thread.join()
        if self.error is not None:
            raise self.error
        return (*self.built, self.result, self.started)


BESIDE_DELAY = 5.0
"""Seconds a solve of the program without the resharded operand copies runs before the one with
them starts on a second core (:class:`_Beside`), so that a solve that ends sooner puts no work
there. The 20-layer KIWI-config GPT's solve on 2x4 at 80% (``experiments.solve_time``), whose
relaxation fits with its copies in about 4 s, builds nothing beside with this delay; with 2 s
it built the other program, and took 7.0-7.1 s against 5.8-6.2 s on one core, a difference
within what the same solve spread over with nothing beside (5.7-7.0 s). The zoo MoE on 2x4 at
80% planned in 54.9 s with this delay, 52.7 s with 2 s, 77.4 s on one core."""


def _solve(problem, budget_bytes, solver, warm_start, deadline, backend, mip_gap, seed,
           threads, reuse_layers, programs: _Programs | None = None,
           final_follows: bool = False) -> Solution | None:
    """One solve, until ``deadline`` (``time.perf_counter()``; building the model counts, at
    least a second is left to the backend): of the program without the resharded operand copies
    first, of the one with them when its plan is over the budget with them or, without a warm
    start, when it has no plan in :data:`RELAXED_SHARE` of the time. None: the budget is
    infeasible. ``programs``: what an earlier solve of the same problem under the same budget
    learnt; it starts from there and adds to it. ``final_follows``: a solve under the whole
    budget follows this one, from its plan; then a plan of the program without the copies
    solved again under less memory (a restriction) is not refined in the exact form (on the
    zoo Llama on 4x2 at 80%, the exact form under the restriction's 507,228 B ran 20 s of a
    14 s window and found nothing faster).

    The exact form refines only a plan the bounded form proved optimal in a solve started
    without a plan (:data:`EXACT_WINDOW`): an unproven one goes to the final solve, which
    proves it sooner from the plan in the bounded form, and a solve from a plan refines
    nothing.

    With a second core (:func:`solver_cores`) and the ``highs`` backend, a solve without a warm
    start solves the program with the copies there while the one without them is solved
    (:class:`_Beside`), so that it is under way when that one's plan is over the budget with
    them; it is stopped when this solve ends."""
    programs = _Programs() if programs is None else programs
    try:
        return _solve_programs(problem, budget_bytes, solver, warm_start, deadline, backend,
                               mip_gap, seed, threads, reuse_layers, programs, final_follows)
    finally:
        programs.stop_beside()


def _solve_programs(problem, budget_bytes, solver, warm_start, deadline, backend, mip_gap, seed,
                    threads, reuse_layers, programs: _Programs, final_follows) -> Solution | None:
    """:func:`_solve`'s loop over its programs."""
    cold = warm_start is None   # the exact form refines only such a solve's proven plan
    limit = budget_bytes
    skip = programs.skip
    if skip is None and budget_bytes is not None:
        skip = _skipped_times(problem, solver, reuse_layers)
    copies = programs.copies  # counted once a plan is over the budget with them (build_joint)
    tightened = False        # the program without them solved again under less memory
    relaxed = deadline       # until when the program without them is solved
    shared = warm_start is None and budget_bytes is not None \
        and any(matrix.any() for matrix in problem.gathered)
    attempts = 0
    exact = programs.exact   # chains' lifetimes bounded from above until that is infeasible
    refining = None          # the bounded form's plan, while the exact form is solved from it
    refine_until = deadline  # and until when
    while attempts < 3:
        programs.copies, programs.exact, programs.skip = copies, exact, skip
        skipped = None if skip is None else skip.tobytes()
        key = (solver, limit, reuse_layers, skipped, copies, exact)
        taken = programs.solved_beside(key) if copies else None
        again = taken is None and key in programs.built
        if taken is not None:
            joint, fixed = taken[:2]
        elif again:
            joint, fixed = programs.built[key]
        else:
            joint, fixed = _formulation(problem, solver, limit, False, reuse_layers, skip,
                                        copies, exact)
        programs.built[key] = joint, fixed
        if shared and not copies:          # its share of the time left once it is built
            now = time.perf_counter()
            relaxed, shared = now + RELAXED_SHARE * max(deadline - now, 0.0), False
            if backend == "highs" and solver_cores() >= 2:
                programs.beside = _Beside(
                    problem, (solver, budget_bytes, reuse_layers, skipped, True, exact), skip,
                    deadline, {"mip_gap": mip_gap, "seed": seed, "threads": threads})
        until, watch = min(deadline if copies else relaxed, refine_until), None
        if not copies and not tightened and backend == "highs" \
                and relaxed < min(deadline, refine_until):
            until = min(deadline, refine_until)
            watch = _Watch(problem, joint, fixed, budget_bytes, relaxed)
        time_limit = max(until - time.perf_counter(), 1.0)
        log.info("%s: %d variables, %d constraints, %s in %.2f s", solver,
                 joint.model.num_vars, joint.model.num_rows,
                 "built before" if again else "built", joint.build_seconds)
        if taken is not None:
            solved = taken[2]
            log.info("%s: solved on a second core, begun %.1f s before: %s in %.1f s", solver,
                     time.perf_counter() - taken[3], solved.status.value, solved.seconds)
        else:
            hint = None
            if warm_start is not None and isinstance(joint, FullModel):
                hint = joint.hint(problem, warm_start.strategy,
                                  recompute_at=warm_start.recompute_at)
            elif warm_start is not None:
                hint = joint.hint(problem, warm_start.strategy,
                                  warm_start.keep if fixed is None else None)
            try:
                solved = joint.model.solve(
                    backend, time_limit=time_limit, mip_gap=mip_gap, seed=seed,
                    threads=threads, hint=hint, **({} if watch is None else watch.hooks))
            finally:
                if watch is not None:
                    watch.close()
        result = programs.bound(key, (solver, budget_bytes, reuse_layers, skipped, False, exact)
                                if copies else None, solved, mip_gap)
        if refining is not None and (result.x is None or (
                result.status != Status.OPTIMAL
                and result.objective >= refining[0].objective * (1 - 1e-6))):
            # keep the bounded form's plan, and its form: HiGHS finds plans faster there
            log.info("%s: the exact form found no %s in %.0f s; the bounded form's stands",
                     solver, "plan" if result.x is None else "faster plan", time_limit)
            result, joint, fixed, again, (strategy, keep, schedule, sim) = refining
            peak, programs.exact = sim.peak_bytes, False
            break
        refining, refine_until = None, deadline
        under_less = tightened and not copies      # a restriction: no plan there proves none
        if result.status == Status.INFEASIBLE and not under_less and solver == "kiwi" \
                and not exact:
            log.info("%s: no plan with recomputed chains' lifetimes bounded from above; solving "
                     "with them counted as held", solver)
            exact = True
            continue
        if result.status == Status.INFEASIBLE and not under_less:
            return None
        if result.x is None and not copies and (under_less or (
                result.status == Status.TIMEOUT_NO_INCUMBENT and relaxed < deadline)):
            log.info("%s: no plan without the resharded operand copies%s in %.0f s; solving "
                     "with them counted", solver, " under less memory" if under_less else "",
                     time_limit)
            copies, limit = True, budget_bytes
            continue
        if result.x is None:
            if result.status == Status.TIMEOUT_NO_INCUMBENT:
                raise SolverTimeoutError(
                    f"{solver}: no plan found within the time limit ({joint.model.num_vars} "
                    f"variables; the final solve had the {time_limit:.0f} s the warm-start "
                    f"stages left); raise time_limit or the budget"
                    + _tie_advice(problem, solver, reuse_layers), budget_bytes)
            raise SolverError(f"{solver}: backend {backend} failed ({result.status.value})")
        strategy, keep, schedule, sim = _decode(joint, problem, result.x, fixed)
        peak = sim.peak_bytes
        fits = budget_bytes is None or peak <= budget_bytes
        if fits and under_less and final_follows:
            log.info("%s: a plan under less memory; the final solve starts from it under the "
                     "whole budget", solver)
            programs.unrefined = True
        elif budget_bytes is not None and fits and solver == "kiwi" and cold \
                and result.status == Status.OPTIMAL \
                and not exact and joint.claimed_peak(result.x) >= EXACT_BINDING * limit \
                and deadline - time.perf_counter() >= max(result.seconds, 2.0) \
                and EXACT_BUILD * joint.build_seconds <= max(result.seconds, 1.0):
            # The bounded form holds a recomputed chain over all of its possible stages: where
            # its memory rows bind, the exact form may fit a faster plan (on the reference GPT
            # at hidden 1024 on one device under 3,788,891,516 B, the bounded form's plan
            # predicted 234.6 ms; the exact form's from it, 226.4 ms; a plan it counts at
            # 5,118,955,532 B holds 3,441,168,396 B). Solve that, from this plan, in its own
            # window (EXACT_WINDOW), where the time limit leaves at least the time this solve
            # took (on the zoo MoE on 2x4 at 80%, after a 24 s solve, the 6 s left found
            # nothing faster, and the backend ran 12 s on them). Only from a plan the bounded
            # form proved, in a solve started without a plan (see EXACT_WINDOW).
            log.info("%s: plan at the budget with recomputed chains' lifetimes bounded from "
                     "above; solving with them counted as held, from it", solver)
            exact, warm_start = True, _Start(strategy, keep, schedule)
            refining = result, joint, fixed, again, (strategy, keep, schedule, sim)
            refine_until = min(deadline, time.perf_counter()
                               + max(EXACT_WINDOW * result.seconds, 2.0))
            relaxed = max(relaxed, refine_until)   # its own window: the relaxation's share
            # may have passed (then it had 1 s, and the final solve redid its work)
            continue
        if fits:
            break
        if not copies and problem.gathered_of(strategy).any():
            over = peak - budget_bytes
            if not tightened and result.status == Status.OPTIMAL \
                    and over <= RELAXED_TIGHTENING * budget_bytes:
                # The program with the copies is the harder one (on the zoo Llama on 2x4 at
                # 80%, 2.3x the nonzeros: no better than 4.3% from optimal in 34 s, where the
                # one without them solves to optimal in 14 s): where the one without them was
                # solved to optimal, first solve it again with the excess taken off, in twice
                # the time it took.
                log.info("%s: plan peaks at %d bytes with its resharded operand copies, %d "
                         "over the budget of %d; solving again without them under %d", solver,
                         peak, over, budget_bytes, limit - over)
                limit -= over
                tightened, relaxation_bound = True, result.bound
                relaxed = min(deadline, time.perf_counter() + 2 * result.seconds)
                continue
            log.info("%s: plan peaks at %d bytes with its resharded operand copies, over the "
                     "budget of %d; solving again with them counted", solver, peak, budget_bytes)
            copies, limit = True, budget_bytes
            continue
        restored = _restored(problem, skip, sim.memory_timeline > budget_bytes)
        if restored is not None:          # over where the tied program had no rows
            log.info("%s: plan peaks at %d bytes, over the budget of %d where the program left "
                     "out memory rows; solving again with them", solver, peak, budget_bytes)
            skip = restored
            continue
        # The backend's feasibility tolerance let a plan through that the simulator puts over
        # the budget: solve again with the excess taken off, and at least what that tolerance
        # lets through, ten times more each time. The excess alone was 1 B in every attempt on
        # the reference GPT at hidden 1024 on one device (a memory unit of 524,288 B there).
        log.warning("%s: plan peaks at %d bytes, over the budget of %d by the backend's "
                    "tolerance; solving again", solver, peak, budget_bytes)
        limit -= max(peak - budget_bytes,
                     int(np.ceil(TOLERANCE_MARGIN * 10 ** attempts * joint.units.bytes)))
        attempts += 1
    else:
        raise SolverError(f"{solver}: the backend's plans stay over the budget ({peak} > "
                          f"{budget_bytes} bytes)")
    if tightened and not copies:     # the plan of the restriction: its gap is to the bound
        result = dataclasses.replace(result, bound=relaxation_bound)   # of the relaxation
    status = status_within_gap(result.status, result.gap, mip_gap)
    return Solution(
        solver=solver, backend=backend, status=status,
        objective=float(result.objective) * joint.units.seconds,
        gap=0.0 if status == Status.OPTIMAL else float(result.gap),
        solve_seconds=result.seconds, build_seconds=0.0 if again else joint.build_seconds,
        num_vars=joint.model.num_vars, num_constraints=joint.model.num_rows,
        budget_bytes=budget_bytes, strategy=strategy, keep=keep, recompute_at=schedule,
        peak_bytes=peak, claimed_peak_bytes=joint.claimed_peak(result.x))


TOLERANCE_MARGIN = 1e-4
"""In the program's memory units, the least taken off the budget when the backend's plan is over
it by its feasibility tolerance (:func:`_solve`), at the first attempt; ten times more at each
next one."""
EXACT_BINDING = 0.99
"""A plan of the bounded form of ``kiwi``'s program whose memory there is at least this share of
the budget is solved for again in the exact form, from that plan (:func:`_solve`)."""
EXACT_WINDOW = 1.0
"""The exact form's window, in the times the bounded solve before it took (2 s at least). On the
zoo it found no faster plan where docs/solvers.md gives its outcome; with twice the time, the
Linen scan on 2x4 at 80% spent 24-28 s there and planned in 70.2 s, and with once the time in
62.6 s. The twelve zoo cells at 80% on 2x4 and 4x2 all fit with the same steps as with twice,
but for the Llama on 4x2, whose budget search took another path (0.342 against 0.357 ms).

Only a plan the bounded form proved, in a solve started without a plan, is refined. The Linen
scan's direct solve stops at its relaxation's share with the bounded plan unproven (a 4.3% gap
after 19 s), and the final solve, from that plan, proves it in 14-18 s; the exact form's 19 s
between the two found nothing, and without them the cell plans in 46.5 s instead of 66.6 s, to
the same plan (alone on two cores). The one faster plan the exact form is recorded to have
found (the reference GPT at hidden 1024 on one device) came from a bounded plan proven in about
a second."""
EXACT_BUILD = 3.0
"""The exact form's build, in bounded builds: the bounded form's plan is solved for again in the
exact form only when that build would take no longer than the bounded solve did (or a second).
The exact form's rows grow with depth where the bounded one's do not: on the KIWI-config GPT on
2x4 at 80%, 29,156 rows against 11,473 at 20 layers (built in 3.2-3.5 s against 1.4 s) and
223,944 against 12,309 at 96 (20.1 s against 6.4 s). There the bounded solve had taken 3.5 s,
the exact form's 1 s left of its window found nothing, and a final solve of it took 6.1 s to the
same plan (45.0 s in all); at 20 layers too it gave the same plan."""


@dataclasses.dataclass(frozen=True)
class _Start:
    """A plan to start a solve from (the hint of :meth:`JointModel.hint`)."""

    strategy: np.ndarray
    keep: np.ndarray
    recompute_at: dict


RELAXED_TIGHTENING = 0.05
"""An optimal plan of the program without the resharded operand copies that is over the budget
with them by at most this share of it is solved for once more in that program, under a budget
less the excess, before the program with them is."""
RELAXED_SHARE = 0.4
"""Share of a solve's time, as left once it is built, for the program without the resharded
operand copies (a relaxation of the one with them: its plan is the answer when it fits with
them) when the solve has no warm start, so that a plan over the budget with them leaves the rest
to the program that counts them. With the whole time, the zoo Llama on 2x4 at 80% found, after
48 s, a plan 1.2% over with its copies, and the program with them then had no time left to find
one (it finds one in 20 s from the start). With a warm start, which fits with the copies, the
counted program always has a plan, and the relaxation keeps the whole time. With the ``highs``
backend the share is where :class:`_Watch` stops the solve unless its plan so far fits with its
copies; it goes on past the share otherwise."""


def _tie_advice(problem: ShardingProblem, solver: str, reuse_layers: bool) -> str:
    """What layer ties can still do for a solve that ran out of time, as advice that is true."""
    if solver == "kiwi-full":
        return " (kiwi-full plans every operator on its own; kiwi ties repeated layers)"
    if not has_ties(problem.ties):
        return " (no repeated layers were found to tie, so reuse_layers changes nothing here)"
    return "" if reuse_layers else ", or pass reuse_layers=True"


def _warm_start(problem, solver, budget, backend, time_limit, reuse_layers) -> Solution | None:
    """A plan that fits, to start the search from (None if none was found in time).

    Cheaper programs run first, each seeding the next, each until a share of ``time_limit``
    (a stage that proves its plan within ``STAGE_GAP`` ends early and leaves its time on):
    0. ``kiwi-full`` starts from ``kiwi``'s plan (half the time).
    1. ``kiwi`` starts from ``alpa``'s plan (a plan without recomputation is a ``kiwi`` plan,
       so ``kiwi`` never ends slower than the ``alpa`` plan it was given), which itself starts
       from the peak-minimising program (up to 25%: on the 20-layer encoder it needs 2.2-3.2 s;
       with 10% of 30 s it ran out and left ``kiwi`` its own peak-minimising plan, 1.46x the
       reference step where ``alpa``'s reaches 1.003x); ``alpa`` runs until 50% of the time
       (85% when the tied program is the one solved): with 30% it did not get past the
       peak-minimising plan on the 4-layer GPT (1.37x the reference step where ``alpa`` alone
       reaches 1.013x); tied, with 60% of 27 s, neither on the 20-layer encoder at 80% (1.39x;
       1.013x with 85%, while the 4-layer models lost nothing).
    2. With repeated layers and no reuse asked for, the tied program (one decision per layer
       position: a third of the variables on the 4-layer GPT) runs until 80% of the time; its
       plan is a plan of the full program, which gets the rest to improve on it.
    """
    start = time.perf_counter()

    def at(share: float) -> float:
        """The deadline ``share`` of the way through the time limit."""
        return start + share * time_limit

    tied = solver != "kiwi-full" and (reuse_layers or has_ties(problem.ties))
    options = {"backend": backend, "mip_gap": STAGE_GAP, "seed": 0, "threads": 1,
               "reuse_layers": tied}
    plan = None
    if solver == "kiwi-full":             # a reduced plan is a plan of the staged program
        plan = _warm_start(problem, "kiwi", budget, backend, 0.5 * time_limit, reuse_layers)
        if plan is not None:
            plan = _improve(problem, budget, "kiwi", plan, at(0.5), options)
        return plan
    if solver == "kiwi":
        plan = _fitting_plan(problem, "alpa", budget, backend, 0.25 * time_limit, tied)
        if plan is not None:
            plan = _improve(problem, budget, "alpa", plan, at(0.85 if reuse_layers else 0.5),
                            options)
    if plan is None:
        plan = _fitting_plan(problem, solver, budget, backend, time_limit / 4, tied)
    if plan is not None and tied and not reuse_layers:
        plan = _improve(problem, budget, solver, plan, at(0.8), options)
    return plan


STAGE_GAP = 1e-3
"""Relative gap at which a warm-start stage stops and hands its plan on."""


def _improve(problem, budget, solver, plan: Solution, deadline: float, options) -> Solution:
    """``solver``'s best plan found by ``deadline`` from ``plan`` (``plan`` if none better)."""
    try:
        better = _solve(problem, budget, solver, plan, deadline, **options)
    except SolverTimeoutError:
        return plan
    return better if better is not None and better.objective <= plan.objective else plan


def min_peak_plan(problem: ShardingProblem, solver: str = DEFAULTS.solver,
                  backend: str = DEFAULTS.backend, time_limit: float = DEFAULTS.time_limit,
                  reuse_layers: bool = DEFAULTS.reuse_layers, mip_gap: float = 1e-6,
                  ) -> tuple[Solution | None, int | None]:
    """The plan of ``solver`` (one of :data:`MILP_SOLVERS`) with the lowest per-device peak:
    the same program with the peak minimised instead of the step time. It fits every budget at
    or above its peak, so it is a warm start for any of them. Its defaults are
    :func:`solvers.solve`'s but for the gap: a bound on the smallest budget is held tight
    (1e-6).

    The program's memory rows bound the simulator's replay from above (the claimed peak is
    never below the simulated one, and on the 1-layer GPT it was above), so the budget a plan
    needs *in the program* is its claimed peak; that is the budget reported, and the smallest
    one under which :func:`solve` finds a plan.

    For ``kiwi`` the bounded form of the chains' lifetimes is solved first (in seconds), and
    the exact form, which :func:`solve` falls back to and which holds chains for less, then
    starts from its plan for :data:`EXACT_PEAK_SHARE` of the time limit: the bound is the
    exact form's, so no budget under it has a plan ``solve`` can find. On the 2-layer
    reference GPT on one device (per-operator model) the bounded form's smallest peak is
    26.97 MB, and ``solve`` plans at 22 MB; the exact form reached 24.26 MB in 5 s, 21.00 MB
    in 15 s, 20.67 MB in 60 s, with bounds of 19.03-19.24 MB.

    Returns:
      ``(plan, lower)``: the plan (its ``objective`` is its simulated step time, its
      ``budget_bytes`` the budget it needs) and a bound no plan's budget goes under (the plan's
      budget when the search finished; None when no bound was found in time);
      ``(None, None)`` when the search found no plan.
    """
    start = time.perf_counter()
    plan, lower = _min_peak(problem, solver, backend, time_limit, reuse_layers, mip_gap)
    if solver != "kiwi" or plan is None:
        return plan, lower
    limit = min(EXACT_PEAK_SHARE * time_limit, time_limit - (time.perf_counter() - start))
    return _min_peak(problem, solver, backend, max(limit, 1.0), reuse_layers, mip_gap,
                     exact_from=plan)


EXACT_PEAK_SHARE = 0.25
"""Share of :func:`min_peak_plan`'s time limit the exact form of ``kiwi``'s program has (its
peak-minimising solve rarely finishes: on the 2-layer reference GPT on one device it was 7%
from its bound after 60 s)."""


def _min_peak(problem, solver, backend, time_limit, reuse_layers, mip_gap,
              exact_from: Solution | None = None) -> tuple[Solution | None, int | None]:
    """:func:`min_peak_plan` of one form of ``solver``'s program: the bounded form of the
    chains' lifetimes, or the exact one started from ``exact_from`` (the bounded form's plan,
    which holds no more in it). The exact one is solved without the resharded operand copies,
    as :func:`_solve` first solves it under a budget: its bound is then one under which that
    solve finds no plan; its plan needs its peak with them (:func:`program_peak`)."""
    key = (problem.digest, solver, backend, reuse_layers, mip_gap, exact_from is not None)
    known = _MIN_PEAK.get(key)
    if known is not None and (known[2] or known[3] >= time_limit):
        return known[:2]
    exact = exact_from is not None
    # every row: the rows a budgeted solve leaves out until its replay asks for them are
    # where the smallest peak may be (the optimizer's updates, on a model of large parameters)
    joint, fixed = _formulation(problem, solver, None, True, reuse_layers, copies=not exact,
                                exact=exact)
    hint = joint.hint(problem, exact_from.strategy, exact_from.keep) if exact else None
    result = joint.model.solve(backend, time_limit=time_limit, mip_gap=mip_gap, hint=hint)
    bound = int(np.floor(result.bound * joint.units.bytes)) if np.isfinite(result.bound) \
        else None

    def unproven(answer: Solution):
        """``answer`` kept with this solve's bound, as an answer a longer limit may better."""
        return _remembered(key, time_limit, answer, bound and min(bound, answer.budget_bytes))

    if result.x is None:
        return unproven(exact_from) if exact else (None, None)
    strategy, keep, schedule, sim = _decode(joint, problem, result.x, fixed)
    claimed = optimum = joint.claimed_peak(result.x)
    if exact and problem.gathered_of(strategy).any():
        try:
            claimed = program_peak(problem, strategy, keep, SolverOptions(
                backend=backend, time_limit=time_limit, reuse_layers=reuse_layers))
        except SolverError as error:
            # Counting the plan with its copies is one solve more, in the exact stage's own
            # time limit; where it finds nothing (the zoo MoE on 2x4 at 80%, under load), the
            # bounded form's plan stands, as when the exact form finds no plan.
            log.info("%s: %s; the bounded form's plan stands", solver, error)
            return unproven(exact_from)
    needs = max(sim.peak_bytes, claimed or 0)
    plan = Solution(solver=solver, backend=backend, status=result.status,
                    objective=sim.step_seconds, gap=float("nan"), solve_seconds=result.seconds,
                    build_seconds=joint.build_seconds, num_vars=joint.model.num_vars,
                    num_constraints=joint.model.num_rows, budget_bytes=needs,
                    strategy=strategy, keep=keep, recompute_at=schedule,
                    peak_bytes=sim.peak_bytes, claimed_peak_bytes=claimed)
    if exact and exact_from.budget_bytes <= needs:
        plan = exact_from
    if result.status != Status.OPTIMAL:
        return unproven(plan)
    lower = min(optimum if exact else needs, plan.budget_bytes)
    return _remembered(key, time_limit, plan, lower, proven=True)


def _remembered(key, time_limit, plan, lower, proven=False):
    """``(plan, lower)``, kept in :data:`_MIN_PEAK` under ``key`` (the latest
    :data:`MIN_PEAK_KEPT` answers)."""
    _MIN_PEAK.pop(key, None)
    _MIN_PEAK[key] = plan, lower, proven, time_limit
    while len(_MIN_PEAK) > MIN_PEAK_KEPT:
        del _MIN_PEAK[next(iter(_MIN_PEAK))]
    return plan, lower


_MIN_PEAK: dict[tuple, tuple[Solution, int | None, bool, float]] = {}
""":func:`_min_peak`'s answers, by problem content (:attr:`ShardingProblem.digest`) and
program: ``(plan, lower, proven, time limit)``; an answer is given again when it was proven,
or found with at least the time asked for. The search of a budget that fits once compiled
(:mod:`kiwi_jax.fit`) solves one problem under several budgets, and each solve's warm start
asked for the same plan again (15 s of each 40 s round on the 1-layer GPT on 2x4); the
decorator starts that search from the plan an infeasible budget's error names. By content,
not by object: each ``optimize`` of a step traces it again and builds its own problem, and a
second budget for the same step (a sweep, a user trying another) asked the same question again
(14 s of the 1 MB error in test_optimize's budget-search test)."""

MIN_PEAK_KEPT = 32
"""Answers :data:`_MIN_PEAK` keeps (the latest; each holds one plan's arrays)."""


def _fitting_plan(problem, solver, budget, backend, time_limit, reuse_layers) -> Solution | None:
    """A plan under ``budget`` from the peak-minimising program: one it gave before (an
    infeasible budget's error named it as fitting), or its bounded form's for ``kiwi`` (None
    if none found in time). On the zoo's Llama, ViT, ResNet and encoder-decoder on 2x4, a
    solve under a budget between the exact and the bounded form's smallest peaks found no plan
    in 30 s without it."""
    plan = min((known[0] for key, known in _MIN_PEAK.items()
                if key[:4] == (problem.digest, solver, backend, reuse_layers)
                and known[0].budget_bytes <= budget),
               key=lambda known: known.budget_bytes, default=None)
    if plan is None:
        plan, _ = _min_peak(problem, solver, backend, time_limit, reuse_layers, 1e-2)
    if plan is None or plan.budget_bytes > budget:
        return None
    log.info("%s: warm start from a plan peaking at %d bytes (%.2f s)", solver, plan.peak_bytes,
             plan.solve_seconds)
    return dataclasses.replace(plan, budget_bytes=budget)


def min_feasible_budget(problem: ShardingProblem, solver: str = DEFAULTS.solver,
                        backend: str = DEFAULTS.backend, time_limit: float = DEFAULTS.time_limit,
                        reuse_layers: bool = DEFAULTS.reuse_layers,
                        ) -> tuple[int | None, int | None]:
    """Bounds on the smallest per-device peak a plan of ``solver`` can have (see
    :func:`min_peak_plan`; its defaults are :func:`solvers.solve`'s, so the two agree).

    Returns:
      ``(lower, upper)``: no plan fits under ``lower``; a plan that fits ``upper`` exists (equal
      when the search finished). ``(None, None)`` when the search found no plan.
    """
    plan, lower = min_peak_plan(problem, solver, backend, time_limit, reuse_layers)
    return (None, None) if plan is None else (lower, plan.budget_bytes)


def reference_plan(problem: ShardingProblem, backend: str = DEFAULTS.backend,
                   time_limit: float = DEFAULTS.time_limit, seed: int = DEFAULTS.seed,
                   threads: int = DEFAULTS.threads,
                   reuse_layers: bool = DEFAULTS.reuse_layers) -> Solution:
    """The ``alpa`` plan with no memory limit that, among the fastest ones, peaks lowest: the
    100% of budgets given as percentages.

    With repeated layers and ``reuse_layers`` (the default, as for every solve), it is the
    tied program's: plans under a budget are tied too, so none is faster. On the 4-layer
    KIWI-config GPT on 2x4 the tied reference has the untied one's step and peak, in 8.0 CPU
    seconds against 16.9. Untied, the tied program (solved in seconds) starts the full one: on
    deep graphs the full program alone stops at the time limit far from the optimum (the
    12-layer encoder's reference was 15% slower than plans found later under a budget).

    The fastest sharding is rarely unique (equally fast plans of the 4-layer KIWI-config GPT
    peak at 18.2, 21.1 and 23.3 GB), so the peak is minimised in a second solve with the step
    time held at the optimum. That solve runs on the tied program when the graph has repeated
    layers (it finishes in seconds where the full one may not within the time limit, which
    would make the reference depend on the limit), else, or if it finds nothing, on the full
    program. Every solve stops at :data:`REFERENCE_GAP`. The peak-minimising solve has
    :data:`REFERENCE_PEAK_SHARE` of the time limit and counts only when it finishes: an
    unfinished one would make the 100% depend on how far it got (on the zoo encoder-decoder on
    2x4 its root LP alone took 53 s, and two references, both stopped at 60 s, peaked at
    644,753 and 500,749 B); without it the 100% is the fastest plan's peak.
    """
    ties = problem.ties
    alpa = SolverOptions(solver="alpa", backend=backend, time_limit=time_limit,
                         mip_gap=REFERENCE_GAP, reuse_layers=False, seed=seed, threads=threads)
    only_tied = reuse_layers and has_ties(ties)
    tied = solve_milp(problem, None, dataclasses.replace(
        alpa, time_limit=time_limit if only_tied else time_limit / 2, reuse_layers=True)) \
        if has_ties(ties) else None
    fastest = tied if only_tied else solve_milp(problem, None, alpa, warm_start=tied)
    if tied is not None and tied.objective < fastest.objective:
        fastest = tied
    fixed = RULES["alpa"](problem)
    # Peaks without the resharded operand copies (with them the 20-layer GPT's reference took
    # 31 s, without 10 s); the plan is kept only if its replay, copies counted, peaks lower.
    for tie in ([ties] if only_tied else [ties, None] if has_ties(ties) else [None]):
        joint = build_joint(problem, None, fixed_keep=fixed, minimize_peak=True, tie=tie,
                            max_seconds=fastest.objective * (1 + 1e-7), copies=False)
        hint = joint.hint(problem, fastest.strategy) if tie is None else None
        result = joint.model.solve(backend, time_limit=REFERENCE_PEAK_SHARE * time_limit,
                                   mip_gap=REFERENCE_GAP, seed=seed, threads=threads, hint=hint)
        if result.x is None or status_within_gap(result.status, result.gap,
                                                 REFERENCE_GAP) != Status.OPTIMAL:
            log.info("reference: the lowest peak among the fastest plans was not found within "
                     "%.0f s (%s)", REFERENCE_PEAK_SHARE * time_limit, result.status.value)
            continue
        strategy, keep, schedule, sim = _decode(joint, problem, result.x, fixed)
        if sim.peak_bytes < fastest.peak_bytes and \
                sim.step_seconds <= fastest.objective * (1 + 1e-6):
            return dataclasses.replace(
                fastest, strategy=strategy, keep=keep, recompute_at=schedule,
                objective=sim.step_seconds, peak_bytes=sim.peak_bytes,
                solve_seconds=fastest.solve_seconds + result.seconds)
    return fastest


def pinned_plan(problem: ShardingProblem, keep: np.ndarray, pinned: dict[int, int],
                options: SolverOptions, name: str = "pinned",
                budget_bytes: int | None = None, least_memory: bool = False) -> Solution:
    """The fastest plan with the keep flags ``keep`` whose nodes in ``pinned`` take the
    strategies given there (a hand-written recipe's state layout and block policy as a plan of
    the program, :func:`kiwi_jax.recipe_plan.recipe_solution`); the other nodes' strategies
    are solved for. ``options.reuse_layers`` ties the repeated layers, as ``kiwi`` does,
    but where the pins set a node and its tied twin apart (then the program is untied).

    Args:
      name: the plan's :attr:`Solution.solver`.
      budget_bytes: a per-device limit (None: none; the plan's peak is its own).
      least_memory: of the fastest plans, the one with the smallest peak (a second solve,
        the peak minimised with the step time held at the fastest's). Many layouts of the
        values the pins leave free cost the same time (a broadcast constant, replicated or
        split, is computed in place either way); the first solve picks any of them, and on
        the zoo Llama (dim 1024, seq 1024) on 2x4 its tensor-parallel plan held 1.00 GB where
        the least of the equally fast ones holds 0.72 GB (0.82 GB compiled).

    Raises:
      ValueError: a pinned strategy no strategy of the node's leader gives, pins that
        contradict each other, or keep flags that break KIWI's eq. 9 outside layers.
      InfeasibleBudgetError: no such plan fits the budget.
      SolverTimeoutError: the time limit passed before any plan was found.
      SolverError: the backend failed.
    """
    tie = _pinned_ties(problem, pinned, options)
    joint = build_joint(problem, budget_bytes, fixed_keep=keep, tie=tie, pinned=pinned)
    result = joint.model.solve(options.backend, time_limit=options.time_limit,
                               mip_gap=options.mip_gap, seed=options.seed,
                               threads=options.threads)
    if result.x is None:
        if result.status == Status.INFEASIBLE and budget_bytes is None and tie is not None:
            return pinned_plan(problem, keep, pinned, dataclasses.replace(
                options, reuse_layers=False), name, budget_bytes, least_memory)
        if result.status == Status.INFEASIBLE and budget_bytes is None:
            raise ValueError(f"{name}: no plan takes every pinned strategy: the pins "
                             "contradict each other")
        if result.status == Status.INFEASIBLE:
            raise InfeasibleBudgetError(name, budget_bytes, None, searched=False)
        if result.status == Status.TIMEOUT_NO_INCUMBENT:
            raise SolverTimeoutError(f"{name}: no plan found within {options.time_limit:.0f} s "
                                     f"({joint.model.num_vars} variables)", budget_bytes)
        raise SolverError(f"{name}: backend {options.backend} failed ({result.status.value})")
    strategy, keep, schedule, sim = _decode(joint, problem, result.x, keep)
    status = status_within_gap(result.status, result.gap, options.mip_gap)
    fastest = Solution(
        solver=name, backend=options.backend, status=status,
        objective=float(result.objective) * joint.units.seconds,
        gap=0.0 if status == Status.OPTIMAL else float(result.gap),
        solve_seconds=result.seconds, build_seconds=joint.build_seconds,
        num_vars=joint.model.num_vars, num_constraints=joint.model.num_rows,
        budget_bytes=budget_bytes, strategy=strategy, keep=keep, recompute_at=schedule,
        peak_bytes=sim.peak_bytes, claimed_peak_bytes=joint.claimed_peak(result.x))
    return least_memory_plan(problem, fastest, pinned, options) if least_memory else fastest


def _pinned_ties(problem: ShardingProblem, pinned: dict[int, int],
                 options: SolverOptions) -> np.ndarray | None:
    """The layer ties of a program with ``pinned`` strategies: the problem's with
    ``options.reuse_layers``, but none where a pinned node and its tied twin are pinned apart
    (a Megatron layout alternates column and row splits over layers the ties make one)."""
    tie = problem.ties if options.reuse_layers else None
    if tie is not None and any(int(tie[node]) in pinned and pinned[int(tie[node])] != choice
                               for node, choice in pinned.items()):
        log.info("tied nodes are pinned to different strategies; solving untied")
        return None
    return tie


def least_memory_plan(problem: ShardingProblem, fastest: Solution, pinned: dict[int, int],
                      options: SolverOptions) -> Solution:
    """Of the plans as fast as ``fastest`` (a :func:`pinned_plan` of ``pinned``, under its
    budget), the one with the smallest peak: the peak minimised with the step time held at
    the fastest's and its keep flags and pins (see ``pinned_plan``'s ``least_memory``). Its
    status and gap are the fastest's; its solve seconds both solves'.

    Raises:
      SolverTimeoutError: the time limit passed before the backend took the fastest plan up.
    """
    tie = _pinned_ties(problem, pinned, options)
    joint = build_joint(problem, fastest.budget_bytes, fixed_keep=fastest.keep,
                        minimize_peak=True, tie=tie, pinned=pinned,
                        max_seconds=fastest.objective * (1 + 1e-7))
    result = joint.model.solve(options.backend, time_limit=options.time_limit,
                               mip_gap=options.mip_gap, seed=options.seed,
                               threads=options.threads,
                               hint=joint.hint(problem, fastest.strategy) if tie is None else None)
    if result.x is None:           # the fastest plan is a solution: only a time-out gets here
        raise SolverTimeoutError(f"{fastest.solver}: the smallest peak at the fastest step time "
                                 f"not found within {options.time_limit:.0f} s "
                                 f"({joint.model.num_vars} variables)", fastest.budget_bytes)
    strategy, keep, schedule, sim = _decode(joint, problem, result.x, fastest.keep)
    return dataclasses.replace(
        fastest, objective=sim.step_seconds, solve_seconds=fastest.solve_seconds + result.seconds,
        build_seconds=joint.build_seconds, num_vars=joint.model.num_vars,
        num_constraints=joint.model.num_rows, strategy=strategy, keep=keep,
        recompute_at=schedule, peak_bytes=sim.peak_bytes,
        claimed_peak_bytes=joint.claimed_peak(result.x))


def program_peak(problem: ShardingProblem, strategy, keep, options: SolverOptions) -> int:
    """The per-device peak kiwi's program itself counts for a plan (its largest U_k; the
    simulator replays the plan to :attr:`Solution.peak_bytes`): the program whose keep flags
    are free, in the exact form of its chains' lifetimes (the one it falls back to), with the
    plan's strategies pinned and its keep flags held by rows. Tied as ``options.reuse_layers``
    says where the plan decides alike for every tied pair of nodes; untied where it does not
    (the plan is then one of the untied program only).

    Raises:
      SolverError: the backend found no solution (it has exactly one).
    """
    strategy, keep = np.asarray(strategy), np.asarray(keep, bool)
    pinned = {i: int(s) for i, s in enumerate(strategy)}
    tie = _pinned_ties(problem, pinned, options)
    if tie is not None and (keep != keep[tie]).any():
        log.info("program_peak: the plan keeps tied nodes apart; counting it untied")
        tie = None
    joint = build_joint(problem, None, minimize_peak=True, tie=tie, pinned=pinned,
                        exact_chains=True)
    for node, index in joint.m_vars.items():
        joint.model.add_row(var(index), float(keep[node]), float(keep[node]))
    result = joint.model.solve(options.backend, time_limit=options.time_limit,
                               mip_gap=REFERENCE_GAP, seed=options.seed, threads=options.threads)
    if result.x is None:
        raise SolverError(f"program_peak: backend {options.backend} found no solution "
                          f"({result.status.value})")
    return joint.claimed_peak(result.x)
