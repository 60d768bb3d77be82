"""Layers of models written without name scopes, found from their parameter trees, and the
tied program they give (see hlo_tools.layers)."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import solvers
from experiments.zoo.llama import Llama
from experiments.zoo.llama import make as llama
from hlo_tools.graph import Phase, _layer_of
from hlo_tools.layers import layer_report, path_components
from kiwi_jax.frontend import problem_for_step, trace
from kiwi_jax.models import build
from solvers.heuristics import attention_core, keep_megatron
from solvers.joint import build_joint
from user_models import CompactNet, linen

_DIGITS = re.compile(r"\d+")

MODELS = {
    "nnx-llama": (lambda layers: llama(layers=layers), r"\['layers'\]\[(\d+)\]"),
    "linen-setup-list": (lambda layers: linen(n_layers=layers), r"layers_(\d+)"),
    "linen-compact": (lambda layers: linen(CompactNet, n_layers=layers), r"MixerBlock_(\d+)"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    make, member = MODELS[request.param]
    graph = trace(*_unpack(make(3))).graph
    return request.param, graph, member


def _unpack(made):
    step, args = made
    return (step, *args)


def test_one_layer_per_block_and_every_block_operator_in_it(model):
    name, graph, member = model
    report = layer_report(graph)
    assert report.layers == 3 and report.uniform, report
    assert report.fraction_in_layers > 0.65, report
    for node in graph.nodes:
        if node.phase == Phase.FORWARD and node.opcode == "dot":
            reads = [graph.nodes[o] for o in node.operands if graph.nodes[o].phase == Phase.PARAM]
            paths = [r.op_name.replace("\\", "") for r in reads]
            blocks = {int(m[1]) for path in paths if (m := re.search(member, path))}
            if reads:                   # a block's weight, or the embedding's or head's
                assert {node.layer} == (blocks or {-1}), (name, node.name, node.op_name)
    for layer in range(3):
        assert set(report.nodes[layer]) == {"param", "forward", "backward", "optimizer"}


@pytest.mark.parametrize("which", ["linen-setup-list", "linen-compact"])
def test_linen_layers_are_its_module_scopes(which):
    make, member = MODELS[which]
    graph = trace(*_unpack(make(3))).graph
    scope = re.compile(rf"/{member.replace('(', '(?P<i>', 1)}/")
    for node in graph.nodes:
        if node.phase in (Phase.FORWARD, Phase.BACKWARD):
            found = scope.search(node.op_name)
            assert node.layer == (int(found["i"]) if found else -1), (node.name, node.op_name)


def test_nnx_layers_are_the_named_scopes_a_planner_user_would_add(monkeypatch):
    plain = trace(*_unpack(llama(layers=3))).graph

    def scoped(self, tokens):
        positions = jnp.arange(tokens.shape[1])
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x = layer(x, positions)
        return self.output(self.norm(x))

    monkeypatch.setattr(Llama, "__call__", scoped)
    with_scopes = trace(*_unpack(llama(layers=3))).graph
    assert [n.opcode for n in plain.nodes] == [n.opcode for n in with_scopes.nodes]
    compared = 0
    for a, b in zip(plain.nodes, with_scopes.nodes):
        if a.phase in (Phase.FORWARD, Phase.BACKWARD) and _layer_of(b.op_name) >= 0:
            assert a.layer == _layer_of(b.op_name), (a.name, b.op_name)
            compared += 1
    assert compared > 600


def test_optimizer_state_and_updates_follow_their_weights():
    graph = trace(*_unpack(llama(layers=2))).graph
    for p in graph.parameters:
        node = graph.nodes[p]
        path = path_components(node.op_name)
        if "layers" in path and ("mu" in path or "nu" in path or "opt_state" not in path):
            assert node.layer == path[path.index("layers") + 1], path
        elif "opt_state" in path or "tok_embeddings" in path:
            assert node.layer == -1, path
    updates = [n for n in graph.nodes if n.phase == Phase.OPTIMIZER and n.layer >= 0]
    assert {n.layer for n in updates} == {0, 1}
    assert len([n for n in updates if n.layer == 0]) == len([n for n in updates if n.layer == 1])


@pytest.fixture(scope="module")
def linen2():
    build, _ = problem_for_step(*_unpack(linen(n_layers=2)), mesh="2x4")
    return build


def test_layer_ties_cover_the_repeated_layer(linen2):
    problem = linen2.problem
    tie = problem.ties
    second = np.flatnonzero(problem.layer == 1)
    tied = second[tie[second] != second]
    assert len(tied) / len(second) > 0.9
    assert (problem.layer[tie[tied]] == 0).all()
    # an input is tied only to the same input of another layer: not Adam's moments of a weight
    # to the weight, nor the optimizer's count to the step, as they were by shape (46% of the
    # operators were tied then, 30% now, with the layers' all still tied)
    names = [_DIGITS.sub("#", name) for name in problem.op_names or problem.names]
    inputs = np.flatnonzero((problem.phase == Phase.PARAM) & (tie != np.arange(len(tie))))
    assert len(inputs) and all(names[i] == names[tie[i]] for i in inputs)
    assert (tie != np.arange(len(tie))).mean() > 0.3


def test_the_tied_program_is_smaller_and_solves(linen2):
    problem = linen2.problem
    reference = solvers.reference_plan(problem)
    budget = int(0.9 * reference.peak_bytes)
    tied = build_joint(problem, budget, tie=problem.ties).model.num_vars
    untied = build_joint(problem, budget, tie=None).model.num_vars
    assert tied < 0.7 * untied
    start = time.perf_counter()
    plan = solvers.solve(problem, budget, solver="kiwi", reuse_layers=True, time_limit=60)
    assert time.perf_counter() - start < 90
    assert plan.num_vars <= tied     # rows the replay does not ask for are left out
    sim = solvers.simulate(problem, plan.strategy, recompute_at=plan.recompute_at)
    assert sim.peak_bytes <= budget
    assert sim.step_seconds == pytest.approx(plan.objective, rel=1e-6)


def test_an_nnx_model_with_one_block_has_no_layers():
    graph = trace(*_unpack(llama(layers=1))).graph
    assert {n.layer for n in graph.nodes} == {-1}


def test_alpa_megatron_finds_the_attention_core_without_scopes():
    build, _ = problem_for_step(*_unpack(llama(layers=2)), mesh="2x4")
    problem = build.problem
    core = attention_core(problem)
    for layer in (0, 1):
        ops = [problem.opcodes[i] for i in np.flatnonzero(core & (problem.layer == layer))]
        assert ops.count("dot") == 2 and "exponential" in ops      # scores, softmax, P V
    recomputed = ~keep_megatron(problem)
    assert recomputed.any() and not (recomputed & ~core).any()


def test_the_structural_attention_core_holds_the_scoped_one():
    ref = build("gpt", layers=2, hidden=32, heads=2, seq=8, batch=4, vocab=64)
    made, _ = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                               mesh="2x4")
    problem, graph = made.problem, made.graph
    scoped = np.array(["attention_core" in name for name in problem.op_names])
    scoped &= problem.phase == Phase.FORWARD
    found = attention_core(problem)
    assert (found >= scoped).all()
    extra = {(graph.nodes[i].opcode, graph.nodes[i].op_name == "") for i in np.flatnonzero(
        found & ~scoped)}
    # beyond the scope: constants only the core reads, and the merge of the heads (a view)
    assert extra <= {("constant", True), ("broadcast", True), ("reshape", False)}


def test_an_encoder_decoders_layers_are_both_stacks_module_scopes():
    """The zoo's Linen encoder-decoder: the encoder's blocks are layers 0-1, the decoder's
    2-3; a node is never put in another block's layer. Some of a block's nodes stay outside
    layers: its attention mask, built from the batch's padding, which every layer builds
    alike, and the sums of the decoder layers' terms of the encoder output's gradient."""
    from experiments.zoo import encdec

    graph = trace(*_unpack(encdec.make(layers=2))).graph
    scopes = (re.compile(r"/encoder/EncoderLayer_(\d+)/"),
              re.compile(r"/decoder/DecoderLayer_(\d+)/"))
    scoped = outside = 0
    for node in graph.nodes:
        if node.phase not in (Phase.FORWARD, Phase.BACKWARD):
            continue
        found = [(k, int(m[1])) for k, scope in enumerate(scopes)
                 if (m := scope.search(node.op_name))]
        want = found[0][1] + 2 * found[0][0] if found else -1
        assert node.layer in (want, -1), (node.name, node.op_name)
        scoped += want >= 0
        outside += want >= 0 and node.layer < 0
    assert outside < 0.03 * scoped, (outside, scoped)
    report = layer_report(graph)
    assert report.layers == 4 and report.structure[0] == report.structure[1] != \
        report.structure[2]


def test_a_resnets_blocks_of_both_stages_are_its_layers():
    """The zoo's Linen ResNet: stage 1's two blocks repeat, stage 2's first block adds a
    projection and its blocks are wider; all four are layers. Nodes of the last block after
    its last weight read (the end of a layer is matched against the layer before's, which
    differs here) stay outside layers."""
    from experiments.zoo import resnet

    graph = trace(*_unpack(resnet.make())).graph
    scope = re.compile(r"/ResNetBlock_(\d+)/")
    scoped = inside = elsewhere = 0
    for node in graph.nodes:
        if node.phase in (Phase.FORWARD, Phase.BACKWARD) and (m := scope.search(node.op_name)):
            scoped += 1
            inside += node.layer == int(m[1])
            elsewhere += node.layer not in (int(m[1]), -1)
    assert inside > 0.8 * scoped and elsewhere < 0.01 * scoped, (inside, elsewhere, scoped)
    report = layer_report(graph)
    assert report.layers == 4 and report.structures == 3
