"""Small hand-made and random train-step problems for the solver tests (numpy only), built with
:func:`solvers.synthetic.make_problem` (which computes liveness from the edges on its own, so
that the tests do not lean on hlo_tools)."""

from __future__ import annotations

import numpy as np

from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.synthetic import layered_problem, make_problem  # noqa: F401 (re-exported)


def chain_problem(unit: int = 1) -> ShardingProblem:
    """p -> a -> b -> c (loss); backward gc, gb (reads b), ga (reads a); update of p.

    One strategy each. Kept, the peak is 312 bytes (stage 5: p, a, b, c, gc, gb); dropping a
    (compute 1 s) makes it 311 (stage 6: p, c, gb, a again, ga); dropping b (5 s) does not help.
    ``unit``: the bytes each of those bytes stands for.
    """
    phases = [Phase.PARAM, *[Phase.FORWARD] * 3, *[Phase.BACKWARD] * 3, Phase.OPTIMIZER]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (2, 5), (5, 6), (1, 6), (6, 7), (0, 7)]
    compute = [[0.0], [1.0], [5.0], [1.0], [1.0], [2.0], [2.0], [1.0]]
    memory = [[m * unit for m in row] for row in
              [[10], [100], [100], [1], [1], [100], [100], [10]]]
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

    x = node(Phase.PARAM, [])
    params = [node(Phase.PARAM, []) for _ in range(layers)]
    acts, h = [], x
    for layer in range(layers):
        ops = [node(Phase.FORWARD, [h, params[layer]])]
        for _ in range(width - 1):
            ops.append(node(Phase.FORWARD, [ops[-1]] + ([h] if rng.random() < 0.3 else [])))
        acts.append(ops)
        h = ops[-1]
    loss = node(Phase.FORWARD, [h])
    g = node(Phase.BACKWARD, [loss])
    grads = []
    for layer in reversed(range(layers)):
        for op in reversed(acts[layer]):
            g = node(Phase.BACKWARD, [g, op])
        grads.append(node(Phase.BACKWARD, [g, acts[layer][0]]))
    updates = [node(Phase.OPTIMIZER, [grad, params[layers - 1 - k]])
               for k, grad in enumerate(grads)]
    n = len(phases)
    k = [1 if phases[i] == Phase.PARAM and i == x else int(rng.integers(1, max_strategies + 1))
         for i in range(n)]
    compute = [rng.uniform(0.5, 3.0, k[i]) for i in range(n)]
    comm = [rng.uniform(0.0, 1.0, k[i]) * (k[i] > 1) for i in range(n)]
    memory = [rng.integers(10, 100, k[i]) for i in range(n)]
    resharding = [rng.uniform(0.0, 2.0, (k[s], k[d])) * (rng.random() < 0.7) for s, d in edges]
    return make_problem(phases, edges, compute, memory, comm=comm, resharding=resharding,
                        outputs=(loss, *updates))
