"""Use the whole budget: search the solver's budget against the compiled step's memory.

The planner's memory model is off against what XLA compiles, in both directions (10-30%
measured; docs/benchmarks.md, docs/apply.md). The compiler is the judge: a plan solved under a
*solver budget* ``b`` is compiled and its per-device memory read, and the search moves ``b``
until the compiled step fits the user's budget ``B`` and uses at least ``1 - tolerance`` of it,
or more memory cannot make the plan faster, or the compiles allowed are spent. It returns the
fastest plan whose compiled memory fits (lowest estimated step of its compiled program where
the caller estimates one, else lowest predicted step), with a record of every trial.

The search sees two callables, ``solve(b) -> plan | None`` (None: no plan under ``b``) and
``compile(plan) -> compiled peak bytes``, and reads each plan's ``predicted_step_seconds`` and
``predicted_peak_bytes``; it imports nothing of jax and is tested with fakes.

The state is an interval of solver budgets still worth trying: ``lo``, the largest budget whose
plan fit once compiled, and ``hi``, the smallest budget known to give a plan that compiles over
``B``. A plan solved under ``b`` with predicted peak ``p <= b`` is the solver's answer for every
budget in ``[p, b]``, so a plan that compiles over moves ``hi`` to ``p`` (a different plan needs
less than ``p``) and one that fits moves ``lo`` to ``b`` (a different, faster plan needs more
than ``b``). The next budget aims at the middle of the band, ``(1 - tolerance / 2) B``. While
only a plan over is known, the next budget is that aim less the plan's excess of compiled over
predicted memory (the excess taken as fixed: over the 411 tightenings recorded in
docs/results, ``python -m experiments.fit_steps``, it predicted the next plan's compiled memory
within 3.6% of the budget at the median, against 5.0% for the compiled/predicted ratio taken as
fixed, which under-predicts by more than half the band more often, 60% of cases against 49%;
on the Linen scan at 80% of 2x4 the excess stayed at 97-109 KB of 424 KB over five plans).
While only a plan under is known, it is scaled up by the observed ratio ``B / compiled`` (a
secant through the origin: 4.5% at the median over 119 loosenings, against 4.7% for the
excess, and under by more than half the band in 48% against 52%). Once both ends are known,
it is interpolated between them (a secant, kept 10% of the width away from either end so the
interval shrinks by at least that), bisected after a
budget with no plan, and put just under ``hi`` after a solve that brought nothing new to
compile: a plan compiled before, or a plan no faster than one that fits (the solver has nothing
faster up to that budget, so ``lo`` moves up to it; such a plan is not compiled, as it would not
be kept whatever it compiles to). The plans between the ends are then few, and one solve just
under ``hi`` tells whether any is faster (bisecting would spend a solve per halving).
Solver budgets with no plan are ruled out from below (``floor``); given the plan with no memory
limit, every budget at or above its peak is answered by that plan without a solve
(``ceiling``), and a fitting plan as fast as it ends the search: more memory cannot make it
faster.

References:
  Brent, "Algorithms for Minimization without Derivatives" (1973), ch. 4: a secant step
  safeguarded by bisection on a bracketing interval.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

__all__ = ["FitStop", "FitTrial", "FitRecord", "FitResult", "NoPlanInTime", "fit_budget", "BAND",
           "RESOLUTION", "FIT_COMPILES"]

log = logging.getLogger(__name__)

FIT_COMPILES = 6
"""Default bound on the compiles of the search, for the decorator and the command line."""
BAND = 0.03
"""Default ``tolerance``: a compiled step within 3% under the budget uses it."""
RESOLUTION = 0.005
"""Default ``resolution``: the search stops when the solver budgets left to try span less than
this fraction of the budget."""
SHRINK = 0.1
"""A guess between two known ends stays this fraction of the interval away from either."""


class SolvedPlan(Protocol):
    """What the search reads of a plan."""

    predicted_step_seconds: float
    predicted_peak_bytes: int


P = TypeVar("P", bound=SolvedPlan)


class NoPlanInTime(Exception):
    """Raised by a search's ``solve`` when the solver found no plan under a budget in its time
    limit, which does not show that none exists there (None does): the search stops
    (:attr:`FitStop.TIME`)."""


class FitStop(enum.Enum):
    """Why the search stopped; every exit of :func:`fit_budget` is one of these."""

    FITS = "fits"
    """The last plan compiled within ``[1 - tolerance, 1]`` of the budget."""
    FASTEST = "fastest"
    """The last plan fits and is as fast as the plan with no memory limit (within
    ``step_tolerance``): more memory cannot make it faster."""
    COMPILES = "compiles"
    """The compile bound is spent."""
    SOLVES = "solves"
    """The solve bound is spent (the solver kept returning plans already compiled)."""
    CONVERGED = "converged"
    """The solver budgets left to try span less than ``resolution`` of the budget."""
    NO_PLAN = "no_plan"
    """The solver has no plan where the search needs one: at the start and
    :data:`NO_PLAN_RETRIES` looser solver budgets, or under every tighter solver budget left
    (the plans compiled over the budget)."""
    TIME = "time"
    """The solver found no plan in its time limit under the last solver budget (and under
    :data:`TIME_RETRIES` budgets halfway back up to the smallest that compiled over): no proof
    that none exists, but each such solve costs the whole limit (on the zoo Llama on 2x4 at
    80%, four in a row took 4 of the search's 8 minutes), so the search keeps what it
    measured."""
    BEATEN = "beaten"
    """The last plan compiled over the budget, and a step that fits is estimated no slower
    (``beaten``: with ``recipes`` on, the decorator's fastest recipe that fits). A tighter
    solver budget only gives plans the model predicts slower still, so the search keeps what it
    measured and the faster step runs."""
    BLOCKS = "blocks"
    """No plan of the search fit, and the whole-block recomputation did, or the budget is under
    the model's smallest peak and it fit with a faster compiled estimate (set by the decorator,
    :meth:`kiwi_jax.optimize.OptimizedStep._whole_blocks`): every layer keeps its input and
    recomputes the rest (on one device, compiled as its export: close to the step
    ``nothing_saveable`` gives)."""
    LAYOUTS = "layouts"
    """The search's plan fit, and the plan of the program with the layouts left free fits
    too, estimated faster: solved with no memory limit where the search's plan was as fast as
    its plan with none (memory does not bind), else under the search's solver budget (set by
    the decorator, :meth:`kiwi_jax.optimize.OptimizedStep._free_layouts`)."""
    DEADLINE = "deadline"
    """A plan that fits is in hand and the search's ``deadline`` has passed: no more solves.
    Until a plan fits, the deadline does not stop the search (only ``max_compiles`` does)."""


@dataclasses.dataclass(frozen=True)
class FitTrial:
    """One plan the search solved and measured."""

    solver_budget_bytes: int
    """Budget the solver was given."""
    predicted_peak_bytes: int
    """The plan's simulated per-device peak."""
    compiled_peak_bytes: int | None
    """Its compiled step's per-device memory (argument + output + temp - alias); None: not
    compiled, as it is no faster than a plan that already fit."""
    predicted_step_seconds: float
    """Its simulated step time."""
    compiled: bool = True
    """The plan was compiled for this trial (False: the solver returned a plan already
    compiled, whose memory was reused, or one not worth compiling)."""
    compiled_step_seconds: float | None = None
    """Its compiled step's estimated time (``fit_budget``'s ``seconds``); None: not compiled,
    or not estimated."""
    blocks: bool = False
    """A plan of the whole-block recomputation's search (set by the decorator after the
    search's own trials, :meth:`kiwi_jax.optimize.OptimizedStep._whole_blocks`)."""
    layouts: bool = False
    """The plan of the program with the layouts left free, with no memory limit (its
    ``solver_budget_bytes`` is then its predicted peak) or under the search's solver budget
    (set by the decorator after the search's own trials,
    :meth:`kiwi_jax.optimize.OptimizedStep._free_layouts`)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class FitRecord:
    """What the search tried and why it stopped."""

    budget_bytes: int
    """The user's per-device budget the compiled step must fit."""
    trials: tuple[FitTrial, ...]
    """Every plan the solver returned, in order."""
    chosen: int | None
    """Index in ``trials`` of the plan returned (None: no plan was measured)."""
    stop: FitStop
    """Why the search stopped."""
    solves: int
    """Calls of the solver (the first plan's included)."""

    @property
    def compiles(self) -> int:
        """Compiles spent."""
        return sum(t.compiled for t in self.trials)

    @property
    def compiled_peak_bytes(self) -> int | None:
        """The chosen plan's compiled memory."""
        return None if self.chosen is None else self.trials[self.chosen].compiled_peak_bytes

    @property
    def solver_budget_bytes(self) -> int | None:
        """The solver budget of the chosen plan."""
        return None if self.chosen is None else self.trials[self.chosen].solver_budget_bytes

    @property
    def ratio(self) -> float | None:
        """The chosen plan's compiled memory over the budget."""
        peak = self.compiled_peak_bytes
        return None if peak is None else peak / self.budget_bytes

    @property
    def fits(self) -> bool:
        """The chosen plan's compiled step fits the budget."""
        return self.chosen is not None and self.compiled_peak_bytes <= self.budget_bytes

    def describe(self) -> str:
        """One line: compiles spent, the final compiled/budget ratio, why it stopped."""
        spent = (f"{self.compiles} compile{'s' if self.compiles != 1 else ''}, "
                 f"{self.solves} solve{'s' if self.solves != 1 else ''}")
        if self.chosen is None:
            return f"{spent}: no plan measured (stopped: {self.stop.value})"
        if self.stop == FitStop.BLOCKS:
            fitted = any(trial.compiled_peak_bytes is not None
                         and trial.compiled_peak_bytes <= self.budget_bytes
                         for trial in self.trials if not trial.blocks)
            searched = ("a plan of the search fit; the whole-block recomputation, estimated "
                        "faster," if fitted else "no plan of the search fit; whole-block "
                        "recomputation")
            return (f"{spent}: {searched} compiled "
                    f"{self.compiled_peak_bytes:,} B = {self.ratio:.3f} of the "
                    f"{self.budget_bytes:,} B budget (stopped: {self.stop.value})")
        if self.stop == FitStop.LAYOUTS:
            return (f"{spent}: the plan with the layouts left free, estimated faster than "
                    f"the search's, compiled {self.compiled_peak_bytes:,} B = {self.ratio:.3f} "
                    f"of the {self.budget_bytes:,} B budget (stopped: {self.stop.value})")
        return (f"{spent}: compiled "
                f"{self.compiled_peak_bytes:,} B = {self.ratio:.3f} of the "
                f"{self.budget_bytes:,} B budget at solver budget {self.solver_budget_bytes:,} B"
                f" (stopped: {self.stop.value})")

    def to_dict(self) -> dict:
        """JSON-ready; ``compiles`` and ``ratio`` are included for readers and not read back."""
        return {"budget_bytes": int(self.budget_bytes), "chosen": self.chosen,
                "stop": self.stop.value, "solves": self.solves, "compiles": self.compiles,
                "ratio": self.ratio, "trials": [t.to_dict() for t in self.trials]}

    @classmethod
    def from_dict(cls, data: dict) -> "FitRecord":
        return cls(budget_bytes=int(data["budget_bytes"]),
                   trials=tuple(FitTrial(**t) for t in data["trials"]),
                   chosen=data["chosen"], stop=FitStop(data["stop"]),
                   solves=int(data["solves"]))


