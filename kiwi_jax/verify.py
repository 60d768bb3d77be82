"""Prove that the step that runs is the step that was planned.

The compiler is the judge: the applied step is compiled (with the options that keep its
recomputation) and its per-device memory (argument + output + temp - alias, from XLA's buffer
assignment) and the collectives of its partitioned HLO are compared with the plan's prediction.
Every compiled collective carries the ``op_name`` of the jaxpr equation it was partitioned from,
so disagreements are reported per operator. The predicted step time is set beside the compiled
step's estimate (:mod:`kiwi_jax.estimate`: XLA's kernels and collectives priced with the same
cluster figures). Given concrete arguments, the applied step is also run against the plain
jitted step and the losses and parameters compared.

When a recipe won the compiler's choice (:mod:`kiwi_jax.choose`), the step that runs is the
recipe's: it is what is checked (compiled memory against the budget, collectives, estimated
step, numerics against the plain step); a recipe has no prediction, so the predicted figures
are None and nothing is compared with them.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hlo_tools.compiled import (MemoryStats, collectives, device_memory, live_at_peak,
                                placements)
from hlo_tools.graph import Phase
from kiwi_jax.apply import carried_pairs
from kiwi_jax.compile import Prepared, compiler_options
from kiwi_jax.estimate import CompiledCost, compiled_cost, source_operation
from kiwi_jax.interpret import OVERLAP_SCOPE, tag_of
from kiwi_jax.multihost import place, to_host
from kiwi_jax.plan import attributed_comms, by_kind
from kiwi_jax.recipes import data_parallel_step
from kiwi_jax.sharding import reshard_comms
from solvers.simulator import live_bytes, simulate

__all__ = ["overlap_placements", "VerifyReport", "verify_prepared", "verify_recipe",
           "Numerics", "LeafDiff", "compare_numerics", "TOLERANCE", "LOSS_TOLERANCE",
           "LEAF_TOLERANCE", "FLOOR_FACTOR", "compute_rows"]

UNCOMBINED = ("all-reduce-combiner", "cpu-all-reduce-combiner", "all-gather-combiner",
              "reduce-scatter-combiner")
"""XLA passes that merge collectives (the CPU backend has its own all-reduce combiner);
disabled only to attribute collectives to operators."""

TOLERANCE = 0.10
"""Relative tolerance of predicted vs compiled memory and collective bytes."""
ARGUMENTS = "(arguments)"
"""The row memory of the step's inputs (parameters, optimizer state, batch) is attributed to."""
LOSS_TOLERANCE = 1e-6
"""Relative tolerance of the loss and metrics against the plain step."""
LEAF_TOLERANCE = 1e-5
"""Relative (2-norm) tolerance of a state leaf against the plain step, unless its noise floor
is larger (:class:`Numerics`)."""
FLOOR_FACTOR = 10.0
"""A state leaf beyond :data:`LEAF_TOLERANCE` (the loss beyond :data:`LOSS_TOLERANCE`) passes
within this many times its noise floor."""


