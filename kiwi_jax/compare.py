"""kiwi's plans against the hand-written recipes, compiled for the same step and mesh.

Every recipe (:mod:`kiwi_jax.recipes`: 4 shardings x 3 per-block policies) and
:func:`kiwi_jax.optimize` at a range of memory budgets (by default the recipes' own compiled
memories: at each, kiwi's plan is asked to fit what a recipe uses) are compiled with abstract
arguments; each row has the compiled per-device memory (argument + output + temp - alias) and
the estimated step of the compiled program (:func:`kiwi_jax.estimate.compiled_cost`: the same
prices for every row). kiwi's row fits when its compiled memory is within its budget.

References:
  KIWI (Liu et al.), sec. 5: plans compared with Megatron-style recipes at a memory budget.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import solvers
from kiwi_jax.estimate import compiled_cost
from kiwi_jax.optimize import optimize
from kiwi_jax.recipes import compare_recipes
from kiwi_jax.step import functionalize

__all__ = ["Row", "Comparison", "compare", "kiwi_row", "draw", "plot"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled configuration: a recipe or a kiwi plan at a budget."""

    name: str
    """``fsdp/nothing_saveable``, or ``kiwi@<budget MiB>``."""
    kind: str
    """``recipe`` or ``kiwi``."""
    compiled_bytes: int | None
    """Per-device memory of the compiled step; None when nothing was compiled."""
    step_seconds: float | None
    """Estimated step of the compiled step (compute + collectives)."""
    budget_bytes: int | None = None
    """kiwi's memory budget (None for recipes)."""
    error: str | None = None
    """Why nothing was compiled (a recipe's policy that cannot be applied, an infeasible
    budget)."""
    seconds: float = 0.0
    """Planning and compiling wall time."""

    @property
    def fits(self) -> bool | None:
        """kiwi's rows: compiled memory within the budget (None for recipes)."""
        if self.budget_bytes is None:
            return None
        return self.compiled_bytes is not None and self.compiled_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits}


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The recipes' and kiwi's rows for one step, mesh and cluster."""

    recipes: tuple
    """A :class:`Row` per recipe."""
    kiwi: tuple
    """A :class:`Row` per budget, smallest budget first."""
    cluster: str
    """The cluster whose figures price the compiled steps."""

    def table(self) -> str:
        """The rows as a text table (MiB, ms)."""
        lines = [f"{'name':28s} {'compiled MiB':>13s} {'est. step ms':>13s} {'budget MiB':>11s}"
                 f" {'fits':>5s}"]
        for row in (*self.recipes, *self.kiwi):
            memory = "-" if row.compiled_bytes is None else f"{row.compiled_bytes / 2**20:.3f}"
            step = "-" if row.step_seconds is None else f"{row.step_seconds * 1e3:.4f}"
            budget = "" if row.budget_bytes is None else f"{row.budget_bytes / 2**20:.3f}"
            fits = "" if row.fits is None else ("yes" if row.fits else "no")
            line = f"{row.name:28s} {memory:>13s} {step:>13s} {budget:>11s} {fits:>5s}"
            if row.error:
                line += f"  ({row.error.splitlines()[0][:70]})"
            lines.append(line)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"cluster": self.cluster, "recipes": [r.to_dict() for r in self.recipes],
                "kiwi": [r.to_dict() for r in self.kiwi]}


def kiwi_row(train_step, args, mesh, budget: int, cluster="v100-nvlink", fit_compiles: int = 2,
             time_limit: float = 60.0, cache_dir=False, **options) -> Row:
    """kiwi's plan at one budget, compiled with abstract ``args`` and priced (kiwi's own plan:
    the decorator's recipes are not compared, the recipes have rows of their own)."""
    start = time.perf_counter()
    step = optimize(train_step, mesh=mesh, memory_budget=int(budget), cluster=cluster,
                    fit_compiles=fit_compiles, time_limit=time_limit, cache_dir=cache_dir,
                    **{**options, "recipes": False})
    name = f"kiwi@{budget / 2**20:.3f}MiB"
    try:
        prepared = step.prepare(functionalize(train_step, args))
    except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError,
            solvers.SolverError) as error:      # a row: the recipes' rows are not lost
        return Row(name, "kiwi", None, None, int(budget), f"{type(error).__name__}: {error}",
                   time.perf_counter() - start)
    cost = compiled_cost(prepared.applied.compiled, mesh, cluster)
    return Row(name, "kiwi", prepared.applied.memory.peak_bytes, cost.step_seconds, int(budget),
               seconds=time.perf_counter() - start)


