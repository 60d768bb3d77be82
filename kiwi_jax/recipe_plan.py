"""Hand-written recipes as plans of kiwi's program: the same sharding and per-block
recomputation, priced by the simulator, so that the solver can start from them and the
program's containment of them can be checked.

A recipe (:class:`kiwi_jax.recipes.Recipe`) fixes two things a user writes by hand:

- the layout of the step's arguments (parameters, optimizer state, batch), its
  ``in_shardings``: :func:`recipe_pins` finds, for every parameter node of the graph, the
  strategy whose output spec is the recipe's PartitionSpec of that argument;
- a per-block ``jax.checkpoint`` policy: the keep flags of
  :data:`solvers.heuristics.POLICY_RULES`, each block a layer of the problem.

What lies between the arguments XLA's sharding propagation decides when the recipe runs as
plain JAX. As a plan, it is solved for (:func:`solvers.solve.pinned_plan`): the fastest layout
of the other operators, by the program's own prices, given the recipe's argument layout and
keep flags. The recipe's plan is thus a plan of kiwi's program, and kiwi's optimum under the
recipe plan's predicted memory is at least as fast by the same prices.
"""

from __future__ import annotations

import logging

import numpy as np

from kiwi_jax.export import leaf_paths
from kiwi_jax.problem import ProblemBuild
from kiwi_jax.recipe_specs import data_flow, parameters, recipe_specs, state_leaves
from kiwi_jax.recipes import Recipe
from kiwi_jax.sharding import from_partition_spec, spec_str
from solvers.heuristics import POLICY_RULES
from solvers.options import SolverOptions
from solvers.solution import Solution, SolverError, SolverTimeoutError
from solvers.solve import least_memory_plan, pinned_plan

__all__ = ["recipe_pins", "recipe_keep", "recipe_solution", "best_recipe_start"]

log = logging.getLogger(__name__)


def recipe_pins(traced, build: ProblemBuild, mesh, recipe: Recipe | str) -> dict[int, int]:
    """``{parameter node: strategy index}``: the recipe's layout of every argument of the
    traced step (:func:`kiwi_jax.recipe_specs.recipe_specs`) as the strategy of its node.

    Args:
      traced: the :class:`kiwi_jax.frontend.TracedStep` ``build`` was built from.
      mesh: the ``jax.sharding.Mesh`` of ``build`` (two axes: data, then model).

    Raises:
      ValueError: an argument's recipe layout is not among its node's strategies.
    """
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    pure, graph = traced.pure, traced.graph
    leaves = state_leaves(pure)
    roles = data_flow(pure, parameters(leaves)).roles if "tp" in recipe.sharding else None
    specs = recipe_specs(pure, mesh, recipe.sharding, leaves, roles)
    axis_names = tuple(mesh.axis_names)
    pins = {}
    for path, node, partition_spec in zip(leaf_paths(pure.args), graph.parameters, specs):
        rank = len(graph.nodes[node].shape.dims)
        spec = from_partition_spec(partition_spec, rank, axis_names, build.mesh)
        outs = [s.out for s in build.strategies[node]]
        if spec not in outs:
            raise ValueError(
                f"recipe {recipe.name}: {path} laid out as {partition_spec} ({spec_str(spec)}) "
                f"is not among its strategies ({', '.join(map(spec_str, outs))})")
        pins[node] = outs.index(spec)
    return pins


def recipe_keep(build: ProblemBuild, recipe: Recipe | str) -> np.ndarray:
    """The keep flag of every node under the recipe's per-block policy."""
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    return POLICY_RULES[recipe.policy](build.problem)


def recipe_solution(traced, build: ProblemBuild, mesh, recipe: Recipe | str,
                    options: SolverOptions | None = None, least_memory: bool = True
                    ) -> Solution:
    """The recipe as a plan of ``build``'s program (see the module docstring), with no
    memory limit: its ``peak_bytes`` is the simulator's peak of the recipe.

    Args:
      options: backend and limits (default: :class:`~solvers.options.SolverOptions`'s;
        ``reuse_layers`` ties the repeated layers, whose pins agree by construction).
      least_memory: of the equally fast layouts of the values the recipe leaves free, the
        one with the smallest peak (:func:`solvers.solve.pinned_plan`), as XLA's sharding
        propagation splits a value where its readers are split; False: any of them (one
        solve instead of two).

    Raises:
      ValueError: see :func:`recipe_pins` and :func:`solvers.solve.pinned_plan`.
    """
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    return pinned_plan(build.problem, recipe_keep(build, recipe),
                       recipe_pins(traced, build, mesh, recipe), options or SolverOptions(),
                       name=f"recipe {recipe.name}", least_memory=least_memory)


def best_recipe_start(traced, build: ProblemBuild, mesh, recipes, budget_bytes: int,
                      options: SolverOptions | None = None) -> Solution | None:
    """The fastest of ``recipes`` whose plan (:func:`recipe_solution`) fits ``budget_bytes``
    as the simulator replays it: the solver's start where its own search found no plan. The
    policies are tried from the fastest kind to the smallest (none, ``dots_saveable``,
    ``nothing_saveable``), and the search stops at the first kind with a plan that fits.
    A recipe whose layout is not among the strategies (:func:`recipe_pins`) or whose plan is
    not found in ``options.time_limit`` is passed over. None: none fits.
    """
    found: list[tuple[float, str, Solution]] = []
    for policy in ("none", "dots_saveable", "nothing_saveable"):
        for recipe in (r for r in recipes if r.policy == policy):
            try:        # any fastest layout first; the least memory of them where it is over
                solution = recipe_solution(traced, build, mesh, recipe, options,
                                           least_memory=False)
                if solution.peak_bytes > budget_bytes:
                    solution = least_memory_plan(build.problem, solution,
                                                 recipe_pins(traced, build, mesh, recipe),
                                                 options or SolverOptions())
            except (ValueError, SolverTimeoutError, SolverError) as error:
                log.info("recipe %s is no start here: %s", recipe.name, error)
                continue
            log.info("recipe %s: %.6g s, %d B per device", recipe.name, solution.objective,
                     solution.peak_bytes)
            if solution.peak_bytes <= budget_bytes:
                found.append((solution.objective, recipe.name, solution))
        if found:
            break
    if not found:
        return None
    _, name, solution = min(found, key=lambda item: item[:2])
    log.info("the solver starts from recipe %s", name)
    return solution