def _within(diff: float, tolerance: float, floor: float) -> bool:
    """A difference from the plain step passes: within ``tolerance``, or within
    :data:`FLOOR_FACTOR` times its noise ``floor``."""
    return diff <= tolerance or diff <= FLOOR_FACTOR * floor


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """One state leaf's relative difference from the plain step, beside its noise floor."""

    path: str
    """The leaf's path in the train state (``jax.tree_util.keystr``)."""
    diff: float
    """||step that runs - plain step|| / ||plain step|| (2-norms)."""
    floor: float
    """Its noise floor (:class:`Numerics`): the larger of the same between the plain step run
    data-parallel on the mesh and on one device, and between the plain step from its
    arguments moved by a unit in the last place and from them as they are."""

    @property
    def ok(self) -> bool:
        return _within(self.diff, LEAF_TOLERANCE, self.floor)

    def to_dict(self) -> dict:
        return {"path": self.path, "diff": self.diff, "floor": self.floor, "ok": self.ok}


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The step that runs against the plain jitted step on one device, over ``steps`` steps
    from the same state.

    The loss and metrics pass within :data:`LOSS_TOLERANCE`; each state leaf within
    :data:`LEAF_TOLERANCE` of its norm; either, beyond it, within :data:`FLOOR_FACTOR` times
    its noise floor: its difference between the plain step on one device and the plain step
    run data-parallel on the mesh. A leaf whose gradient is rounding noise (an attention key
    bias, which softmax cancels) differs between any two shardings once Adam normalises it; a
    loss computed in bfloat16 differs between any two orders of its sums (the plain step
    data-parallel on 2x4 against one device: 1.5e-4 on a Linen model with ``dtype=bfloat16``).
    The floor says how much. It is measured only when something is beyond its tolerance.

    Data parallelism computes every example as one device does, so a gradient that is zero in
    exact arithmetic because two computations of a step are the same (an EMA teacher
    initialised to its student, the loss their cross-entropy) is zero there too, while a plan
    that shards the two apart rounds them apart. The floor is therefore also the plain step's
    difference when each floating element of its arguments moves by one unit in the last place,
    up or down at random (:func:`_rounded`): how far rounding alone carries each leaf over the
    steps. For that EMA teacher (an MLP, SGD with momentum) on 2x4 at 100% over 3 steps it is
    3.3-7.6 on the biases and the momentum, which the plan moved by 1.2-2.7, where data
    parallelism moved them by 1e-7. On well-conditioned leaves it stays near the rounding: the
    zoo Llama's 92 leaves 9.6e-7 at the median, 1.9e-6 at most (its loss 1.2e-7); on the zoo
    ViT and mixer the leaves over 1e-5 are the 9 each whose gradient is zero in exact
    arithmetic (attention key biases; the token-mixing output bias before a LayerNorm), at
    1.1-1.6."""

    steps: int
    max_param_rel_diff: float
    """max over state leaves of the relative difference."""
    max_loss_rel_diff: float
    """The same over the step's other outputs (loss, metrics), every step."""
    beyond: tuple = ()
    """:class:`LeafDiff` of every leaf beyond :data:`LEAF_TOLERANCE`, largest first."""
    loss_floor: float = 0.0
    """The loss and metrics' noise floor (measured only when they are beyond
    :data:`LOSS_TOLERANCE`)."""

    @property
    def loss_ok(self) -> bool:
        return _within(self.max_loss_rel_diff, LOSS_TOLERANCE, self.loss_floor)

    @property
    def failing(self) -> tuple:
        """The leaves beyond both the tolerance and their noise floor's bound."""
        return tuple(leaf for leaf in self.beyond if not leaf.ok)

    @property
    def ok(self) -> bool:
        return self.loss_ok and not self.failing

    def to_dict(self) -> dict:
        return {"steps": self.steps, "max_param_rel_diff": self.max_param_rel_diff,
                "max_loss_rel_diff": self.max_loss_rel_diff, "loss_floor": self.loss_floor,
                "ok": self.ok,
                "beyond_tolerance": [leaf.to_dict() for leaf in self.beyond]}

    def summary(self) -> str:
        """One line: the differences and the verdict."""
        text = (f"numerics vs the plain step, {self.steps} steps: max relative difference "
                f"{self.max_param_rel_diff:.2e} (state), {self.max_loss_rel_diff:.2e} (loss "
                "and metrics)")
        if self.max_loss_rel_diff > LOSS_TOLERANCE:
            text += (f"; loss beyond {LOSS_TOLERANCE:.0e}, " + (
                f"within {FLOOR_FACTOR:g}x" if self.loss_ok else "FAILS: over "
                f"{FLOOR_FACTOR:g}x") + f" its noise floor ({self.loss_floor:.2e})")
        if self.beyond:
            text += (f"; {len(self.beyond) - len(self.failing)} of {len(self.beyond)} leaves "
                     f"beyond {LEAF_TOLERANCE:.0e} are within {FLOOR_FACTOR:g}x their noise "
                     "floor (data-parallel vs one device, or the arguments moved by an ulp)")
        for leaf in self.failing[:5]:
            text += f"; FAILS {leaf.path}: {leaf.diff:.2e} (floor {leaf.floor:.2e})"
        return text


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """Predicted vs compiled, for one applied step (or, for a recipe's step, compiled only)."""

    budget_bytes: int
    predicted_peak_bytes: int | None
    """The plan's simulated peak; None for a recipe's step (no prediction)."""
    compiled_memory: MemoryStats
    predicted_collectives: dict | None
    """``{kind: {"count", "bytes"}}`` the plan implies; None for a recipe's step."""
    compiled_collectives: dict
    """``{kind: {"count", "bytes"}}`` in the partitioned HLO (each instruction once)."""
    disagreements: tuple
    """Operators whose predicted and compiled collective bytes differ by more than the tolerance,
    largest difference first: dicts with ``operator``, ``predicted_bytes``, ``compiled_bytes``."""
    memory_disagreements: tuple = ()
    """When the memory is explained (by default: when it is off by more than the tolerance):
    operators whose bytes alive at the predicted peak and at the compiled peak (XLA's
    buffers and live ranges) differ by more than the tolerance and 1% of the predicted peak,
    largest difference first; ``(arguments)`` are the step's inputs (parameters, optimizer
    state, batch). Same dicts as ``disagreements``."""
    compiled_live_bytes: int | None = None
    """The sum of the buffers alive at the peak of the compiled heap
    (:func:`hlo_tools.compiled.live_at_peak`; None: memory not explained); below the compiled
    peak by the heap's packing."""
    numerics: Numerics | None = None
    """The step that runs against the plain step, given concrete arguments (None: not run)."""
    predicted_step_seconds: float | None = None
    """The simulator's step time of the plan (``Plan.predicted_step_seconds``)."""
    predicted_compute_seconds: float | None = None
    """Its compute part: the operators' compute over every execution, recomputation included
    (less what a Lynx plan hides under communication)."""
    compiled_cost: CompiledCost | None = None
    """The compiled step priced with the plan's cluster (:func:`kiwi_jax.estimate.compiled_cost`);
    None: not estimated."""
    compute_rows: tuple = ()
    """The plan's compute against the compiled step's, by the JAX operation they come from
    (:func:`compute_rows`; empty for a recipe's step)."""
    runs: str = "kiwi"
    """Whose compiled step this is: ``"kiwi"`` (kiwi's plan) or the recipe that won the
    compiler's choice (:mod:`kiwi_jax.choose`), whose step runs instead."""

    @property
    def compiled_peak_bytes(self) -> int:
        return self.compiled_memory.peak_bytes

    @property
    def steps(self) -> int:
        """Steps run for the numerics (0: not run)."""
        return 0 if self.numerics is None else self.numerics.steps

    @property
    def max_param_rel_diff(self) -> float | None:
        """max over state leaves of ||run - plain|| / ||plain|| after ``steps`` steps."""
        return None if self.numerics is None else self.numerics.max_param_rel_diff

    @property
    def max_loss_rel_diff(self) -> float | None:
        """The same over the step's other outputs (loss, metrics), every step."""
        return None if self.numerics is None else self.numerics.max_loss_rel_diff

    @property
    def fits(self) -> bool:
        """The compiled step fits the budget."""
        return self.compiled_peak_bytes <= self.budget_bytes

    @property
    def predicted_collective_bytes(self) -> int | None:
        if self.predicted_collectives is None:
            return None
        return sum(v["bytes"] for v in self.predicted_collectives.values())

    @property
    def compiled_collective_bytes(self) -> int:
        return sum(v["bytes"] for v in self.compiled_collectives.values())

    @property
    def memory_error(self) -> float | None:
        """(compiled - predicted) / predicted peak; None without a prediction (a recipe)."""
        if self.predicted_peak_bytes is None:
            return None
        return (self.compiled_peak_bytes - self.predicted_peak_bytes) / max(
            self.predicted_peak_bytes, 1)

    @property
    def collective_error(self) -> float | None:
        """(compiled - predicted) / predicted collective bytes; None without a prediction."""
        if self.predicted_collectives is None:
            return None
        return (self.compiled_collective_bytes - self.predicted_collective_bytes) / max(
            self.predicted_collective_bytes, 1)

    @property
    def estimated_step_seconds(self) -> float | None:
        """The compiled step's estimated time (compute + collectives, no overlap)."""
        return None if self.compiled_cost is None else self.compiled_cost.step_seconds

    @property
    def step_error(self) -> float | None:
        """(predicted - estimated) / estimated step time: how far the model is from what XLA
        compiled, priced the same way."""
        if self.compiled_cost is None or self.predicted_step_seconds is None:
            return None
        return (self.predicted_step_seconds - self.estimated_step_seconds) / max(
            self.estimated_step_seconds, 1e-30)

    @property
    def within_tolerance(self) -> bool | None:
        """Compiled memory and collective bytes within :data:`TOLERANCE` of the prediction;
        None without a prediction (a recipe)."""
        if self.memory_error is None:
            return None
        return abs(self.memory_error) <= TOLERANCE and abs(self.collective_error) <= TOLERANCE

    def to_dict(self) -> dict:
        m = self.compiled_memory
        return {
            "runs": self.runs, "budget_bytes": int(self.budget_bytes),
            "predicted_peak_bytes": None if self.predicted_peak_bytes is None
            else int(self.predicted_peak_bytes),
            "compiled_peak_bytes": int(self.compiled_peak_bytes),
            "compiled_argument_bytes": m.argument_bytes, "compiled_output_bytes": m.output_bytes,
            "compiled_temp_bytes": m.temp_bytes, "compiled_alias_bytes": m.alias_bytes,
            "fits": self.fits, "memory_error": self.memory_error,
            "predicted_collective_bytes": self.predicted_collective_bytes,
            "compiled_collective_bytes": self.compiled_collective_bytes,
            "collective_error": self.collective_error,
            "predicted_collectives": self.predicted_collectives,
            "compiled_collectives": self.compiled_collectives,
            "within_tolerance": self.within_tolerance,
            "disagreements": list(self.disagreements),
            "memory_disagreements": list(self.memory_disagreements),
            "compiled_live_bytes": self.compiled_live_bytes,
            "steps": self.steps, "max_param_rel_diff": self.max_param_rel_diff,
            "max_loss_rel_diff": self.max_loss_rel_diff,
            "numerics": None if self.numerics is None else self.numerics.to_dict(),
            "predicted_step_seconds": self.predicted_step_seconds,
            "predicted_compute_seconds": self.predicted_compute_seconds,
            "estimated_step_seconds": self.estimated_step_seconds,
            "step_error": self.step_error,
            "compiled_cost": None if self.compiled_cost is None else self.compiled_cost.to_dict(),
            "compute_rows": list(self.compute_rows),
        }

    def table(self) -> str:
        """The report as aligned text."""
        if self.predicted_peak_bytes is None:
            return self._recipe_table()
        mb = lambda b: f"{b / 2**20:10.3f} MiB"  # noqa: E731
        m = self.compiled_memory
        lines = [
            f"{'per device':28s} {'predicted':>14s} {'compiled':>14s}",
            f"{'peak memory':28s} {mb(self.predicted_peak_bytes)} {mb(self.compiled_peak_bytes)}"
            f"   ({self.memory_error:+.1%}; budget {mb(self.budget_bytes).strip()}, "
            f"{'fits' if self.fits else 'DOES NOT FIT'})",
            f"{'  argument/output/temp/alias':28s} {'':14s} {m.argument_bytes:,} / "
            f"{m.output_bytes:,} / {m.temp_bytes:,} / {m.alias_bytes:,} B",
        ]
        for kind in sorted(set(self.predicted_collectives) | set(self.compiled_collectives)):
            p = self.predicted_collectives.get(kind, {"count": 0, "bytes": 0})
            c = self.compiled_collectives.get(kind, {"count": 0, "bytes": 0})
            if p["count"] or c["count"]:
                lines.append(f"{kind:28s} {p['bytes']:>12,} B {c['bytes']:>12,} B   "
                             f"(count {p['count']} vs {c['count']})")
        lines.append(f"{'collective bytes, total':28s} {self.predicted_collective_bytes:>12,} B "
                     f"{self.compiled_collective_bytes:>12,} B   ({self.collective_error:+.1%})")
        lines += self._time_rows()
        if self.disagreements:
            lines.append("operators whose collectives disagree (predicted vs compiled bytes):")
            lines += [f"  {d['operator'][:60]:60s} {d['predicted_bytes']:>12,} "
                      f"{d['compiled_bytes']:>12,}" for d in self.disagreements[:12]]
        if self.memory_disagreements:
            lines.append("operators whose bytes at the peak disagree (predicted vs compiled; "
                         f"XLA's live buffers at its peak: {self.compiled_live_bytes:,} B):")
            lines += [f"  {d['operator'][:60]:60s} {d['predicted_bytes']:>12,} "
                      f"{d['compiled_bytes']:>12,}" for d in self.memory_disagreements[:12]]
        lines += self._numerics_rows()
        return "\n".join(lines)

    def _numerics_rows(self) -> list[str]:
        return [] if self.numerics is None else [self.numerics.summary()]

    def _recipe_table(self) -> str:
        """A recipe's step: compiled figures only (a recipe has no prediction)."""
        m, cost = self.compiled_memory, self.compiled_cost
        what = f"recipe {self.runs}'s (compiled; a recipe has no prediction to compare with)"
        lines = [f"the step that runs is {what}",
                 f"{'peak memory':28s} {self.compiled_peak_bytes / 2**20:10.3f} MiB   (budget "
                 f"{self.budget_bytes / 2**20:.3f} MiB, "
                 f"{'fits' if self.fits else 'DOES NOT FIT'})",
                 f"{'  argument/output/temp/alias':28s} {m.argument_bytes:,} / "
                 f"{m.output_bytes:,} / {m.temp_bytes:,} / {m.alias_bytes:,} B"]
        for kind, c in sorted(self.compiled_collectives.items()):
            lines.append(f"{kind:28s} {c['bytes']:>12,} B   (count {c['count']})")
        if cost is not None:
            lines.append(f"{'step time (est.)':28s} {cost.step_seconds * 1e3:10.4f} ms   "
                         f"(compute {cost.compute_seconds * 1e3:.4f} ms, collectives "
                         f"{cost.collective_seconds * 1e3:.4f} ms)")
        return "\n".join(lines + self._numerics_rows())


    def _time_rows(self) -> list[str]:
        """Predicted vs the compiled step's estimate: step, compute, collectives."""
        cost, predicted = self.compiled_cost, self.predicted_step_seconds
        if cost is None or predicted is None:
            return []
        ms = lambda s: f"{s * 1e3:11.4f} ms"  # noqa: E731
        rows = [f"{'step time (compiled: est.)':28s} {ms(predicted)} {ms(cost.step_seconds)}   "
                f"({self.step_error:+.1%}; the compiled step priced like the plan)"]
        if self.predicted_compute_seconds is not None:
            rows += [f"{'  compute':28s} {ms(self.predicted_compute_seconds)} "
                     f"{ms(cost.compute_seconds)}   ({cost.kernels} kernels; whole-program "
                     f"roofline {cost.compute_lower_seconds * 1e3:.4f}-"
                     f"{cost.compute_upper_seconds * 1e3:.4f} ms)",
                     f"{'  communication':28s} "
                     f"{ms(predicted - self.predicted_compute_seconds)} "
                     f"{ms(cost.collective_seconds)}"]
        compute = self.predicted_compute_seconds
        if self.compute_rows and compute is not None \
                and abs(cost.compute_seconds - compute) > TOLERANCE * max(compute, 1e-30):
            rows.append("  compute by the operation it comes from, the largest differences "
                        "(predicted: operators, compiled: kernels):")
            rows += [f"    {r['operation'][:36]:36s} {ms(r['predicted_seconds'])} "
                     f"{ms(r['compiled_seconds'])}   ({r['operators']} vs {r['kernels']})"
                     for r in self.compute_rows[:8]]
        return rows


