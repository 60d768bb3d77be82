"""Hand-written recipes as baselines: the sharding and per-block recomputation users write
without kiwi-jax, applied to the same ``(train_step, args)`` that :func:`kiwi_jax.optimize`
takes, compiled and priced like a plan.

A :class:`Recipe` is a sharding rule (``dp``, ``fsdp``, ``tp``, ``fsdp+tp``; see
:mod:`kiwi_jax.recipe_specs`) and a per-block ``jax.checkpoint`` policy (``none``,
``dots_saveable``, ``nothing_saveable``; see :mod:`kiwi_jax.recipe_remat`).
:func:`recipe_step` turns a step into the jitted step the recipe makes (in and out shardings,
the train state donated and kept in its layout); :func:`compile_recipe` compiles it and reports
its per-device memory (argument + output + temp - alias, :func:`hlo_tools.compiled.
device_memory`) and its compiled cost (:func:`kiwi_jax.estimate.compiled_cost`), the figures
``kiwi-jax verify`` reports for a plan.

References:
  Shoeybi et al., "Megatron-LM" (2019), sec. 3; Rajbhandari et al., "ZeRO" (SC 2020), sec. 5;
  Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016): the recipes compared.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlo_tools.compiled import MemoryStats, device_memory
from kiwi_jax.compile import compiler_options, jit_step
from kiwi_jax.estimate import CompiledCost, compiled_cost
from kiwi_jax.recipe_remat import (POLICIES, BlockPolicyError, block_paths, stacked_layers,
                                   with_block_policy, with_scan_policy)
from kiwi_jax.recipe_specs import (SHARDINGS, batch_axes, data_flow, parameters, recipe_specs,
                                   state_leaves)
from kiwi_jax.step import PureStep, abstract_arrays, carried_state, functionalize

__all__ = ["Recipe", "RecipeStep", "RecipeResult", "BlockPolicyError", "SHARDINGS", "POLICIES",
           "all_recipes", "recipe_step", "data_parallel_step", "compile_recipe", "compare_recipes"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A hand-written recipe: a sharding rule and a per-block recomputation policy."""

    sharding: str
    """``dp``, ``fsdp``, ``tp`` or ``fsdp+tp`` (:data:`kiwi_jax.recipe_specs.SHARDINGS`)."""
    policy: str = "none"
    """``none``, ``dots_saveable`` or ``nothing_saveable``: the ``jax.checkpoint_policies``
    policy every block runs under (``none``: no checkpoint)."""

    def __post_init__(self):
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown recipe sharding {self.sharding!r}: expected one of "
                             f"{', '.join(SHARDINGS)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown recipe policy {self.policy!r}: expected one of "
                             f"{', '.join(POLICIES)}")

    @property
    def name(self) -> str:
        """``fsdp/dots_saveable``; ``dp`` alone for the policy ``none``."""
        return self.sharding if self.policy == "none" else f"{self.sharding}/{self.policy}"

    @classmethod
    def parse(cls, text: str) -> Recipe:
        """``"fsdp"``, ``"tp/nothing_saveable"`` -> a Recipe.

        Raises:
          ValueError: an unknown sharding or policy.
        """
        sharding, _, policy = text.strip().partition("/")
        return cls(sharding, policy or "none")


def all_recipes() -> tuple[Recipe, ...]:
    """Every sharding with every policy (4 x 3)."""
    return tuple(Recipe(s, p) for s in SHARDINGS for p in POLICIES)