@dataclasses.dataclass(frozen=True)
class FitResult(Generic[P]):
    """The plan the search returns, with its record."""

    plan: P | None
    """The fastest plan whose compiled step fits; when none fits, the one that compiled
    smallest (``record.fits`` tells which); None when the solver returned no plan."""
    record: FitRecord
    """Every trial and why the search stopped."""


NO_PLAN_STEP = 1.1
"""When a solve gives no plan before any plan was compiled, the next solver budget is this much
higher: at the model's smallest feasible budget the program is at its tightest, and its solve
may end at the time limit without a plan (the zoo mixer on 2x4 at 80%: none at 562,824 B in
60 s; plans, proven optimal, at 619,106 B in 34 s and at 675,389 B in 8 s)."""
NO_PLAN_RETRIES = 2
"""How many times the search steps up so before it stops without a plan."""
TIME_RETRIES = 1
"""When the solver finds no plan in its time limit under a solver budget below one whose plan
compiled over the budget, the search tries this many more times halfway back up to that one
before it stops (:attr:`FitStop.TIME`): the program is looser there and a plan may be found.
The reference GPT at hidden 1024 on 2x4 for 484,807,276 B: its plan solved under 428,986,832 B
compiled to 525,478,108 B; none was found under 389,512,029 B in 60 s, and the one solved
halfway back, under 409,064,884 B, compiled to 478,339,164 B and fit."""


