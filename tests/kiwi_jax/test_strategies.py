"""Strategy enumeration, costs, resharding, merging and the problem object."""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hlo_tools.lower import lower_to_graph
from kiwi_jax.cli import main
from kiwi_jax.cluster import Cluster, MeshSpec, parse_bytes
from kiwi_jax.frontend import problem_for_step
from kiwi_jax.models import build
from kiwi_jax.problem import build_problem
from kiwi_jax.sharding import (Comm, collective_seconds, comm_seconds, enumerate_specs,
                               reshard_comms)
from kiwi_jax.strategies import combined_all_reduces, node_strategies, reshape_groups
from solvers.joint import build_joint
from solvers.lynx import fixed_strategy
from solvers.phase import Phase
from solvers.problem import ShardingProblem
from solvers.simulator import live_bytes, simulate

MESH = MeshSpec((2, 4))
CLUSTER = Cluster.parse("v100-nvlink")


def test_axes_that_do_not_divide_are_excluded():
    specs = enumerate_specs((3, 8), MESH)
    assert all(not spec[0] for spec in specs)              # 3 splits over neither axis
    assert ((), (0, 1)) in specs and ((), (1,)) in specs
    assert len(enumerate_specs((8, 8), MESH)) == 9          # (rank + 1) ** 2


@pytest.mark.parametrize("src,dst,expected", [
    (((0,), ()), ((), ()), [Comm("all-gather", (0,), 512)]),
    (((), ()), ((0,), (1,)), []),                                  # slices are free
    (((0,), ()), ((), (0,)), [Comm("all-to-all", (0,), 256)]),
    (((0, 1), ()), ((), ()), [Comm("all-gather", (0, 1), 512)]),
])
def test_reshard_comms(src, dst, expected):
    assert list(reshard_comms(512, src, dst, MESH)) == expected


def test_alpha_beta_costs():
    link = CLUSTER.axis_link(MESH, (1,))
    gather = comm_seconds(Comm("all-gather", (1,), 4096), MESH, CLUSTER)
    reduce = comm_seconds(Comm("all-reduce", (1,), 4096), MESH, CLUSTER)
    assert gather == pytest.approx(link.latency_s + 0.75 * 4096 / link.bandwidth)
    assert reduce == pytest.approx(link.latency_s + 1.5 * 4096 / link.bandwidth)
    slow = CLUSTER.with_slowdown(10)
    assert comm_seconds(Comm("all-reduce", (1,), 4096), MESH, slow) == pytest.approx(10 * reduce)
    # a collective-permute sends its buffer once, pairs have no group size
    assert collective_seconds("collective-permute", 0, 4096, link) == pytest.approx(
        link.latency_s + 4096 / link.bandwidth)
    assert collective_seconds("all-reduce", 4, 4096, link) == reduce
    assert collective_seconds("all-gather", 1, 4096, link) == 0.0
    two_node = Cluster.parse("v100-2node")
    assert two_node.axis_link(MESH, (0,)) == two_node.inter_node
    assert two_node.axis_link(MESH, (1,)) == two_node.intra_node


@pytest.mark.parametrize("value,expected", [("6GiB", 6 * 2**30), ("512MB", 512e6), (1000, 1000)])
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


def test_bad_shorthand_names_the_fix():
    with pytest.raises(ValueError, match="expected a mesh shape such as '2x4'"):
        MeshSpec.parse("2by4")
    with pytest.raises(ValueError, match="expected a 2-D mesh"):
        MeshSpec((2, 2, 2))
    with pytest.raises(ValueError, match="unknown cluster 'tpu'.*v100-nvlink"):
        Cluster.parse("tpu")


@pytest.mark.parametrize("src,dst,groups", [
    ((2, 8), (2, 8, 1), [([0], [0]), ([1], [1]), ([], [2])]),
    ((4, 16), (4, 4, 4), [([0], [0]), ([1], [1, 2])]),
    ((2, 3, 4), (6, 4), [([0, 1], [0]), ([2], [1])]),
])
def test_reshape_groups(src, dst, groups):
    assert reshape_groups(src, dst) == groups