@dataclasses.dataclass(frozen=True)
class RecipeStep:
    """A train step made into a recipe's jitted step."""

    recipe: Recipe
    """The recipe."""
    pure: PureStep
    """The step as a pure function of arrays, under the recipe's block policy."""
    specs: tuple
    """A PartitionSpec per leaf of ``pure.args`` (HLO parameter order)."""
    in_shardings: tuple
    """NamedSharding trees per argument of ``pure.fn``."""
    out_shardings: object
    """NamedSharding tree of the outputs; the updated state keeps the input state's."""
    state_out: int | None
    """Position of the updated train state among the outputs (None: not carried)."""
    jitted: Callable
    """``jax.jit`` of ``pure.fn`` with the shardings (the state donated)."""
    blocks: tuple
    """Paths of the block modules the policy wraps (relative to the parameter root)."""

    def spec_of(self, *components, prefix: tuple = ()) -> dict:
        """``{path: spec}`` of the leaves whose path starts with ``prefix`` and holds
        ``components`` in order after it, e.g. ``spec_of('layers', 0, 'wq', 'kernel',
        prefix=(0, 0))`` (paths without the leading ``'args'``: argument, then the path in
        it; an NNX state's first component is the object's position)."""
        leaves = state_leaves(self.pure)
        found = {}
        for path, spec in zip(leaves.paths, self.specs):
            if tuple(path[:len(prefix)]) != tuple(prefix):
                continue
            rest = iter(path[len(prefix):])
            if all(any(c == p for p in rest) for c in components):
                found[path] = spec
        return found


def activation_constraint(mesh, sharding: str):
    """A function that puts a value's leading (batch) dimension on the recipe's data axes
    (all devices for ``dp`` and ``fsdp``, the first axis for ``tp`` and ``fsdp+tp``) with
    ``jax.lax.with_sharding_constraint``; values it does not divide pass unchanged."""
    axes = batch_axes(mesh, sharding)
    size = 1
    for name, n in zip(mesh.axis_names, mesh.devices.shape):
        size *= n if name in axes else 1
    target = NamedSharding(mesh, P(axes if len(axes) > 1 else axes[0]))

    def constrain(x):
        shape = getattr(x, "shape", ())
        if len(shape) < 2 or shape[0] % size:
            return x
        return jax.lax.with_sharding_constraint(x, target)
    return constrain


def recipe_step(train_step, args: tuple, mesh, recipe: Recipe | str,
                donate: bool = True, constrain: bool = True) -> RecipeStep:
    """The recipe's jitted step for ``train_step`` at ``args`` (concrete or abstract) on
    ``mesh`` (two axes: data, then model).

    Args:
      constrain: put the activations at block boundaries on the data axes
        (:func:`activation_constraint`), as hand-written recipes do; otherwise XLA's sharding
        propagation alone decides the layout between the arguments and the outputs.

    The policy wraps each block module, or, where the layers are stacked for a scan (a scan
    slices parameters, :attr:`~kiwi_jax.recipe_specs.DataFlow.scanned`), the scan's body
    (:mod:`kiwi_jax.recipe_remat`). Blocks called inside a scan over micro-batches, which
    reads the parameters whole, are block modules.

    Raises:
      BlockPolicyError: a policy other than ``none`` on a model whose blocks cannot be wrapped
        (no repeated blocks in its parameter tree, or a block never called as a module).
      ValueError: an unknown recipe, or a mesh without two axes.
    """
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    plain = functionalize(train_step, args)
    leaves = state_leaves(plain)
    flow = data_flow(plain, parameters(leaves))
    constraint = activation_constraint(mesh, recipe.sharding) if constrain else None
    paths = []
    if flow.scanned:                    # layers stacked for a scan
        wrapped = with_scan_policy(train_step, stacked_layers(plain, flow.scanned),
                                   recipe.policy, constraint)
    else:
        if recipe.policy != "none" or constrain:
            paths = block_paths(leaves, plain.args)
        wrapped = with_block_policy(train_step, args, plain.style, paths, recipe.policy,
                                    constraint)
    pure = functionalize(wrapped, args) if wrapped is not train_step else plain
    specs = recipe_specs(plain, mesh, recipe.sharding, leaves, flow.roles)
    return _jitted(recipe, pure, specs, mesh, donate, tuple(paths))


def data_parallel_step(pure: PureStep, mesh) -> RecipeStep:
    """The plain step run data-parallel on ``mesh``: recipe ``dp`` with no policy, no
    activation constraints and nothing donated. How far it is from the step on one device is
    the rounding any sharding of the step brings (:func:`kiwi_jax.verify.compare_numerics`)."""
    return _jitted(Recipe("dp"), pure, recipe_specs(pure, mesh, "dp"), mesh, False, ())


