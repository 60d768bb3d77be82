"""Replay a plan on the problem: step time and the per-device memory timeline.

The simulator is the judge of every solver and baseline: it is written from the execution
semantics below, not from any solver's formulation, and the tests check each solver's claims
against it.

Semantics:
- Time t = 0 .. n-1 is the stage in which node t runs; a forward value may also be recomputed
  in later stages (before the stage's own node, in topological order). A plan gives, per node,
  a strategy and, per forward value, the stages where it is recomputed. KIWI's reduced plans
  (keep flags) recompute a dropped value once, in the stage of its first backward reader.
- Every use of a value (by the node of stage t, by a recomputation in stage t, or as a step
  output at time n) is served by the latest copy created at or before t; using a value before
  any copy exists cannot happen (every use comes after the value's own stage). A copy is
  alive from its creation to the last use it serves (free after last use); inputs (phase
  ``param``) are alive throughout.
- Step time = sum over nodes of (number of executions) x (c_i + d_i + resharding on the node's
  incoming edges) (KIWI eq. 1 and 2).
- The operand copies the resharding of node t's operands makes (an all-gathered or exchanged
  operand: ``ShardingProblem.gathered``) are alive in stage t, beside its operands and output;
  those of a recomputation are not counted.
- Peak = max over t of the bytes alive at t. A stage runs its recomputations in node order,
  then its node, and each copy is alive from its own point in its creation stage to its last
  reader's point in its last stage (:func:`copy_spans`): the copies alive through a stage
  count whole, and of those alive for part of it (an intermediate of a chain, as a per-block
  ``jax.checkpoint`` recomputes one; a kept value a recomputation alone reads last; a copy
  from its recomputation or run on) the most alive at once. On the zoo Llama (dim 1024, seq
  1024) on 2x4 under ``nothing_saveable`` the attention block's chain held eight score-sized
  values at once.
- With ``overlap=True`` (Lynx), recomputations in the stage of a node with communication
  (its own collectives or operand resharding) run beside that communication when they have
  none of their own and neither the node nor a recomputation it waits for in that stage reads
  them: their compute, up to the node's communication seconds, leaves the step time.

References:
  KIWI (Liu et al.), eq. 1-11; Lynx (sec. 4.1, eq. 1 and C1-C2: overlapped recomputation);
  Checkmate (Jain et al., 2020), sec. 4 (stages, free after
  last use).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem

__all__ = ["SimResult", "simulate", "reduced_schedule", "overlapped_recomputations",
           "buffers", "copy_spans"]



@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a plan costs under the model."""

    step_seconds: float
    """Total: compute + communication + resharding + recomputation."""
    compute_seconds: float
    """Operators' compute, first execution."""
    comm_seconds: float
    """Operators' own collectives, first execution."""
    reshard_seconds: float
    """Resharding on edges, first execution."""
    recompute_seconds: float
    """Everything recomputations cost on the critical path (all three kinds; with ``overlap``,
    what hides under communication is not counted)."""
    peak_bytes: int
    """Per-device peak memory."""
    peak_time: int
    """Stage at which the peak occurs."""
    memory_timeline: np.ndarray
    """Bytes alive at every stage."""
    overlapped_recompute_seconds: float = 0.0
    """Recomputation hidden under communication (``overlap=True``); already taken off
    ``step_seconds``."""


def reduced_schedule(problem: ShardingProblem, keep) -> dict[int, tuple[int, ...]]:
    """KIWI's reduced semantics: each dropped forward value read by the backward pass is
    recomputed once, in the stage of its first backward reader, or earlier where a dropped
    value of its layer is recomputed from it; a dropped value the backward pass does not read,
    at the stage of its first dropped reader that chains from it (not at all without one: it is
    then as good as kept). See :meth:`~solvers.problem.ShardingProblem.dropped_stages`."""
    return {i: (t,) for i, t in problem.dropped_stages(keep).items()}


