"""The compiler chooses: kiwi's compiled plan against the hand-written recipes, the faster one
that fits the budget runs.

kiwi's plan is solved on a cost model; a recipe (:mod:`kiwi_jax.recipes`) is only written down.
Both are compiled for the same step, mesh and argument shapes and measured the same way: the
per-device memory of the executable (argument + output + temp - alias,
:func:`hlo_tools.compiled.device_memory`) and its estimated step
(:func:`kiwi_jax.estimate.compiled_cost` with the same cluster). The fastest recipe whose
compiled memory is within the budget runs instead of kiwi's plan when it is estimated faster,
or when kiwi's compiled plan does not fit the budget, or when kiwi has no plan for it; otherwise
kiwi's plan runs (a tie goes to kiwi). So the step that runs is never estimated slower than a
fitting recipe among those compared.

References:
  KIWI (Liu et al.), sec. 5: plans compared with Megatron-style recipes at a memory budget.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from kiwi_jax.compile import CompiledPlan
from kiwi_jax.recipes import BlockPolicyError, Recipe, all_recipes, compile_recipe

__all__ = ["KIWI", "RecipeRow", "Choice", "parse_recipes", "compile_recipes", "choose",
           "fastest_fitting"]

log = logging.getLogger(__name__)

KIWI = "kiwi"
"""The winner's name when kiwi's plan runs."""


def parse_recipes(recipes) -> tuple[Recipe, ...]:
    """The decorator's ``recipes`` option as recipes: True -> every recipe
    (:func:`kiwi_jax.recipes.all_recipes`), False or None -> none, a name (``"fsdp"``,
    ``"tp/dots_saveable"``) or a sequence of names or :class:`Recipe` -> those.

    Raises:
      ValueError: a name that is no recipe (the message lists the valid names), or a value of
        another type.
    """
    if recipes is True:
        return all_recipes()
    if recipes is False or recipes is None:
        return ()
    if isinstance(recipes, (str, Recipe)):
        recipes = (recipes,)
    if not isinstance(recipes, Iterable):
        raise ValueError(f"recipes: expected True, False or a sequence of recipe names, got "
                         f"{recipes!r}")
    valid = ", ".join(r.name for r in all_recipes())
    found = []
    for item in recipes:
        if isinstance(item, Recipe):
            found.append(item)
            continue
        try:
            found.append(Recipe.parse(item))
        except (ValueError, AttributeError):
            raise ValueError(f"recipes: unknown recipe {item!r}; the recipes are {valid}") \
                from None
    return tuple(dict.fromkeys(found))


@dataclasses.dataclass(frozen=True)
class RecipeRow:
    """One recipe compiled for the step (or why it could not be)."""

    name: str
    """The recipe's name (``fsdp/dots_saveable``)."""
    compiled_bytes: int | None
    """Per-device memory of its compiled step; None when it was not compiled."""
    step_seconds: float | None
    """Estimated step of its compiled step."""
    error: str | None = None
    """Why it was not compiled (its policy cannot be applied to the model)."""
    compile_seconds: float = 0.0
    """Wall time of its lowering, compiling and pricing."""

    def fits(self, budget_bytes: int) -> bool:
        """Compiled within ``budget_bytes`` per device."""
        return self.compiled_bytes is not None and self.compiled_bytes <= budget_bytes


def fastest_fitting(rows, budget_bytes: int) -> RecipeRow | None:
    """The row estimated fastest of those that fit ``budget_bytes`` (None: none fits)."""
    fitting = [row for row in rows if row.fits(budget_bytes)]
    return min(fitting, key=lambda row: row.step_seconds) if fitting else None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms"


