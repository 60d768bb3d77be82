"""Plans: a solved sharding + rematerialisation problem, tied to the step it was made for.

References:
  KIWI (Liu et al.), sec. 3.2: a plan is a strategy per operator and a keep flag per forward
  operator; its predicted cost is eq. 2 and its memory the recurrence eq. 3-8.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import time

import numpy as np

from hlo_tools.graph import Phase
from kiwi_jax.apply import TracedStep
from kiwi_jax.cluster import Cluster, MeshSpec, parse_bytes
from kiwi_jax.problem import ProblemBuild, build_problem
from kiwi_jax.sharding import Comm, reshard_comms, spec_str
import solvers
from solvers.simulator import reduced_schedule, simulate

__all__ = ["Plan", "make_plan", "solve_plan", "plan_from_solution", "resolve_budget",
           "predicted_comms", "attributed_comms", "by_kind"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A solved plan for one train step on one mesh."""

    solver: str
    """Formulation that produced it (``kiwi``, ``alpa``, ...)."""
    status: str
    """Solver outcome (``optimal``, ``feasible`` ...)."""
    mesh_shape: tuple[int, int]
    """Mesh the plan is for."""
    cluster: str
    """Cluster preset the costs are for."""
    budget_bytes: int
    """Per-device memory budget the plan was solved under."""
    strategy: np.ndarray
    """Chosen strategy index of every graph node."""
    keep: np.ndarray
    """Keep flag of every node (False: a forward value dropped after the forward pass and
    recomputed before its first backward reader)."""
    recomputed: tuple[int, ...]
    """Ids of the recomputed nodes."""
    specs: tuple
    """Output spec of every node under the plan."""
    node_names: tuple[str, ...]
    """Stable ids of the nodes."""
    predicted_step_seconds: float
    """Simulated step time (compute + communication + resharding + recomputation)."""
    predicted_peak_bytes: int
    """Simulated per-device peak memory."""
    solve_seconds: float
    """Solver wall time."""
    objective: float
    """Solver objective."""
    ideal_compute_seconds: float
    """Total FLOPs / (devices x peak FLOP/s)."""
    solver_budget_bytes: int | None = None
    """Budget the solver was given when it differs from ``budget_bytes``: tightened after the
    compiled step of a first plan came out over the budget (see ``kiwi_jax.optimize``)."""
    hidden_under: dict[int, int] | None = None
    """Lynx plans: per recomputed node hidden under a collective, the node issuing it (the
    recomputation is placed beside that node when the step is applied with overlap)."""
    recompute_at: dict[int, tuple[int, ...]] | None = None
    """Per recomputed node, the stages (node ids) where the simulator recomputes it; None:
    KIWI's reduced schedule of ``keep`` (before its first backward reader)."""

    def schedule(self, problem) -> dict[int, tuple[int, ...]]:
        """The recomputation schedule the plan was simulated with."""
        if self.recompute_at is not None:
            return self.recompute_at
        return reduced_schedule(problem, self.keep)

    def summary(self) -> dict:
        return {
            "solver": self.solver, "status": self.status, "mesh": "x".join(map(str, self.mesh_shape)),
            "cluster": self.cluster, "budget_bytes": int(self.budget_bytes),
            "predicted_step_seconds": self.predicted_step_seconds,
            "predicted_peak_bytes": int(self.predicted_peak_bytes),
            "recomputed_nodes": len(self.recomputed), "solve_seconds": self.solve_seconds,
            "ideal_compute_seconds": self.ideal_compute_seconds,
            "solver_budget_bytes": self.solver_budget_bytes,
        }

    def to_json(self) -> str:
        data = self.summary()
        data.update(objective=self.objective, strategy=self.strategy.tolist(),
                    keep=self.keep.tolist(),
                    node_names=list(self.node_names),
                    hidden_under=None if self.hidden_under is None
                    else {str(k): v for k, v in self.hidden_under.items()},
                    recompute_at=None if self.recompute_at is None
                    else {str(k): list(v) for k, v in self.recompute_at.items()},
                    specs=[[list(axes) for axes in spec] for spec in self.specs])
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, ideal: float = 0.0) -> "Plan":
        data = json.loads(text)
        keep = np.array(data["keep"], bool)
        return cls(
            solver=data["solver"], status=data["status"],
            mesh_shape=tuple(int(v) for v in data["mesh"].split("x")), cluster=data["cluster"],
            budget_bytes=data["budget_bytes"], strategy=np.array(data["strategy"]), keep=keep,
            recomputed=tuple(int(i) for i in np.flatnonzero(~keep)),
            specs=tuple(tuple(tuple(a) for a in spec) for spec in data["specs"]),
            node_names=tuple(data["node_names"]),
            hidden_under=None if data.get("hidden_under") is None
            else {int(k): int(v) for k, v in data["hidden_under"].items()},
            recompute_at=None if data.get("recompute_at") is None
            else {int(k): tuple(int(t) for t in v) for k, v in data["recompute_at"].items()},
            predicted_step_seconds=data["predicted_step_seconds"],
            predicted_peak_bytes=data["predicted_peak_bytes"],
            solve_seconds=data["solve_seconds"], objective=data.get("objective", 0.0),
            ideal_compute_seconds=data.get("ideal_compute_seconds", ideal),
            solver_budget_bytes=data.get("solver_budget_bytes"))