def test_matmul_strategies_and_costs():
    graph = lower_to_graph(lambda x, w: x @ w, jax.ShapeDtypeStruct((8, 16), jnp.float32),
                           jax.ShapeDtypeStruct((16, 32), jnp.float32))
    dot = next(n for n in graph.nodes if n.opcode == "dot")
    strategies, _ = node_strategies(graph, dot, MESH, CLUSTER)
    by_specs = {(s.operands[0], s.operands[1], s.out): s for s in strategies}
    # Alpa's SS = SR x RS: no communication, 1/8 of the output per device.
    ss = by_specs[(((0,), ()), ((), (1,)), ((0,), (1,)))]
    assert ss.comms == () and ss.memory == 8 * 32 * 4 // 8
    assert ss.compute_s == pytest.approx(max(2 * 8 * 16 * 32 / 8 / CLUSTER.device.flops,
                                             (128 + 256 + 512) / CLUSTER.device.memory_bandwidth))
    # SR = SS x SR: partial sums all-reduced over mesh axis 1.
    sr = by_specs[(((0,), (1,)), ((1,), ()), ((0,), ()))]
    assert sr.comms == (Comm("all-reduce", (1,), 8 * 32 * 4 // 2),)
    assert sr.comm_s == pytest.approx(comm_seconds(sr.comms[0], MESH, CLUSTER))
    assert len({s.name for s in strategies}) == len(strategies)


def test_independent_all_reduces_share_one_latency():
    # The gradient of a 3-layer MLP: only the three weight gradients feed no later operator
    # that may all-reduce, so XLA's combiner can merge their all-reduces; the forward and
    # input-gradient dots feed later dots.
    def loss(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return h.sum()

    w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    graph = lower_to_graph(jax.grad(loss), (w, w, w), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    combined = combined_all_reduces(graph)
    dots = [n for n in graph.nodes if n.opcode == "dot"]
    assert len(dots) == 8 and sum(combined[n.id] for n in dots) == combined.sum() == 3
    assert all(graph.nodes[i].phase == Phase.BACKWARD for i in np.flatnonzero(combined))
    build = build_problem(graph, MESH, CLUSTER, merge=False)
    for dot in dots:
        for strategy in build.strategies[dot.id]:
            if not strategy.comms:
                assert strategy.comm_s == 0.0
                continue
            (comm,) = strategy.comms
            full = comm_seconds(comm, MESH, CLUSTER)
            latency = CLUSTER.axis_link(MESH, comm.axes).latency_s
            # each of the three pays a third of the combined all-reduce's latency
            expected = full - 2 / 3 * latency if combined[dot.id] else full
            assert strategy.comm_s == pytest.approx(expected, rel=1e-12)


def test_argmax_and_top_k_keep_their_reduced_dimension_whole():
    def step(w, x):
        def loss(w):
            gates, experts = jax.lax.top_k(jax.nn.softmax(x @ w), 2)
            return jnp.sum(gates * (experts + 1)), (x @ w).argmax(-1)

        (value, best), grad = jax.value_and_grad(loss, has_aux=True)(w)
        return w - 0.1 * grad, value, best

    graph = lower_to_graph(step, jax.ShapeDtypeStruct((16, 8), jnp.float32),
                           jax.ShapeDtypeStruct((8, 16), jnp.float32))
    argmax = next(n for n in graph.nodes if n.opcode == "reduce" and "#" in n.name)
    topk = [n for n in graph.nodes if n.opcode == "topk"]
    assert len(topk) == 2
    for node in [argmax, *topk]:
        strategies, supported = node_strategies(graph, node, MESH, CLUSTER)
        assert supported and len(strategies) > 1
        for strategy in strategies:
            data, *others = strategy.operands
            assert data[1] == () and not strategy.comms       # the reduced dimension is whole
            if node is argmax:                                # values and indices alike
                assert others == [data, (), ()] and strategy.out == data[:1]
            else:
                assert strategy.out == data
        assert len({s.out for s in strategies}) == 4     # rows over no axis, 0, 1 or both
    assert not combined_all_reduces(graph)[argmax.id]   # a variadic reduce never all-reduces
    assert build_problem(graph, MESH, CLUSTER).unsupported == {}


def test_convolutions_split_like_dots_and_pooling_keeps_its_window_whole():
    def loss(kernel, image):
        y = jax.lax.conv_general_dilated(image, kernel, (2, 2), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        return jnp.sum(y ** 2)

    kernel = jax.ShapeDtypeStruct((3, 3, 8, 16), jnp.float32)
    image = jax.ShapeDtypeStruct((8, 16, 16, 8), jnp.float32)
    graph = lower_to_graph(jax.grad(loss), kernel, image)
    forward, kernel_grad = [n for n in graph.nodes if n.opcode == "convolution"]
    by_out = {}
    for strategy in node_strategies(graph, forward, MESH, CLUSTER)[0]:
        by_out.setdefault(strategy.out, []).append(strategy)
    batch = by_out[((0, 1), (), (), ())]                   # data parallel: no collective
    assert [(s.operands, s.comms) for s in batch] == [((((0, 1), (), (), ()), ((),) * 4), ())]
    out_features = by_out[((), (), (), (0, 1))]            # the kernel's output features split
    assert [s.operands for s in out_features] == [(((),) * 4, ((), (), (), (0, 1)))]
    contracted = [s for s in by_out[((),) * 4] if s.comms]  # input features: partial sums
    assert {s.operands[0][3]: (s.operands[1][2], s.comms) for s in contracted} == {
        axes: (axes, (Comm("all-reduce", axes, 8 * 8 * 8 * 16 * 4),))
        for axes in [(0,), (1,), (0, 1)]}
    # The kernel gradient contracts the batch: split, it is data parallelism's all-reduce.
    reduced = [s for s in node_strategies(graph, kernel_grad, MESH, CLUSTER)[0]
               if s.operands[0][0] == (0, 1)]
    assert any(s.out == ((),) * 4 and s.comms == (Comm("all-reduce", (0, 1), 3 * 3 * 8 * 16 * 4),)
               for s in reduced)
    # FLOPs as XLA counts them: 2 x output x kernel window x input features, per convolution.
    compiled = jax.jit(jax.grad(loss)).lower(kernel, image).compile()
    convolutions = graph.flops(forward.id) + graph.flops(kernel_grad.id)
    assert convolutions == 2 * 2 * (8 * 8 * 8 * 16) * (3 * 3 * 8)
    assert convolutions == pytest.approx(compiled.cost_analysis()["flops"], rel=0.01)
    for node in graph.nodes:
        if node.opcode in ("reduce-window", "select-and-scatter"):
            strategies, supported = node_strategies(graph, node, MESH, CLUSTER)
            assert supported and len(strategies) == 9       # batch and channels over 0, 1, both
            assert all(not any(s.out[1:3]) and not s.comms for s in strategies)
    assert build_problem(graph, MESH, CLUSTER).unsupported == {}


def test_resharded_operand_copies_are_held_while_their_reader_runs():
    graph = lower_to_graph(lambda x, w: jnp.tanh(x @ w), jax.ShapeDtypeStruct((8, 64), jnp.float32),
                           jax.ShapeDtypeStruct((64, 32), jnp.float32))
    build = build_problem(graph, MESH, CLUSTER, merge=False)
    problem, strategies = build.problem, build.strategies
    x = graph.parameters[0]
    dot = next(n.id for n in graph.nodes if n.opcode == "dot")
    edge = next(e for e, (src, dst, _) in enumerate(problem.edges) if (src, dst) == (x, dot))

    def index(node, out=None, operands=None):
        return next(k for k, s in enumerate(strategies[node])
                    if (out is None or s.out == out) and (operands is None or s.operands == operands))

    whole = index(dot, operands=(((), ()), ((), ())))
    # Gathering the outer dimension fills the buffer in place; an inner one is gathered
    # outermost first and copied into the value's layout, two buffers at once; a slice holds
    # nothing (fused into the reader).
    assert problem.gathered[edge][index(x, ((0, 1), ())), whole] == 8 * 64 * 4
    assert problem.gathered[edge][index(x, ((), (0, 1))), whole] == 2 * 8 * 64 * 4
    assert problem.gathered[edge][index(x, ((), ())), index(dot, operands=(((0,), ()), ((), ())))] == 0
    strategy = np.zeros(problem.num_nodes, np.int64)
    strategy[x], strategy[dot] = index(x, ((), (0, 1))), whole
    held = simulate(problem, strategy)
    without = simulate(dataclasses.replace(problem, gathered=()), strategy)
    assert held.memory_timeline[dot] - without.memory_timeline[dot] == 2 * 8 * 64 * 4
    assert held.peak_time == dot and live_bytes(problem, strategy, dot).sum() == held.peak_bytes
    # The program counts the copy as the simulator does.
    joint = build_joint(fixed_strategy(problem, strategy), None,
                        fixed_keep=np.ones(problem.num_nodes, bool), minimize_peak=True)
    result = joint.model.solve("highs", time_limit=10, mip_gap=1e-9)
    assert joint.claimed_peak(result.x) == held.peak_bytes


def test_unknown_opcode_falls_back_to_replicated_with_a_warning(caplog):
    graph = lower_to_graph(lambda x: jnp.sort(x, axis=0) * 2,
                           jax.ShapeDtypeStruct((8, 8), jnp.float32))
    with caplog.at_level(logging.WARNING):
        build = build_problem(graph, MESH, CLUSTER)
    assert build.unsupported == {"sort": 1}
    assert "sort (x1)" in caplog.text
    sort = next(i for i, n in enumerate(graph.nodes) if n.opcode == "sort")
    assert build.problem.num_strategies[sort] == 1


def test_one_device_charges_no_memory_to_values_fused_into_their_readers():
    graph = lower_to_graph(lambda x: jnp.exp(x * 2.0) @ x,
                           jax.ShapeDtypeStruct((8, 8), jnp.float32))
    scaled = next(i for i, n in enumerate(graph.nodes) if n.opcode == "multiply")
    exp = next(i for i, n in enumerate(graph.nodes) if n.opcode == "exponential")
    memory = {model: build_problem(graph, "1x1", CLUSTER, merge=False,
                                   memory_model=model).problem.memory
              for model in ("auto", "fused", "operator")}
    assert memory["auto"][scaled][0] == memory["fused"][scaled][0] == 0   # computed in exp's loop
    assert memory["operator"][scaled][0] == 8 * 8 * 4
    assert memory["auto"][exp][0] == 8 * 8 * 4                             # the dot reads it
    on_mesh = build_problem(graph, MESH, CLUSTER, merge=False).problem
    assert on_mesh.memory[scaled].min() > 0          # a mesh: every operator's output counts
    with pytest.raises(ValueError, match="unknown memory_model 'xla'"):
        build_problem(graph, MESH, CLUSTER, memory_model="xla")


@pytest.fixture(scope="module")
def gpt_build():
    ref = build("gpt", layers=2, hidden=32, heads=4, seq=8, batch=8, vocab=64)
    return problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                            mesh="2x4", cluster="v100-nvlink")[0]


def test_problem_is_consistent(gpt_build):
    problem = gpt_build.problem
    k = problem.num_strategies
    for e, (src, dst, _slot) in enumerate(problem.edges):
        assert problem.resharding[e].shape == (k[src], k[dst])
        assert (problem.resharding[e] >= 0).all()
    assert all((m >= 0).all() for m in problem.memory)
    assert all((problem.memory[i] > 0).all() for i in np.flatnonzero(problem.phase == Phase.PARAM))
    assert problem.ideal_compute_seconds() > 0


def test_merged_followers_need_no_resharding(gpt_build):
    problem = gpt_build.problem
    assert len(problem.leaders) < problem.num_nodes / 2
    for e, (src, dst, _slot) in enumerate(problem.edges):
        if problem.leader[dst] != dst and problem.leader[src] == problem.leader[dst]:
            a = np.arange(len(problem.follow[dst]))
            assert (problem.resharding[e][problem.follow[src][a], problem.follow[dst][a]]
                    == 0).all()
    assert all(len(problem.follow[i]) == problem.num_strategies[problem.leader[i]]
               for i in range(problem.num_nodes))


def test_problem_round_trips_through_npz(gpt_build, tmp_path):
    problem = gpt_build.problem
    problem.save(tmp_path / "p.npz")
    again = ShardingProblem.load(tmp_path / "p.npz")
    assert again.names == problem.names and again.summary() == problem.summary()
    assert all((a == b).all() for a, b in zip(again.resharding, problem.resharding))
    assert np.array_equal(again.ties, problem.ties)


def test_kiwi_config_gpt_builds_with_abstract_shapes():
    ref = build("gpt", preset="kiwi", layers=1)
    built, _ = problem_for_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch(),
                                mesh="2x4", cluster="v100-nvlink")
    assert built.unsupported == {}
    assert max(m.max() for m in built.problem.memory) > 2**30   # logits of 16x1024x51200 fp32


@pytest.mark.parametrize("model", ["gpt", "bert", "mlp", "linen_mlp"])
def test_cli_problem_json(model, capsys):
    assert main(["problem", "--model", model, "--mesh", "2x4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("nodes", "edges", "strategies_total", "nodes_after_merge", "build_seconds"):
        assert key in summary
    assert summary["nodes_after_merge"] < summary["nodes"]


def test_cli_reports_bad_input(capsys):
    assert main(["problem", "--model", "resnet"]) == 2
    assert "resnet" in capsys.readouterr().err
    assert main(["problem", "--model", "mlp", "--memory-model", "xla"]) == 2
    assert "unknown memory_model 'xla'" in capsys.readouterr().err
    assert main(["problem", "--model", "mlp", "--order", "xla"]) == 2
    assert "unknown order 'xla'" in capsys.readouterr().err


def test_cli_memory_model_reaches_the_problem(capsys):
    args = ["problem", "--model", "gpt", "--layers", "1", "--hidden", "32", "--heads", "2",
            "--seq", "16", "--batch", "4", "--vocab", "64", "--mesh", "1x1", "--json"]
    recomputable = {}
    for model in ("fused", "operator"):
        assert main(args + ["--memory-model", model]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        recomputable[model] = summary["recomputable_nodes"]
    # fused values hold nothing: fewer forward values are stored for the backward pass
    assert recomputable["fused"] < recomputable["operator"]