def predicted_compute_seconds(prepared: Prepared) -> float:
    """The compute part of the plan's simulated step: every operator's compute times its
    executions (recomputations included), less the recomputation a Lynx plan hides under
    communication; the rest of the step is communication."""
    return float(_operator_compute(prepared).sum()) \
        - prepared.plan.simulation.overlapped_recompute_seconds


def _operator_compute(prepared: Prepared) -> np.ndarray:
    """Per operator of the plan's problem, its compute times its executions (recomputations
    included)."""
    plan, problem = prepared.plan, prepared.build.problem
    compute, _, _ = problem.costs_of(plan.strategy)
    executions = np.ones(problem.num_nodes)
    for node, stages in plan.recompute_at.items():
        executions[node] += len(stages)
    return compute * executions


def compute_rows(prepared: Prepared, cost: CompiledCost) -> tuple:
    """The plan's compute against the compiled step's, by the JAX operation they come from
    (:func:`kiwi_jax.estimate.source_operation`: the primitive, and whether autodiff's
    backward pass made it): one dict per operation with ``operation``, ``predicted_seconds``
    and ``operators`` (the model's, recomputations counted per execution), and
    ``compiled_seconds`` and ``kernels`` (the roofline of the kernels whose ``op_name`` is
    that operation's, :attr:`~kiwi_jax.estimate.CompiledCost.compute_by_operation` of
    ``cost``, the compiled step's estimate), the largest difference first. Their sums are
    :func:`predicted_compute_seconds` (before a Lynx plan's hidden recomputation is taken off)
    and ``cost.compute_seconds``. A fused chain is one kernel under its root's operation, so
    its other operators' compute shows up as theirs predicted and nothing compiled; copies
    XLA adds have no ``op_name`` (``copy (no op_name)``).
    """
    problem = prepared.build.problem
    per_operator = _operator_compute(prepared)
    predicted = collections.defaultdict(lambda: [0, 0.0])
    for name, opcode, seconds in zip(problem.op_names, problem.opcodes, per_operator):
        if seconds > 0:
            row = predicted[source_operation(name, opcode)]
            row[0] += 1
            row[1] += float(seconds)
    kernels = cost.compute_by_operation
    rows = []
    for op in set(predicted) | set(kernels):
        (operators, model), (count, compiled) = predicted.get(op, (0, 0.0)), \
            kernels.get(op, (0, 0.0))
        rows.append({"operation": op, "predicted_seconds": model, "operators": operators,
                     "compiled_seconds": compiled, "kernels": count})
    return tuple(sorted(rows, key=lambda r: (-abs(r["predicted_seconds"]
                                                  - r["compiled_seconds"]), r["operation"])))


