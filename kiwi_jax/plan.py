"""Plans: a solved sharding + rematerialisation problem, tied to the step it was made for.

References:
  KIWI (Liu et al.), sec. 3.2: a plan is a strategy per operator and a keep flag per forward
  operator; its predicted cost is eq. 2 and its memory the recurrence eq. 3-8.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import time

import numpy as np

from hlo_tools.graph import Phase
from kiwi_jax.cluster import parse_bytes
from kiwi_jax.fit import FitRecord
from kiwi_jax.problem import ProblemBuild
from kiwi_jax.sharding import Comm, reshard_comms
import solvers
from solvers.simulator import SimResult, reduced_schedule, simulate

__all__ = ["Plan", "solve_plan", "plan_from_solution", "resolve_budget", "budget_fraction",
           "reference_solution", "predicted_comms", "attributed_comms", "by_kind"]

log = logging.getLogger(__name__)


FORMAT = 3
"""Version of :meth:`Plan.to_json`'s layout; a plan written in another is not read back."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """A solved plan for one train step on one mesh: the solver's answer, the simulator's replay
    of it and the sharding it implies. The decisions live in ``solution`` only; the properties
    below read them from there.

    Figures are named by who states them: ``predicted_*`` is the simulator's replay of the plan
    (what verify compares with the compiled step); ``objective_step_seconds`` and
    ``claimed_peak_bytes`` are what the solver's program claims for it.
    """

    solution: solvers.Solution
    """The solver's answer: status, objective, gap, sizes, and the decisions (strategy per node,
    keep flags, recomputation schedule, Lynx's hidden recomputations)."""
    simulation: SimResult
    """The simulator's replay of the plan (step time, per-device memory timeline)."""
    specs: tuple
    """Output spec of every node under the plan."""
    node_names: tuple[str, ...]
    """Stable ids of the nodes."""
    mesh_shape: tuple[int, int]
    """Mesh the plan is for."""
    cluster: str
    """Cluster preset the costs are for."""
    budget_bytes: int
    """Per-device memory budget the plan was made for."""
    ideal_compute_seconds: float
    """Total FLOPs / (devices x peak FLOP/s)."""
    solver_budget_bytes: int | None = None
    """Budget the solver was given when it differs from ``budget_bytes``: the one the search
    against the compiled step settled on (see ``fit``)."""
    memory_model: str = "operator"
    """The memory model of the problem it was solved on (``operator`` or ``fused``): with
    ``fused``, the values that model fuses are recomputed with the values they read, so a plan
    from the cache or from process 0 is applied on a problem of the same model."""
    fit: FitRecord | None = None
    """How ``kiwi_jax.optimize`` searched the solver's budget against the compiled step:
    every plan compiled, the compiles spent, the final compiled/budget ratio (None: the plan
    was not compiled by the decorator)."""

    # ------------------------------------------------------------ the solver's decisions
    @property
    def solver(self) -> str:
        """Formulation that produced it (``kiwi``, ``alpa``, ...)."""
        return self.solution.solver

    @property
    def status(self) -> str:
        """Solver outcome (``optimal``, ``feasible`` ...)."""
        return self.solution.status.value

    @property
    def strategy(self) -> np.ndarray:
        """Chosen strategy index of every graph node."""
        return self.solution.strategy

    @property
    def keep(self) -> np.ndarray:
        """Keep flag of every node (False: a forward value dropped after the forward pass and
        recomputed in the backward pass)."""
        return self.solution.keep

    @property
    def recomputed(self) -> tuple[int, ...]:
        """Ids of the recomputed nodes."""
        return tuple(int(i) for i in self.solution.recomputed)

    @property
    def recompute_at(self) -> dict[int, tuple[int, ...]]:
        """Per recomputed node, the stages (node ids) where it is recomputed."""
        return self.solution.recompute_at or {}

    @property
    def hidden_under(self) -> dict[int, int] | None:
        """Lynx plans: per recomputed node hidden under a collective, the node issuing it (the
        recomputation is placed beside that node when the step is applied with overlap)."""
        return self.solution.hidden_under

    @property
    def solve_seconds(self) -> float:
        """Solver wall time."""
        return self.solution.solve_seconds

    # ------------------------------------------------------------ the simulator's figures
    @property
    def predicted_step_seconds(self) -> float:
        """Simulated step time (compute + communication + resharding + recomputation)."""
        return self.simulation.step_seconds

    @property
    def predicted_peak_bytes(self) -> int:
        """Simulated per-device peak memory."""
        return int(self.simulation.peak_bytes)

    @property
    def fingerprint(self) -> str:
        """A short hash of the decisions (strategy, keep flags, schedule, specs, node ids): two
        plans with the same fingerprint run the same program."""
        data = json.dumps([list(self.node_names), self.strategy.tolist(), self.keep.tolist(),
                           sorted((k, list(v)) for k, v in self.recompute_at.items()),
                           sorted((self.hidden_under or {}).items()),
                           [[list(axes) for axes in spec] for spec in self.specs]])
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    def summary(self) -> dict:
        """The plan's figures (no per-node arrays), as printed by the CLI."""
        solution, sim = self.solution, self.simulation
        out = {
            "solver": self.solver, "backend": solution.backend, "status": self.status,
            "mesh": "x".join(map(str, self.mesh_shape)), "cluster": self.cluster,
            "budget_bytes": int(self.budget_bytes),
            "solver_budget_bytes": self.solver_budget_bytes,
            "predicted_step_seconds": float(sim.step_seconds),
            "predicted_peak_bytes": int(sim.peak_bytes),
            "recompute_seconds": float(sim.recompute_seconds),
            "objective_step_seconds": float(solution.objective),
            "claimed_peak_bytes": solution.claimed_peak_bytes, "gap": float(solution.gap),
            "recomputed_nodes": len(self.recomputed), "solve_seconds": self.solve_seconds,
            "model_build_seconds": solution.build_seconds, "num_vars": solution.num_vars,
            "num_constraints": solution.num_constraints,
            "ideal_compute_seconds": self.ideal_compute_seconds,
            "fingerprint": self.fingerprint,
            "fit": None if self.fit is None else self.fit.to_dict(),
        }
        if self.hidden_under is not None:
            out.update(overlapped_recompute_seconds=float(sim.overlapped_recompute_seconds),
                       on_demand_recompute_seconds=float(sim.recompute_seconds),
                       hidden_recomputations=len(self.hidden_under))
        return out

    def to_json(self) -> str:
        solution, sim = self.solution, self.simulation
        data = {
            "format": FORMAT, "specs": [[list(axes) for axes in spec] for spec in self.specs],
            "node_names": list(self.node_names), "mesh": list(self.mesh_shape),
            "cluster": self.cluster, "budget_bytes": int(self.budget_bytes),
            "ideal_compute_seconds": self.ideal_compute_seconds,
            "solver_budget_bytes": self.solver_budget_bytes,
            "memory_model": self.memory_model,
            "fit": None if self.fit is None else self.fit.to_dict(),
            "solution": {
                **{f.name: getattr(solution, f.name) for f in dataclasses.fields(solution)
                   if f.name not in ("status", "strategy", "keep", "recompute_at",
                                     "hidden_under")},
                "status": solution.status.value, "strategy": solution.strategy.tolist(),
                "keep": solution.keep.tolist(),
                "recompute_at": {str(k): list(v) for k, v in self.recompute_at.items()},
                "hidden_under": None if solution.hidden_under is None
                else {str(k): v for k, v in solution.hidden_under.items()}},
            "simulation": {**{f.name: getattr(sim, f.name) for f in dataclasses.fields(sim)
                              if f.name != "memory_timeline"},
                           "memory_timeline": sim.memory_timeline.tolist()},
        }
        return json.dumps(data, default=_plain)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan :meth:`to_json` wrote.

        Raises:
          ValueError: the text is of another format version (written by another kiwi-jax).
        """
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"plan format {data.get('format', 1)}, this kiwi-jax reads "
                             f"format {FORMAT}")
        raw = dict(data["solution"])
        hidden = raw.pop("hidden_under")
        solution = solvers.Solution(
            **raw | {"status": solvers.Status(raw["status"]),
                     "strategy": np.array(raw["strategy"], np.int64),
                     "keep": np.array(raw["keep"], bool),
                     "recompute_at": {int(k): tuple(int(t) for t in v)
                                      for k, v in raw["recompute_at"].items()}},
            hidden_under=None if hidden is None else {int(k): int(v) for k, v in hidden.items()})
        sim = dict(data["simulation"])
        sim["memory_timeline"] = np.array(sim["memory_timeline"], np.int64)
        return cls(
            solution=solution, simulation=SimResult(**sim),
            specs=tuple(tuple(tuple(a) for a in spec) for spec in data["specs"]),
            node_names=tuple(data["node_names"]), mesh_shape=tuple(data["mesh"]),
            cluster=data["cluster"], budget_bytes=data["budget_bytes"],
            ideal_compute_seconds=data["ideal_compute_seconds"],
            solver_budget_bytes=data["solver_budget_bytes"],
            memory_model=data["memory_model"],
            fit=None if data.get("fit") is None else FitRecord.from_dict(data["fit"]))


def _plain(value):
    """numpy scalars as Python numbers, for ``json.dumps``."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to a plan file")


