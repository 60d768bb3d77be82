"""``kiwi_jax.optimize``: plan, apply and compile a Flax train step for a mesh and a memory budget.

Used as a decorator::

    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    @kiwi_jax.optimize(mesh=mesh, memory_budget="6GiB", cluster="v100-nvlink")
    def train_step(model, optimizer, batch):      # Flax NNX: updates in place, like nnx.jit
        ...

    @kiwi_jax.optimize(mesh=mesh, memory_budget="80%")
    def train_step(state, batch):                 # Flax Linen TrainState -> (state, metrics)
        ...

The first call with a set of argument shapes traces the step, plans it (or loads the plan from the
disk cache), applies the plan (every planned value gets its sharding constraint, dropped forward
values are recomputed before their first backward reader, inputs and outputs get the plan's
NamedShardings) and compiles it; later calls with the same shapes run the compiled step; new
shapes plan again. The train state (first argument) is donated, as ``nnx.Optimizer`` updates
imply: its updated value keeps the sharding of the input, so the next step reads it in place.

The compiler chooses (``recipes``, on by default): once kiwi's plan is compiled, the
hand-written recipes (:mod:`kiwi_jax.recipes`) are compiled for the same step and mesh, and the
fastest one that fits the budget runs instead when it is estimated faster than kiwi's compiled
plan, when kiwi's compiled plan does not fit, or when kiwi has no plan for the budget
(:mod:`kiwi_jax.choose`); ``.prepared.choice`` and ``explain()`` say which runs.

Under ``jax.distributed`` (several processes, one global mesh) process 0 plans and the others
receive its plan; every process checks that all run the same plan before the first step (see
:mod:`kiwi_jax.multihost`). The recipes are not compared there: kiwi's plan runs (a warning says
so).

References:
  KIWI (Liu et al.), sec. 3: the joint program whose plan this applies.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import time
import warnings
from collections.abc import Callable

import jax
from flax import nnx

import solvers
from hlo_tools.graph import Phase
from kiwi_jax.apply import (TracedStep, carried_pairs, check_order, in_program_order,
                            trace_for_planning)
from kiwi_jax.cache import PlanCache, default_cache_dir
from kiwi_jax.choose import (KIWI, Choice, RecipeRow, choose, compile_recipes,
                             fastest_fitting, parse_recipes)
from kiwi_jax.cluster import Cluster, MeshSpec, parse_bytes
from kiwi_jax.compile import CompiledPlan, Prepared
from kiwi_jax.estimate import compiled_cost
from kiwi_jax.export import PlanExport, compile_applied, export_plan, with_buckets, with_export
from kiwi_jax.fit import (FIT_COMPILES, FitRecord, FitResult, FitStop, FitTrial, NoPlanInTime,
                          fit_budget)
from kiwi_jax.multihost import Exchange, exchange, place
from kiwi_jax.plan import (Plan, budget_fraction, plan_from_solution, reference_solution,
                           solve_plan)
from kiwi_jax.problem import (ProblemBuild, build_problem, check_memory_model, chooses_memory_model,
                              of_memory_model, with_compiled_reference, with_free_layouts)
from kiwi_jax.recipe_plan import best_recipe_start
from kiwi_jax.step import PureStep, abstract_arrays, functionalize, step_arguments
from kiwi_jax.verify import VerifyReport, verify_prepared
from solvers.options import DEFAULTS as SOLVER_DEFAULTS, SolverOptions

__all__ = ["optimize", "OptimizedStep", "Options", "NotATrainStepError"]

log = logging.getLogger(__name__)

HOLD_THE_REFERENCE = ("alpa", "kiwi", "kiwi-full")
"""The solvers whose programs hold the reference plan (``alpa``'s sharding, every value kept):
under a budget its compiled step fits, it is their plan (the baselines' plans run as their
rules make them)."""

BLOCK_COMPILES = 3
"""Most compiles of the whole-block recomputation's budget search: its fastest plan, then two
solver budgets under it (``fit_compiles`` where that is 2, and 2 where it is 1: the fastest
plan and one under it, as before the search)."""


FREE_LAYOUT_SOLVES = 3
"""Most solves of the program with the layouts left free after the budget search
(:meth:`OptimizedStep._free_layouts`): its plan, then, where that is estimated faster than the
search's and compiles over the budget, once more under its solver budget scaled by the
overshoot (on the zoo ViT and mixer at their test sizes on 2x4 and 4x2 at 80%, its plans were
estimated 2.1-3.1x faster and compiled 1-9% over)."""


class NotATrainStepError(ValueError):
    """The function has no backward pass: there is nothing to plan recomputation for."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What a plan is made for and how it is solved."""

    mesh: jax.sharding.Mesh
    """A 2-axis ``jax.sharding.Mesh``; its axis order is the plan's."""
    memory_budget: object
    """Per-device bytes (int), a size such as ``"6GiB"``, or a percentage such as ``"80%"`` of
    the compiled per-device memory of the reference plan (the fastest ``alpa`` plan with no
    memory limit; one more compile when the plan is not cached)."""
    cluster: object = "v100-nvlink"
    """Cluster preset name (``v100-nvlink``, ``a100-nvlink``, ``h100``, ...) or a Cluster."""
    solver: str = SOLVER_DEFAULTS.solver
    """``kiwi`` (default), ``alpa``, ``alpa+dots``, ``alpa+megatron``, ``alpa+full``, or the
    Lynx solvers ``lynx-heu`` / ``lynx-opt`` (the reference plan's sharding, recomputation
    hidden under its collectives)."""
    backend: str = SOLVER_DEFAULTS.backend
    """``highs`` (embedded), ``cpsat`` or ``gurobi``."""
    time_limit: float = SOLVER_DEFAULTS.time_limit
    """Seconds for the solver; the best plan found by then is used (its gap is logged)."""
    mip_gap: float = SOLVER_DEFAULTS.mip_gap
    """Relative optimality gap at which the solver stops."""
    reuse_layers: bool = SOLVER_DEFAULTS.reuse_layers
    """Give corresponding operators of identical layers one decision (faster solves)."""
    cache_dir: object = None
    """Plan cache directory; None: ``$KIWI_JAX_CACHE_DIR`` or ``~/.cache/kiwi-jax``;
    False: no cache."""
    donate: bool = True
    """Donate the train state (first argument) to the step."""
    overlap: bool = True
    """Lynx plans (``solver="lynx-heu"`` or ``"lynx-opt"``): recompute what the plan hides
    under a collective beside that collective (False: before the first backward reader)."""
    memory_model: str = "auto"
    """How values are charged memory: ``auto`` (values fused into their readers hold none on
    one device; on a mesh, of that model and the one where every operator's output counts,
    the one closer to the compiled reference plan: one more compile for a budget in bytes),
    ``fused`` or ``operator``; see :data:`kiwi_jax.problem.MEMORY_MODELS`. With the fused
    model the values the compiled reference plan stores are charged for a percentage or on a
    mesh; for a budget in bytes on one device only when ``fused`` is asked for (one more
    compile): there ``auto`` plans on the fusion rules alone, which kept the zoo mixer's
    faster plans (docs/benchmarks.md)."""
    order: str = "auto"
    """The schedule the planner replays (:data:`kiwi_jax.apply.ORDERS`): ``auto`` (the
    traced program's order on one device, the order XLA prints the module on a mesh),
    ``program`` or ``printed``; see :func:`kiwi_jax.apply.in_program_order`."""
    fit_compiles: int = FIT_COMPILES
    """Most plans compiled while searching the solver's budget against the compiled step
    (:mod:`kiwi_jax.fit`): until it fits the budget and uses at least 97% of it, or more
    memory cannot make it faster. 0: no search; the plan solved under the budget runs as
    compiled, and a budget the model finds no plan under is an error."""
    share_plan: bool = True
    """Several processes (``jax.distributed``): process 0 plans and the others receive its plan
    (False: every process plans on its own, from its cache or its own solve; the plans are
    still compared before the first step and must agree)."""
    sync_timeout: float = 300.0
    """Several processes: seconds a process waits for another's plan fingerprint, and for
    process 0's plan beyond process 0's worst-case solving time (``(fit_compiles + 4 +
    FREE_LAYOUT_SOLVES) * time_limit``: the reference plan, the first solve, the search's
    ``fit_compiles + 2`` solves and the solves of the program with the layouts left free,
    :data:`FREE_LAYOUT_SOLVES`); past it the step raises naming the process that did not
    answer."""
    recipes: object = True
    """The compiler chooses (:mod:`kiwi_jax.choose`): after kiwi's plan is compiled, these
    hand-written recipes are compiled for the same step and the fastest that fits the budget
    runs when it is estimated faster than kiwi's plan (or kiwi's does not fit, or kiwi has no
    plan for the budget). True: all twelve (:func:`kiwi_jax.recipes.all_recipes`); False:
    kiwi's plan only; or names such as ``("fsdp/dots_saveable", "dp")``. Each recipe is one
    more compile for every new argument signature, cached plan or not (plans are cached,
    compiled steps are not). Not compared when several processes plan (kiwi's plan runs).
    They are also the solver's start where its own search finds no plan under the budget
    (:func:`kiwi_jax.recipe_plan.best_recipe_start`); where none of them fits, or with
    False, a solve that found no plan in its time limit starts the budget search from the
    program's smallest-peak plan."""

    fit_seconds: float | None = None
    """Seconds the search of the solver's budget may run (from its start, the plan solved under
    the budget in hand) before it stops at the fastest plan that fits once compiled; a solve
    under way runs to ``time_limit``, and until a plan fits the search goes on (``fit_compiles``
    bounds it). None: no deadline. The NNX LM with a tied embedding of docs/cost_model.md
    ("Layout copies of the arguments") on 2x4 at 80% spent 229 s in its search (five solves
    of 20-61 s, each with a compile) for a plan at 0.927 of the budget; with 60 s, 73 s for the
    plan the second compile fit at 0.940, and the same export ran (estimated 0.1621 ms)."""

    def solver_options(self) -> dict:
        return {"backend": self.backend, "time_limit": self.time_limit,
                "mip_gap": self.mip_gap, "reuse_layers": self.reuse_layers}


def optimize(train_step=None, *, mesh, memory_budget, cluster="v100-nvlink",
             solver=SOLVER_DEFAULTS.solver, backend=SOLVER_DEFAULTS.backend,
             time_limit=SOLVER_DEFAULTS.time_limit, mip_gap=SOLVER_DEFAULTS.mip_gap,
             reuse_layers=SOLVER_DEFAULTS.reuse_layers, cache_dir=None, donate=True,
             overlap=True, memory_model="auto", order="auto", fit_compiles=FIT_COMPILES,
             share_plan=True, sync_timeout=300.0, recipes=True, fit_seconds=None):
    """Plan sharding and recomputation of a Flax train step jointly (KIWI) and run it that way.

    Args: see :class:`Options`; the solver's defaults are :data:`solvers.options.DEFAULTS`,
    shared with :func:`solvers.solve` and ``kiwi-jax plan``. Usable as
    ``@optimize(mesh=..., memory_budget=...)`` or ``optimize(step, mesh=..., memory_budget=...)``.

    Returns:
      An :class:`OptimizedStep`: call it like the step; ``.plan``, ``.explain()``, ``.verify()``.

    Raises:
      ValueError: a mesh that does not have exactly two axes, a negative ``fit_compiles`` or
        ``fit_seconds``, or an unknown recipe name in ``recipes``.
    """
    MeshSpec.parse(mesh)                      # a clear error for a mesh of the wrong rank
    Cluster.parse(cluster)
    check_memory_model(memory_model)
    check_order(order)
    if not (isinstance(fit_compiles, int) and fit_compiles >= 0):
        raise ValueError(f"fit_compiles: expected a count of compiles >= 0 (0: no search), "
                         f"got {fit_compiles!r}")
    if fit_seconds is not None and not (isinstance(fit_seconds, (int, float))
                                        and fit_seconds >= 0):
        raise ValueError(f"fit_seconds: expected seconds >= 0 or None (no deadline), got "
                         f"{fit_seconds!r}")
    parse_recipes(recipes)
    options = Options(mesh, memory_budget, cluster, solver, backend, time_limit, mip_gap,
                      reuse_layers, cache_dir, donate, overlap, memory_model, order,
                      fit_compiles, share_plan, sync_timeout, recipes, fit_seconds)
    if train_step is None:
        return functools.partial(OptimizedStep, options=options)
    return OptimizedStep(train_step, options=options)


class _RecipeSteps:
    """The recipes compiled for one step, once per budget (:func:`compile_recipes`): by the
    budget search, where the fastest that fits may beat kiwi's plans over the budget, and by
    the choice after it."""

    def __init__(self, compile_):
        self._compile = compile_                  # budget -> (rows, steps)
        self._done: dict[int, tuple[tuple, dict, float]] = {}

    def compiled(self, budget: int) -> tuple[tuple, dict, float]:
        """``(rows, steps)`` of :func:`compile_recipes` for ``budget``, and the seconds they
        took to compile."""
        if budget not in self._done:
            start = time.perf_counter()
            rows, steps = self._compile(budget)
            self._done[budget] = rows, steps, time.perf_counter() - start
        return self._done[budget]

    def fastest_fitting(self, budget: int) -> RecipeRow | None:
        """The recipe estimated fastest of those that fit ``budget`` once compiled."""
        return fastest_fitting(self.compiled(budget)[0], budget)


def _signature(args) -> tuple:
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else ("static", x)
                       for x in leaves)