def carried_comms(prepared: Prepared) -> list:
    """Resharding of updated state leaves whose planned spec differs from the input's (the
    updated state keeps the input's sharding so the next step reads it in place)."""
    graph, specs, mesh = prepared.traced.graph, prepared.plan.specs, prepared.build.mesh
    comms = []
    for value, param in carried_pairs(prepared.traced):
        comms += reshard_comms(graph.nodes[value].nbytes, specs[value], specs[param], mesh)
    return comms


def _operator_disagreements(prepared: Prepared, attributed, carried, found) -> tuple:
    """Per equation path, predicted (``attributed_comms`` and the carried state's resharding)
    vs compiled collective bytes, where they disagree."""
    graph = prepared.traced.graph
    predicted, compiled = collections.Counter(), collections.Counter()
    for node, c in attributed:
        predicted[tag_of(graph.nodes[node].op_name) or "(untagged)"] += c.bytes
    predicted["(untagged)"] += sum(c.bytes for c in carried)
    for c in found:
        compiled[tag_of(c.op_name) or "(untagged)"] += c.bytes
    total = max(sum(predicted.values()), sum(compiled.values()), 1)
    return _disagreeing(graph, predicted, compiled, 0.005 * total)


def _memory_disagreements(prepared: Prepared, live) -> tuple:
    """Per equation path, bytes alive at the predicted peak (the simulator's live set) vs at
    the compiled peak (``live``: XLA's live buffers), where they disagree."""
    graph, plan, problem = prepared.traced.graph, prepared.plan, prepared.build.problem
    schedule = plan.recompute_at
    peak = simulate(problem, plan.strategy, recompute_at=schedule).peak_time
    alive = live_bytes(problem, plan.strategy, peak, schedule)
    predicted, compiled = collections.Counter(), collections.Counter()
    for node, nbytes in zip(graph.nodes, alive):
        if nbytes:
            key = ARGUMENTS if node.phase == Phase.PARAM else tag_of(node.op_name)
            predicted[key or "(untagged)"] += int(nbytes)
    for buffer in live:
        key = ARGUMENTS if buffer.parameter else tag_of(buffer.op_name)
        compiled[key or "(untagged)"] += buffer.nbytes
    return _disagreeing(graph, predicted, compiled, 0.01 * plan.predicted_peak_bytes)


