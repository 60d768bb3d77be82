"""Layer ties: counterparts by structure, never by position alone."""

import dataclasses

import numpy as np
import pytest

from solvers.reuse import layer_ties, with_layer_ties
from solvers.phase import Phase
from solvers.synthetic import make_problem

KINDS = ("start", "scale", "end")
"""Each block: an add starting it, a multiply, an add ending it (a chain x -> a -> m -> e)."""


def _blocks(layers: list[int]):
    """Three chained blocks and a loss; ``layers`` gives each of the 9 block nodes' layer."""
    phases, edges, compute, memory, opcodes, kinds = [Phase.PARAM], [], [[0.0]], [[10]], ["param"], [""]
    for _ in range(3):
        for kind in KINDS:
            edges.append((len(phases) - 1, len(phases)))
            phases.append(Phase.FORWARD)
            compute.append([2.0 if kind == "scale" else 1.0])
            memory.append([100])
            opcodes.append("multiply" if kind == "scale" else "add")
            kinds.append(kind)
    edges.append((len(phases) - 1, len(phases)))
    phases.append(Phase.FORWARD)
    compute.append([0.5])
    memory.append([1])
    opcodes.append("reduce")
    kinds.append("")
    layer = [-1, *layers, -1]
    problem = make_problem(phases, edges, compute, memory, outputs=(len(phases) - 1,),
                           layer=layer, opcodes=opcodes)
    return problem, kinds


def test_identical_layers_tie_every_operator_to_its_counterpart():
    problem, kinds = _blocks([0, 0, 0, 1, 1, 1, 2, 2, 2])
    tie = layer_ties(problem)
    for i in np.flatnonzero(problem.layer >= 1):
        assert problem.layer[tie[i]] == 0 and kinds[tie[i]] == kinds[i]


@pytest.mark.parametrize("layers", [
    [0, 0, 0, -1, 1, 1, 1, -1, -1],       # layer 1 found one operator late: scale, end, start
    [0, 0, 0, 0, 1, 1, 1, 1, -1],         # layer 0 took layer 1's start, layer 1 layer 2's
])
def test_a_misplaced_boundary_ties_nothing_to_the_wrong_operator(layers):
    problem, kinds = _blocks(layers)
    tie = layer_ties(problem)
    tied = [i for i in range(problem.num_nodes) if tie[i] != i]
    assert all(kinds[tie[i]] == kinds[i] for i in tied), [(kinds[i], kinds[tie[i]])
                                                          for i in tied]


def test_each_stack_of_layers_ties_to_its_own_first_layer():
    # an encoder's two blocks (add, multiply, add) then a decoder's two (add, multiply,
    # exponential, multiply, add), chained
    opcode = {"start": "add", "scale": "multiply", "gate": "exponential", "mix": "multiply",
              "end": "add"}
    blocks = [("start", "scale", "end")] * 2 + [("start", "scale", "gate", "mix", "end")] * 2
    phases, edges, compute, memory = [Phase.PARAM], [], [[0.0]], [[10]]
    opcodes, kinds, layer = ["param"], [""], [-1]
    for number, block in enumerate(blocks):
        for kind in block:
            edges.append((len(phases) - 1, len(phases)))
            phases.append(Phase.FORWARD)
            compute.append([1.0 + KINDS.index(kind) if kind in KINDS else 4.0])
            memory.append([100])
            opcodes.append(opcode[kind])
            kinds.append(kind)
            layer.append(number)
    problem = make_problem(phases, edges, compute, memory, outputs=(len(phases) - 1,),
                           layer=layer, opcodes=opcodes)
    tie = layer_ties(problem)
    for i in np.flatnonzero(problem.layer >= 0):
        twin = int(tie[i])
        assert kinds[twin] == kinds[i]
        assert problem.layer[twin] == {0: 0, 1: 0, 2: 2, 3: 2}[int(problem.layer[i])], i


def test_updates_outside_layers_tie_to_the_same_parameters_not_to_its_shape():
    """Adam's bias correction: one scalar broadcast to each parameter's shape, outside layer
    scope. Layer 1's broadcast for a parameter ties to layer 0's for the same parameter, the
    first shape's or not, and two parameters of one shape keep their own."""
    shapes = {"a": [100, 50], "b": [100, 50], "c": [40, 20]}        # b is a's shape, c not
    names, phases, edges, memory, opcodes, layer = [], [], [], [], [], []

    def node(name, phase, op, bytes_, at=-1, reads=()):
        names.append(name)
        phases.append(phase)
        memory.append(bytes_)
        opcodes.append(op)
        layer.append(at)
        edges.extend((src, len(names) - 1) for src in reads)
        return len(names) - 1

    count = node("count", Phase.PARAM, "parameter", [4, 4])
    scalar = node("correction", Phase.OPTIMIZER, "power", [4, 4], reads=[count])
    roles = {}
    for at in (0, 1):
        for p, shape in shapes.items():
            weight = node(f"blocks/{at}/{p}", Phase.PARAM, "parameter", shape)
            out = node(f"blocks/{at}/{p}/use", Phase.FORWARD, "tanh", shape, at, [weight])
            grad = node(f"blocks/{at}/{p}/grad", Phase.BACKWARD, "multiply", shape, at, [out])
            bcast = node(f"b{at}{p}", Phase.OPTIMIZER, "broadcast", shape, reads=[scalar])
            ratio = node(f"u{at}{p}", Phase.OPTIMIZER, "divide", shape, reads=[grad, bcast])
            new = node(f"w{at}{p}", Phase.OPTIMIZER, "subtract", shape, reads=[weight, ratio])
            roles[at, p] = {"broadcast": bcast, "divide": ratio, "subtract": new}
    problem = make_problem(phases, edges, [[1.0, 1.0]] * len(names), memory, layer=layer,
                           opcodes=opcodes, outputs=[r["subtract"] for r in roles.values()])
    problem = with_layer_ties(dataclasses.replace(problem, names=tuple(names)))
    tie = problem.ties
    for p in shapes:
        for kind, i in roles[1, p].items():
            assert tie[i] == roles[0, p][kind], (p, kind)
    assert tie[roles[0, "b"]["broadcast"]] != roles[0, "a"]["broadcast"]     # roles kept apart
