"""Small hand-made and random train-step problems for the solver tests (numpy only).

Liveness (z, live, first backward use, last forward use) is computed here from the edges, on its
own, so that the tests do not lean on hlo_tools.
"""

from __future__ import annotations

import numpy as np

from solvers.problem import PHASES, ShardingProblem

PARAM, FORWARD, BACKWARD, OPTIMIZER = range(4)


def make_problem(phases, edges, compute, memory, comm=None, resharding=None, outputs=(),
                 layer=None, mesh_shape=(1, 2), opcodes=None) -> ShardingProblem:
    """A problem from per-node lists.

    Args:
      phases: phase index per node (topological order).
      edges: ``(src, dst)`` pairs; operand slots are numbered per destination.
      compute: per node, compute seconds per strategy.
      memory: per node, bytes per strategy.
      comm: per node, communication seconds per strategy (default zeros).
      resharding: per edge, a [src strategies, dst strategies] matrix (default zeros).
      outputs: ids of the step's outputs.
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
    for i in np.flatnonzero(phase == FORWARD):
        later = sorted(u for u in users[i] if phase[u] in (BACKWARD, OPTIMIZER))
        forward = [u for u in users[i] if phase[u] == FORWARD]
        fwd_last[i] = max(forward) if forward else i
        if later:
            z[i], first_bwd[i] = True, later[0]
    return ShardingProblem(
        names=tuple(f"n{i}" for i in range(n)),
        opcodes=tuple(opcodes) if opcodes else tuple("op" for _ in range(n)), phase=phase,
        layer=np.full(n, -1) if layer is None else np.array(layer),
        strategy_names=tuple(tuple(f"s{a}" for a in range(len(c))) for c in compute),
        compute=compute, comm=comm, memory=memory, edges=edge_array,
        resharding=tuple(np.array(r, float) for r in resharding), z=z, live=live,
        fwd_last_use=fwd_last, first_bwd_use=first_bwd, is_output=is_output,
        mesh_shape=mesh_shape, flops=np.ones(n), peak_flops=1e12)


def chain_problem() -> ShardingProblem:
    """p -> a -> b -> c (loss); backward gc, gb (reads b), ga (reads a); update of p.

    One strategy each. Kept, the peak is 312 bytes (stage 5: p, a, b, c, gc, gb); dropping a
    (compute 1 s) makes it 311 (stage 6: p, c, gb, a again, ga); dropping b (5 s) does not help.
    """
    phases = [PARAM, FORWARD, FORWARD, FORWARD, BACKWARD, BACKWARD, BACKWARD, OPTIMIZER]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (2, 5), (5, 6), (1, 6), (6, 7), (0, 7)]
    compute = [[0.0], [1.0], [5.0], [1.0], [1.0], [2.0], [2.0], [1.0]]
    memory = [[10], [100], [100], [1], [1], [100], [100], [10]]
    return make_problem(phases, edges, compute, memory, outputs=(3, 7))


def random_problem(seed: int, layers: int = 2, width: int = 2,
                   max_strategies: int = 3) -> ShardingProblem:
    """A random train-step-like problem: per layer a few forward ops, the mirrored backward
    ops reading them, an optimizer update per parameter; 1 to ``max_strategies`` strategies per
    node."""
    rng = np.random.default_rng(seed)
    phases, edges = [], []

    def node(phase, inputs):
        phases.append(phase)
        i = len(phases) - 1
        edges.extend((j, i) for j in inputs)
        return i

    x = node(PARAM, [])
    params = [node(PARAM, []) for _ in range(layers)]
    acts, h = [], x
    for layer in range(layers):
        ops = [node(FORWARD, [h, params[layer]])]
        for _ in range(width - 1):
            ops.append(node(FORWARD, [ops[-1]] + ([h] if rng.random() < 0.3 else [])))
        acts.append(ops)
        h = ops[-1]
    loss = node(FORWARD, [h])
    g = node(BACKWARD, [loss])
    grads = []
    for layer in reversed(range(layers)):
        for op in reversed(acts[layer]):
            g = node(BACKWARD, [g, op])
        grads.append(node(BACKWARD, [g, acts[layer][0]]))
    updates = [node(OPTIMIZER, [grad, params[layers - 1 - k]]) for k, grad in enumerate(grads)]
    n = len(phases)
    k = [1 if phases[i] == PARAM and i == x else int(rng.integers(1, max_strategies + 1))
         for i in range(n)]
    compute = [rng.uniform(0.5, 3.0, k[i]) for i in range(n)]
    comm = [rng.uniform(0.0, 1.0, k[i]) * (k[i] > 1) for i in range(n)]
    memory = [rng.integers(10, 100, k[i]) for i in range(n)]
    resharding = [rng.uniform(0.0, 2.0, (k[s], k[d])) * (rng.random() < 0.7) for s, d in edges]
    return make_problem(phases, edges, compute, memory, comm=comm, resharding=resharding,
                        outputs=(loss, *updates))


def layered_problem(layers: int = 2, window_comm: float = 1.5) -> ShardingProblem:
    """``layers`` identical layers x -> a -> b -> c (c feeds the next layer), a loss, and the
    mirrored backward: per layer gc (reads c), gb (reads b, issues a collective of
    ``window_comm`` seconds), ga (reads a). One strategy per node; a costs 1 s, b 2 s.

    Nodes of layer l: forward a, b, c then (after the loss) backward gc, gb, ga.
    """
    phases, edges, compute, memory, comm, layer = [], [], [], [], [], []

    def node(phase, inputs, seconds, nbytes, lay, collective=0.0):
        phases.append(phase)
        compute.append([seconds])
        memory.append([nbytes])
        comm.append([collective])
        layer.append(lay)
        edges.extend((j, len(phases) - 1) for j in inputs)
        return len(phases) - 1

    h = node(PARAM, [], 0.0, 10, -1)
    acts = []
    for lay in range(layers):
        a = node(FORWARD, [h], 1.0, 100, lay)
        b = node(FORWARD, [a], 2.0, 100, lay)
        h = node(FORWARD, [b], 0.5, 10, lay)
        acts.append((a, b, h))
    loss = node(FORWARD, [h], 0.5, 1, -1)
    g = node(BACKWARD, [loss], 0.5, 10, -1)
    for lay in reversed(range(layers)):
        a, b, c = acts[lay]
        g = node(BACKWARD, [g, c], 0.5, 10, lay)
        g = node(BACKWARD, [g, b], 1.0, 10, lay, collective=window_comm)
        g = node(BACKWARD, [g, a], 1.0, 10, lay)
    node(OPTIMIZER, [g, 0], 0.5, 10, -1)
    return make_problem(phases, edges, compute, memory, comm=comm, layer=layer,
                        outputs=(loss, len(phases) - 1))
