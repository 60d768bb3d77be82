"""How a problem is solved: the formulation, the backend and its limits, with the one set of
defaults.

:func:`solvers.solve`, the ``kiwi_jax.optimize`` decorator and the ``kiwi-jax`` command line
all take their defaults from :data:`DEFAULTS` (``SolverOptions()``), so the same model and budget
give the same plan whichever way it is asked for.
"""

from __future__ import annotations

import dataclasses

from solvers.backend import BACKENDS, DEFAULT_BACKEND

__all__ = ["SolverOptions", "DEFAULTS"]


@dataclasses.dataclass(frozen=True)
class SolverOptions:
    """What a solve is asked to do; every formulation of :data:`solvers.FORMULATIONS` takes one
    (each documents how the options apply to it)."""

    solver: str = "kiwi"
    """Formulation: one of :data:`solvers.SOLVERS` (checked where it is dispatched)."""
    backend: str = DEFAULT_BACKEND
    """MILP backend: ``highs`` (embedded), ``cpsat`` or ``gurobi`` (:data:`solvers.BACKENDS`)."""
    time_limit: float = 60.0
    """Seconds for the solve, its warm-start stages included; the best plan found by then is
    returned with its gap."""
    mip_gap: float = 5e-3
    """Relative optimality gap at which the backend stops (a plan within 0.5% of the optimum of
    its program). The cost model's steps differ from the compiled programs' estimates by 5-27%
    (docs/cost_model.md), so a tighter proof buys nothing the compiled step shows: on the
    4-layer KIWI-config GPT on 2x4 at 80%, 1e-3 took HiGHS 13.2 s to a plan 0.21% faster than
    the one it proves within 5e-3 in 5.1 s."""
    reuse_layers: bool = True
    """Give corresponding operators of identical layers one decision (solve one layer, apply it
    to its repeats; :func:`solvers.reuse.layer_ties`): fewer variables and faster solves, at
    the price of a possibly slower plan. A problem without repeated layers is solved untied."""
    seed: int = 0
    """The backend's random seed (same seed, same model: same answer)."""
    threads: int = 1
    """Backend threads."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        if not self.time_limit > 0:
            raise ValueError(f"time_limit: expected seconds above 0, got {self.time_limit!r}")
        if not 0 <= self.mip_gap < 1:
            raise ValueError(f"mip_gap: expected a relative gap in [0, 1), got "
                             f"{self.mip_gap!r} (5e-3 stops within 0.5% of the optimum)")
        if self.threads < 1:
            raise ValueError(f"threads: expected at least 1, got {self.threads!r}")


DEFAULTS = SolverOptions()
"""The defaults of every entry point (frozen: one instance serves them all)."""