def budget_fraction(budget) -> float | None:
    """The fraction a percentage budget names (``"80%"``: 0.8); None for bytes."""
    if not (isinstance(budget, str) and budget.strip().endswith("%")):
        return None
    fraction = float(budget.strip()[:-1]) / 100.0
    if not fraction > 0:
        raise ValueError(f"expected a positive percentage such as 80%, got {budget!r}")
    return fraction


def reference_solution(problem, **options) -> solvers.Solution:
    """The reference plan (the fastest ``alpa`` plan with no memory limit, lowest peak among
    equals; see :func:`solvers.reference_plan`), solved with the options that apply to it."""
    return solvers.reference_plan(problem, **{
        k: v for k, v in options.items()
        if k in ("backend", "time_limit", "seed", "threads", "reuse_layers")})


def resolve_budget(budget, problem, **options) -> int:
    """Bytes from ``6GiB``, an int, or ``"80%"``: a percentage of the reference plan's
    per-device peak as the model predicts it (:func:`reference_solution`). The decorator, which
    compiles, takes percentages of the reference plan's compiled memory instead
    (:class:`kiwi_jax.optimize.Options`)."""
    fraction = budget_fraction(budget)
    if fraction is None:
        return parse_bytes(budget)
    return int(fraction * reference_solution(problem, **options).peak_bytes)