@dataclasses.dataclass(frozen=True)
class Choice:
    """kiwi's compiled plan against the recipes, for one argument signature: which runs."""

    winner: str
    """``"kiwi"`` (:data:`KIWI`) or the name of the recipe whose compiled step runs."""
    budget_bytes: int
    """The per-device budget both are held to."""
    kiwi_bytes: int | None
    """Per-device memory of kiwi's compiled plan; None: kiwi has no plan for the budget."""
    kiwi_step_seconds: float | None
    """Estimated step of kiwi's compiled plan."""
    recipes: tuple
    """A :class:`RecipeRow` per recipe compared, in the order given."""
    compile_seconds: float
    """Wall time of the recipes' compiles."""
    kiwi_error: str | None = None
    """Why kiwi has no plan (its :class:`solvers.InfeasibleBudgetError`)."""

    @property
    def runs_recipe(self) -> bool:
        """A recipe's compiled step runs instead of kiwi's plan."""
        return self.winner != KIWI

    @property
    def kiwi_fits(self) -> bool:
        """kiwi's compiled plan is within the budget."""
        return self.kiwi_bytes is not None and self.kiwi_bytes <= self.budget_bytes

    @property
    def best(self) -> RecipeRow | None:
        """The fastest recipe that fits the budget (None: none fits)."""
        return fastest_fitting(self.recipes, self.budget_bytes)

    def _kiwi(self) -> str:
        if self.kiwi_bytes is None:
            return "; kiwi has no plan for the budget"
        over = "" if self.kiwi_fits else ", over the budget"
        return (f" against kiwi's plan's {_ms(self.kiwi_step_seconds)} at "
                f"{_mib(self.kiwi_bytes)}{over}")

    def describe(self) -> str:
        """One line: what runs, with both figures."""
        budget = f"budget {_mib(self.budget_bytes)}"
        fitting = sum(r.fits(self.budget_bytes) for r in self.recipes)
        counted = f"{fitting} of {len(self.recipes)} recipes fit"
        best = self.best
        if self.runs_recipe:
            return (f"recipe {best.name} runs: est. {_ms(best.step_seconds)} at "
                    f"{_mib(best.compiled_bytes)}{self._kiwi()} ({budget}; {counted})")
        if self.kiwi_bytes is None:
            return (f"nothing runs: kiwi has no plan for the budget and none of the "
                    f"{len(self.recipes)} recipes fits it ({budget})")
        if best is None:
            over = "" if self.kiwi_fits else ", over the budget"
            return (f"kiwi's plan runs: est. {_ms(self.kiwi_step_seconds)} at "
                    f"{_mib(self.kiwi_bytes)}{over} ({budget}); none of the "
                    f"{len(self.recipes)} recipes fits")
        return (f"kiwi's plan runs: est. {_ms(self.kiwi_step_seconds)} at "
                f"{_mib(self.kiwi_bytes)}, no slower than the best fitting recipe, {best.name} "
                f"(est. {_ms(best.step_seconds)} at {_mib(best.compiled_bytes)}; {budget}; "
                f"{counted})")

    def table(self) -> str:
        """:meth:`describe` and a line per recipe (compiled MiB, est. step ms, fits)."""
        lines = [self.describe(), f"  {'recipe':26s} {'compiled MiB':>13s} {'est. step ms':>13s}"]
        for row in self.recipes:
            if row.compiled_bytes is None:
                lines.append(f"  {row.name:26s} {'-':>13s} {'-':>13s}  "
                             f"({(row.error or 'not compiled').splitlines()[0][:60]})")
                continue
            fits = "fits" if row.fits(self.budget_bytes) else "over the budget"
            lines.append(f"  {row.name:26s} {row.compiled_bytes / 2**20:13.3f} "
                         f"{row.step_seconds * 1e3:13.4f}  {fits}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "runs_recipe": self.runs_recipe,
                "recipes": [dataclasses.asdict(r) for r in self.recipes]}


def compile_recipes(train_step, args: tuple, mesh, recipes, budget_bytes: int, cluster,
                    donate: bool = True) -> tuple[tuple, dict]:
    """Compile each recipe for ``train_step`` at ``args`` (abstract arrays are enough) as
    kiwi's plan is compiled (:func:`kiwi_jax.recipes.compile_recipe`: the compiler options of
    :func:`kiwi_jax.compile.compiler_options`, the state donated with ``donate``) and price it.

    Returns:
      ``(rows, steps)``: a :class:`RecipeRow` per recipe, and ``{name: CompiledPlan}`` of the
      fastest one that fits ``budget_bytes`` (empty when none fits): the others' executables
      are not kept. A recipe whose policy cannot be applied to the model
      (:class:`~kiwi_jax.recipes.BlockPolicyError`) is a row with its error.
    """
    rows, best, best_seconds = [], {}, None
    for recipe in recipes:
        try:
            result = compile_recipe(train_step, args, mesh, recipe, cluster, donate=donate)
        except BlockPolicyError as error:
            log.debug("recipe %s skipped: %s", recipe.name, error)
            rows.append(RecipeRow(recipe.name, None, None, str(error)))
            continue
        memory, seconds = result.peak_bytes, result.step_seconds
        rows.append(RecipeRow(recipe.name, memory, seconds,
                              compile_seconds=result.compile_seconds))
        log.debug("recipe %s: %d B, est. %.6f s", recipe.name, memory, seconds)
        if memory <= budget_bytes and (best_seconds is None or seconds < best_seconds):
            step = result.step
            best = {recipe.name: CompiledPlan(step.in_shardings, step.out_shardings,
                                              step.state_out, step.jitted, result.compiled)}
            best_seconds = seconds
    return tuple(rows), best


def choose(budget_bytes: int, kiwi_bytes: int | None, kiwi_step_seconds: float | None,
           rows: tuple, compile_seconds: float = 0.0, kiwi_error: str | None = None) -> Choice:
    """Which runs: the fastest fitting recipe when it is estimated faster than kiwi's compiled
    plan (``kiwi_bytes`` per device, ``kiwi_step_seconds`` priced with the same
    :func:`~kiwi_jax.estimate.compiled_cost` as the rows), or kiwi's plan does not fit the
    budget, or there is none (``kiwi_bytes`` None); otherwise kiwi's plan (a tie included).
    With no plan and no fitting recipe the winner is kiwi's absent plan: the caller raises."""
    choice = Choice(KIWI, int(budget_bytes), kiwi_bytes, kiwi_step_seconds, tuple(rows),
                    compile_seconds, kiwi_error)
    best = choice.best
    if best is not None and (not choice.kiwi_fits or best.step_seconds < kiwi_step_seconds):
        choice = dataclasses.replace(choice, winner=best.name)
    return choice