def fit_budget(budget: int, solve: Callable[[int], P | None], compile: Callable[[P], int], *,
               key: Callable[[P], Hashable], unlimited: Callable[[], P] | None = None,
               start: int | None = None, floor: int | None = None, max_compiles: int = 6,
               max_solves: int | None = None, tolerance: float = BAND,
               resolution: float = RESOLUTION, step_tolerance: float = 1e-6,
               beaten: Callable[[P], bool] | None = None,
               seconds: Callable[[P], float] | None = None,
               deadline: float | None = None) -> FitResult[P]:
    """Search the solver's budget until the compiled step fits ``budget`` and uses it.

    Args:
      budget: the user's per-device budget the compiled step must fit.
      solve: the plan for a solver budget, or None when the solver has none under it; raises
        :class:`NoPlanInTime` when it found none in its time limit.
      compile: the compiled per-device memory of a plan.
      key: a plan's identity (plans with equal keys apply to the same step and are compiled
        once).
      unlimited: the plan with no memory limit (the fastest), asked for once, when a plan that
        fits leaves more than ``tolerance`` of the budget unused; None: no such stop and no
        ceiling on the solver budget.
      start: the first solver budget (default ``budget``; e.g. the smallest feasible budget
        when the solver has no plan under ``budget``).
      floor: no solver budget under it has a plan (default: none known).
      max_compiles: most plans compiled (the first one included); at least 1.
      max_solves: most calls of ``solve`` (default ``max_compiles + 2``: a solve per compile
        and two that return no plan or a plan compiled before).
      tolerance: a fitting step that uses at least ``1 - tolerance`` of the budget ends the
        search.
      resolution: the search ends when the solver budgets left span less than this fraction
        of the budget.
      step_tolerance: a plan within this relative distance of the ``unlimited`` plan's step
        is as fast as it (e.g. the solver's optimality gap).
      beaten: asked of each plan newly compiled over the budget: is a step that fits (outside
        the search) no slower than it? True stops the search (:attr:`FitStop.BEATEN`): every
        plan under a tighter solver budget is predicted slower still. None: never.
      seconds: a compiled plan's estimated step, from its compiled program: the plans that fit
        are ranked by it (then by their predicted step), not by their predicted step alone.
        The model's ranking of near plans is not the compiled program's: on the reference GPT
        at hidden 1024 on 4x2 for 638,129,964 B, plans predicted at 29.375 and 29.449 ms
        compiled to 633.0 MB at an estimated 22.273 ms and 598.5 MB at 21.994 ms. None: the
        predicted step alone.
      deadline: a ``time.perf_counter()`` after which, once a plan fits, no solve starts
        (:attr:`FitStop.DEADLINE`); a solve under way runs to its own time limit. None: none.

    Returns:
      The fastest plan that fit (lowest estimated step with ``seconds``, then lowest predicted
      step, then lowest compiled memory), or, if none fit, the one that compiled smallest;
      with the record.

    Raises:
      ValueError: ``max_compiles`` or ``max_solves`` under 1, or ``tolerance`` outside
        (0, 1).
    """
    if max_compiles < 1:
        raise ValueError(f"max_compiles: expected at least 1 (the first plan is compiled), "
                         f"got {max_compiles}")
    if max_solves is not None and max_solves < 1:
        raise ValueError(f"max_solves: expected at least 1 (the first plan is solved), got "
                         f"{max_solves}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance: expected a fraction in (0, 1), got {tolerance}")
    max_solves = max_compiles + 2 if max_solves is None else max_solves
    target = (1 - tolerance / 2) * budget
    slack = max(resolution * budget, 1.0)
    floor = 0 if floor is None else int(floor)
    trials: list[FitTrial] = []
    plans: list[P] = []
    measured: dict[Hashable, int] = {}
    estimated: dict[Hashable, float] = {}
    lo: tuple[int, int] | None = None       # (largest solver budget that fit, its compiled)
    hi: tuple[int, int] | None = None       # (smallest known to compile over, its compiled)
    fastest: P | None = None
    ceiling: int | None = None              # budgets at or above it: the unlimited plan
    best_step = float("inf")                # of the plans that fit
    solves = compiles = 0
    guess = int(budget if start is None else start)
    retries = timeouts = 0
    while True:
        if ceiling is not None and guess >= ceiling:
            plan = fastest
        elif lo is not None and deadline is not None and time.perf_counter() >= deadline:
            log.info("fit: the search's deadline has passed; it keeps the plans that fit")
            stop = FitStop.DEADLINE
            break
        elif solves >= max_solves:
            stop = FitStop.SOLVES
            break
        else:
            solves += 1
            try:
                plan = solve(guess)
            except NoPlanInTime:
                back = None if hi is None else (guess + hi[0]) // 2
                if back is not None and timeouts < TIME_RETRIES and guess < back < hi[0] and \
                        back - guess >= slack and (lo is None or back > lo[0]):
                    timeouts += 1
                    log.info("fit: no plan found under a solver budget of %d B in the solver's "
                             "time limit; trying %d B", guess, back)
                    guess = back
                    continue
                log.info("fit: no plan found under a solver budget of %d B in the solver's time "
                         "limit; the search stops", guess)
                stop = FitStop.TIME
                break
        new = False
        if plan is None:
            log.info("fit: no plan under a solver budget of %d B", guess)
            floor = max(floor, guess + 1)
            if hi is None and lo is None and retries < NO_PLAN_RETRIES:
                retries += 1
                guess = int(guess * NO_PLAN_STEP)
                continue
            if hi is None:
                stop = FitStop.NO_PLAN
                break
        elif lo is not None and key(plan) not in measured and \
                plan.predicted_step_seconds >= best_step:
            # no faster than a plan that fits: whatever it compiles to, it would not be kept;
            # the solver found nothing faster under this budget, so the fit moves up to it
            trials.append(FitTrial(int(guess), int(plan.predicted_peak_bytes), None,
                                   float(plan.predicted_step_seconds), False))
            plans.append(plan)
            log.info("fit: solver budget %d B: predicted %d B, no faster than a plan that fits:"
                     " not compiled", guess, plan.predicted_peak_bytes)
            lo = (int(guess), lo[1])
        else:
            identity = key(plan)
            new = identity not in measured
            if new:
                measured[identity] = int(compile(plan))
                compiles += 1
            compiled = measured[identity]
            if new and seconds is not None:
                estimated[identity] = float(seconds(plan))
            trials.append(FitTrial(int(guess), int(plan.predicted_peak_bytes), compiled,
                                   float(plan.predicted_step_seconds), new,
                                   estimated.get(identity)))
            plans.append(plan)
            log.info("fit: solver budget %d B: predicted %d B, compiled %d B, %.3f of the %d B "
                     "budget%s", guess, plan.predicted_peak_bytes, compiled, compiled / budget,
                     budget, "" if new else " (a plan compiled before)")
            if compiled <= budget:
                best_step = min(best_step, float(plan.predicted_step_seconds))
                lo = (int(guess), compiled)
                if compiled >= (1 - tolerance) * budget:
                    stop = FitStop.FITS
                    break
                if fastest is None and unlimited is not None and compiles < max_compiles:
                    fastest = unlimited()
                    ceiling = int(fastest.predicted_peak_bytes)
                if fastest is not None and plan.predicted_step_seconds <= \
                        fastest.predicted_step_seconds * (1 + step_tolerance):
                    stop = FitStop.FASTEST
                    break
            else:
                hi = (min(int(plan.predicted_peak_bytes), int(guess)), compiled)
                if new and beaten is not None and beaten(plan):
                    stop = FitStop.BEATEN
                    break
        if compiles >= max_compiles:
            stop = FitStop.COMPILES
            break
        low = max(floor, lo[0] + 1 if lo is not None else 0)
        high = hi[0] - 1 if hi is not None else ceiling
        if high is not None and high < low:
            stop = FitStop.NO_PLAN if lo is None else FitStop.CONVERGED
            break
        if high is not None and high - low < slack:
            if hi is None and ceiling is not None:
                guess = ceiling                 # one step short of the unlimited plan: try it
                continue
            stop = FitStop.CONVERGED
            break
        guess = _next_guess(target, lo, hi, low, high,
                            "secant" if new else "bisect" if plan is None else "top")
    chosen = _choose(trials, budget)
    record = FitRecord(int(budget), tuple(trials), chosen, stop, solves)
    log.info("fit: %s", record.describe())
    return FitResult(None if chosen is None else plans[chosen], record)


