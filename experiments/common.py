"""Shared pieces of the experiment scripts: the papers' reference numbers, result files, the
budget sweep of KIWI's Fig. 2 and 3, and plotting."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import numpy as np

import solvers

__all__ = ["KIWI_TABLE2", "SWEEP_METHODS", "TIED_MODELS", "results_path", "write_result",
           "budget_sweep", "sweep_fractions", "problem_of", "pyplot", "save_figure", "byte_unit",
           "overhead_axes", "PlanCompiler"]


KIWI_TABLE2 = {1: 308, 4: 1192, 8: 2254, 12: 3366, 16: 4478, 20: 5590}
"""KIWI Table 2: HLO operators per encoder depth."""

SWEEP_METHODS = ("alpa", "alpa+dots", "alpa+megatron", "kiwi")
"""The methods of KIWI's Fig. 2 and 3."""

TIED_MODELS = ("gpt", "bert")
"""Models whose sweeps solve with layer reuse: their full 4-layer programs do not finish in
a sweep's time per solve on 2 cores (docs/solvers.md); small MLPs solve untied."""

STUDY_GAP = 1e-4
"""Relative optimality gap of the studies' solves: the figures in docs/ were measured with it
(``solvers.solve``'s default then); the library's default is 5e-3 (``solvers.options``)."""


