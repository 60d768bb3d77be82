"""Small synthetic train-step problems (numpy only): for tests, and for studies that need
graphs small enough for the staged programs to be solved to optimality.

Liveness (z, live, first backward use, last forward use) is computed here from the edges, on its
own, so that tests built on these graphs do not lean on hlo_tools.
"""

from __future__ import annotations

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.reuse import with_layer_ties

__all__ = ["make_problem", "layered_problem"]


def make_problem(phases, edges, compute, memory, comm=None, resharding=None, outputs=(),
                 layer=None, mesh_shape=(1, 2), opcodes=None) -> ShardingProblem:
    """A problem from per-node lists.

    Args:
      phases: :class:`~solvers.phase.Phase` per node (topological order).
      edges: ``(src, dst)`` pairs; operand slots are numbered per destination.
      compute: per node, compute seconds per strategy.
      memory: per node, bytes per strategy.
      comm: per node, communication seconds per strategy (default zeros).
      resharding: per edge, a [src strategies, dst strategies] matrix (default zeros).
      outputs: ids of the step's outputs.

    Returns:
      The problem, its layer ties filled (:func:`solvers.reuse.with_layer_ties`).
    """
    n = len(phases)
    phase = np.array(phases, np.int8)
    compute = tuple(np.array(c, float) for c in compute)
    memory = tuple(np.array(m, np.int64) for m in memory)
    comm = tuple(np.zeros(len(c)) for c in compute) if comm is None \
        else tuple(np.array(c, float) for c in comm)
    slots: dict[int, int] = {}
    edge_rows = []
    for src, dst in edges:
        edge_rows.append((src, dst, slots.get(dst, 0)))
        slots[dst] = slots.get(dst, 0) + 1
    edge_array = np.array(edge_rows, np.int64).reshape(-1, 3)
    if resharding is None:
        resharding = [np.zeros((len(compute[s]), len(compute[d]))) for s, d in edges]
    users = [[] for _ in range(n)]
    for src, dst in edges:
        users[src].append(dst)
    is_output = np.zeros(n, bool)
    is_output[list(outputs)] = True
    live = np.array([max(u) if u else i for i, u in enumerate(users)])
    live[is_output] = n
    z = np.zeros(n, bool)
    fwd_last = np.full(n, -1)
    first_bwd = np.full(n, -1)
    for i in np.flatnonzero(phase == Phase.FORWARD):
        later = sorted(u for u in users[i] if phase[u] in (Phase.BACKWARD, Phase.OPTIMIZER))
        forward = [u for u in users[i] if phase[u] == Phase.FORWARD]
        fwd_last[i] = max(forward) if forward else i
        if later:
            z[i], first_bwd[i] = True, later[0]
    return with_layer_ties(ShardingProblem(
        names=tuple(f"n{i}" for i in range(n)),
        opcodes=tuple(opcodes) if opcodes else tuple("op" for _ in range(n)), phase=phase,
        layer=np.full(n, -1) if layer is None else np.array(layer),
        strategy_names=tuple(tuple(f"s{a}" for a in range(len(c))) for c in compute),
        compute=compute, comm=comm, memory=memory, edges=edge_array,
        resharding=tuple(np.array(r, float) for r in resharding), z=z, live=live,
        fwd_last_use=fwd_last, first_bwd_use=first_bwd, is_output=is_output,
        mesh_shape=mesh_shape, flops=np.ones(n), peak_flops=1e12))


def layered_problem(layers: int = 2, window_comm: float = 1.5, seed: int | None = None,
                    width: int = 3) -> ShardingProblem:
    """``layers`` identical layers of ``width`` chained forward operators (the last feeds the
    next layer), a loss, and the mirrored backward: one backward operator per forward one,
    reading it; one strategy per node.

    Without ``seed``: width 3, operators a (1 s, 100 B), b (2 s, 100 B), c (0.5 s, 10 B); b's
    backward reader issues a collective of ``window_comm`` seconds. With ``seed``: random
    seconds (0.2-3), bytes (20-200) and collectives (on about half the backward operators,
    0.5-3 s), the same in every layer.
    """
    rng = np.random.default_rng(seed)
    if seed is None:
        width = 3
        f_sec, f_bytes = [1.0, 2.0, 0.5], [100, 100, 10]
        b_sec, b_comm = [1.0, 1.0, 0.5], [0.0, window_comm, 0.0]
    else:
        f_sec = rng.uniform(0.2, 3.0, width).round(2).tolist()
        f_bytes = rng.integers(20, 200, width).tolist()
        b_sec = rng.uniform(0.2, 3.0, width).round(2).tolist()
        b_comm = (rng.uniform(0.5, 3.0, width) * (rng.random(width) < 0.5)).round(2).tolist()
    phases, edges, compute, memory, comm, layer = [], [], [], [], [], []

    def node(phase, inputs, seconds, nbytes, lay, collective=0.0):
        phases.append(phase)
        compute.append([seconds])
        memory.append([nbytes])
        comm.append([collective])
        layer.append(lay)
        edges.extend((j, len(phases) - 1) for j in inputs)
        return len(phases) - 1

    h = node(Phase.PARAM, [], 0.0, 10, -1)
    acts = []
    for lay in range(layers):
        ops = []
        for k in range(width):
            h = node(Phase.FORWARD, [h], f_sec[k], f_bytes[k], lay)
            ops.append(h)
        acts.append(ops)
    loss = node(Phase.FORWARD, [h], 0.5, 1, -1)
    g = node(Phase.BACKWARD, [loss], 0.5, 10, -1)
    for lay in reversed(range(layers)):
        for k in reversed(range(width)):
            g = node(Phase.BACKWARD, [g, acts[lay][k]], b_sec[k], 10, lay, collective=b_comm[k])
    node(Phase.OPTIMIZER, [g, 0], 0.5, 10, -1)
    return make_problem(phases, edges, compute, memory, comm=comm, layer=layer,
                        outputs=(loss, len(phases) - 1))
