"""Lynx: recomputation hidden under collectives.

A sharding plan fixes every operator's collectives; while a collective runs, the device's compute
units are idle, and a forward value dropped after the forward pass can be recomputed there for
free. Two programs decide which values to drop and where to recompute them:

- Lynx-HEU (:func:`heu_policy`, :func:`lynx_heu`): one program for one representative layer,
  applied to every identical layer. Phases: the layer's forward collectives (windows in the
  forward pass of a later micro-batch, pipeline stages other than the last only), its backward
  collectives (the backward pass of the layer after it runs just before its own), and on demand
  (on the critical path). Lynx has two of each with Megatron's tensor parallelism; here there is
  one window per collective of the plan, which is Lynx's five phases for that layout.
- Lynx-OPT (:func:`lynx_opt`): the staged program over the whole graph (KIWI's full program with
  the sharding fixed, :mod:`solvers.full`) with the overlap credit of Lynx's objective: in the
  stage of a node with a collective, recomputations of operators without collectives that the
  node does not read hide under it, up to its communication time. Small graphs only.

Both return a :class:`~solvers.solution.Solution` with ``hidden_under`` (each overlapped
recomputation's collective node) and are judged by :func:`solvers.simulator.simulate` with
``overlap=True``.

References:
  Lynx (sec. 4.1, Table 2: D1-D4, M1-M4, C1-C2 and eq. 1; sec. 4.2, eq. 2-9); KIWI (Liu et al.),
  eq. 1 and appendix eq. 12-23 (the staged program Lynx-OPT extends).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from solvers.backend import DEFAULT_BACKEND, Model
from solvers.full import build_full
from solvers.linexpr import Expr, const, total, var
from solvers.options import DEFAULTS
from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.simulator import overlapped_recomputations, simulate
from solvers.solution import (InfeasibleBudgetError, Solution, SolverError, Status, gap_to,
                              status_within_gap)

__all__ = ["LayerOps", "LayerPolicy", "layer_ops", "heu_policy", "policy_from_keep", "lynx_heu",
           "lynx_opt", "split_costs", "fixed_strategy"]

log = logging.getLogger(__name__)
WINDOW_PENALTY = 1e-3
"""Objective weight of overlapped recomputation (Lynx's is 0): among plans with the same
critical path, keep what memory allows."""


def split_costs(problem: ShardingProblem, strategy) -> tuple[np.ndarray, np.ndarray]:
    """``(compute, communication)`` seconds per node under ``strategy``: communication is the
    node's own collectives plus the resharding of its operands."""
    compute, comm, reshard = problem.costs_of(strategy)
    return compute, comm + reshard


def fixed_strategy(problem: ShardingProblem, strategy) -> ShardingProblem:
    """The same problem with each node's strategy fixed to ``strategy`` (one option each)."""
    strategy = np.asarray(strategy)
    pick = [np.asarray(v)[[s]] for v, s in zip(problem.compute, strategy)]
    return dataclasses.replace(
        problem, compute=tuple(pick),
        comm=tuple(np.asarray(c)[[s]] for c, s in zip(problem.comm, strategy)),
        memory=tuple(np.asarray(m)[[s]] for m, s in zip(problem.memory, strategy)),
        strategy_names=tuple((n[s],) for n, s in zip(problem.strategy_names, strategy)),
        resharding=tuple(r[[strategy[a]]][:, [strategy[b]]]
                         for r, (a, b, _slot) in zip(problem.resharding, problem.edges)),
        gathered=tuple(g[[strategy[a]]][:, [strategy[b]]]
                       for g, (a, b, _slot) in zip(problem.gathered, problem.edges)),
        carried_resharding=tuple(r[[strategy[v]]][:, [strategy[p]]]
                                 for r, (v, p) in zip(problem.carried_resharding,
                                                      problem.carried)),
        leader=np.arange(problem.num_nodes),
        follow=tuple(np.zeros(1, np.int64) for _ in range(problem.num_nodes)))


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """One representative layer's forward operators under a fixed sharding plan (per device)."""

    nodes: np.ndarray
    """Node ids in the problem (topological order)."""
    names: tuple[str, ...]
    """Their op_names (name scopes), for rule-based baselines."""
    compute: np.ndarray
    """Compute seconds of each operator (C_i)."""
    comm: np.ndarray
    """Communication seconds of each operator (its collectives and operand resharding)."""
    memory: np.ndarray
    """Output bytes of each operator (M_i)."""
    operands: tuple[tuple[int, ...], ...]
    """Per operator, its operands inside the layer (local indices); operands from outside the
    layer (parameters, the previous layer's output) are always available."""
    needed: np.ndarray
    """bool: read by the backward pass (must be kept or recomputed)."""
    pinned: np.ndarray
    """bool: kept in every policy (the layer's outputs, values alive throughout anyway)."""
    forward_windows: np.ndarray
    """Seconds of each forward collective of the layer (CTime_1, CTime_2 in Lynx)."""
    backward_windows: np.ndarray
    """Seconds of each backward collective of the layer (CTime_3, CTime_4 in Lynx)."""
    backward_window_nodes: np.ndarray
    """Node ids of the backward collectives (in the representative layer)."""
    forward_seconds: float
    """The layer's forward time, collectives included."""
    backward_seconds: float
    """The layer's backward time, collectives included."""

    @property
    def size(self) -> int:
        return len(self.nodes)

    def readers(self) -> list[list[int]]:
        """Per operator, the operators of the layer that read it (local indices)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        for i, ins in enumerate(self.operands):
            for j in ins:
                out[j].append(i)
        return out

    def kept_bytes(self, keep: np.ndarray) -> int:
        """Bytes one micro-batch holds from the forward to the backward pass."""
        return int(self.memory[keep].sum())


def layer_ops(problem: ShardingProblem, strategy, layer: int) -> LayerOps:
    """The forward operators of ``layer`` under ``strategy`` (see :class:`LayerOps`)."""
    compute, comm = split_costs(problem, strategy)
    memory = problem.memory_of(strategy)
    in_layer = problem.layer == layer
    fwd = np.flatnonzero(in_layer & (problem.phase == Phase.FORWARD))
    bwd = np.flatnonzero(in_layer & (problem.phase == Phase.BACKWARD))
    if not len(fwd):
        raise ValueError(f"layer {layer} has no forward operators")
    local = {int(n): k for k, n in enumerate(fwd)}
    operands = problem.operands()
    readers = problem.readers()
    crossing = np.array([any(problem.layer[r] != layer for r in readers[n]) for n in fwd])
    needed = problem.z[fwd].astype(bool)
    always_alive = needed & (problem.first_bwd_use[fwd] <= problem.fwd_last_use[fwd])
    pinned = crossing | always_alive | problem.is_output[fwd]
    windows = bwd[comm[bwd] > 0]
    ops = problem.op_names if problem.op_names else problem.names
    return LayerOps(
        nodes=fwd, names=tuple(ops[n] for n in fwd), compute=compute[fwd], comm=comm[fwd],
        memory=memory[fwd],
        operands=tuple(tuple(local[o] for o in operands[n] if o in local) for n in fwd),
        needed=needed, pinned=pinned,
        forward_windows=comm[fwd][comm[fwd] > 0], backward_windows=comm[windows],
        backward_window_nodes=windows,
        forward_seconds=float((compute + comm)[fwd].sum()),
        backward_seconds=float((compute + comm)[bwd].sum()))


@dataclasses.dataclass(frozen=True)
class LayerPolicy:
    """Which of a layer's forward values are kept, and where the others are recomputed."""

    keep: np.ndarray
    """bool per operator: held from the forward to the backward pass (S_i)."""
    phase: np.ndarray
    """int per operator: -1 not recomputed; 0..F-1 a forward window; F..W-1 a backward window;
    W (= :attr:`windows`) on demand."""
    forward_windows: int
    """F: forward windows the program could use (0 on a pipeline's last stage)."""
    windows: int
    """W: all windows (forward and backward)."""
    on_demand_seconds: float
    """Recomputation on the critical path, per layer and micro-batch."""
    overlapped_seconds: float
    """Recomputation hidden under collectives, per layer and micro-batch."""
    held_bytes: int
    """Bytes a micro-batch holds from its forward to its backward pass, per layer."""
    early_bytes: int
    """Bytes recomputed in forward windows (held one micro-batch early, Lynx eq. 9)."""
    status: Status = Status.OPTIMAL
    """Outcome of the program (rule-based policies: exact by construction)."""
    solve_seconds: float = 0.0
    """Wall time of the program."""
    num_vars: int = 0
    """Variables of the program."""
    num_constraints: int = 0
    """Constraints of the program."""

    @property
    def recomputed(self) -> np.ndarray:
        """bool per operator: recomputed somewhere."""
        return self.phase >= 0


def _closure(ops: LayerOps, keep: np.ndarray) -> np.ndarray:
    """bool per operator: recomputed when ``keep`` is held: needed values not kept, and the
    operands those recomputations read that are not kept (transitively)."""
    recompute = ops.needed & ~keep
    stack = list(np.flatnonzero(recompute))
    while stack:
        i = stack.pop()
        for j in ops.operands[i]:
            if not keep[j] and not recompute[j]:
                recompute[j] = True
                stack.append(j)
    return recompute


def _through_free(ops: LayerOps, free: np.ndarray) -> list[tuple[int, ...]]:
    """Per operator, its operands with free ones (no cost, not needed by the backward pass)
    replaced by their own operands: recomputing those costs nothing and holds nothing, so the
    program need not decide about them (Lynx sec. 6 groups small operators likewise)."""
    out: list[tuple[int, ...]] = []
    for ins in ops.operands:
        flat: list[int] = []
        for j in ins:
            flat.extend(out[j] if free[j] else (j,))
        out.append(tuple(dict.fromkeys(flat)))
    return out


def _policy(ops: LayerOps, keep: np.ndarray, phase: np.ndarray, forward_windows: int,
            windows: int, **stats) -> LayerPolicy:
    on_demand = phase == windows
    early = (phase >= 0) & (phase < forward_windows)
    hidden = (phase >= 0) & ~on_demand
    return LayerPolicy(
        keep=keep, phase=phase, forward_windows=forward_windows, windows=windows,
        on_demand_seconds=float((ops.compute + ops.comm)[on_demand].sum()),
        overlapped_seconds=float(ops.compute[hidden].sum()),
        held_bytes=ops.kept_bytes(keep), early_bytes=int(ops.memory[early].sum()), **stats)


def policy_from_keep(ops: LayerOps, keep) -> LayerPolicy:
    """A rule-based policy: hold ``keep`` (and the pinned values), recompute everything else
    the backward pass needs on demand (no overlap), with the operands it reads.

    Full recomputation is ``keep`` all False (only the layer's outputs stay), Megatron's selective
    recomputation drops the attention core.
    """
    keep = np.asarray(keep, bool) | ops.pinned
    phase = np.where(_closure(ops, keep), 0, -1)
    return _policy(ops, keep, phase, 0, 0)


def heu_policy(ops: LayerOps, activation_budget: float | None, layers: int = 1,
               in_flight: int = 1, forward_windows: bool = False,
               backend: str = DEFAULT_BACKEND, time_limit: float = 10.0,
               minimize_memory: bool = False, pooled: bool = True, seed: int = DEFAULTS.seed,
               threads: int = DEFAULTS.threads) -> LayerPolicy | None:
    """Lynx-HEU for one layer: choose S (keep) and the phase of every recomputation.

    Program (Lynx eq. 2-9): binaries S_i and R_{t,i} for phases t = windows, on demand;
    - eq. 3: a value the backward pass reads is kept or recomputed once (S_i + sum_t R_ti = 1);
      other values at most once (they are recomputed only as operands);
    - eq. 4: R_ti <= S_j + sum_{t' <= t} R_t'j for every operand j in the layer;
    - eq. 5: sum_i C_i R_ti <= CTime_t in every window; eq. 6: operators with collectives are
      recomputed on demand only;
    - eq. 7-9: layers x (in_flight x sum_i M_i S_i + sum_i M_i R_ti over forward windows)
      <= activation_budget;
    - eq. 2: minimise the on-demand recomputation seconds (plus WINDOW_PENALTY x the hidden
      seconds, so that memory left over keeps values rather than recomputing them for free).

    With ``pooled`` (default) the windows of a pass form one phase whose capacity is their sum,
    and the recomputations the program puts there are then packed into the pass's collectives
    first-fit in topological order (what does not fit, and what reads it, runs on demand): a
    layer with many collectives of equal length makes the per-window program symmetric, and on
    the 7B layer (16 windows) it took 2.4 s to prove where the pooled one takes a fraction.
    ``pooled=False`` is the per-window program as written in the paper.

    Args:
      ops: the layer.
      activation_budget: bytes the stage's activations may take (None: no limit).
      layers: identical layers the policy is applied to (N_layer).
      in_flight: micro-batches whose activations are held at the peak (N_batch).
      forward_windows: allow recomputation under forward collectives of a later micro-batch
        (pipeline stages other than the last).
      minimize_memory: minimise the held bytes instead (for the smallest feasible budget).
      pooled: one phase per pass instead of one per collective (see above).
      seed, threads: the backend's (see :class:`~solvers.options.SolverOptions`); the program
        is solved to a 1e-6 gap within ``time_limit``.

    Returns:
      The policy, or None when no policy fits the budget.
    """
    start = time.perf_counter()
    free = (ops.compute + ops.comm <= 0) & ~ops.needed & ~ops.pinned
    operands = _through_free(ops, free)
    decide = ~ops.pinned & ~free
    fwd = ops.forward_windows if forward_windows else np.zeros(0)
    windows = [fwd, ops.backward_windows]
    if pooled:
        caps = np.array([w.sum() for w in windows if len(w)])
        n_fwd = int(len(fwd) > 0)
    else:
        caps, n_fwd = np.concatenate(windows), len(fwd)
    n_phases = len(caps)
    model = Model()
    s_var = np.full(ops.size, -1)
    r_var = np.full((ops.size, n_phases + 1), -1)
    for i in np.flatnonzero(decide):
        s_var[i] = model.add_var()
        phases = [n_phases] if ops.comm[i] > 0 else range(n_phases + 1)
        for t in phases:
            r_var[i, t] = model.add_var()
        row = var(s_var[i]) + total(var(r_var[i, t]) for t in phases)
        model.add_row(row, 1.0 if ops.needed[i] else 0.0, 1.0)                 # eq. 3

    def recomputed_by(j: int, t: int) -> Expr:
        return total(var(r_var[j, u]) for u in range(t + 1) if r_var[j, u] >= 0)

    for i in np.flatnonzero(decide):                                            # eq. 4
        for j in operands[i]:
            if not decide[j]:
                continue
            for t in np.flatnonzero(r_var[i] >= 0):
                model.add_row(var(s_var[j]) + recomputed_by(j, int(t)) - var(r_var[i, t]),
                              0.0, np.inf)
    for t, cap in enumerate(caps):                                              # eq. 5
        rows = [var(r_var[i, t], ops.compute[i]) for i in np.flatnonzero(r_var[:, t] >= 0)]
        if rows:
            model.add_row(total(rows), -np.inf, float(cap))
    scale = float(max(ops.memory.max(initial=1), 1))
    pinned = float(ops.memory[ops.pinned].sum())
    held = total([const(layers * in_flight * pinned / scale)]
                 + [var(s_var[i], layers * in_flight * ops.memory[i] / scale)
                    for i in np.flatnonzero(decide)]
                 + [var(r_var[i, t], layers * ops.memory[i] / scale)
                    for i in np.flatnonzero(decide) for t in range(n_fwd) if r_var[i, t] >= 0])
    if activation_budget is not None and not minimize_memory:                   # eq. 7
        model.add_row(held, -np.inf, float(activation_budget) / scale)
    if minimize_memory:
        model.minimize(held)
    else:
        cost = ops.compute + ops.comm
        time_scale = float(max(cost.max(initial=0), 1e-12))
        model.minimize(total(
            [var(r_var[i, n_phases], cost[i] / time_scale) for i in np.flatnonzero(decide)]
            + [var(r_var[i, t], WINDOW_PENALTY * ops.compute[i] / time_scale)
               for i in np.flatnonzero(decide) for t in range(n_phases) if r_var[i, t] >= 0]))
    result = model.solve(backend, time_limit=time_limit, mip_gap=1e-6, seed=seed,
                         threads=threads)
    if result.x is None:
        if result.status not in (Status.INFEASIBLE, Status.TIMEOUT_NO_INCUMBENT):
            raise SolverError(f"lynx-heu: backend {backend} failed ({result.status.value})")
        return None
    x = np.round(result.x)
    keep = ops.pinned.copy()
    keep[decide] = x[s_var[decide]] > 0.5
    phase = np.full(ops.size, -1)
    for i, t in zip(*np.nonzero(r_var >= 0)):
        if x[r_var[i, t]] > 0.5:
            phase[i] = t
    n_windows = len(fwd) + len(ops.backward_windows)
    if pooled:
        phase = _pack(ops, operands, phase, windows, n_phases)
    readers = ops.readers()
    for j in reversed(np.flatnonzero(free)):      # free operands go with their first reader
        phase[j] = min((phase[r] for r in readers[j] if phase[r] >= 0), default=-1)
    return _policy(ops, keep, phase, len(fwd), n_windows, status=result.status,
                   solve_seconds=time.perf_counter() - start, num_vars=model.num_vars,
                   num_constraints=model.num_rows)


def _pack(ops: LayerOps, operands, pooled_phase: np.ndarray, windows, n_pools: int
          ) -> np.ndarray:
    """Per-window phases from pooled ones: first-fit in topological order into the pool's
    collectives, no earlier than the operands' windows; what does not fit, or reads something
    recomputed later, runs on demand."""
    on_demand = sum(len(w) for w in windows)
    phase = np.where(pooled_phase == n_pools, on_demand, -1)
    left = np.concatenate([np.asarray(w, float) for w in windows])
    bounds, offset = [], 0
    for caps in windows:
        if len(caps):
            bounds.append((offset, offset + len(caps)))
        offset += len(caps)
    for i in range(ops.size):
        if pooled_phase[i] < 0 or pooled_phase[i] == n_pools:
            continue
        first, stop = bounds[pooled_phase[i]]
        first = max([first, *(phase[j] for j in operands[i] if phase[j] >= 0)])
        fits = [w for w in range(first, stop) if left[w] + 1e-15 >= ops.compute[i]]
        if fits:
            phase[i] = fits[0]
            left[fits[0]] -= ops.compute[i]
        else:
            phase[i] = on_demand
    return phase


def _counterparts(problem: ShardingProblem, ops: LayerOps) -> dict[int, dict[int, int]]:
    """Per layer, reference node -> the node of that layer it corresponds to (operators whose
    costs differ from the reference's, such as a last layer's output feeding the head, have
    none: the policy keeps them in that layer)."""
    tie = problem.ties
    out: dict[int, dict[int, int]] = {}
    for i in np.flatnonzero(problem.layer >= 0):
        out.setdefault(int(problem.layer[i]), {})[int(tie[i])] = int(i)
    for layer, mapping in out.items():
        missing = sum(int(r) not in mapping for r in ops.nodes)
        if missing > ops.size // 2:
            raise ValueError(
                f"lynx-heu applies one layer's policy to every layer, but layer {layer} has no "
                f"counterpart for {missing} of the reference layer's {ops.size} forward "
                "operators: the layers are not identical (or the problem was built without its "
                "layer ties: solvers.reuse.with_layer_ties); use solver 'kiwi' or 'lynx-opt'")
        if missing:
            log.info("lynx-heu: layer %d keeps %d operators that differ from the reference "
                     "layer's", layer, missing)
    return out


def _schedule(problem: ShardingProblem, ops: LayerOps, policy: LayerPolicy,
              counterparts) -> dict[int, tuple[int, ...]]:
    """The whole graph's recomputation stages for a layer policy.

    A recomputation in backward window w of layer l runs in the stage of window w's collective
    in layer l + 1 (whose backward runs just before l's); on demand, or where layer l + 1 does
    not exist, in the stage of its first backward reader. Operands recomputed for another
    recomputation move as early as their readers.
    """
    n = problem.num_nodes
    readers = ops.readers()
    schedule: dict[int, tuple[int, ...]] = {}
    for layer, mapping in sorted(counterparts.items()):
        nodes = [mapping.get(int(r), -1) for r in ops.nodes]
        after = counterparts.get(layer + 1)
        stage = np.full(ops.size, n)
        for k in reversed(range(ops.size)):
            if policy.phase[k] < 0 or nodes[k] < 0:
                continue
            first_use = int(problem.first_bwd_use[nodes[k]]) if ops.needed[k] else n
            window = int(policy.phase[k]) - policy.forward_windows
            wanted = first_use
            if after is not None and 0 <= window < len(ops.backward_window_nodes):
                window_stage = after.get(int(ops.backward_window_nodes[window]), n)
                if window_stage > nodes[k]:
                    wanted = min(first_use, window_stage)
            stage[k] = min([wanted, *(stage[r] for r in readers[k] if policy.phase[r] >= 0)])
            if stage[k] < n:
                schedule[nodes[k]] = (int(stage[k]),)
    return schedule


def _solution(problem: ShardingProblem, strategy, schedule: dict[int, tuple[int, ...]],
              sim, **fields) -> Solution:
    """The typed answer of a Lynx program: keep flags, the window of each hidden recomputation
    (the simulator's overlap rule) and the simulated figures."""
    keep = np.ones(problem.num_nodes, bool)
    keep[list(schedule)] = False
    pairs = overlapped_recomputations(schedule, problem.operands(),
                                      split_costs(problem, strategy)[1])
    return Solution(
        strategy=strategy, keep=keep, recompute_at=schedule, peak_bytes=sim.peak_bytes,
        hidden_under=dict(pairs), overlapped_recompute_seconds=sim.overlapped_recompute_seconds,
        on_demand_recompute_seconds=sim.recompute_seconds, **fields)


def lynx_heu(problem: ShardingProblem, budget_bytes: int | None, strategy,
             backend: str = DEFAULT_BACKEND, time_limit: float = 10.0,
             seed: int = DEFAULTS.seed, threads: int = DEFAULTS.threads) -> Solution:
    """Lynx-HEU on a whole train step (one stage, one micro-batch: backward windows and on
    demand, as on Lynx's last pipeline stage): the sharding is fixed to ``strategy``, one layer's
    policy is solved and applied to every layer, and the simulator checks the step's peak; when
    it is over the budget, the activation budget is lowered by the excess and the layer solved
    again, and the layer's activation budget is also swept; the fastest plan that fits wins,
    and is polished by local moves on the whole step (:func:`_polish`; on 14 random layered
    graphs this took HEU from 0.84 to 0.94 of Lynx-OPT's throughput, median).

    ``backend``, ``time_limit`` (each layer program's), ``seed`` and ``threads`` go to every
    layer program (:func:`heu_policy`).

    Raises:
      InfeasibleBudgetError: no policy fits; carries the peak of the policy holding least.
      ValueError: the graph has no identical layers.
    """
    start = time.perf_counter()
    strategy = np.asarray(strategy)
    layers = np.unique(problem.layer[problem.layer >= 0])
    if not len(layers):
        raise ValueError("lynx-heu needs a model with repeated layers, found none: name scopes "
                         "layer_<i>, or numbered blocks of identical parameters in the "
                         "parameter tree (blocks[i], layers_i); use solver 'kiwi' or "
                         "'lynx-opt'")
    ops = layer_ops(problem, strategy, int(layers[0]))
    counterparts = _counterparts(problem, ops)
    keep_all = simulate(problem, strategy)
    held_all = len(layers) * ops.kept_bytes(ops.needed | ops.pinned)
    rest = keep_all.peak_bytes - held_all
    budget = None if budget_bytes is None else budget_bytes - rest
    program = {"backend": backend, "time_limit": time_limit, "seed": seed, "threads": threads}
    found: list[tuple[LayerPolicy, dict, object]] = []
    for _round in range(8):
        policy = heu_policy(ops, budget, layers=len(layers), **program)
        if policy is None:
            break
        found.append(_candidate(problem, strategy, ops, policy, counterparts))
        excess = 0 if budget_bytes is None else found[-1][2].peak_bytes - budget_bytes
        if excess <= 0:
            break
        budget -= excess
        log.info("lynx-heu: step peaks %d bytes over the budget; solving again", excess)
    if budget_bytes is not None and (len(found) != 1 or found[0][2].peak_bytes > budget_bytes):
        # lowering by the excess overshoots, and the peak is not monotone in the held bytes
        # (values recomputed together can peak above the ones they replace): sweep the layer's
        # activation budget as well and keep the fastest plan that fits
        found += _sweep(problem, strategy, ops, counterparts, len(layers), held_all, program)
    solves = sum(c[0].solve_seconds for c in found)
    fitting = [c for c in found if budget_bytes is None or c[2].peak_bytes <= budget_bytes]
    if not fitting:
        smallest = min([keep_all.peak_bytes] + [c[2].peak_bytes for c in found])
        raise InfeasibleBudgetError("lynx-heu", int(budget_bytes), int(smallest))
    policy, schedule, sim = min(fitting, key=lambda c: c[2].step_seconds)
    schedule, sim = _polish(problem, strategy, schedule, sim, budget_bytes)
    return _solution(
        problem, strategy, schedule, sim, solver="lynx-heu", backend=backend,
        status=policy.status, objective=sim.step_seconds, gap=0.0, solve_seconds=solves,
        build_seconds=time.perf_counter() - start - solves, num_vars=policy.num_vars,
        num_constraints=policy.num_constraints, budget_bytes=budget_bytes,
        claimed_peak_bytes=None)


def _polish(problem, strategy, schedule, sim, budget_bytes, seconds: float = 1.0):
    """Local moves on a whole-step schedule, judged by the simulator: the layer policy is sized
    with Lynx's memory model (every layer's activations held at the end of the forward pass),
    which overestimates the backward peaks of the whole step, and places recomputations by layer.
    Costliest recomputation first, each is kept again, or moved earlier into the stage of a
    backward collective (after its recomputed operands), whichever makes the step fastest within
    the budget; then swaps: a recomputed value kept again and a kept one (cheapest first)
    recomputed under a backward collective instead. Stops after ``seconds``. Returns
    ``(schedule, simulation)``."""
    if budget_bytes is None or not schedule:
        return schedule, sim
    compute, comm = split_costs(problem, strategy)
    cost = compute + comm
    windows = np.flatnonzero((comm > 0) & (problem.phase == Phase.BACKWARD))
    operands = problem.operands()
    deadline = time.perf_counter() + seconds

    def stages_for(node, schedule) -> list[int]:
        """Backward collectives' stages where ``node`` can be recomputed: after its last
        forward reader and its recomputed operands, before its first backward reader."""
        ready = max([problem.fwd_last_use[node]] + [schedule[o][0] for o in operands[node]
                                                     if o in schedule])
        return [int(t) for t in windows if ready < t < problem.first_bwd_use[node]]

    def better(trial) -> bool:
        nonlocal schedule, sim
        result = simulate(problem, strategy, recompute_at=trial, overlap=True)
        if result.step_seconds < sim.step_seconds and result.peak_bytes <= budget_bytes:
            schedule, sim = trial, result
            return True
        return False

    for node in sorted(schedule, key=lambda i: -cost[i]):
        if time.perf_counter() > deadline:
            break
        for stage in [None] + [t for t in stages_for(node, schedule) if t < schedule[node][0]]:
            trial = {i: stages for i, stages in schedule.items() if i != node}
            if stage is not None:
                trial[node] = (stage,)
            better(trial)
    # Swaps: keep a recomputed value again and drop a kept one instead, recomputed under a
    # backward collective (Lynx-OPT's plans differ from HEU's mostly in which value of a layer
    # is dropped and how early it is recomputed).
    kept = [int(j) for j in np.flatnonzero(problem.recomputable) if int(j) not in schedule]
    for node in sorted(schedule, key=lambda i: -cost[i]):
        for other in sorted(kept, key=lambda j: cost[j]):
            if time.perf_counter() > deadline:
                return schedule, sim
            if node not in schedule or other in schedule:
                continue
            rest = {i: stages for i, stages in schedule.items() if i != node}
            if any(better({**rest, other: (t,)}) for t in stages_for(other, rest)):
                kept = [j for j in kept if j != other] + [node]
    return schedule, sim


def _sweep(problem, strategy, ops, counterparts, layers, held_all, program: dict,
           points: int = 8) -> list[tuple[LayerPolicy, dict, object]]:
    """HEU policies for activation budgets from the least the layer can hold to all of it,
    with their schedules and simulations (the step's peak is not monotone in the held bytes:
    values recomputed together in the backward pass can peak above the ones they replace);
    ``program``: :func:`heu_policy`'s backend settings."""
    least = heu_policy(ops, None, layers=layers, minimize_memory=True, **program)
    if least is None:
        return []
    out = []
    for budget in np.linspace(layers * least.held_bytes, held_all, points):
        policy = heu_policy(ops, budget, layers=layers, **program)
        if policy is not None:
            out.append(_candidate(problem, strategy, ops, policy, counterparts))
    return out


def _candidate(problem, strategy, ops, policy: LayerPolicy, counterparts
               ) -> tuple[LayerPolicy, dict, object]:
    """A layer policy with the whole step's schedule and its simulation (overlap credited)."""
    schedule = _schedule(problem, ops, policy, counterparts)
    return policy, schedule, simulate(problem, strategy, recompute_at=schedule, overlap=True)


def lynx_opt(problem: ShardingProblem, budget_bytes: int | None, strategy,
             backend: str = DEFAULTS.backend, time_limit: float = DEFAULTS.time_limit,
             mip_gap: float = DEFAULTS.mip_gap, warm_start: Solution | None = None,
             seed: int = DEFAULTS.seed, threads: int = DEFAULTS.threads) -> Solution:
    """Lynx-OPT: the staged program over the whole graph with the sharding fixed, nodes with
    collectives as extra recomputation stages, and the overlap credit in the objective.

    Credit (Lynx eq. 1 and C2, exact for the simulator's rule): in the stage of node t with
    communication d_t, ``h_t <= d_t`` and ``h_t <= sum_i C_i q_ti`` over recomputations i
    without communication, where ``q_ti <= A_ti`` and ``q_ti <= 1 - w_ti``, and ``w_ti`` (node t
    waits for i) is forced to 1 when t reads i or a recomputation j of the stage that t waits
    for reads i: ``w_ti >= w_tj + A_ti - 1``. The objective is the staged program's minus
    ``sum_t h_t``.

    The gap is against the larger of the backend's bound and the step that keeps everything
    (no plan with the sharding fixed is faster).

    Args:
      warm_start: a plan with the same sharding to start from (e.g. :func:`lynx_heu`'s).
      backend, time_limit, mip_gap, seed, threads: the backend's (see
        :class:`~solvers.options.SolverOptions`).
    """
    start = time.perf_counter()
    strategy = np.asarray(strategy)
    fixed = fixed_strategy(problem, strategy)
    compute, comm = split_costs(fixed, np.zeros(problem.num_nodes, np.int64))
    staged = build_full(fixed, budget_bytes, recompute_stages=comm > 0)
    model, a = staged.model, staged.a_vars
    operands = fixed.operands()
    readers = fixed.readers()
    units = staged.units.seconds
    credit = []
    for t in np.flatnonzero(comm > 0):
        t = int(t)
        here = sorted(i for (u, i) in a if u == t)
        if not here:
            continue
        wait = {i: model.add_var(ub=1.0, integer=False) for i in here}
        reads = set(operands[t])
        free = []
        for i in here:
            if i in reads:
                model.add_row(var(wait[i]) - var(a[t, i]), 0.0, np.inf)
            for j in readers[i]:
                if j in wait:
                    model.add_row(var(wait[i]) - var(wait[j]) - var(a[t, i]), -1.0, np.inf)
            if comm[i] <= 0 and compute[i] > 0:
                q = model.add_var(ub=1.0, integer=False)
                model.add_row(var(q) - var(a[t, i]), -np.inf, 0.0)
                model.add_row(var(q) + var(wait[i]), -np.inf, 1.0)
                free.append(var(q, compute[i] / units))
        if free:
            h = model.add_var(lb=0.0, ub=comm[t] / units, integer=False,
                              resolution=staged.units.time_resolution)
            model.add_row(var(h) - total(free), -np.inf, 0.0)
            credit.append(var(h, -1.0))
    model.minimize(model.objective + total(credit))
    hint = staged.hint(fixed, np.zeros(problem.num_nodes, np.int64),
                       recompute_at=None if warm_start is None else warm_start.recompute_at)
    result = model.solve(backend, time_limit=time_limit, mip_gap=mip_gap, seed=seed,
                         threads=threads, hint=hint)
    # No plan with this sharding is faster than keeping everything: a recomputation runs at
    # least once more and its overlap credit is at most its compute. HiGHS's own bound on the
    # 2-layer GPT's program is no better after 60 s (its LP relaxation's optimum is the
    # objective's constant), so this one bounds the gap.
    keep_all = simulate(problem, strategy).step_seconds
    fields = {"solver": "lynx-opt", "backend": backend, "solve_seconds": result.seconds,
              "build_seconds": time.perf_counter() - start - result.seconds,
              "num_vars": model.num_vars, "num_constraints": model.num_rows,
              "budget_bytes": budget_bytes}
    if result.x is None:
        if result.status == Status.INFEASIBLE:
            raise InfeasibleBudgetError("lynx-opt", int(budget_bytes), None, searched=False)
        if warm_start is not None:
            return _warm_start_incumbent(problem, strategy, warm_start, keep_all, fields)
        raise SolverError(f"lynx-opt: no plan ({result.status.value}) in {time_limit:.0f} s")
    schedule = staged.schedule(result.x)
    sim = simulate(problem, strategy, recompute_at=schedule, overlap=True)
    status = status_within_gap(result.status, result.gap, mip_gap)
    objective = float(result.objective) * units
    return _solution(
        problem, strategy, schedule, sim, status=status, objective=objective,
        gap=0.0 if status == Status.OPTIMAL else _gap(objective, float(result.gap), keep_all),
        claimed_peak_bytes=staged.claimed_peak(result.x), **fields)


def _gap(objective: float, gap: float, keep_all: float) -> float:
    """The relative gap against the larger of the backend's bound (``gap`` from
    ``objective``; inf or nan: none) and the step that keeps everything."""
    return gap_to(objective, max(objective * (1 - gap) if np.isfinite(gap) else 0.0, keep_all))


def _warm_start_incumbent(problem, strategy, warm_start: Solution, keep_all: float,
                          fields) -> Solution:
    """The warm start as Lynx-OPT's answer when the backend stopped before it found (or
    accepted: HiGHS completes a partial start only once presolve is done) a plan of its own:
    the warm start is an incumbent, its gap against the step that keeps everything."""
    schedule = warm_start.recompute_at
    sim = simulate(problem, strategy, recompute_at=schedule, overlap=True)
    budget = fields["budget_bytes"]
    if budget is not None and sim.peak_bytes > budget:
        raise SolverError(f"lynx-opt: no plan in time, and the warm start peaks at "
                          f"{sim.peak_bytes} bytes, over the budget of {budget}")
    log.warning("lynx-opt: the backend found no plan within its time limit; returning the "
                "warm start (raise time_limit for a plan and a bound of its own)")
    return _solution(problem, strategy, schedule, sim, status=Status.TIMEOUT_WITH_INCUMBENT,
                     objective=sim.step_seconds,
                     gap=_gap(sim.step_seconds, float("inf"), keep_all),
                     claimed_peak_bytes=sim.peak_bytes, **fields)
