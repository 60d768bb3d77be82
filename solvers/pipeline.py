"""Pipeline parallelism: a 1F1B simulator and three ways to cut a model into stages.

A model is a run of identical layers between an embedding part (first stage) and a head with
the loss (last stage); each stage holds its layers' parameters, optimizer state and gradient
accumulator, and, under 1F1B, the activations of up to ``stages - index`` micro-batches
(earlier stages hold more). Each stage's recomputation policy is planned under the per-device
budget (Lynx-HEU, or a rule: keep all, full or selective recomputation).

Partitioning methods:
- ``even``: the parameter-balanced split (Lynx's dp-partitioning baseline).
- ``lynx``: from the even split, move one layer from the slowest stage to the fastest while the
  slowest stage gets faster and every stage fits (Lynx sec. 5).
- ``dawnpiper``: binary partitioning: split the stages in two halves and search the cut between
  the compute-balanced and the memory-balanced position, recursively (DawnPiper Theorem 4.1,
  Algorithm 1; cuts at layer boundaries).

References:
  Lynx (sec. 2.3 observation 2, sec. 4.2 eq. 7-9, sec. 5); DawnPiper (sec. 4.1-4.2, Algorithm 1,
  appendix B.1 Algorithm 2); PipeDream-Flush / 1F1B (Narayanan et al., 2021).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from solvers.backend import DEFAULT_BACKEND
from solvers.lynx import LayerOps, LayerPolicy, heu_policy, policy_from_keep

__all__ = ["Block", "ModelProfile", "StagePlan", "PipelineResult", "simulate_1f1b",
           "plan_stage", "partition", "PARTITIONS", "POLICIES"]

PARTITIONS = ("even", "lynx", "dawnpiper")
POLICIES = ("lynx", "full", "selective", "none")


@dataclasses.dataclass(frozen=True)
class Block:
    """Per-device costs of one part of the model, per micro-batch."""

    forward_seconds: float
    """Forward time, collectives included."""
    backward_seconds: float
    """Backward time, collectives included."""
    optimizer_seconds: float
    """Its share of the optimizer update (once per step)."""
    static_bytes: int
    """Parameters, optimizer state and gradient accumulator."""
    held_bytes: int
    """Activations one micro-batch holds from its forward to its backward pass when nothing is
    recomputed."""


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A model for pipeline planning: embedding, ``layers`` identical layers, head."""

    layer_ops: LayerOps
    """The representative layer's forward operators under the sharding plan."""
    layer: Block
    """One layer's totals."""
    embed: Block
    """What runs before the first layer (first stage)."""
    head: Block
    """What runs after the last layer, the loss included (last stage)."""
    layers: int
    """Number of layers."""
    workspace_bytes: int
    """Transient bytes on top of static and held bytes at the peak (backward temporaries)."""
    boundary_bytes: int
    """Bytes a layer hands to the next one (sent between stages, and its gradient back)."""
    link_latency: float
    """Seconds to start a transfer between stages."""
    link_bandwidth: float
    """Bytes per second between stages."""
    micro_batch: int
    """Samples per micro-batch."""

    def transfer_seconds(self) -> float:
        return self.link_latency + self.boundary_bytes / self.link_bandwidth


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage's layers, recomputation policy, time and memory."""

    index: int
    """Stage index (0 = first)."""
    layers: int
    """Number of layers on the stage."""
    in_flight: int
    """Micro-batches whose activations the stage holds at its peak (1F1B)."""
    policy: LayerPolicy | None
    """The layers' recomputation policy (None: none fits)."""
    forward_seconds: float
    """Forward time per micro-batch."""
    backward_seconds: float
    """Backward time per micro-batch, on-demand recomputation included."""
    optimizer_seconds: float
    """Optimizer update."""
    peak_bytes: int
    """Per-device peak."""
    fits: bool
    """Whether the peak is within the budget."""

    @property
    def step_seconds(self) -> float:
        """Forward + backward per micro-batch (infinite when the stage does not fit)."""
        return self.forward_seconds + self.backward_seconds if self.fits else math.inf

    @property
    def on_demand_seconds(self) -> float:
        return 0.0 if self.policy is None else self.layers * self.policy.on_demand_seconds

    @property
    def overlapped_seconds(self) -> float:
        return 0.0 if self.policy is None else self.layers * self.policy.overlapped_seconds


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """A partition, its per-stage plans and the simulated 1F1B step."""

    method: str
    """Partitioning method."""
    policy: str
    """Recomputation policy of every stage."""
    stages: tuple[StagePlan, ...]
    """Per stage."""
    micro_batches: int
    """Micro-batches per step."""
    step_seconds: float
    """Simulated 1F1B step (optimizer included); infinite when a stage does not fit."""
    throughput: float
    """Samples per second (0 when a stage does not fit)."""
    search_seconds: float
    """Wall time of the partition and policy search."""
    policies_solved: int
    """Stage policies planned during the search."""

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    def summary(self) -> dict:
        return {
            "method": self.method, "policy": self.policy, "fits": self.fits,
            "stage_layers": [s.layers for s in self.stages],
            "stage_step_seconds": [s.step_seconds if s.fits else None for s in self.stages],
            "stage_peak_bytes": [s.peak_bytes for s in self.stages],
            "stage_in_flight": [s.in_flight for s in self.stages],
            "stage_on_demand_recompute_seconds": [s.on_demand_seconds for s in self.stages],
            "stage_overlapped_recompute_seconds": [s.overlapped_seconds for s in self.stages],
            "micro_batches": self.micro_batches,
            "simulated_step_seconds": self.step_seconds if self.fits else None,
            "simulated_throughput": self.throughput, "search_seconds": self.search_seconds,
            "policies_solved": self.policies_solved}