def compare(train_step, args, mesh, recipes=None, budgets=None, cluster="v100-nvlink",
            fit_compiles: int = 2, time_limit: float = 60.0, progress=None,
            max_budgets: int | None = None, **options) -> Comparison:
    """Compile every recipe and kiwi's plan at each budget (see the module docstring).

    Args:
      args: the step's example arguments (abstract arrays are enough).
      recipes: recipe names or :class:`~kiwi_jax.recipes.Recipe` (default: all twelve).
      budgets: kiwi's per-device budgets in bytes; None: the recipes' distinct compiled
        memories (at most ``max_budgets`` of them, evenly spread from the smallest to the
        largest).
      progress: called with each :class:`Row` as it is ready.
      options: more :func:`kiwi_jax.optimize` options (``solver``, ``memory_model``, ...).
    """
    rows = []
    for recipe, result in compare_recipes(train_step, args, mesh, recipes, cluster):
        if isinstance(result, Exception):
            row = Row(recipe.name, "recipe", None, None, error=str(result))
        else:
            row = Row(recipe.name, "recipe", result.peak_bytes, result.step_seconds,
                      seconds=result.compile_seconds)
        rows.append(row)
        if progress is not None:
            progress(row)
    if budgets is None:
        budgets = sorted({r.compiled_bytes for r in rows if r.compiled_bytes is not None})
        if max_budgets is not None and len(budgets) > max_budgets:
            picks = {round(i * (len(budgets) - 1) / max(max_budgets - 1, 1))
                     for i in range(max_budgets)} if max_budgets > 0 else set()
            budgets = [budgets[i] for i in sorted(picks)]
    kiwi = []
    for budget in sorted(int(b) for b in budgets):
        row = kiwi_row(train_step, args, mesh, budget, cluster, fit_compiles, time_limit,
                       **options)
        kiwi.append(row)
        if progress is not None:
            progress(row)
    name = cluster if isinstance(cluster, str) else getattr(cluster, "name", str(cluster))
    return Comparison(tuple(rows), tuple(kiwi), name)



def draw(comparison: Comparison, ax) -> None:
    """Compiled memory (x, MiB) against estimated step (y, ms) on ``ax``: each recipe a
    labelled point (marker per sharding, colour per policy), kiwi's plans a curve (a hollow
    star: compiled over its budget)."""
    markers = {"dp": "o", "fsdp": "s", "tp": "^", "fsdp+tp": "D"}
    colors = {"none": "C0", "dots_saveable": "C1", "nothing_saveable": "C2"}
    for row in comparison.recipes:
        if row.compiled_bytes is None:
            continue
        sharding, _, policy = row.name.partition("/")
        x, y = row.compiled_bytes / 2**20, row.step_seconds * 1e3
        ax.scatter([x], [y], marker=markers.get(sharding, "x"),
                   color=colors.get(policy or "none", "k"), s=30, zorder=3)
        ax.annotate(row.name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    points = sorted((r.compiled_bytes / 2**20, r.step_seconds * 1e3, r.fits)
                    for r in comparison.kiwi if r.compiled_bytes is not None)
    if points:
        xs, ys, fits = zip(*points)
        ax.plot(xs, ys, color="C3", lw=1.5, label="kiwi (budget sweep; hollow: over its "
                "budget)", zorder=4, marker="*", ms=0)
        for x, y, fit in points:
            ax.plot([x], [y], marker="*", ms=9, color="C3",
                    markerfacecolor="C3" if fit else "none", zorder=5)
        ax.legend(fontsize=7, loc="upper right")
    ax.set_xlabel("compiled memory per device (MiB)", fontsize=8)
    ax.set_ylabel(f"estimated step (ms, {comparison.cluster})", fontsize=8)
    ax.tick_params(labelsize=7)


def plot(comparison: Comparison, path, title: str) -> None:
    """Write :func:`draw`'s figure as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    draw(comparison, ax)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