def _next_guess(target: float, lo, hi, low: int, high: int | None, after: str) -> int:
    """The next solver budget in ``[low, high]`` (``high`` None: unbounded above).

    ``after``: what the last solve gave: ``secant`` (a plan compiled now), ``bisect`` (no
    plan), ``top`` (a plan compiled before, or one no faster than a plan that fits: the
    solver has nothing faster up to that budget, so the plans between the ends are few, and
    one solve just under ``hi`` tells whether any of them is faster).
    """
    if hi is not None and after == "bisect":
        return (low + high) // 2
    if hi is not None and after == "top":
        return high
    if lo is not None and hi is not None:       # secant between the ends, kept off them
        (b0, c0), (b1, c1) = lo, hi
        guess = b0 + (target - c0) * (b1 - b0) / (c1 - c0)
        margin = SHRINK * (high - low)
        guess = min(max(guess, low + margin), high - margin)
    elif hi is not None:                        # only over: the aim less the excess,
        guess = target - (hi[1] - hi[0])
        if guess <= low:                        # or halve where that is under what has no
            guess = (low + high) // 2           # plan (a byte above it would have none)
    else:                                       # only under: scale up by the ratio
        guess = lo[0] * target / lo[1]
    guess = max(int(round(guess)), low)
    return guess if high is None else min(guess, high)


def _choose(trials: list[FitTrial], budget: int) -> int | None:
    """The fastest trial that fits (by its compiled estimate where it has one, then its
    prediction, then the smallest compiled); else the smallest compiled."""
    measured = [i for i, t in enumerate(trials) if t.compiled_peak_bytes is not None]
    if not measured:
        return None
    fitting = [i for i in measured if trials[i].compiled_peak_bytes <= budget]
    if fitting:
        return min(fitting, key=lambda i: (
            trials[i].compiled_step_seconds if trials[i].compiled_step_seconds is not None
            else float("inf"), trials[i].predicted_step_seconds,
            trials[i].compiled_peak_bytes, i))
    return min(measured, key=lambda i: (trials[i].compiled_peak_bytes,
                                        trials[i].predicted_step_seconds, i))