def _disagreeing(graph, predicted, compiled, min_bytes: float) -> tuple:
    """Rows of the equation paths whose predicted and compiled bytes differ by more than the
    tolerance and ``min_bytes``, largest difference first."""
    label = {}
    for node in graph.nodes:
        label.setdefault(tag_of(node.op_name) or "(untagged)", f"{node.opcode} {node.name}")
    rows = []
    for tag in set(predicted) | set(compiled):
        p, c = predicted[tag], compiled[tag]
        if abs(p - c) > TOLERANCE * max(p, c) and abs(p - c) > min_bytes:
            name = tag if tag.startswith("(") else f"k{tag} {label.get(tag, '')}".strip()
            rows.append({"operator": name, "predicted_bytes": int(p), "compiled_bytes": int(c)})
    rows.sort(key=lambda r: -abs(r["predicted_bytes"] - r["compiled_bytes"]))
    return tuple(rows)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


def leaf_rel_diffs(a, b) -> list[tuple[str, float]]:
    """``(path, ||a - b|| / ||b||)`` per leaf of ``a`` (2-norms; 0 where both are 0)."""
    out = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diff = float(np.linalg.norm((x - y).ravel()))
        out.append((jax.tree_util.keystr(path),
                    diff / max(float(np.linalg.norm(y.ravel())), 1e-30) if diff else 0.0))
    return out


