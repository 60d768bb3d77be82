"""Compile a plan: the applied step under ``jax.jit`` with the plan's shardings, and what was
made for one argument signature.

This module sits between planning (``kiwi_jax.plan``) and its users (``kiwi_jax.optimize``,
``kiwi_jax.verify``, the experiments), which all compile plans the same way.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax

import solvers
from hlo_tools.compiled import MemoryStats, device_memory
from hlo_tools.liveness import fused_values
from kiwi_jax.apply import TracedStep, applied_function, operand_specs_of
from kiwi_jax.plan import Plan
from kiwi_jax.problem import ProblemBuild
from kiwi_jax.step import PureStep

if TYPE_CHECKING:
    from kiwi_jax.choose import Choice

__all__ = ["KEEP_REMAT", "CompiledPlan", "Prepared", "compile_plan", "compiler_options", "jit_step"]

KEEP_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}
"""Compiler options that keep recomputation on the CPU backend, whose CSE otherwise merges a
recomputed value with its original (see docs/apply.md)."""


def compiler_options() -> dict:
    """Options that keep the plan's recomputation in the compiled step on this backend."""
    return dict(KEEP_REMAT) if jax.default_backend() == "cpu" else {}


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """A plan applied to a traced step and compiled for one set of argument shapes (or a
    recipe's step compiled for them: :mod:`kiwi_jax.choose`)."""

    in_shardings: tuple
    """NamedSharding per argument leaf tree, as the jitted step takes them."""
    out_shardings: tuple
    """NamedSharding per output; the updated state keeps the input state's."""
    state_out: int | None
    """Position of the updated train state among the outputs (None: not carried)."""
    jitted: object
    """The applied step under ``jax.jit`` with the plan's shardings."""
    compiled: object
    """Its compiled executable."""
    program: str = "values"
    """How a plan was applied: ``"values"``, value by value (:func:`compile_plan`);
    ``"regathered"``, so, the backward pass resharding the step's arguments and the forward
    pass's values again for each reader and reducing each gradient where it is made
    (``compile_plan(..., regather=True, settle=True)``); or ``"blocks"``, as its export, each
    block under its layer's ``jax.checkpoint`` policy
    (:func:`kiwi_jax.export.compile_exported`)."""
    settle_bytes: int = 0
    """``"regathered"``: the most bytes of gradients reduced together by one all-reduce in
    the backward pass (``compile_plan(..., settle_bytes=...)``); 0: each where it is made."""

    @property
    def label(self) -> str:
        """The program's name, with its gradients' bucket where it has one."""
        return f"{self.program} (gradients reduced by {self.settle_bytes:,} B)" \
            if self.settle_bytes else self.program

    @property
    def memory(self) -> MemoryStats:
        """Per-device memory of the compiled step (argument + output + temp - alias)."""
        return device_memory(self.compiled)


def compile_plan(traced: TracedStep, build: ProblemBuild, plan: Plan, mesh, abstract: PureStep,
                 donate: bool = True, overlap: bool = True, regather: bool = False,
                 settle: bool = False, settle_bytes: int = 0) -> CompiledPlan:
    """Apply ``plan`` (solved on ``build``, whose strategies say in which spec each operator
    reads its operands) to the traced step and compile it for ``abstract``'s argument shapes.
    The updated state (``traced.state_out``) gets the input state's layout and, with
    ``donate``, reuses its buffers.

    Args:
      overlap: place the recomputations a Lynx plan hides under collectives beside them.
      regather: the backward pass reshards the step's arguments and the forward pass's values
        again, for each reader (:func:`~kiwi_jax.apply.applied_function`).
      settle: each gradient is tied into the backward pass where it is made, or by buckets
        of at most ``settle_bytes`` (:func:`~kiwi_jax.apply.applied_function`).
    """
    fn, in_shardings, out_shardings = applied_function(
        traced, list(plan.specs), plan.recomputed, mesh,
        beside=plan.hidden_under if overlap else None,
        chains=plan.solver not in solvers.LYNX_SOLVERS,
        operand_specs=operand_specs_of(build.strategies, plan.strategy),
        # the fusion rules' flags, not the build's: they follow from the graph alone, so a
        # plan from the cache or from process 0 is applied as it was when it was compiled
        fused=fused_values(traced.graph) if build.memory_model == "fused" else None,
        regather=regather, settle=settle, settle_bytes=settle_bytes)
    jitted, out_shardings = jit_step(fn, in_shardings, out_shardings, traced.state_out, donate)
    compiled = jitted.lower(*abstract.args).compile(compiler_options=compiler_options())
    return CompiledPlan(tuple(in_shardings), tuple(out_shardings), traced.state_out, jitted,
                        compiled)


def jit_step(fn, in_shardings, out_shardings, state_out: int | None, donate: bool = True):
    """``(jax.jit(fn, ...), out_shardings)`` for a step whose updated state (output
    ``state_out``, see :func:`kiwi_jax.step.carried_state`) keeps the input state's layout and,
    with ``donate``, reuses its buffers; a plan's step and a recipe's are jitted alike."""
    donate_argnums = ()
    if state_out is not None:
        out_list = list(out_shardings)
        out_list[state_out] = in_shardings[0]           # the state keeps its layout
        out_shardings = tuple(out_list)
        donate_argnums = (0,) if donate else ()
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate_argnums, keep_unused=True)
    return jitted, out_shardings


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything made for one argument signature: traced, planned, applied and compiled; and,
    when recipes were compared, which step runs (kiwi's plan or a recipe's)."""

    traced: TracedStep
    """The traced step (graph, jaxpr, the pure function and its abstract arguments)."""
    build: ProblemBuild
    """The costed problem the plan was solved on."""
    plan: Plan | None
    """kiwi's plan: the solver's answer (fitted to the compiler), what the plan cache stores.
    It runs unless ``choice`` says a recipe does; None when kiwi has no plan for the budget
    and a recipe runs."""
    applied: CompiledPlan | None
    """kiwi's plan applied and compiled (None with ``plan``)."""
    plan_seconds: float
    """Tracing and planning wall time (the plan cache's load when cached)."""
    compile_seconds: float
    """Applying and compiling wall time (every compile of the fitting rounds, and the
    recipes' compiles when they were compared)."""
    cached: bool
    """The plan came from the disk cache."""
    received: bool = False
    """The plan came from process 0 (a multi-process run; see :mod:`kiwi_jax.multihost`)."""
    choice: Choice | None = None
    """kiwi's compiled plan against the recipes (:mod:`kiwi_jax.choose`); None: not compared."""
    recipe: CompiledPlan | None = None
    """The winning recipe's step, compiled like a plan; it runs instead of ``applied``."""

    @property
    def runs_recipe(self) -> bool:
        """A recipe's step runs, not kiwi's plan."""
        return self.recipe is not None

    @property
    def running(self) -> CompiledPlan:
        """The compiled step that runs: the recipe's when one won, else kiwi's plan's."""
        return self.recipe if self.recipe is not None else self.applied

    @property
    def in_shardings(self) -> tuple:
        return self.running.in_shardings

    @property
    def out_shardings(self) -> tuple:
        return self.running.out_shardings

    @property
    def state_out(self) -> int | None:
        return self.running.state_out

    @property
    def jitted(self):
        return self.running.jitted

    @property
    def compiled(self):
        return self.running.compiled