def results_path(name: str) -> pathlib.Path:
    """``results/<name>`` (the folder is ``$KIWI_RESULTS_DIR`` when set), folder created."""
    folder = pathlib.Path(os.environ.get("KIWI_RESULTS_DIR", "results"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def write_result(study: str, result: dict, print_json: bool = False) -> pathlib.Path:
    """Write ``results/<study>.json``; with ``print_json``, also print the result as the last
    line of stdout (the ``--json`` convention of every study)."""
    path = results_path(f"{study}.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    if print_json:
        print(json.dumps(result))
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, title: str, path) -> None:
    """Title, lay out, write the PNG and free the figure."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def problem_of(model: str, layers: int, mesh: str, cluster: str = "v100-nvlink",
               merge: bool = True, **config):
    """``(build, seconds)``: the sharding problem of a reference model's train step, traced
    with abstract arguments (nothing is allocated); ``merge``: follower merging."""
    from kiwi_jax.frontend import problem_for_step
    from kiwi_jax.models import build

    ref = build(model, layers=layers, **config)
    built, timings = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                      mesh=mesh, cluster=cluster, merge=merge)
    return built, sum(timings.values())


def timed_solve(problem, budget: int, time_limit: float, reuse_layers: bool = True) -> dict:
    """One ``solvers.solve`` of ``problem`` under ``budget`` with the library's other defaults,
    timed: status, gap, program size, the plan's simulated step and peak, and the seconds; an
    error's name as the status where there is no plan."""
    start = time.perf_counter()
    try:
        sol = solvers.solve(problem, budget, time_limit=time_limit, reuse_layers=reuse_layers,
                            search_min_feasible=False)
    except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError) as error:
        return {"status": type(error).__name__, "solve_seconds":
                round(time.perf_counter() - start, 2)}
    sim = solvers.simulate(problem, sol.strategy, recompute_at=sol.recompute_at)
    return {"status": sol.status.value, "gap": sol.gap, "num_vars": sol.num_vars,
            "num_constraints": sol.num_constraints, "step_seconds": sim.step_seconds,
            "peak_bytes": sim.peak_bytes, "solve_seconds": round(time.perf_counter() - start, 2)}


def sweep_fractions(lowest: float, step: float = 0.05) -> list[float]:
    """Budget fractions from 100% down in ``step``s, ending with the first one under
    ``lowest`` (the point where every method has failed)."""
    fractions = [1.0]
    while fractions[-1] >= lowest:
        fractions.append(round(fractions[-1] - step, 4))
        if fractions[-1] <= 0:
            fractions.pop()
            break
    return fractions


def _plan_row(problem, sol, reference) -> dict:
    sim = solvers.simulate(problem, sol.strategy, recompute_at=sol.recompute_at)
    recomputed = sol.recomputed
    recomputed_bytes = int(problem.memory_of(sol.strategy)[recomputed].sum())
    return {"feasible": True, "status": sol.status.value, "gap": sol.gap,
            "solve_seconds": round(sol.solve_seconds, 3), "step_seconds": sim.step_seconds,
            "normalised_overhead": sim.step_seconds / reference.objective,
            "peak_bytes": int(sim.peak_bytes), "recomputed_nodes": int(len(recomputed)),
            "recomputed_bytes": recomputed_bytes, "recompute_seconds": sim.recompute_seconds,
            "comm_seconds": sim.comm_seconds + sim.reshard_seconds}


def _progress(row: dict) -> None:
    """One line per sweep point on stderr (sweeps of the big models take many minutes)."""
    outcome = (f"{row['normalised_overhead']:.4f} in {row['solve_seconds']:.1f} s"
               if row["feasible"] else row["status"])
    print(f"  {row['budget_fraction']:7.2%} {row['method']:14s} {outcome}", file=sys.stderr,
          flush=True)


def budget_sweep(problem, reference, methods=SWEEP_METHODS, step: float = 0.05,
                 time_limit: float = 60.0, reuse_layers: bool = True, on_plan=None) -> list[dict]:
    """Every method at budgets from the reference peak down past the point where all fail.

    Each method's lowest-peak plan comes first (the same program with the peak minimised): a
    budget under its proven lower bound is recorded infeasible without a solve, its peak is one
    of the sweep's points (so each method's curve ends where the method stops fitting), and it
    warm-starts the method's solves. Budgets are solved from the smallest up, and each solve
    also starts from the method's plan at the budget below (it fits), so more memory never
    gives a slower plan, time limits or not. ``kiwi`` (last) also starts from the fastest plan
    any method found at the same budget: every baseline's plan is a plan of its program, so
    ``kiwi`` never ends slower than a baseline.
    ``on_plan(method, budget, solution)`` is called for every plan found (e.g. to compile it)
    and returns fields for its row.

    Returns:
      One row per (budget, method): budget_bytes, budget_fraction, method, feasible,
      normalised_overhead (simulated step / the reference's), ...
    """
    lowest = {}
    for method in methods:
        lowest[method] = solvers.min_peak_plan(problem, method, time_limit=time_limit,
                                               reuse_layers=reuse_layers)
        low = lowest[method][1]
        print(f"  {method}: " + (f"no plan under {low} B" if low is not None else
                                 "no bound on its smallest peak found in time"),
              file=sys.stderr, flush=True)
    known = [low / reference.peak_bytes for _, low in lowest.values() if low is not None]
    budgets = {int(f * reference.peak_bytes): f
               for f in sweep_fractions(min(known) if known else 1.0, step)}
    for plan, _ in lowest.values():
        if plan is not None:
            budgets.setdefault(int(plan.budget_bytes), plan.budget_bytes / reference.peak_bytes)
    rows, previous = [], {}
    for budget in sorted(budgets):
        found = {}
        for method in methods:
            plan, low = lowest[method]
            row = {"method": method, "budget_bytes": budget,
                   "budget_fraction": round(budget / reference.peak_bytes, 4),
                   "min_feasible_bytes": plan and int(plan.budget_bytes)}
            if plan is None or (low is not None and budget < low):   # none found, or proven
                row.update(feasible=False, solve_seconds=0.0,
                           status="infeasible" if plan is not None else "timeout_no_incumbent")
                _progress(row)
                rows.append(row)
                continue
            starts = [plan] if plan.budget_bytes <= budget else []
            starts += [previous[method]] if method in previous else []
            if method == "kiwi":
                starts += found.values()
            warm = min(starts, key=lambda p: p.objective) if starts else "auto"
            try:
                sol = solvers.solve(problem, budget, solver=method, time_limit=time_limit,
                                    mip_gap=STUDY_GAP, reuse_layers=reuse_layers,
                                    search_min_feasible=False, warm_start=warm)
            except (solvers.InfeasibleBudgetError, solvers.SolverTimeoutError) as err:
                row.update(feasible=False, status=type(err).__name__)
            else:
                found[method] = previous[method] = sol
                row.update(_plan_row(problem, sol, reference))
                if on_plan is not None:
                    row.update(on_plan(method, budget, sol))
            _progress(row)
            rows.append(row)
    return sorted(rows, key=lambda r: -r["budget_bytes"])


def byte_unit(peak: float) -> tuple[float, str]:
    """``(scale, name)`` to plot per-device bytes of this size in: GB, or MiB for small models."""
    return (1e9, "GB") if peak >= 1e8 else (2**20, "MiB")


def overhead_axes(ax, rows, title: str, reference_peak: float) -> None:
    """One panel of KIWI's Fig. 2: normalised overhead against the per-device budget (GB), one
    line per method, ending where the method stops fitting."""
    styles = {"alpa": ("C0", "o"), "alpa+dots": ("C1", "s"), "alpa+megatron": ("C2", "^"),
              "alpa+full": ("C4", "v"), "kiwi": ("C3", "D")}
    scale, unit = byte_unit(reference_peak)
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = sorted((r["budget_bytes"] / scale, r["normalised_overhead"]) for r in rows
                     if r["method"] == method and r["feasible"])
        if pts:
            color, marker = styles.get(method, ("k", "."))
            ax.plot(*np.array(pts).T, color=color, marker=marker, ms=3, lw=1.2, label=method)
    ax.axvline(reference_peak / scale, color="0.7", lw=0.8, ls=":")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(f"per-device budget ({unit})", fontsize=8)
    ax.set_ylabel("overhead / alpa no limit", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.invert_xaxis()


class PlanCompiler:
    """Applies plans of one reference step on one mesh of the simulated devices and compiles
    them: the compiled per-device memory next to the predicted one.

    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before jax is imported.
    """

    def __init__(self, model: str, layers: int, mesh: str, cluster: str = "v100-nvlink",
                 **config):
        from kiwi_jax.models import build

        ref = build(model, layers=layers, **config)
        self._setup(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()), mesh, cluster)

    @classmethod
    def for_step(cls, train_step, args, mesh: str, cluster: str = "v100-nvlink",
                 memory_model: str = "auto", order: str = "auto"):
        """The compiler of any train step (a zoo model's, say) at ``args`` (abstract or
        concrete); ``memory_model`` and ``order`` as for :func:`kiwi_jax.optimize`."""
        compiler = cls.__new__(cls)
        compiler._setup(train_step, tuple(args), mesh, cluster, memory_model, order)
        return compiler

    def _setup(self, train_step, args: tuple, mesh: str, cluster: str,
               memory_model: str = "auto", order: str = "auto") -> None:
        import jax

        from kiwi_jax.apply import carried_pairs, in_program_order
        from kiwi_jax.cluster import Cluster, MeshSpec
        from kiwi_jax.frontend import trace
        from kiwi_jax.problem import build_problem

        spec = MeshSpec.parse(mesh)
        self.train_step, self.args, self.memory_model = train_step, args, memory_model
        in_order = in_program_order(spec.num_devices, order)
        self.traced = trace(train_step, *args, traced_order=in_order)
        self.pure = self.traced.pure
        self.build = build_problem(self.traced.graph, spec, Cluster.parse(cluster),
                                   carried=carried_pairs(self.traced), memory_model=memory_model)
        size = spec.shape[0] * spec.shape[1]
        self.mesh = jax.make_mesh(spec.shape, ("data", "model"), devices=jax.devices()[:size],
                                  axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def charge_stored(self, **options) -> None:
        """With the fused memory model, compile the reference plan
        (:func:`solvers.reference_plan` with ``options``) and rebuild the problem with the
        values it stores charged (:func:`kiwi_jax.problem.with_stored`), as the decorator
        does; with ``auto`` on a mesh, choose the memory model against that compile
        (:func:`kiwi_jax.problem.closer_to_compiled`), as the decorator does too. The operator
        model charges every value already and is left as it is."""
        import solvers
        from kiwi_jax.apply import carried_pairs
        from kiwi_jax.compile import compile_plan
        from kiwi_jax.plan import plan_from_solution
        from kiwi_jax.problem import chooses_memory_model, with_compiled_reference

        if (self.build.memory_model != "fused"
                and not chooses_memory_model(self.memory_model, self.mesh.devices.size)):
            return
        reference = solvers.reference_plan(self.build.problem, **options)
        plan = plan_from_solution(self.build, reference, reference.peak_bytes)
        applied = compile_plan(self.traced, self.build, plan, self.mesh, self.pure)
        self.build = with_compiled_reference(self.build, self.memory_model, applied.compiled,
                                             reference, carried_pairs(self.traced))

    def compile(self, plan):
        """``plan`` applied and compiled as the decorator runs it
        (:func:`kiwi_jax.export.compile_applied`; its ``program`` says how)."""
        from kiwi_jax.export import compile_applied

        return compile_applied(self.train_step, self.args, self.traced, self.build, plan,
                               self.mesh, self.pure)

    def compiled_memory(self, solution, budget: int) -> dict:
        """``compiled_peak_bytes`` (argument + output + temp - alias, per device) of the
        solution compiled as the decorator runs it (:meth:`compile`; ``program``: how), and
        whether it fits ``budget``."""
        from kiwi_jax.plan import plan_from_solution

        start = time.perf_counter()
        applied = self.compile(plan_from_solution(self.build, solution, budget))
        peak = applied.memory.peak_bytes
        return {"compiled_peak_bytes": int(peak), "compiled_fits": bool(peak <= budget),
                "program": applied.program,
                "compile_seconds": round(time.perf_counter() - start, 2)}