def attributed_comms(build: ProblemBuild, strategy, keep=None) -> list[tuple[int, Comm]]:
    """Every collective the plan implies, with the node it runs at: the operators' own, and the
    resharding of each edge at its reader.

    A value that several readers need in the same spec is resharded once (XLA's CSE merges
    the identical collectives of one value: measured on the demo GPT, where counting one per
    reader over-predicted all-gather bytes 1.8x). With ``keep``, a dropped value's
    recomputation repeats its own collectives and its operands' resharding (behind the
    optimization barrier that keeps the recomputation, nothing merges with the forward pass),
    and the backward readers of a dropped value reshard the recomputed copy.
    """
    graph, strategies = build.graph, build.strategies
    rerun = set() if keep is None else {int(i) for i in np.flatnonzero(~np.asarray(keep, bool))}
    comms = []
    for node in graph.nodes:
        own = [(node.id, c) for c in strategies[node.id][strategy[node.id]].comms]
        comms += own * (2 if node.id in rerun else 1)
    seen = set()
    for src, dst, slot in graph.edges:
        target = strategies[dst][strategy[dst]].operands[slot]
        copy = src in rerun and graph.nodes[dst].phase == Phase.BACKWARD
        instances = [(src, target, copy)] + ([(src, target, ("rerun", dst))]
                                             if dst in rerun else [])
        for key in instances:
            if key not in seen:
                seen.add(key)
                comms += [(dst, c) for c in reshard_comms(
                    graph.nodes[src].nbytes, strategies[src][strategy[src]].out, target,
                    build.mesh)]
    return comms


def predicted_comms(build: ProblemBuild, strategy, keep=None) -> list[Comm]:
    """Every collective the plan implies (see :func:`attributed_comms`)."""
    return [c for _, c in attributed_comms(build, strategy, keep)]


def by_kind(comms) -> dict:
    """``{kind: {"count", "bytes"}}`` of the kinds present in ``comms``."""
    table = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in comms:
        table[c.kind]["count"] += 1
        table[c.kind]["bytes"] += int(c.bytes)
    return dict(table)


def solve_plan(build: ProblemBuild, memory_budget, solver: str = "kiwi", **options) -> Plan:
    """Solve a built problem under a budget (bytes, ``"6GiB"`` or ``"80%"``) and simulate the
    result. ``options`` go to :func:`solvers.solve`."""
    problem = build.problem
    budget = resolve_budget(memory_budget, problem, **options)
    start = time.perf_counter()
    solution = solvers.solve(problem, budget, solver=solver, **options)
    log.info("%s: %s in %.2f s", solver, solution.status, time.perf_counter() - start)
    return plan_from_solution(build, solution, budget)


def plan_from_solution(build: ProblemBuild, solution: solvers.Solution, budget: int,
                       solver_budget: int | None = None) -> Plan:
    """The plan of a solver's answer, simulated on the problem (Lynx plans with the overlap
    credit); ``solver_budget``: the budget the solver was given, when not ``budget``."""
    problem = build.problem
    if solution.recompute_at is None:
        solution = dataclasses.replace(solution,
                                       recompute_at=reduced_schedule(problem, solution.keep))
    sim = simulate(problem, solution.strategy, recompute_at=solution.recompute_at,
                   overlap=solution.hidden_under is not None)
    return Plan(
        solution=solution, simulation=sim,
        specs=tuple(build.strategies[i][int(s)].out for i, s in enumerate(solution.strategy)),
        node_names=problem.names, mesh_shape=build.mesh.shape, cluster=build.cluster.name,
        budget_bytes=int(budget), ideal_compute_seconds=problem.ideal_compute_seconds(),
        solver_budget_bytes=None if solver_budget is None or solver_budget == budget
        else int(solver_budget), memory_model=build.memory_model)