def max_rel_diff(a, b) -> float:
    """max over leaves of ||a - b|| / ||b|| (2-norms; 0 where both are 0).

    Norms, not elements: Adam divides each gradient element by its running magnitude, so an
    element whose gradient cancels to rounding level (a sum of terms of both signs) turns the
    rounding of a reordered reduction into a visible update; such single elements differ by up
    to ~1e-4 of the leaf's scale between any two shardings of the same step."""
    return max((diff for _, diff in leaf_rel_diffs(a, b)), default=0.0)


def _run(step, args, steps: int, state_out):
    """Run ``steps`` steps; return (final state, per-step other outputs)."""
    args, others = list(args), []
    for _ in range(steps):
        outputs = step(*args)
        if state_out is None:
            others.append(outputs)
            continue
        others.append([o for i, o in enumerate(outputs) if i != state_out])
        args[0] = outputs[state_out]
    return args[0], others


def compare_numerics(prepared: Prepared, pure, steps: int, mesh) -> Numerics:
    """The step that runs (kiwi's plan or the recipe that won) against the plain jitted step
    on one device, from the same state, over ``steps`` steps; the noise floor of the leaves
    beyond :data:`LEAF_TOLERANCE` from the plain step run data-parallel on ``mesh``, or on
    every local device when ``mesh`` has one (:func:`_floor_mesh`), and from the plain step
    from its arguments moved by a unit in the last place (:func:`_rounded`)."""
    plain = jax.jit(pure.fn)
    plain_state, plain_out = _run(plain, _copy(pure.args), steps, prepared.state_out)
    plain_state = to_host(plain_state)
    placed = place(_copy(pure.args), prepared.in_shardings)
    state, out = _run(prepared.compiled, placed, steps, prepared.state_out)
    diffs = leaf_rel_diffs(to_host(state), plain_state)
    beyond = [(k, path, diff) for k, (path, diff) in enumerate(diffs) if diff > LEAF_TOLERANCE]
    loss_diff = max_rel_diff(to_host(out), plain_out)
    floors, loss_floor = [0.0] * len(diffs), 0.0
    floor_mesh = _floor_mesh(mesh)
    if (beyond or loss_diff > LOSS_TOLERANCE) and floor_mesh is not None:
        dp = data_parallel_step(pure, floor_mesh)
        dp_state, dp_out = _run(dp.jitted, place(_copy(pure.args), dp.in_shardings), steps,
                                prepared.state_out)
        floors = [diff for _, diff in leaf_rel_diffs(to_host(dp_state), plain_state)]
        loss_floor = max_rel_diff(to_host(dp_out), plain_out)
    if beyond or loss_diff > LOSS_TOLERANCE:
        moved_state, moved_out = _run(plain, _rounded(_copy(pure.args)), steps,
                                      prepared.state_out)
        moved = leaf_rel_diffs(to_host(moved_state), plain_state)
        floors = [max(floor, diff) for floor, (_, diff) in zip(floors, moved)]
        loss_floor = max(loss_floor, max_rel_diff(to_host(moved_out), plain_out))
    leaves = sorted((LeafDiff(path, diff, floors[k]) for k, path, diff in beyond),
                    key=lambda leaf: -leaf.diff)
    return Numerics(steps, max((d for _, d in diffs), default=0.0), loss_diff, tuple(leaves),
                    loss_floor)