class OptimizedStep:
    """A train step with a plan per argument signature. Call it like the original step."""

    def __init__(self, train_step, options: Options):
        functools.update_wrapper(self, train_step)
        self.train_step, self.options = train_step, options
        self._prepared: dict = {}
        self._last: Prepared | None = None

    # ------------------------------------------------------------------ running
    def __call__(self, *args, **kwargs):
        if kwargs:
            raise TypeError(f"{self.__name__}: pass the step's arguments positionally "
                            f"(got keywords {sorted(kwargs)})")
        pure = functionalize(self.train_step, args)
        prepared = self.prepare(pure)
        placed = place(pure.args, prepared.in_shardings)
        outputs = prepared.compiled(*placed)
        if pure.style == "nnx":
            result, state = outputs
            nnx.update(tuple(args[i] for i in pure.module_positions), state)
            return result
        return outputs

    def prepare(self, pure: PureStep) -> Prepared:
        """Trace, plan, apply and compile for the signature of ``pure.args`` (memoised)."""
        key = _signature(pure.args)
        if key not in self._prepared:
            self._prepared[key] = self._prepare(pure)
        self._last = self._prepared[key]
        return self._last

    def lower(self, *args) -> Prepared:
        """Plan and compile for these arguments (concrete or abstract) without running."""
        return self.prepare(functionalize(self.train_step, args))

    def _prepare(self, pure: PureStep) -> Prepared:
        processes = exchange(self.options.sync_timeout)
        try:
            prepared, key = self._prepare_here(pure, processes)
        except BaseException as error:    # the other processes must not wait for this one
            if processes is not None:
                processes.abandon(f"{type(error).__name__}: {error}", self.options.share_plan)
            raise
        if processes is not None:         # the last thing before the first step
            processes.check(key, None if prepared is None else prepared.plan.fingerprint)
        return prepared

    def _prepare_here(self, pure: PureStep,
                      processes: Exchange | None) -> tuple[Prepared | None, str]:
        """This process's part: trace, then plan (or receive process 0's plan), apply and
        compile, and compare the recipes (a single process only); and the key of what was
        planned for. None instead of the Prepared: process 0's plan is for another graph (the
        check then raises in every process).

        Raises:
          solvers.InfeasibleBudgetError: kiwi has no plan for the budget and no recipe
            compared fits it.
          solvers.SolverTimeoutError: the solver found no plan in its time limit and no recipe
            compared fits the budget.
        """
        options = self.options
        abstract = PureStep(pure.fn, abstract_arrays(pure.args), pure.style, pure.graphdef,
                            pure.module_positions)
        start = time.perf_counter()
        traced = trace_for_planning(abstract, in_program_order(options.mesh.devices.size,
                                                                 options.order))
        graph = traced.graph
        if not any(node.phase == Phase.BACKWARD for node in graph.nodes):
            raise NotATrainStepError(
                f"{self.__name__} computes no gradient: kiwi_jax.optimize plans the forward, "
                "backward and optimizer of a train step (use jax.grad / nnx.value_and_grad "
                "inside it); for a forward-only function use jax.jit")
        build = build_problem(graph, MeshSpec.parse(options.mesh), Cluster.parse(options.cluster),
                              memory_model=options.memory_model, carried=carried_pairs(traced),
                              donated=options.donate)
        key = self._key(traced, build)
        receives = processes is not None and options.share_plan and not processes.is_planner
        recipes = parse_recipes(options.recipes)
        if recipes and processes is not None:
            log.warning("%s: %d processes plan this step: the recipes are not compared and "
                        "kiwi's plan runs (recipes=False says so without this warning)",
                        self.__name__, processes.process_count)
            recipes = ()
        choice = recipe = None
        recipe_steps = _RecipeSteps(functools.partial(
            compile_recipes, self.train_step, step_arguments(abstract), options.mesh, recipes,
            cluster=build.cluster, donate=options.donate)) if recipes else None
        if receives:
            plan, cached = self._received(processes, traced, build), False
            if plan is None:
                return None, key
            plan_seconds, start = time.perf_counter() - start, time.perf_counter()
            build = of_memory_model(build, plan.memory_model, carried_pairs(traced))
            applied = self._apply(traced, build, plan, abstract)
        else:
            try:
                plan, applied, cached, plan_seconds, start, build = self._planned(
                    traced, build, abstract, start, recipes, recipe_steps)
                infeasible = None
            except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError) as error:
                if not recipes or error.budget_bytes is None:
                    raise
                plan = applied = None
                cached, infeasible = False, error
                plan_seconds, start = time.perf_counter() - start, time.perf_counter()
            if recipes:
                budget = infeasible.budget_bytes if plan is None else plan.budget_bytes
                choice, recipe = self._choose(abstract, traced, build, plan, applied,
                                              recipe_steps, budget, infeasible)
                if applied is None and recipe is None:
                    raise infeasible
            if not cached and recipe is None and plan.fit is not None \
                    and applied.memory.peak_bytes > plan.budget_bytes:
                self._warn_over_budget(plan, applied)
            if processes is not None and options.share_plan:
                processes.publish_plan(plan.to_json())
        log.info("%s: planned in %.1f s (%s), compiled (the budget searched) in %.1f s",
                 self.__name__, plan_seconds, "received" if receives else "cached" if cached else
                 "no plan" if plan is None else plan.status, time.perf_counter() - start)
        return Prepared(traced, build, plan, applied, plan_seconds=plan_seconds,
                        compile_seconds=time.perf_counter() - start, cached=cached,
                        received=receives, choice=choice, recipe=recipe), key

    def _choose(self, abstract: PureStep, traced: TracedStep, build: ProblemBuild,
                plan: Plan | None, applied: CompiledPlan | None, recipe_steps: _RecipeSteps,
                budget: int,
                infeasible: solvers.InfeasibleBudgetError | solvers.SolverTimeoutError | None
                ) -> tuple[Choice, CompiledPlan | None]:
        """The recipes, compiled for the step and set against kiwi's compiled plan
        (:func:`kiwi_jax.choose.choose`, priced with the problem's cluster); the winner's
        compiled step, or None when kiwi's plan runs (or nothing fits). ``infeasible``: why
        kiwi has no plan (no plan under the budget, or none found in the time limit), when it
        has none."""
        rows, steps, seconds = recipe_steps.compiled(budget)
        start = time.perf_counter()
        kiwi_bytes = kiwi_seconds = None
        if applied is not None:
            kiwi_bytes = applied.memory.peak_bytes
            kiwi_seconds = self._estimate(applied, build)
        choice = choose(budget, kiwi_bytes, kiwi_seconds, rows,
                        seconds + time.perf_counter() - start,
                        None if infeasible is None else str(infeasible))
        if applied is None and not choice.runs_recipe:
            log.info("%s: kiwi has no plan for the budget and none of the %d recipes fits it",
                     self.__name__, len(rows))
        else:
            log.info("%s: %s; %d recipes compiled in %.1f s", self.__name__, choice.describe(),
                     len(rows), choice.compile_seconds)
        return choice, steps.get(choice.winner) if choice.winner != KIWI else None

    def _planned(self, traced, build, abstract, start, recipes=(), recipe_steps=None):
        """This process's plan (cached, or solved and fitted to the compiler's memory), applied;
        with the planning and compiling times' split, and the problem it was solved on (see
        :meth:`_plan`; ``recipes``: the solver's starts where its own search finds no plan;
        ``recipe_steps``: them compiled, for the search to stop at when they are faster)."""
        options = self.options
        compiled: dict[str, CompiledPlan] = {}     # by plan fingerprint
        plan, cached, build, infeasible = self._plan(traced, build, abstract, compiled, recipes)
        if infeasible is not None and (infeasible.min_feasible_bytes is None
                                       or not options.fit_compiles):
            raise infeasible
        plan_seconds = time.perf_counter() - start
        start = time.perf_counter()
        if cached or not options.fit_compiles:
            applied = compiled.get(plan.fingerprint) or self._apply(traced, build, plan, abstract)
        else:
            plan, applied = self._fit(traced, build, plan, infeasible, abstract, compiled,
                                      recipe_steps)
        if not cached:
            self._store(traced, build, plan)
        return plan, applied, cached, plan_seconds, start, build

    def _received(self, processes: Exchange, traced: TracedStep,
                  build: ProblemBuild) -> Plan | None:
        """A receiving process: process 0's plan (kept in this process's cache too); None when
        it is for another graph."""
        options = self.options
        plan = Plan.from_json(processes.receive_plan(
            options.sync_timeout
            + (options.fit_compiles + 4 + FREE_LAYOUT_SOLVES) * options.time_limit))
        if plan.node_names != tuple(build.problem.names):
            log.error("%s: process 0's plan is for another graph (%d operators, here %d)",
                      self.__name__, len(plan.node_names), len(build.problem.names))
            return None
        self._store(traced, build, plan)
        return plan

    def _apply(self, traced: TracedStep, build: ProblemBuild, plan: Plan,
               abstract: PureStep, budget: int | None = None,
               blocks: bool = True) -> CompiledPlan:
        """The plan applied and compiled (:func:`kiwi_jax.export.compile_applied`: the program
        of the plan that runs within ``budget``, the user's budget; default: the plan's, which
        after the budget search is the user's; ``blocks``: the export among them on a mesh)."""
        options = self.options
        return compile_applied(self.train_step, step_arguments(abstract), traced, build, plan,
                               options.mesh, abstract, options.donate, options.overlap, budget,
                               blocks)

    def _fit(self, traced, build, first: Plan | None,
             infeasible: solvers.InfeasibleBudgetError | None, abstract,
             applied: dict[str, CompiledPlan], recipe_steps: _RecipeSteps | None = None
             ) -> tuple[Plan, CompiledPlan]:
        """The compiler is the judge: search the solver's budget against the compiled step
        (:func:`kiwi_jax.fit.fit_budget`, at most ``fit_compiles`` compiles) and keep the
        fastest plan that fits once compiled. ``first``: the plan solved under the budget;
        None with ``infeasible``, the model's error for the budget, when the search starts
        from its smallest feasible one (the model over-predicts XLA's memory on some steps).
        ``applied``: the plans compiled so far, by fingerprint (the search adds its own).
        ``recipe_steps``: the recipes; once a plan compiles over the budget and the fastest
        recipe that fits is estimated no slower, the search stops there (the recipe runs).

        Raises:
          solvers.InfeasibleBudgetError: the model has no plan under the budget and none of
            the plans above it compiles under it; names the bytes the smallest one needs.
        """
        options = self.options
        budget = infeasible.budget_bytes if first is None else first.budget_bytes

        def solve(solver_budget: int) -> Plan | None:
            if first is not None and solver_budget == budget:
                return first
            if first is None and solver_budget == start \
                    and options.solver not in solvers.LYNX_SOLVERS:
                return self._smallest(build, start)
            try:
                return solve_plan(build, solver_budget, options.solver,
                                  search_min_feasible=False, **options.solver_options())
            except solvers.InfeasibleBudgetError:
                log.info("%s: no plan under a solver budget of %d B", self.__name__,
                         solver_budget)
                return None
            except solvers.SolverTimeoutError as error:
                raise NoPlanInTime(str(error)) from error

        def compile_(plan: Plan) -> int:
            if plan.fingerprint not in applied:   # the user's budget, not its solver budget
                applied[plan.fingerprint] = self._apply(traced, build, plan, abstract, budget,
                                                        blocks=False)
            return applied[plan.fingerprint].memory.peak_bytes

        def settled(plan: Plan) -> CompiledPlan:
            """The plan the search settles on, compiled, with its gradients by buckets and its
            export weighed on a mesh (left out of the trials:
            :func:`kiwi_jax.export.compile_applied`)."""
            own = with_buckets(traced, build, plan, options.mesh, abstract,
                               applied[plan.fingerprint], budget, options.donate,
                               options.overlap)
            return with_export(self.train_step, step_arguments(abstract), traced, build, plan,
                               options.mesh, own, budget, options.donate)

        estimates: dict[str, float] = {}               # by plan fingerprint

        def estimate(plan: Plan) -> float:
            if plan.fingerprint not in estimates:
                estimates[plan.fingerprint] = self._estimate(applied[plan.fingerprint], build)
            return estimates[plan.fingerprint]

        def beaten(plan: Plan) -> bool:
            recipe = recipe_steps.fastest_fitting(budget)
            if recipe is None:
                return False
            seconds = estimate(plan)
            if seconds < recipe.step_seconds:
                return False
            log.info("%s: a plan over the budget is estimated at %.4f ms, and recipe %s, which "
                     "fits, at %.4f ms: plans under less memory are slower still", self.__name__,
                     seconds * 1e3, recipe.name, recipe.step_seconds * 1e3)
            return True

        floor = None if first is not None else infeasible.min_feasible_bytes \
            if infeasible.lower_bound_bytes is None else infeasible.lower_bound_bytes
        start = None if first is not None else infeasible.min_feasible_bytes
        deadline = None if options.fit_seconds is None \
            else time.perf_counter() + options.fit_seconds
        result = fit_budget(
            budget, solve, compile_, key=lambda plan: plan.fingerprint,
            unlimited=lambda: self._unlimited(build, budget), start=start, floor=floor,
            max_compiles=options.fit_compiles, step_tolerance=options.mip_gap,
            beaten=None if recipe_steps is None else beaten,
            seconds=estimate, deadline=deadline)
        record = result.record
        if record.fits and infeasible is None and record.compiles < options.fit_compiles \
                and (deadline is None or time.perf_counter() < deadline) \
                and options.mesh.devices.size > 1 and options.solver not in solvers.LYNX_SOLVERS:
            if record.stop == FitStop.FASTEST:
                result = self._free_layouts(build, result, compile_, estimate)
            elif record.stop in (FitStop.FITS, FitStop.CONVERGED) \
                    and result.plan.solution.status == solvers.Status.OPTIMAL:
                result = self._free_layouts(build, result, compile_, estimate,
                                            under=record.solver_budget_bytes)
            record = result.record
        # not for Lynx, whose plans are the recomputations it hides under collectives, nor
        # where a recipe that fits beat the search (a whole-block plan is slower still)
        if (not record.fits or infeasible is not None) and record.stop != FitStop.BEATEN \
                and options.solver not in solvers.LYNX_SOLVERS:
            whole = self._whole_blocks(build, budget, record, compile_, estimate)
            if whole is not None and (not record.fits
                                      or estimate(whole) < estimate(result.plan)):
                return whole, settled(whole)
        if result.plan is None or (not record.fits and infeasible is not None):
            if not applied:                     # nothing compiled: the model's error stands
                raise infeasible
            # the smallest budget known to fit: the smallest step compiled (the reference
            # plan's among them, for a percentage), not the model's floor, which named more
            # than the reference plan compiles to (the zoo MoE on one device at 80%:
            # 2,519,256 B against 2,468,488 B; the mixer on 2x4 at 80%, where no plan was
            # found at the floor: 562,824 B against 556,896 B)
            smallest = min(step.memory.peak_bytes for step in applied.values())
            raise solvers.InfeasibleBudgetError(infeasible.solver, budget,
                                                smallest) from infeasible
        compiled_peak = record.compiled_peak_bytes
        if infeasible is not None:
            log.warning("%s: the model finds no plan under %d B (its smallest peak is %d B), but "
                        "a plan solved under %d B compiles to %d B: running it", self.__name__,
                        budget, infeasible.min_feasible_bytes, record.solver_budget_bytes,
                        compiled_peak)
        log.info("%s: budget search: %s", self.__name__, record.describe())
        solver_budget = record.solver_budget_bytes
        plan = dataclasses.replace(
            result.plan, budget_bytes=budget, fit=record,
            solver_budget_bytes=None if solver_budget == budget else solver_budget)
        return plan, settled(result.plan)

    def _estimate(self, applied: CompiledPlan, build: ProblemBuild) -> float:
        """The compiled-cost estimate of a compiled step's time (:mod:`kiwi_jax.estimate`)."""
        return compiled_cost(applied.compiled, self.options.mesh, build.cluster).step_seconds

    def _whole_blocks(self, build: ProblemBuild, budget: int, record: FitRecord,
                      compile_: Callable[[Plan], int],
                      estimate: Callable[[Plan], float]) -> Plan | None:
        """When no plan of the budget search fits, or the budget is under the model's
        smallest peak (there the search's plans are the model's least-memory ones, which it
        ranks worst: on the 2-layer reference GPT on one device at 19 MB with the
        per-operator model, the smallest-peak plan compiles to 16.51 MB and an estimated
        0.7468 ms, the whole-block one to 17.90 MB and 0.7096 ms, the faster of the two
        runs): the planner's whole-block recomputation (``alpa+full``: each layer keeps its
        input and recomputes the rest that eq. 9 and its chains allow), its solver budget
        searched against the compiled step as the search's is (:func:`kiwi_jax.fit.fit_budget`,
        at most :data:`BLOCK_COMPILES` compiles), from its fastest plan (no memory limit)
        down. The fastest plan that fits once compiled is returned (None if none does), with
        the search's trials after ``record``'s (``FitStop.BLOCKS``).

        The model over-predicts these plans' memory, so the plan solved under the budget
        leaves much of it unused: the GPT at hidden 1024 on 4x2 at 434,601,892 B (the
        ``fsdp+tp/nothing_saveable`` recipe's compiled memory) has no whole-block plan
        under 600 MB in the model; its fastest is predicted at 717.5 MB and compiles to
        465.8 MB, over; solved under its smallest feasible budget it compiles to 374.2 MB
        (0.861 of the budget) at an estimated 25.86 ms, and solved under 680 MB to 428.1 MB
        (0.985) at 24.98 ms, where the recipe's is 25.55 ms.

        On one device, run as its export (each block under its layer's ``jax.checkpoint``),
        it is close to the step ``nothing_saveable`` gives, where the search's smallest plans
        were 7.7-9.9% over that policy's memory (``docs/benchmarks.md``): on the problem
        charged with what the compiled reference stores, the zoo mixer's, ViT's, Llama's and
        encoder-decoder's compiled to that policy's bytes exactly; on the fusion rules' (a
        byte budget with ``memory_model="auto"``), which leave some values undroppable, the
        ViT's to 3.2% under it and the mixer's 7.3% over. On a mesh, the zoo
        encoder-decoder on 2x4 at 80% (501,027 B): the search's plans compiled to 565,060
        and 550,020 B, the whole-block one to 465,284 B."""
        options = self.options

        def solve(solver_budget: int | None) -> Plan | None:
            try:
                return plan_from_solution(build, solvers.solve(
                    build.problem, solver_budget, solver="alpa+full", search_min_feasible=False,
                    **options.solver_options()), budget)
            except solvers.InfeasibleBudgetError:
                return None
            except solvers.SolverTimeoutError as error:
                raise NoPlanInTime(str(error)) from error

        try:
            fastest = solve(None)
        except NoPlanInTime as error:
            log.info("%s: no whole-block plan (%s)", self.__name__, error)
            return None
        if fastest is None:
            log.info("%s: no whole-block plan", self.__name__)
            return None
        if not fastest.recomputed:          # no layer to recompute: the search's plans stand
            return None
        top = int(fastest.predicted_peak_bytes)

        def solve_under(solver_budget: int) -> Plan | None:
            return fastest if solver_budget >= top else solve(solver_budget)

        result = fit_budget(
            budget, solve_under, compile_, key=lambda plan: plan.fingerprint,
            unlimited=lambda: fastest, start=top,
            max_compiles=min(BLOCK_COMPILES, max(2, options.fit_compiles)),
            step_tolerance=options.mip_gap, seconds=estimate)
        blocks = result.record
        log.info("%s: whole-block recomputation: %s", self.__name__, blocks.describe())
        if not blocks.fits:
            return None
        trials = tuple(dataclasses.replace(trial, blocks=True) for trial in blocks.trials)
        fit = dataclasses.replace(record, trials=(*record.trials, *trials),
                                  chosen=len(record.trials) + blocks.chosen, stop=FitStop.BLOCKS,
                                  solves=record.solves + blocks.solves)
        return dataclasses.replace(result.plan, fit=fit)

    def _free_layouts(self, build: ProblemBuild, result: FitResult[Plan],
                      compile_: Callable[[Plan], int], estimate: Callable[[Plan], float],
                      under: int | None = None) -> FitResult[Plan]:
        """The plan of the program with the layouts left free
        (:func:`kiwi_jax.problem.with_free_layouts`), compiled, its trial after the search's:
        with no memory limit where memory does not bind (the search's plan fits and is as fast
        as its plan with no memory limit); ``under`` the search's solver budget, from the
        search's plan, where the search stopped at a plan that fits. It is ``result``'s plan
        (``FitStop.LAYOUTS``) where it fits and is estimated faster; where it is estimated
        faster and compiles over the budget, the program is solved again under its solver
        budget scaled by the overshoot (:data:`FREE_LAYOUT_SOLVES` solves at most, within
        ``fit_compiles``); else ``result`` stands.
        The merge that makes the program small fixes the update's and the weight gradients'
        layouts, and the model's price of the replicated update is right on some models and
        not on others (docs/cost_model.md, "Update chains in their operand's spec"): the
        compiled step chooses. Under a memory limit that program solves up to 2.7x slower, so
        the caller asks for it there only when the search's plan was proven optimal (where
        the search's own solves run to their limit, this larger one would too: docs/recipes.md,
        last section), and only while the search has a compile of ``fit_compiles`` left."""
        options, record = self.options, result.record
        problem = with_free_layouts(build).problem
        searched = estimate(result.plan)
        for _ in range(FREE_LAYOUT_SOLVES):
            try:
                solution = solvers.solve(
                    problem, under, solver=options.solver,
                    warm_start="auto" if under is None else result.plan.solution,
                    search_min_feasible=False, **options.solver_options())
            except (solvers.SolverTimeoutError, solvers.InfeasibleBudgetError) as error:
                log.info("%s: the program with the layouts left free: %s", self.__name__, error)
                return FitResult(result.plan, record)
            plan = plan_from_solution(build, solution, record.budget_bytes)
            if plan.fingerprint == result.plan.fingerprint:
                log.info("%s: the program with the layouts left free gives the same plan",
                         self.__name__)
                return FitResult(result.plan, record)
            solver_budget = int(plan.predicted_peak_bytes if under is None else under)
            compiled, seconds = compile_(plan), estimate(plan)
            trial = FitTrial(solver_budget, int(plan.predicted_peak_bytes), compiled,
                             float(plan.predicted_step_seconds), compiled_step_seconds=seconds,
                             layouts=True)
            record = dataclasses.replace(record, trials=(*record.trials, trial),
                                         solves=record.solves + 1)
            fits, faster = compiled <= record.budget_bytes, seconds < searched
            log.info("%s: the program with the layouts left free, %s: compiled %d B, estimated "
                     "%.4f ms against the search's %.4f ms: %s", self.__name__,
                     "no memory limit" if under is None else f"solver budget {under:,} B",
                     compiled, seconds * 1e3, searched * 1e3,
                     "it runs" if fits and faster else "the search's plan runs" if fits
                     or not faster else "over the budget")
            if fits and faster:
                return FitResult(plan, dataclasses.replace(
                    record, chosen=len(record.trials) - 1, stop=FitStop.LAYOUTS))
            if fits or not faster or record.compiles >= options.fit_compiles:
                break
            # faster and over the budget: again, the solver budget scaled by the overshoot
            under = solver_budget * record.budget_bytes // compiled
        return FitResult(result.plan, record)

    def _warn_over_budget(self, plan: Plan, applied: CompiledPlan) -> None:
        """Warn that kiwi's plan runs over the budget: no plan the budget search compiled fit
        it, nor its export (and no recipe that fits was compared)."""
        record = plan.fit
        more = {FitStop.COMPILES: " or fit_compiles", FitStop.SOLVES: " or fit_compiles",
                FitStop.TIME: " or time_limit"}.get(record.stop, "")
        how = " as its export (per-block jax.checkpoint)" if applied.program == "blocks" else ""
        warnings.warn(
            f"{self.__name__}: the compiled step needs {applied.memory.peak_bytes:,} B per "
            f"device, over the {plan.budget_bytes:,} B budget; the search of the solver's "
            f"budget ({record.describe()}) found no plan that fits; running the one that "
            f"compiled smallest{how} (raise the budget{more} to fit)", stacklevel=5)

    def _unlimited(self, build: ProblemBuild, budget: int) -> Plan:
        """The solver's plan with no memory limit, solved with the same options (with
        ``reuse_layers`` the tied program's optimum, which may be slower than the untied one):
        no solver budget gives a faster plan of this solver."""
        options = self.options
        solution = solvers.solve(build.problem, None, solver=options.solver,
                                 **options.solver_options())
        return plan_from_solution(build, solution, budget)

    def _smallest(self, build: ProblemBuild, budget: int) -> Plan | None:
        """The plan the error of a budget under the model's smallest peak names as fitting
        ``budget`` (:func:`solvers.min_peak_plan`, the answer that error was given, kept):
        the budget search's first trial, as solving for it again under so tight a budget may
        take the whole time limit (120 s, to a plan of the same peak, on the 2-layer reference
        GPT on one device). None where its peak is over ``budget``."""
        solution, _ = self._least_memory(build)
        if solution is None or solution.budget_bytes > budget:
            return None
        return plan_from_solution(build, dataclasses.replace(solution, budget_bytes=budget),
                                  budget)

    def _least_memory(self, build: ProblemBuild) -> tuple[solvers.Solution | None, int | None]:
        """The program's smallest-peak plan and its bound (:func:`solvers.min_peak_plan` with
        the step's options). One call for :meth:`_smallest_start` and :meth:`_smallest`, so
        that the second finds the first's answer kept under the same key."""
        options = self.options
        return solvers.min_peak_plan(build.problem, options.solver, options.backend,
                                     options.time_limit, options.reuse_layers)

    def _key(self, traced: TracedStep, build: ProblemBuild) -> str:
        """What this step's plan depends on, hashed: the step's HLO, the mesh, the budget, the
        cluster and the solver options (the plan cache's key)."""
        options = self.options
        return PlanCache.key(hlo=traced.fingerprint, mesh=build.mesh.shape,
                             budget=options.memory_budget, cluster=build.cluster.name,
                             solver=options.solver, backend=options.backend,
                             reuse_layers=options.reuse_layers, mip_gap=options.mip_gap,
                             memory_model=options.memory_model, order=options.order,
                             fit_compiles=options.fit_compiles)

    def _cache(self, traced: TracedStep, build: ProblemBuild):
        """``(cache, key)`` for this step's plan, or ``(None, None)`` without a cache."""
        options = self.options
        if options.cache_dir is False:
            return None, None
        return PlanCache(options.cache_dir or default_cache_dir()), self._key(traced, build)

    def _plan(self, traced: TracedStep, build: ProblemBuild, abstract: PureStep,
              compiled: dict[str, CompiledPlan], recipes: tuple = ()
              ) -> tuple[Plan | None, bool, ProblemBuild, solvers.InfeasibleBudgetError | None]:
        """The cached plan, or a new one; whether it came from the cache; the problem it was
        solved on; and, instead of a plan, the model's error for a budget it has no plan
        under. ``compiled`` gets the plans compiled on the way (the reference plan, for a
        percentage, ``memory_model="fused"`` or ``auto`` on a mesh).

        Where the solver finds no plan under the budget (none in its program, or none in its
        time limit), it is run again from the fastest of ``recipes`` whose plan fits the budget
        as the simulator replays it (:func:`kiwi_jax.recipe_plan.best_recipe_start`): its
        answer is that plan or a faster one. Where none in its time limit and no recipe's
        plan fits, from the program's smallest-peak plan (:meth:`_smallest_start`).

        With the fused memory model, the reference plan, compiled (:meth:`_budget_bytes`),
        says which values XLA stores: the problem is rebuilt with them charged
        (:func:`kiwi_jax.problem.with_stored`), and the plan solved, or the reference plan
        when it runs, is predicted on it. With ``auto`` on a mesh that problem is the one
        solved on where it predicts the compiled reference closer than the per-operator
        model's (:func:`kiwi_jax.problem.closer_to_compiled`). A cached plan is applied on a
        problem of the memory model it was solved with."""
        cache, key = self._cache(traced, build)
        plan = cache.load(key, build.problem.names) if cache is not None else None
        if plan is not None:
            return plan, True, of_memory_model(build, plan.memory_model, carried_pairs(traced)), \
                None
        options = self.options
        budget, reference = self._budget_bytes(traced, build, abstract, compiled)
        if reference is not None:
            charged = with_compiled_reference(build, options.memory_model,
                                              compiled[reference.fingerprint].compiled,
                                              reference.solution, carried_pairs(traced))
            if charged is not build:           # the same decisions, predicted on it
                build = charged
                reference = plan_from_solution(build, reference.solution,
                                               reference.budget_bytes)
        if (reference is not None and options.solver in HOLD_THE_REFERENCE
                and compiled[reference.fingerprint].memory.peak_bytes <= budget):
            # No plan is faster than the fastest one with no memory limit. Solved under the
            # budget instead, the model's program breaks ties anyhow (on the one-device zoo
            # Llama it recomputed eight reshapes and a broadcast that cost no time, and that
            # plan compiled to 2,573,828 B against the reference's 2,557,048 B, over "100%"),
            # or, where it over-predicts, finds no plan (the zoo mixer on 2x4 at 100%).
            log.info("%s: the reference plan compiles within the budget: running it",
                     self.__name__)
            return dataclasses.replace(reference, budget_bytes=budget), False, build, None
        try:
            return solve_plan(build, budget, options.solver, **options.solver_options()), \
                False, build, None
        except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError) as error:
            failed = error
        start = best_recipe_start(traced, build, options.mesh, recipes, budget,
                                  SolverOptions(**options.solver_options())) if recipes else None
        if start is not None:
            log.warning("%s: %s; solving again from a recipe's plan that fits", self.__name__,
                        str(failed).splitlines()[0])
        elif isinstance(failed, solvers.SolverTimeoutError):
            start, failed = self._smallest_start(build, budget, failed)
        if start is None:
            return None, False, build, failed
        return solve_plan(build, budget, options.solver, warm_start=start,
                          search_min_feasible=False, **options.solver_options()), \
            False, build, None

    def _smallest_start(self, build: ProblemBuild, budget: int,
                        timeout: solvers.SolverTimeoutError
                        ) -> tuple[solvers.Solution | None,
                                   solvers.SolverTimeoutError | solvers.InfeasibleBudgetError]:
        """Where the solver found no plan under the budget in its time limit, and no recipe's
        plan fits it: the program's smallest-peak plan (:func:`solvers.min_peak_plan`). Under
        the budget, it is the start to solve again from (``(plan, timeout)``). Over it, the
        budget is below the least memory the model found, and the budget search starts from
        that plan's budget, as for a budget the model has no plan under (``(None, error)``).
        The model over-predicts XLA's memory where plans recompute much: on the reference GPT
        at hidden 1024 on 2x4 under ``fsdp/nothing_saveable``'s compiled 484,807,276 B, the
        solve found no plan in 60 s, the least memory found was 556,562,444 B, and the search
        from there ran a plan solved under 511,916,281 B that compiles to 472,377,548 B. The
        time-out stands where no search follows (``fit_compiles=0``, Lynx), or where the
        smallest-peak search finds no plan either.

        Raises:
          solvers.SolverTimeoutError: ``timeout``, in those cases.
        """
        options = self.options
        if options.solver in solvers.LYNX_SOLVERS or not options.fit_compiles:
            raise timeout
        solution, lower = self._least_memory(build)
        if solution is None:
            raise timeout
        if solution.budget_bytes <= budget:
            log.warning("%s: the solver found no plan under %d B in its time limit; solving "
                        "again from the plan of the least memory (%d B), which fits",
                        self.__name__, budget, solution.budget_bytes)
            return dataclasses.replace(solution, budget_bytes=budget), timeout
        log.warning("%s: the solver found no plan under %d B in its time limit, and the least "
                    "memory the model found is %d B: searching the budget against the compiled "
                    "step from there", self.__name__, budget, solution.budget_bytes)
        return None, solvers.InfeasibleBudgetError(options.solver, budget, solution.budget_bytes,
                                                   lower)

    def _budget_bytes(self, traced: TracedStep, build: ProblemBuild, abstract: PureStep,
                      compiled: dict[str, CompiledPlan]) -> tuple[int, Plan | None]:
        """The budget in bytes per device, and the reference plan, compiled, when the budget
        is a percentage, ``memory_model="fused"`` was asked for (the values XLA stores are
        read from that compile; see :attr:`Options.memory_model`) or ``auto`` on a mesh (the
        memory model is chosen against it: :func:`kiwi_jax.problem.closer_to_compiled`). A
        percentage is of the reference plan's compiled memory (argument + output + temp -
        alias), what the step takes without recomputation as XLA counts it: the model's
        prediction of it misses what the model does not count (on the one-device zoo ViT
        1,585,388 B predicted, 1,946,468 B compiled), and "100%" of a prediction that low is
        a budget the reference plan itself does not fit."""
        options = self.options
        fraction = budget_fraction(options.memory_budget)
        if (fraction is None and options.memory_model != "fused"
                and not chooses_memory_model(options.memory_model, options.mesh.devices.size)):
            return parse_bytes(options.memory_budget), None
        solution = reference_solution(build.problem, **options.solver_options())
        reference = plan_from_solution(build, solution, solution.peak_bytes)
        # against the user's budget, not the reference's prediction: over that, the reference
        # would run as the smaller, slower program at budgets it fits value by value; and a
        # percentage is of the step value by value
        budget = parse_bytes(options.memory_budget) if fraction is None else sys.maxsize
        applied = compiled[reference.fingerprint] = self._apply(traced, build, reference,
                                                                abstract, budget)
        if fraction is None:
            return budget, reference
        budget = int(fraction * applied.memory.peak_bytes)
        log.info("%s: a budget of %s is %d B per device: the reference plan compiles to %d B "
                 "(predicted %d B)", self.__name__, options.memory_budget, budget,
                 applied.memory.peak_bytes, solution.peak_bytes)
        return budget, reference

    def _store(self, traced: TracedStep, build: ProblemBuild, plan: Plan) -> None:
        cache, key = self._cache(traced, build)
        if cache is not None:
            cache.store(key, plan)

    # ------------------------------------------------------------------ inspecting
    @property
    def prepared(self) -> Prepared:
        """What the last call planned and compiled."""
        if self._last is None:
            raise RuntimeError(f"{self.__name__} has not been called yet: call it (or "
                               ".lower(*args)) once to plan it")
        return self._last

    @property
    def plan(self) -> Plan | None:
        """kiwi's plan of the last call's argument shapes: the solver's answer, fitted to the
        compiler (what the plan cache stores). It runs unless a recipe won (:attr:`choice`);
        None when kiwi has no plan for the budget and a recipe runs."""
        return self.prepared.plan

    @property
    def choice(self) -> Choice | None:
        """Which step runs for the last call's argument shapes, kiwi's plan or a recipe's, with
        the figures it was chosen on (:class:`kiwi_jax.choose.Choice`); None when the recipes
        were not compared (``recipes=False``, several processes)."""
        return self.prepared.choice

    def explain(self, png=None, verbose: bool = False, file=None) -> str:
        """Per layer, what is kept or recomputed and each operator's sharding, with predicted
        time and memory; optionally a PNG of the per-device memory timeline. Prints and returns
        the text.

        When the recipes were compared, the text starts with which step runs (a recipe's or
        kiwi's plan, both figures: compiled memory and estimated step) and each recipe's row;
        the per-layer lines are kiwi's plan's, whether it runs or not.
        """
        from kiwi_jax.explain import explain, plot_memory_timeline

        prepared, parts = self.prepared, []
        if prepared.choice is not None:
            parts.append(prepared.choice.table())
        if self.plan is None:
            parts.append(f"kiwi's plan: none ({prepared.choice.kiwi_error})")
        else:
            text = explain(prepared.build, self.plan, verbose=verbose)
            whole = self.plan.fit is not None and self.plan.fit.stop == FitStop.BLOCKS
            held = (self.options.solver in HOLD_THE_REFERENCE       # see _plan
                    and self.plan.solver != self.options.solver and not whole)
            if whole:
                text = (f"kiwi's plan is the whole-block recomputation ({self.plan.solver}: "
                        f"each layer keeps its input and recomputes the rest): no plan of the "
                        f"budget search fit the budget, this one does\n{text}")
            elif self.plan.fit is not None and self.plan.fit.stop == FitStop.LAYOUTS:
                text = ("kiwi's plan was solved again on its program with the update's and "
                        "the weight gradients' layouts left to the solver (with no memory "
                        "limit where memory does not bind, else under the search's solver "
                        "budget), and it compiles to a faster step than the search's plan"
                        f"\n{text}")
            elif held:
                text = (f"kiwi's plan is the reference plan ({self.plan.solver}'s fastest with "
                        f"no memory limit, no recomputation): it compiles within the budget, "
                        f"so {self.options.solver!r} solved nothing\n{text}")
            if not prepared.runs_recipe and prepared.applied.program == "blocks":
                text = (f"kiwi's plan, run as its export (each block under its layer's "
                        f"jax.checkpoint policy):\n{self.export().table()}\n{text}")
            elif prepared.runs_recipe:
                text = f"kiwi's plan (not run: the recipe runs)\n{text}"
            elif prepared.applied.program == "regathered":
                bucket = prepared.applied.settle_bytes
                where = (f"the gradients as it goes, by buckets of at most {bucket:,} B with "
                         f"one all-reduce each" if bucket else
                         "each gradient where it is made, as the plan prices them")
                text = (f"kiwi's plan, its backward pass resharding the step's arguments again "
                        f"for each reader and reducing {where} (merged with the forward pass's "
                        f"copies and the gradients' all-reduces merged at the end, the step "
                        f"compiled over the budget)\n{text}")
            parts.append(text)
        text = "\n\n".join(parts)
        print(text, file=file)
        if png is not None and self.plan is not None:
            plot_memory_timeline(prepared.build, self.plan, png)
        return text

    def export(self) -> PlanExport:
        """kiwi's plan of the last call's argument shapes for a step written by hand: the
        arguments' PartitionSpecs by path and a ``jax.checkpoint`` policy per layer
        (:mod:`kiwi_jax.export`).

        Raises:
          RuntimeError: kiwi has no plan for the budget (a recipe runs: its own specs and
            policy are what to write).
        """
        if self.plan is None:
            raise RuntimeError(f"kiwi has no plan to export for this budget; the recipe "
                               f"{self.choice.winner!r} runs: write that recipe's shardings and "
                               "per-block policy (kiwi_jax.recipes)")
        prepared = self.prepared
        return export_plan(prepared.traced, prepared.build, self.plan, self.options.mesh)

    def verify(self, *args, steps: int = 3,
               explain_memory: bool | None = None) -> VerifyReport:
        """Compare the compiled step with the plan (memory, collectives) and, given concrete
        arguments, its numerics with the plain jitted step over ``steps`` steps;
        ``explain_memory``: attribute the bytes at both peaks to operators (None: only when
        the memory is off by more than the tolerance).

        When a recipe runs instead of kiwi's plan, the report is of the recipe's step
        (``report.runs`` names it): its compiled memory against the budget, its collectives,
        estimated step and numerics; it has no prediction (those fields are None).

        Returns:
          A :class:`kiwi_jax.verify.VerifyReport`.
        """
        prepared = self.lower(*args) if args else self.prepared
        return verify_prepared(prepared, self.options.mesh,
                               functionalize(self.train_step, args) if args else None, steps,
                               explain_memory)
