"""kiwi-jax: joint sharding and rematerialisation planning for JAX train steps.

The user API: the :func:`optimize` decorator, the :class:`Plan` it runs and the
:class:`VerifyReport` that checks it against the compiled step (with :func:`compiled_cost`, the
compiled step priced like the plan); :func:`problem_for_step` and
:func:`build_problem` for the costed problem itself; the errors a plan can raise (with
:class:`PlanMismatchError` and :class:`PlanExchangeError` of multi-process runs); the
hand-written recipes kiwi is compared with (:class:`Recipe`, :func:`compile_recipe`) and the
:class:`Choice` the decorator makes between them and kiwi's plan.
"""

from kiwi_jax.choose import Choice
from kiwi_jax.cluster import Cluster, MeshSpec, parse_bytes
from kiwi_jax.compile import CompiledPlan, Prepared
from kiwi_jax.estimate import CompiledCost, compiled_cost
from kiwi_jax.frontend import problem_for_step
from kiwi_jax.multihost import PlanExchangeError, PlanMismatchError
from kiwi_jax.optimize import NotATrainStepError, OptimizedStep, Options, optimize
from kiwi_jax.plan import Plan
from kiwi_jax.recipes import (BlockPolicyError, Recipe, RecipeResult, RecipeStep, compile_recipe,
                              recipe_step)
from kiwi_jax.problem import ProblemBuild, build_problem
from kiwi_jax.verify import VerifyReport
from solvers.options import SolverOptions
from solvers.solution import (InfeasibleBudgetError, Solution, SolverError, SolverTimeoutError,
                              SolverUnavailableError, Status)

__all__ = [
    "optimize", "OptimizedStep", "Options", "Plan", "VerifyReport", "Prepared", "CompiledPlan",
    "CompiledCost", "compiled_cost",
    "Cluster", "MeshSpec", "parse_bytes", "problem_for_step", "build_problem", "ProblemBuild",
    "SolverOptions", "Solution", "Status", "NotATrainStepError", "InfeasibleBudgetError", "SolverError",
    "SolverTimeoutError", "SolverUnavailableError", "PlanMismatchError", "PlanExchangeError",
    "Recipe", "RecipeStep", "RecipeResult", "recipe_step", "compile_recipe", "BlockPolicyError",
    "Choice",
]