def _rounded(args, seed: int = 0):
    """``args`` with each floating element one unit in the last place up or down (its own
    dtype's, at random from ``seed``); other leaves as they are."""
    leaves, treedef = jax.tree.flatten(args)
    keys = iter(jax.random.split(jax.random.key(seed), max(len(leaves), 1)))
    out = []
    for leaf in leaves:
        key = next(keys)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating):
            up = jax.random.bernoulli(key, shape=leaf.shape)
            leaf = jnp.where(up, jnp.nextafter(leaf, jnp.inf), jnp.nextafter(leaf, -jnp.inf))
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def _floor_mesh(mesh):
    """The mesh the noise floor is measured on: ``mesh``, or, when it has one device, its axes
    over every local device (None when there is only one). On one device the floor would be
    the plain step against itself, zero, and a leaf whose gradient is rounding noise (an
    attention key bias, which softmax cancels) would fail on any change of XLA's fusion: the
    zoo ViT's plans on one device, whose recomputation XLA fuses differently, moved those
    leaves by 0.4-0.99 (relative, with their Adam moments) and no other leaf past 1e-5."""
    if mesh.devices.size > 1:
        return mesh
    devices = jax.local_devices()
    if len(devices) < 2:
        return None
    shape = (len(devices),) + (1,) * (len(mesh.axis_names) - 1)
    return jax.sharding.Mesh(np.array(devices).reshape(shape), mesh.axis_names)