def _jitted(recipe, pure: PureStep, specs, mesh, donate: bool, blocks: tuple) -> RecipeStep:
    shardings = [NamedSharding(mesh, s) for s in specs]
    tree = jax.tree.structure(pure.args)
    in_shardings = tuple(jax.tree.unflatten(tree, shardings))
    outputs = jax.eval_shape(pure.fn, *pure.args)
    state_out = carried_state(pure, outputs)
    replicated = NamedSharding(mesh, P())
    out = tuple(jax.tree.map(lambda _: replicated, o) for o in outputs) \
        if isinstance(outputs, (tuple, list)) else jax.tree.map(lambda _: replicated, outputs)
    jitted, out_shardings = jit_step(pure.fn, in_shardings, out, state_out, donate)
    return RecipeStep(recipe, pure, tuple(specs), in_shardings, out_shardings, state_out,
                      jitted, blocks)


@dataclasses.dataclass(frozen=True)
class RecipeResult:
    """One recipe compiled for one step and mesh."""

    recipe: Recipe
    """The recipe."""
    memory: MemoryStats
    """Per-device memory of the compiled step (argument, output, temp, alias)."""
    cost: CompiledCost
    """The compiled step priced with the cluster's figures."""
    compile_seconds: float
    """Lowering and compiling wall time."""
    step: RecipeStep | None = dataclasses.field(default=None, repr=False, compare=False)
    """The jitted step that was compiled."""
    compiled: object = dataclasses.field(default=None, repr=False, compare=False)
    """Its compiled executable (what runs when the recipe wins :mod:`kiwi_jax.choose`)."""

    @property
    def peak_bytes(self) -> int:
        """argument + output + temp - alias, per device."""
        return self.memory.peak_bytes

    @property
    def step_seconds(self) -> float:
        """Estimated step: compute + collectives of the compiled step."""
        return self.cost.step_seconds

    def to_dict(self) -> dict:
        m = self.memory
        return {"name": self.recipe.name, "sharding": self.recipe.sharding,
                "policy": self.recipe.policy, "compiled_peak_bytes": m.peak_bytes,
                "argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes,
                "temp_bytes": m.temp_bytes, "alias_bytes": m.alias_bytes,
                "step_seconds": self.step_seconds,
                "compute_seconds": self.cost.compute_seconds,
                "collective_seconds": self.cost.collective_seconds,
                "compile_seconds": self.compile_seconds}


def compile_recipe(train_step, args: tuple, mesh, recipe: Recipe | str,
                   cluster="v100-nvlink", options: dict | None = None,
                   donate: bool = True) -> RecipeResult:
    """Compile the recipe's step (abstract arguments are enough) and price it.

    Args:
      options: XLA compiler options added to :func:`kiwi_jax.compile.compiler_options` (which
        keep the recomputation on the CPU backend).
      donate: see :func:`recipe_step`.

    Raises:
      BlockPolicyError: see :func:`recipe_step`.
    """
    start = time.perf_counter()
    step = recipe_step(train_step, args, mesh, recipe, donate=donate)
    compiled = step.jitted.lower(*abstract_arrays(step.pure.args)).compile(
        compiler_options={**compiler_options(), **(options or {})})
    return RecipeResult(step.recipe, device_memory(compiled),
                        compiled_cost(compiled, mesh, cluster), time.perf_counter() - start,
                        step, compiled)


def compare_recipes(train_step, args: tuple, mesh, recipes=None, cluster="v100-nvlink",
                    on_result=None) -> list:
    """Every recipe (default :func:`all_recipes`) compiled: a :class:`RecipeResult` per
    recipe, or the :class:`BlockPolicyError` that says why its policy cannot be applied.

    Args:
      on_result: called with each result (or error) as it is ready (progress output).
    """
    found = []
    for recipe in recipes or all_recipes():
        recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
        try:
            result = compile_recipe(train_step, args, mesh, recipe, cluster)
        except BlockPolicyError as error:
            result = error
        found.append((recipe, result))
        if on_result is not None:
            on_result(recipe, result)
    return found