def resolve_budget(budget, problem, **options) -> int:
    """Bytes from ``6GiB``, an int, or ``"80%"``: a percentage of the per-device peak of the
    reference plan (the fastest ``alpa`` plan with no memory limit, lowest peak among equals;
    see :func:`solvers.reference_plan`)."""
    if isinstance(budget, str) and budget.strip().endswith("%"):
        fraction = float(budget.strip()[:-1]) / 100.0
        if not fraction > 0:
            raise ValueError(f"expected a positive percentage such as 80%, got {budget!r}")
        reference = solvers.reference_plan(
            problem, **{k: v for k, v in options.items()
                        if k in ("backend", "time_limit", "seed", "threads")})
        return int(fraction * reference.peak_bytes)
    return parse_bytes(budget)


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


def make_plan(traced: TracedStep, mesh, cluster, memory_budget, solver: str = "kiwi",
              merge: bool = True, **options) -> tuple[Plan, ProblemBuild]:
    """Build the problem of a traced step, solve it and simulate the result.

    Raises:
      solvers.InfeasibleBudgetError: no plan fits; the message names the smallest budget that does.
    """
    build = build_problem(traced.graph, MeshSpec.parse(mesh), Cluster.parse(cluster), merge=merge)
    return solve_plan(build, memory_budget, solver, **options), build


def solve_plan(build: ProblemBuild, memory_budget, solver: str = "kiwi", **options) -> Plan:
    """Solve a built problem under a budget (bytes, ``"6GiB"`` or ``"80%"``) and simulate the
    result. ``options`` go to :func:`solvers.solve`."""
    problem = build.problem
    budget = resolve_budget(memory_budget, problem, **options)
    start = time.perf_counter()
    solution = solvers.solve(problem, budget, solver=solver, **options)
    log.info("%s: %s in %.2f s", solver, solution.status, time.perf_counter() - start)
    return plan_from_solution(build, solution, budget)


def plan_from_solution(build: ProblemBuild, solution: solvers.Solution, budget: int) -> Plan:
    """The plan of a solver's answer, simulated on the problem (Lynx plans with the overlap
    credit)."""
    problem = build.problem
    sim = simulate(problem, solution.strategy, recompute_at=solution.recompute_at,
                   overlap=solution.hidden_under is not None)
    return Plan(
        solver=solution.solver, status=str(solution.status.name.lower()),
        mesh_shape=build.mesh.shape,
        cluster=build.cluster.name, budget_bytes=budget, strategy=np.asarray(solution.strategy),
        keep=np.asarray(solution.keep),
        recomputed=tuple(int(i) for i in solution.recomputed),
        specs=tuple(build.strategies[i][int(s)].out for i, s in enumerate(solution.strategy)),
        node_names=problem.names, predicted_step_seconds=float(sim.step_seconds),
        predicted_peak_bytes=int(sim.peak_bytes), solve_seconds=float(solution.solve_seconds),
        objective=float(solution.objective), ideal_compute_seconds=problem.ideal_compute_seconds(),
        hidden_under=solution.hidden_under,
        recompute_at={int(i): tuple(int(t) for t in ts)
                      for i, ts in solution.recompute_at.items()})


def describe_node(build: ProblemBuild, plan: Plan, node_id: int) -> str:
    """One line: node, opcode, shape, spec, kept or recomputed."""
    node = build.graph.nodes[node_id]
    state = "recompute" if node_id in set(plan.recomputed) else "keep"
    return (f"{node.name:40s} {node.opcode:12s} {str(node.shape):22s} "
            f"{spec_str(plan.specs[node_id]):10s} {state}")