def verify_prepared(prepared: Prepared, mesh, pure=None, steps: int = 3,
                    explain_memory: bool | None = None) -> VerifyReport:
    """Check a prepared (planned, applied, compiled) step; see the module docstring.

    Args:
      explain_memory: attribute the memory at both peaks to operators (one more compile with
        XLA's dumps on); None: only when it is off by more than the tolerance. Neither the
        memory nor the collectives are attributed for a plan run as its export
        (``CompiledPlan.program == "blocks"``): its instructions carry no equation tags.

    A recipe's step that runs instead of kiwi's plan is checked by :func:`verify_recipe`
    (``explain_memory`` does not apply: there is no prediction to attribute against).
    """
    if prepared.runs_recipe:
        return verify_recipe(prepared, mesh, pure, steps)
    compiled = prepared.compiled
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    found = collectives(compiled.as_text(), ids)
    attributed = attributed_comms(prepared.build, prepared.plan.strategy, prepared.plan.keep)
    carried = carried_comms(prepared)
    # a plan run as its export: its instructions carry no equation tags to attribute by
    tagged = prepared.applied.program != "blocks"
    disagreements = ()
    if tagged:
        # Per operator: a second compile without the combiners that merge collectives of
        # several operators into one instruction (totals come from the executable that runs).
        options = dict(compiler_options())
        options["xla_disable_hlo_passes"] = ",".join(
            filter(None, [options.get("xla_disable_hlo_passes"), *UNCOMBINED]))
        separate = prepared.jitted.lower(*prepared.traced.pure.args).compile(
            compiler_options=options)
        disagreements = _operator_disagreements(prepared, attributed, carried,
                                                collectives(separate.as_text(), ids))
    numerics = _numerics(prepared, pure, steps, mesh)
    cost = compiled_cost(compiled, mesh, prepared.build.cluster)
    report = VerifyReport(
        budget_bytes=prepared.plan.budget_bytes,
        predicted_peak_bytes=prepared.plan.predicted_peak_bytes,
        compiled_memory=device_memory(compiled),
        predicted_collectives=by_kind([c for _, c in attributed] + carried),
        compiled_collectives=by_kind(found),
        disagreements=disagreements,
        predicted_step_seconds=prepared.plan.predicted_step_seconds,
        predicted_compute_seconds=predicted_compute_seconds(prepared),
        compiled_cost=cost, compute_rows=compute_rows(prepared, cost), numerics=numerics)
    if tagged and (explain_memory
                   or (explain_memory is None and abs(report.memory_error) > TOLERANCE)):
        live = live_at_peak(prepared.jitted.lower(*prepared.traced.pure.args),
                            compiler_options())
        report = dataclasses.replace(
            report, memory_disagreements=_memory_disagreements(prepared, live),
            compiled_live_bytes=sum(b.nbytes for b in live))
    return report


def _numerics(prepared: Prepared, pure, steps: int, mesh) -> Numerics | None:
    """The report's numerics: the step that runs against the plain step over ``steps`` steps,
    given ``pure`` (concrete arguments); None without."""
    if pure is None or steps <= 0:
        return None
    return compare_numerics(prepared, pure, steps, mesh)


def verify_recipe(prepared: Prepared, mesh, pure=None, steps: int = 3) -> VerifyReport:
    """Check the recipe's step that runs (it won the compiler's choice): its compiled memory
    against the budget, its collectives and estimated step (the cluster of kiwi's problem),
    and, given ``pure`` (the plain step with concrete arguments), its numerics against the
    plain jitted step over ``steps`` steps. The predicted fields are None.

    Raises:
      ValueError: no recipe runs for this prepared step.
    """
    if not prepared.runs_recipe:
        raise ValueError("verify_recipe: kiwi's plan runs for this step, not a recipe; use "
                         "verify_prepared")
    compiled = prepared.recipe.compiled
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    return VerifyReport(
        budget_bytes=prepared.choice.budget_bytes, predicted_peak_bytes=None,
        compiled_memory=device_memory(compiled), predicted_collectives=None,
        compiled_collectives=by_kind(collectives(compiled.as_text(), ids)), disagreements=(),
        compiled_cost=compiled_cost(compiled, mesh, prepared.build.cluster),
        runs=prepared.choice.winner, numerics=_numerics(prepared, pure, steps, mesh))


def overlap_placements(prepared: Prepared) -> list:
    """Where the compiled, scheduled step runs the recomputations a Lynx plan hides under
    collectives: per recomputation (found by its ``lynx_overlap`` name scope, fused or not),
    the next collective issued for one of the plan's anchors and the collectives in between.
    Empty for plans without hidden recomputation or applied without overlap.

    Returns:
      A list of :class:`hlo_tools.compiled.Placement`.
    """
    hidden = prepared.plan.hidden_under or {}
    paths = prepared.traced.node_paths()
    tags = {f"/k{paths[a][0]}/" for a in hidden.values() if a in paths}
    return placements(prepared.applied.compiled.as_text(), OVERLAP_SCOPE, tags)