def simulate(problem: ShardingProblem, strategy, keep=None,
             recompute_at: dict[int, tuple[int, ...]] | None = None,
             overlap: bool = False) -> SimResult:
    """Replay a plan.

    Args:
      problem: the problem.
      strategy: strategy index per node.
      keep: keep flag per node (KIWI's reduced plans), or None.
      recompute_at: per forward node, the stages where it is recomputed (overrides ``keep``).
      overlap: credit recomputation hidden under communication (Lynx; see the module notes).

    Raises:
      ValueError: a recomputation of a node that is not a forward node, or outside the stages
        after its own.
    """
    n = problem.num_nodes
    strategy = np.asarray(strategy, dtype=np.int64)
    if strategy.shape != (n,):
        raise ValueError(f"expected a strategy per node, shape ({n},), got {strategy.shape}")
    if recompute_at is None:
        recompute_at = reduced_schedule(problem, np.ones(n, bool) if keep is None else keep)
    operands = problem.operands()
    served_until, last_reader = _lifetimes(problem, recompute_at, operands)
    compute, comm, reshard = problem.costs_of(strategy)
    per_node = compute + comm + reshard
    executions = np.array([len(c) for c in served_until])
    hidden = _hidden_seconds(overlapped_recomputations(recompute_at, operands, comm + reshard),
                             compute, comm + reshard) if overlap else 0.0
    memory = problem.memory_of(strategy)
    whole, parts = copy_spans(problem, served_until, last_reader)
    delta = np.zeros(n + 2, dtype=np.int64)
    for (i, _), (lo, hi) in whole.items():
        if lo <= hi:
            delta[lo] += memory[i]
            delta[hi + 1] -= memory[i]
    timeline = np.cumsum(delta)[:n] + problem.gathered_of(strategy)
    for stage, (extra, _) in _most_at_once(parts, memory).items():
        timeline[stage] += extra
    return SimResult(
        step_seconds=float(per_node @ executions) - hidden,
        compute_seconds=float(compute.sum()), comm_seconds=float(comm.sum()),
        reshard_seconds=float(reshard.sum()),
        recompute_seconds=float(per_node @ (executions - 1)) - hidden,
        peak_bytes=int(timeline.max()) if n else 0,
        peak_time=int(np.argmax(timeline)) if n else 0, memory_timeline=timeline,
        overlapped_recompute_seconds=hidden)


def live_bytes(problem: ShardingProblem, strategy, stage: int,
               recompute_at: dict[int, tuple[int, ...]] | None = None) -> np.ndarray:
    """Per node, the bytes of its copies alive at ``stage`` under the simulator's semantics,
    the node of ``stage`` holding its resharded operand copies too (their sum is the memory
    timeline at ``stage``: a chain's intermediates as alive at the recomputation of the stage
    where most of them are); ``recompute_at`` None: keep everything."""
    n = problem.num_nodes
    strategy = np.asarray(strategy, dtype=np.int64)
    served_until, last_reader = _lifetimes(problem, recompute_at or {}, problem.operands())
    memory = problem.memory_of(strategy)
    whole, parts = copy_spans(problem, served_until, last_reader)
    at = _most_at_once({k: [p for p in v if p[0] == stage] for k, v in parts.items()}, memory)
    point = at[stage][1] if stage in at else -1      # the point where most are alive

    def counted(key) -> bool:
        lo, hi = whole[key]
        return lo <= stage <= hi or any(s == stage and first <= point <= last
                                        for s, first, last in parts.get(key, ()))

    copies = np.zeros(n, np.int64)
    for key in whole:
        copies[key[0]] += counted(key)
    alive = memory * copies
    alive[stage] += problem.gathered_of(strategy)[stage]
    return alive


def buffers(problem: ShardingProblem, strategy,
            recompute_at: dict[int, tuple[int, ...]] | None = None) -> list[tuple[int, int, int]]:
    """The plan's values as buffers, ``(bytes, first stage, last stage)``: every copy of every
    non-input node (its own and each recomputation, alive from its creation to the last use it
    serves; a step output to stage ``n``) and the resharded operand copies of each stage's node.
    The inputs (phase ``param``) are left out: they are the step's arguments, alive throughout.
    Their sum at a stage, plus the inputs, bounds the memory timeline there from above: a
    copy alive for part of a stage (:func:`copy_spans`) is counted over the whole stage here."""
    n = problem.num_nodes
    strategy = np.asarray(strategy, dtype=np.int64)
    served_until, _ = _lifetimes(problem, recompute_at or {}, problem.operands())
    memory = problem.memory_of(strategy)
    out = [(int(memory[i]), c, min(until, n))
           for i in range(n) if problem.phase[i] != Phase.PARAM and memory[i]
           for c, until in served_until[i].items()]
    gathered = problem.gathered_of(strategy)
    return out + [(int(gathered[t]), int(t), int(t)) for t in np.flatnonzero(gathered)]


def _lifetimes(problem: ShardingProblem, recompute_at, operands
               ) -> tuple[list[dict[int, int]], dict[tuple[int, int], int]]:
    """Per node, ``{stage a copy is created: last stage it serves}`` (the node's own stage and
    every recomputation; ``n`` for the step's outputs); ``operands``: ``problem.operands()``.
    And per copy ``(node, creation stage)`` that serves a use, its last reader: the node whose
    recomputation or run in that last stage reads it last (``n`` for a step output).

    Raises:
      ValueError: a recomputation of a node that is not a forward node, or outside the stages
        after its own.
    """
    n = problem.num_nodes
    creations = [[i] for i in range(n)]
    for i, stages in recompute_at.items():
        if problem.phase[i] != Phase.FORWARD:
            raise ValueError(f"{problem.names[i]} is not a forward node; only forward values "
                             "are recomputed")
        bad = [t for t in stages if t <= i or t >= n]
        if bad:
            raise ValueError(f"{problem.names[i]} cannot be recomputed in stage(s) {bad}: "
                             f"recomputations run after stage {i} and before stage {n}")
        creations[i] = sorted({i, *stages})

    served_until = [{c: c for c in cs} for cs in creations]
    recomputed_in: dict[int, list[int]] = {}
    for i in sorted(recompute_at):
        for t in recompute_at[i]:
            recomputed_in.setdefault(int(t), []).append(int(i))

    last_reader: dict[tuple[int, int], int] = {}
    param = (problem.phase == Phase.PARAM).tolist()

    def use(i: int, t: int, reader: int) -> None:
        if param[i]:
            return
        c = creations[i][bisect.bisect_right(creations[i], t) - 1]     # stage i <= t
        served_until[i][c] = max(served_until[i][c], t)
        last_reader[(i, c)] = reader                 # uses come in stage and node order

    for t in range(n):
        for i in recomputed_in.get(t, ()):
            for src in operands[i]:
                use(src, t, i)
        for src in operands[t]:
            use(src, t, t)
    for i in np.flatnonzero(problem.is_output):
        use(int(i), n, n)
    return served_until, last_reader


