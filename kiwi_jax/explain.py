"""Plans for people: per layer, what is kept or recomputed and how each operator is sharded, and
a picture of the per-device memory timeline."""

from __future__ import annotations

import collections

import numpy as np

from hlo_tools.graph import Phase
from kiwi_jax.plan import Plan
from kiwi_jax.problem import ProblemBuild
from kiwi_jax.sharding import spec_str
from solvers.simulator import simulate

__all__ = ["explain", "plot_memory_timeline"]

_NOTABLE = {"dot", "convolution"}


def _mib(nbytes) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def explain(build: ProblemBuild, plan: Plan, verbose: bool = False) -> str:
    """The plan as text.

    Per layer (``layer_<i>`` name scopes; ``-`` for everything outside layers): operator counts,
    predicted seconds of its forward, backward and optimizer operators (compute + own
    collectives, recomputation counted again), kept and recomputed forward bytes, then one line
    per operator: matmuls, inputs and every recomputed operator (all operators with
    ``verbose``), with its sharding spec (``S0``: split over mesh axis 0, ``R``: replicated),
    predicted seconds and per-device output bytes.
    """
    graph, problem = build.graph, build.problem
    strategy, recomputed = plan.strategy, set(plan.recomputed)
    compute, comm, _reshard = problem.costs_of(strategy)
    seconds = compute + comm
    memory = problem.memory_of(strategy)
    layers = collections.defaultdict(list)
    for node in graph.nodes:
        layers[node.layer].append(node)
    lines = [f"plan: {plan.solver} ({plan.status}) on a {plan.mesh_shape[0]}x{plan.mesh_shape[1]}"
             f" mesh, cluster {plan.cluster}, budget {_mib(plan.budget_bytes)} per device",
             f"predicted step {plan.predicted_step_seconds * 1e3:.3f} ms (ideal compute "
             f"{plan.ideal_compute_seconds * 1e3:.3f} ms), peak {_mib(plan.predicted_peak_bytes)}"
             f", {len(recomputed)} forward values recomputed"]
    if plan.fit is not None:
        lines.append(f"solver budget searched against the compiled step: {plan.fit.describe()}")
    for layer in sorted(layers, key=lambda v: (v < 0, v)):
        nodes = layers[layer]
        by_phase = collections.defaultdict(float)
        for node in nodes:
            by_phase[node.phase] += seconds[node.id] * (2 if node.id in recomputed else 1)
        forward = [n for n in nodes if n.phase == Phase.FORWARD and problem.z[n.id]]
        kept = sum(int(memory[n.id]) for n in forward if n.id not in recomputed)
        dropped = sum(int(memory[n.id]) for n in forward if n.id in recomputed)
        name = f"layer {layer}" if layer >= 0 else "outside layers"
        lines.append(
            f"\n== {name}: {len(nodes)} operators; forward {by_phase[Phase.FORWARD] * 1e3:.3f} ms"
            f", backward {by_phase[Phase.BACKWARD] * 1e3:.3f} ms, optimizer "
            f"{by_phase[Phase.OPTIMIZER] * 1e3:.3f} ms; activations kept {_mib(kept)}, "
            f"recomputed {_mib(dropped)} ({sum(n.id in recomputed for n in forward)} values)")
        for node in nodes:
            if not (verbose or node.opcode in _NOTABLE or node.id in recomputed):
                continue
            state = "recompute" if node.id in recomputed else (
                "keep" if node.phase == Phase.FORWARD and problem.z[node.id] else "")
            lines.append(f"  {node.phase.name.lower()[:5]:5s} {node.opcode:14s} "
                         f"{str(node.shape.dims):22s} {spec_str(plan.specs[node.id]):10s} "
                         f"{seconds[node.id] * 1e6:9.2f} us {memory[node.id]:>12,} B {state}")
    return "\n".join(lines)


def plot_memory_timeline(build: ProblemBuild, plan: Plan, path,
                         compiled_peak_bytes: int | None = None) -> None:
    """PNG of the per-device bytes alive at every operator: the plan, the same shardings with
    every forward value kept, the budget and (when given) the compiled step's peak; a strip at
    the bottom marks each operator's phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problem = build.problem
    planned = simulate(problem, plan.strategy, recompute_at=plan.recompute_at)
    kept = simulate(problem, plan.strategy)
    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(problem.num_nodes)
    ax.plot(x, kept.memory_timeline / 2**20, color="0.6", lw=1, label="same shardings, keep all")
    ax.plot(x, planned.memory_timeline / 2**20, color="C0", lw=1.5,
            label=f"plan ({len(plan.recomputed)} values recomputed)")
    ax.axhline(plan.budget_bytes / 2**20, color="C3", ls="--", lw=1, label="budget")
    if compiled_peak_bytes is not None:
        ax.axhline(compiled_peak_bytes / 2**20, color="k", ls=":", lw=1,
                   label="compiled peak (XLA buffer assignment)")
    phases = np.asarray(problem.phase)
    colors = {Phase.FORWARD: "C2", Phase.BACKWARD: "C1", Phase.OPTIMIZER: "C4"}
    for phase, color in colors.items():
        ax.fill_between(x, 0, 0.03, where=phases == int(phase), color=color, step="mid",
                        transform=ax.get_xaxis_transform(), label=phase.name.lower())
    top = max(plan.budget_bytes, compiled_peak_bytes or 0, kept.peak_bytes)
    ax.set_ylim(0, top / 2**20 * 1.08)
    ax.set_xlabel("operator (execution order)")
    ax.set_ylabel("MiB alive per device")
    ax.set_title(f"{plan.solver} plan on a {plan.mesh_shape[0]}x{plan.mesh_shape[1]} mesh: "
                 f"peak {plan.predicted_peak_bytes / 2**20:.2f} MiB")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