def simulate_1f1b(forward, backward, transfer: float, micro_batches: int,
                  optimizer=None) -> float:
    """Seconds of one 1F1B pipeline step.

    Stage s runs ``min(S - s - 1, m)`` forward passes (warm-up), then alternates one forward and
    one backward (steady), then the remaining backward passes (cool-down). A forward pass waits
    for the previous stage's forward of the same micro-batch and the transfer; a backward pass
    for the next stage's backward of the same micro-batch and the transfer back. The step ends
    when every stage has finished its optimizer update.

    Args:
      forward, backward: per stage, seconds per micro-batch.
      transfer: seconds to send a micro-batch's boundary activation (or its gradient).
      micro_batches: m.
      optimizer: per stage, seconds of the optimizer update (default 0).
    """
    stages = len(forward)
    m = micro_batches
    f_done = np.full((stages, m), np.nan)
    b_done = np.full((stages, m), np.nan)
    orders = []
    for s in range(stages):
        warm = min(stages - s - 1, m)
        order = [("F", b) for b in range(warm)]
        for b in range(m - warm):
            order += [("F", warm + b), ("B", b)]
        order += [("B", b) for b in range(m - warm, m)]
        orders.append(order)
    clock = np.zeros(stages)
    cursor = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            while cursor[s] < len(orders[s]):
                kind, b = orders[s][cursor[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else f_done[s - 1, b] + transfer
                else:
                    ready = f_done[s, b] if s == stages - 1 else b_done[s + 1, b] + transfer
                if np.isnan(ready):
                    break
                start = max(clock[s], ready)
                clock[s] = start + (forward[s] if kind == "F" else backward[s])
                (f_done if kind == "F" else b_done)[s, b] = clock[s]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")        # pragma: no cover
    extra = np.zeros(stages) if optimizer is None else np.asarray(optimizer, float)
    return float((clock + extra).max())


def _stage_policy(profile: ModelProfile, layers: int, in_flight: int, last: bool,
                  activation_budget: float, policy: str, backend: str) -> LayerPolicy | None:
    ops = profile.layer_ops
    if policy == "lynx":
        return heu_policy(ops, activation_budget, layers=max(layers, 1), in_flight=in_flight,
                          forward_windows=not last, backend=backend)
    if policy == "none":
        return policy_from_keep(ops, np.ones(ops.size, bool))
    if policy == "full":
        return policy_from_keep(ops, np.zeros(ops.size, bool))
    if policy == "selective":
        return policy_from_keep(ops, np.array(["attention_core" not in n for n in ops.names]))
    raise ValueError(f"unknown recomputation policy {policy!r}; expected one of {POLICIES}")


def _in_flight(index: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``index`` holds at its peak under 1F1B: its
    warm-up forwards plus the one in flight."""
    return min(stages - index, micro_batches)


def plan_stage(profile: ModelProfile, index: int, layers: int, stages: int, micro_batches: int,
               budget_bytes: int, policy: str = "lynx",
               backend: str = DEFAULT_BACKEND) -> StagePlan:
    """Plan one stage: its static bytes, the policy of its layers under the budget, its times
    and its peak (Lynx eq. 7: static + workspace + in-flight micro-batches' held activations +
    activations recomputed early in forward windows)."""
    first, last = index == 0, index == stages - 1
    in_flight = _in_flight(index, stages, micro_batches)
    extras = [b for b, on in ((profile.embed, first), (profile.head, last)) if on]
    static = layers * profile.layer.static_bytes + sum(b.static_bytes for b in extras)
    fixed = profile.workspace_bytes + static + in_flight * sum(b.held_bytes for b in extras)
    chosen = _stage_policy(profile, layers, in_flight, last, budget_bytes - fixed, policy,
                           backend)
    if chosen is None:            # no policy fits: report the one holding least
        least = heu_policy(profile.layer_ops, None, layers=max(layers, 1), in_flight=in_flight,
                           forward_windows=not last, backend=backend, minimize_memory=True)
        held = 0 if least is None else least.held_bytes
        peak = fixed + layers * in_flight * held
        on_demand = 0.0 if least is None else least.on_demand_seconds
    else:
        peak = fixed + layers * (in_flight * chosen.held_bytes + chosen.early_bytes)
        on_demand = chosen.on_demand_seconds
    lay = profile.layer
    return StagePlan(
        index=index, layers=layers, in_flight=in_flight, policy=chosen,
        forward_seconds=layers * lay.forward_seconds + sum(b.forward_seconds for b in extras),
        backward_seconds=layers * (lay.backward_seconds + on_demand)
        + sum(b.backward_seconds for b in extras),
        optimizer_seconds=layers * lay.optimizer_seconds
        + sum(b.optimizer_seconds for b in extras),
        peak_bytes=int(peak), fits=chosen is not None and peak <= budget_bytes)


class _Planner:
    """Stage plans by (index, layers), cached: layers are identical, so a stage's plan depends
    on its position and its layer count only."""

    def __init__(self, profile, stages, micro_batches, budget, policy, backend):
        self.profile, self.stages, self.micro_batches = profile, stages, micro_batches
        self.budget, self.policy, self.backend = budget, policy, backend
        self.cache: dict[tuple[int, int], StagePlan] = {}

    def __call__(self, index: int, layers: int) -> StagePlan:
        key = (index, layers)
        if key not in self.cache:
            self.cache[key] = plan_stage(self.profile, index, layers, self.stages,
                                         self.micro_batches, self.budget, self.policy,
                                         self.backend)
        return self.cache[key]

    def plans(self, counts) -> list[StagePlan]:
        return [self(s, int(n)) for s, n in enumerate(counts)]


def _balanced_counts(per_layer: float, first: float, last: float, layers: int,
                     stages: int) -> list[int]:
    """Contiguous split of ``layers`` identical layers minimising the largest stage total, the
    first stage carrying ``first`` extra and the last ``last`` (at least one layer each; the
    middle stages, which carry no extra, split their layers as evenly as possible)."""
    if stages == 1:
        return [layers]
    best, best_counts = math.inf, None
    for lead in range(1, layers - stages + 2):
        for tail in range(1, layers - lead - (stages - 2) + 1):
            middle = layers - lead - tail
            if stages == 2:
                if middle:
                    continue
                counts = [lead, tail]
            else:
                k = stages - 2
                if middle < k:
                    continue
                counts = [lead] + [middle // k + (i < middle % k) for i in range(k)] + [tail]
            totals = [c * per_layer for c in counts]
            totals[0] += first
            totals[-1] += last
            if max(totals) < best:
                best, best_counts = max(totals), counts
    return best_counts


def _step_seconds(planner: _Planner, plans: list[StagePlan]) -> float:
    """The simulated 1F1B step of these stage plans (infinite when a stage does not fit)."""
    if not all(p.fits for p in plans):
        return math.inf
    return simulate_1f1b([p.forward_seconds for p in plans], [p.backward_seconds for p in plans],
                         planner.profile.transfer_seconds(), planner.micro_batches,
                         [p.optimizer_seconds for p in plans])


def _result(method, policy, planner: _Planner, counts, start) -> PipelineResult:
    plans = planner.plans(counts)
    seconds = _step_seconds(planner, plans)
    samples = planner.micro_batches * planner.profile.micro_batch
    return PipelineResult(method=method, policy=policy, stages=tuple(plans),
                          micro_batches=planner.micro_batches, step_seconds=seconds,
                          throughput=samples / seconds,         # 0 when a stage does not fit
                          search_seconds=time.perf_counter() - start,
                          policies_solved=len(planner.cache))


def _even(profile: ModelProfile, stages: int) -> list[int]:
    return _balanced_counts(profile.layer.static_bytes, profile.embed.static_bytes,
                            profile.head.static_bytes, profile.layers, stages)


def _lynx(planner: _Planner, counts: list[int]) -> list[int]:
    """Lynx sec. 5: move a layer from the slowest stage to the fastest while that helps.

    "Helps" is judged by the simulated 1F1B step, then by the bytes stages need beyond the
    budget (so that a split that does not fit moves towards one that does), then by the stage
    times sorted from the slowest down (so that of two equally slow stages one may shed a
    layer first); a stage that does not fit counts as infinitely slow. Balancing stage times
    alone can lengthen the step: on the 7B GPT over 4 stages Lynx's rule moved [7, 9, 9, 7] to
    [8, 8, 8, 8], 0.6% slower in 1F1B.
    """
    def score(counts):
        plans = planner.plans(counts)
        times = [p.step_seconds for p in plans]
        step = _step_seconds(planner, plans)
        over = sum(max(0, p.peak_bytes - planner.budget) for p in plans)
        return [step, over, *sorted(times, reverse=True)], times

    counts = list(counts)
    current, times = score(counts)
    while True:
        slow, fast = int(np.argmax(times)), int(np.argmin(times))
        if slow == fast or counts[slow] <= 1:
            return counts
        trial = list(counts)
        trial[slow] -= 1
        trial[fast] += 1
        candidate, trial_times = score(trial)
        if candidate >= current:
            return counts
        counts, current, times = trial, candidate, trial_times


def _dawnpiper(planner: _Planner, profile: ModelProfile, stages: int) -> list[int]:
    """DawnPiper Algorithm 1 at layer granularity."""
    lay = profile.layer
    layer_time = lay.forward_seconds + lay.backward_seconds
    memo: dict[tuple[int, int, int], tuple[float, list[int]]] = {}

    def extra_time(a: int, b: int) -> float:
        out = 0.0
        if a == 0:
            out += profile.embed.forward_seconds + profile.embed.backward_seconds
        if b == stages - 1:
            out += profile.head.forward_seconds + profile.head.backward_seconds
        return out

    def side_memory(n: int, a: int, b: int) -> float:
        """Largest keep-all stage peak of stages a..b holding n layers evenly."""
        k = b - a + 1
        worst = 0.0
        for s in range(a, b + 1):
            in_flight = _in_flight(s, stages, planner.micro_batches)
            mem = n / k * (lay.static_bytes + in_flight * lay.held_bytes)
            if s == 0:
                mem += profile.embed.static_bytes + in_flight * profile.embed.held_bytes
            if s == stages - 1:
                mem += profile.head.static_bytes + in_flight * profile.head.held_bytes
            worst = max(worst, mem)
        return worst

    def bipar(n: int, a: int, b: int) -> tuple[float, list[int]]:
        """Best (largest stage time, counts) for n layers on stages a..b."""
        if (n, a, b) in memo:
            return memo[n, a, b]
        if a == b:
            plan = planner(a, n)
            memo[n, a, b] = (plan.step_seconds, [n])
            return memo[n, a, b]
        mid = (a + b) // 2
        left_k, right_k = mid - a + 1, b - mid
        cuts = range(left_k, n - right_k + 1)
        if not len(cuts):
            memo[n, a, b] = (math.inf, [])
            return memo[n, a, b]
        cb = min(cuts, key=lambda c: abs((c * layer_time + extra_time(a, mid)) / left_k
                                         - ((n - c) * layer_time + extra_time(mid + 1, b))
                                         / right_k))
        mb = min(cuts, key=lambda c: max(side_memory(c, a, mid), side_memory(n - c, mid + 1, b)))
        step = 1 if mb >= cb else -1
        best = (math.inf, [])
        for c in range(cb, mb + step, step):
            left, right = bipar(c, a, mid), bipar(n - c, mid + 1, b)
            value = (max(left[0], right[0]), left[1] + right[1])
            if value[0] < best[0]:
                best = value
            optimised = any(planner(a + i, k).on_demand_seconds > 0 or not planner(a + i, k).fits
                            for i, k in enumerate(value[1]))
            if not optimised:             # no stage needed recomputation: stop moving the cut
                break
        memo[n, a, b] = best
        return best

    counts = bipar(profile.layers, 0, stages - 1)[1]
    return counts if len(counts) == stages else _even(profile, stages)


def partition(profile: ModelProfile, stages: int, micro_batches: int, budget_bytes: int,
              method: str = "lynx", policy: str = "lynx",
              backend: str = DEFAULT_BACKEND) -> PipelineResult:
    """Cut the model into ``stages`` stages and plan each under ``budget_bytes``.

    Args:
      profile: the model.
      stages: pipeline stages (at most the number of layers).
      micro_batches: micro-batches per step.
      budget_bytes: per-device memory budget.
      method: one of :data:`PARTITIONS`.
      policy: every stage's recomputation policy, one of :data:`POLICIES`.
    """
    if method not in PARTITIONS:
        raise ValueError(f"unknown partitioning {method!r}; expected one of {PARTITIONS}")
    if not 1 <= stages <= profile.layers:
        raise ValueError(f"{stages} stages for {profile.layers} layers: expected 1 to "
                         f"{profile.layers} stages (one layer at least per stage)")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
    start = time.perf_counter()
    planner = _Planner(profile, stages, micro_batches, budget_bytes, policy, backend)
    counts = _even(profile, stages)
    if method == "lynx":
        counts = _lynx(planner, counts)
    elif method == "dawnpiper":
        counts = _dawnpiper(planner, profile, stages)
    return _result(method, policy, planner, counts, start)