def copy_spans(problem: ShardingProblem, served_until, last_reader
               ) -> tuple[dict[tuple[int, int], tuple[int, int]],
                          dict[tuple[int, int], list[tuple[int, int, int]]]]:
    """Where each copy ``(node, creation stage)`` is alive: the stages it is alive through
    whole, ``(first, last)`` (first > last: none), and the stages it is alive in for part of,
    ``[(stage, first point, last point)]``.

    A stage runs its recomputations in node order, then its own node: a point is the node
    recomputed or run there. A copy is alive from its own point in its creation stage (a
    recomputed copy from its recomputation, the node's own copy from the node's run) to its
    last reader's point in its last stage (a recomputation there, or the stage's node): a
    chain's intermediate lives between two recomputations of its stage, a kept value a
    recomputation alone reads last dies once it has read it, as ``jax.checkpoint`` frees a
    residual, and a recomputed value lives from its recomputation on. The inputs (phase
    ``param``) and the step's outputs after their creation are alive whole."""
    n = problem.num_nodes
    whole: dict[tuple[int, int], tuple[int, int]] = {}
    parts: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, copies in enumerate(served_until):
        if problem.phase[i] == Phase.PARAM:
            whole[(i, i)] = (0, n)
            continue
        for c, until in copies.items():
            reader = last_reader.get((i, c), i)
            if until >= n:                                  # a step output
                whole[(i, c)], parts[(i, c)] = (c + 1, n), [(c, i, c)]
            elif c == until:
                whole[(i, c)], parts[(i, c)] = (c, c - 1), [(c, i, reader)]
            else:
                whole[(i, c)] = (c + 1, until - 1)
                parts[(i, c)] = [(c, i, c), (until, -1, reader)]
    return whole, parts


def _most_at_once(parts, memory) -> dict[int, tuple[int, int]]:
    """Per stage, the most bytes of the copies alive in part of it (:func:`copy_spans`) alive
    at once, and the point (node) where that is."""
    events: dict[int, list[tuple[int, int, int]]] = {}
    for (i, _), spans in parts.items():
        for stage, first, last in spans:
            events.setdefault(stage, []).extend([(first, 0, int(memory[i])),
                                                 (last, 1, -int(memory[i]))])
    most = {}
    for stage, stage_events in events.items():
        alive, best = 0, (0, -1)
        for node, _, change in sorted(stage_events):   # a copy is alive at its last reader
            alive += change
            if change > 0 and alive > best[0]:
                best = (alive, node)
        most[stage] = best
    return most


def overlapped_recomputations(recompute_at: dict[int, tuple[int, ...]], operands,
                               communication) -> list[tuple[int, int]]:
    """``(recomputed node, stage)`` of every recomputation that runs beside the communication of
    its stage's node (the overlap rule in the module notes).

    Args:
      recompute_at: per forward node, the stages where it is recomputed.
      operands: per node, the nodes it reads.
      communication: per node, seconds of its collectives and operand resharding.
    """
    by_stage: dict[int, list[int]] = {}
    for i, stages in recompute_at.items():
        for t in stages:
            by_stage.setdefault(int(t), []).append(int(i))
    return [(j, t) for t, nodes in sorted(by_stage.items()) if communication[t] > 0
            for j in sorted(_not_waited_for(t, nodes, operands)) if communication[j] <= 0]


def _not_waited_for(t: int, recomputed: list[int], operands) -> set[int]:
    """The recomputations of stage ``t`` that node t does not wait for: not read by it, nor by
    a recomputation of the stage it waits for."""
    here = set(recomputed)
    waited = set()
    stack = [j for j in operands[t] if j in here]
    while stack:
        j = stack.pop()
        if j not in waited:
            waited.add(j)
            stack.extend(k for k in operands[j] if k in here)
    return here - waited


def _hidden_seconds(pairs, compute, communication) -> float:
    """Seconds of recomputation that run beside a stage node's communication: per stage, the
    recomputations' compute up to the node's communication seconds."""
    per_stage: dict[int, float] = {}
    for j, t in pairs:
        per_stage[t] = per_stage.get(t, 0.0) + float(compute[j])
    return sum(min(float(communication[t]), seconds) for t, seconds in per_stage.items())
