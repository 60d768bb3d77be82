"""HLO text parsing, the operator graph, phases, layers and KIWI's liveness sets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib import xla_client

from hlo_tools.graph import Phase, UnsupportedOpError, graph_from_text
from hlo_tools.hlo_text import DTYPE_BITS, HloParseError, parse_module, parse_shape
from hlo_tools.liveness import liveness
from hlo_tools.lower import lower_to_graph, lower_to_hlo
from kiwi_jax.cluster import Cluster, MeshSpec
from kiwi_jax.frontend import trace_step
from kiwi_jax.interpret import program_order, tag_of
from kiwi_jax.models import build
from kiwi_jax.problem import build_problem
from kiwi_jax.strategies import node_strategies


@pytest.fixture(scope="module")
def mlp_graph():
    ref = build("mlp", layers=3, width=16, in_dim=16, out_dim=16, batch=8)
    return trace_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch())[1]


@pytest.fixture(scope="module")
def gpt_graph():
    ref = build("gpt", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=64)
    return trace_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch())[1]


@pytest.mark.parametrize("text,dtype,dims", [
    ("f32[2,8,16]{2,1,0}", "f32", (2, 8, 16)), ("s32[]", "s32", ()),
    ("/*index=5*/bf16[4]{0}", "bf16", (4,)), ("pred[3,1]", "pred", (3, 1))])
def test_parse_array_shapes(text, dtype, dims):
    shape, rest = parse_shape(text + " rest")
    assert (shape.dtype, shape.dims, rest.strip()) == (dtype, dims, "rest")


def test_parse_tuple_shape_bytes():
    shape, _ = parse_shape("(f32[2,3]{1,0}, s32[4]{0})")
    assert shape.is_tuple and shape.nbytes == 2 * 3 * 4 + 4 * 4


@pytest.mark.parametrize("text,nbytes", [
    ("f32[8,16]{1,0}", 512), ("(f32[8,4]{1,0}, bf16[8,2]{1,0})", 128 + 32), ("pred[]", 1),
    ("s4[3]{0:E(4)}", 2), ("u4[4]", 2), ("s2[5]{0:E(2)}", 2), ("u2[4]", 1), ("s1[9]", 2),
    ("f4e2m1fn[3]{0:E(4)}", 2), ("f8e4m3b11fnuz[4]", 4), ("f8e8m0fnu[2]", 2),
    ("f8e3m4[3]", 3), ("(f8e4m3fn[4]{0}, token[])", 4), ("c128[2]", 32), ("opaque[]", 8)])
def test_shape_bytes_pack_sub_byte_types(text, nbytes):
    assert parse_shape(text)[0].nbytes == nbytes


def test_dtype_table_names_every_xla_element_type():
    names = {name.lower() for name in dir(xla_client.PrimitiveType) if name.isupper()}
    names = (names - {"primitive_type_invalid", "tuple", "opaque_type"}) | {"opaque"}
    assert names <= set(DTYPE_BITS), sorted(names - set(DTYPE_BITS))
    assert {"f8e5m2", "f8e4m3fn", "f8e4m3b11fnuz", "f8e5m2fnuz", "f8e4m3fnuz", "f8e4m3",
            "f8e3m4", "f8e8m0fnu", "f4e2m1fn", "s2", "u2"} <= set(DTYPE_BITS)
    with pytest.raises(HloParseError, match="expected an XLA element type.*found 'q7'"):
        _ = parse_shape("q7[2]")[0].nbytes


def test_parameter_bytes_match_xla_for_every_jax_dtype():
    # XLA's own accounting of a compiled module's arguments: sub-byte types are packed.
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64, jnp.uint32, jnp.int8,
              jnp.bool_, jnp.int4, jnp.uint4, jnp.int2, jnp.uint2, jnp.float4_e2m1fn,
              jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3b11fnuz, jnp.float8_e4m3fnuz,
              jnp.float8_e5m2fnuz, jnp.float8_e8m0fnu, jnp.float8_e3m4, jnp.float8_e4m3]
    args = [jax.ShapeDtypeStruct((3, 5), dtype) for dtype in dtypes]
    compiled = jax.jit(lambda *xs: [x.reshape(5, 3) for x in xs]).lower(*args).compile()
    entry = parse_module(compiled.as_text()).entry
    params = [i.shape for i in entry.instructions if i.opcode == "parameter"]
    assert len(params) == len(dtypes) and "s4[3,5]{1,0:E(4)}" in [p.text for p in params]
    assert sum(p.nbytes for p in params) == compiled.memory_analysis().argument_size_in_bytes


def test_layouts_with_tiles_and_bounded_dims():
    shape, rest = parse_shape("f32[8,128]{1,0:T(8,128)(2,1)S(1)} add(x)")
    assert (shape.dims, shape.layout, rest) == ((8, 128), "{1,0:T(8,128)(2,1)S(1)}", " add(x)")
    assert shape.text == "f32[8,128]{1,0:T(8,128)(2,1)S(1)}" and str(shape) == "f32[8,128]"
    assert shape == parse_shape("f32[8,128]{0,1}")[0]          # the layout is not the value
    assert parse_shape("f32[<=8,4]{1,0}")[0].dims == (8, 4)


_TUPLE_ALL_REDUCE = """\
HloModule tuple_all_reduce, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

ENTRY %main (p: f32[16,16]) -> (f32[16,16], f32[16,16], f32[16,16], f32[16,16], f32[16,16], /*index=5*/f32[16,16], bf16[2,16]) {
  %p = f32[16,16]{1,0} parameter(0)
  %h = bf16[2,16]{1,0} convert(%p), metadata={op_name="jit(f)/convert"}
  ROOT %all-reduce.7 = (f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, /*index=5*/f32[16,16]{1,0}, bf16[2,16]{1,0}) all-reduce(%p, %p, %p, %p, %p, /*index=5*/%p, %h), channel_id=1, replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}, use_global_device_ids=true, to_apply=%add
}
"""


def test_tuple_with_index_comments_and_mesh_replica_groups():
    root = parse_module(_TUPLE_ALL_REDUCE).entry.root
    assert root.operands == ("p",) * 6 + ("h",)
    assert len(root.shape.elements) == 7 and root.shape.nbytes == 6 * 16 * 16 * 4 + 2 * 16 * 2
    assert "/*" not in root.shape.text and root.shape.text.count("f32[16,16]{1,0}") == 6
    assert root.attrs["replica_groups"] == "mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}"
    assert "device_ids" not in root.attrs and root.attrs["use_global_device_ids"] == "true"


def test_parse_errors_name_what_was_expected():
    with pytest.raises(HloParseError, match="expected text starting with 'HloModule'"):
        parse_module("not hlo")
    with pytest.raises(HloParseError, match="expected a shape"):
        parse_shape("banana")


def test_dot_attributes_and_flops():
    graph = lower_to_graph(lambda x, w: jnp.einsum("bsh,hf->bsf", x, w),
                           jax.ShapeDtypeStruct((2, 8, 16), jnp.float32),
                           jax.ShapeDtypeStruct((16, 32), jnp.float32))
    dot = next(n for n in graph.nodes if n.opcode == "dot")
    assert dot.int_list("lhs_contracting_dims") == (2,)
    assert dot.int_list("rhs_contracting_dims") == (0,)
    assert graph.flops(dot.id) == 2 * 2 * 8 * 32 * 16
    assert dot.nbytes == 2 * 8 * 32 * 4


def test_phases_and_layers_of_an_mlp_step(mlp_graph):
    dots = [n for n in mlp_graph.nodes if n.opcode == "dot"]
    forward = [n for n in dots if n.phase == Phase.FORWARD]
    backward = [n for n in dots if n.phase == Phase.BACKWARD]
    assert len(forward) == 3                      # one matmul per layer
    assert len(backward) == 5                     # 3 weight grads + 2 input grads
    assert sorted({n.layer for n in forward}) == [0, 1, 2]
    assert all(n.phase == Phase.PARAM for n in (mlp_graph.nodes[p] for p in mlp_graph.parameters))
    assert mlp_graph.phase_counts()["optimizer"] > 0
    # topological order: operands come first
    assert all(o < n.id for n in mlp_graph.nodes for o in n.operands)


def test_calls_are_inlined_tagged_and_stable(gpt_graph):
    assert not any(n.opcode in ("call", "tuple", "get-tuple-element") for n in gpt_graph.nodes)
    untagged = {n.opcode for n in gpt_graph.nodes if tag_of(n.op_name) is None}
    assert untagged <= {"parameter", "constant", "broadcast"}     # literals have no equation
    assert any("attention_core" in n.op_name for n in gpt_graph.nodes)
    ref = build("gpt", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=64)
    again = trace_step(ref.train_step, *ref.abstract_init(), ref.abstract_batch())[1]
    assert [n.name for n in again.nodes] == [n.name for n in gpt_graph.nodes]


def _while_loop(x):
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))[1]


def _traced_fori_loop(x):
    return jax.lax.fori_loop(0, x.shape[0] + jnp.int32(x[0] > 0), lambda i, c: c * 2.0, x)


def _cond(x):
    return jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x)


def _raw_scan(x):
    return jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=3)[0]


@pytest.mark.parametrize("fn,opcode,advice", [
    pytest.param(_while_loop, "while", "write it as lax.scan with that length", id="while_loop"),
    pytest.param(_traced_fori_loop, "while", "write it as lax.scan with that length",
                 id="fori_loop-traced-bounds"),
    pytest.param(_cond, "conditional", r"select the result \(jnp.where\)", id="cond"),
    # a scan lowered without kiwi-jax's interpreter is a while like the others; the message
    # names the entry points that unroll it
    pytest.param(_raw_scan, "while", r"kiwi_jax.optimize", id="scan-lowered-directly"),
])
def test_loops_and_conditionals_are_rejected_with_what_is_supported(fn, opcode, advice):
    with pytest.raises(UnsupportedOpError, match=f"'{opcode}'.*{advice}") as error:
        lower_to_graph(fn, jax.ShapeDtypeStruct((4,), jnp.float32))
    assert opcode != "while" or "lax.scan, nnx.scan, nn.scan" in str(error.value)


def _dropout(x, key):
    keep = jax.random.bernoulli(jax.random.fold_in(key, 3), 0.9, x.shape)
    return jnp.sum(jnp.where(keep, x / 0.9, 0.0))


def test_each_random_draw_is_one_operator_of_two_results():
    # on the CPU JAX lowers Threefry to a five-iteration while (elsewhere to twenty rounds of
    # elementwise operators); lowered for the graph, each draw is one custom call, elementwise,
    # whose two results are the two words of bits, also after the same function was lowered
    # with JAX's own rule (JAX keeps that lowering), and JAX's own rule is back afterwards
    args = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.uint32))
    assert "while" in jax.jit(_dropout, keep_unused=True).lower(*args).as_text(dialect="hlo")
    text = lower_to_hlo(_dropout, *args)
    assert "while" not in text and "shift-left" not in text
    graph = lower_to_graph(_dropout, *args)
    draws = [n for n in graph.nodes if n.is_random_bits]
    # fold_in's draw on the key, then the bits of the mask's shape
    assert [(n.name[-2:], str(n.shape)) for n in draws] == [
        ("#0", "u32[1]"), ("#1", "u32[1]"), ("#0", "u32[8,16]"), ("#1", "u32[8,16]")]
    assert all(len(n.operands) == 4 and
               all(graph.nodes[o].shape.dims == n.shape.dims for o in n.operands) for n in draws)
    assert len(graph) < 100                             # 376 nodes as the rounds
    strategies, supported = node_strategies(graph, draws[-1], MeshSpec.parse("2x4"),
                                            Cluster.parse("v100-nvlink"))
    assert supported and len(strategies) > 1           # split like an elementwise operator
    assert all(s.operands == (s.out,) * 4 for s in strategies)
    x, key = jnp.arange(128.0).reshape(8, 16), jax.random.PRNGKey(0)
    assert "while" in jax.jit(lambda *a: _dropout(*a)).lower(x, key).as_text()


def _accuracy_step(w, x, labels):
    """A step that reports an argmax accuracy beside its loss."""
    (loss, logits), grad = jax.value_and_grad(
        lambda w: (jnp.mean((x @ w) ** 2), x @ w), has_aux=True)(w)
    return w - 0.1 * grad, loss, jnp.mean(logits.argmax(-1) == labels)


def _routed_step(w, x):
    """A step that routes with top-2 gates, as a mixture of experts does."""
    def loss(w):
        gates, experts = jax.lax.top_k(jax.nn.softmax(x @ w), 2)
        return jnp.sum(gates[..., None] * jax.nn.one_hot(experts, 4))

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


def test_argmax_keeps_the_index_result_of_its_variadic_reduce():
    graph = lower_to_graph(_accuracy_step, jax.ShapeDtypeStruct((16, 4), jnp.float32),
                           jax.ShapeDtypeStruct((8, 16), jnp.float32),
                           jax.ShapeDtypeStruct((8,), jnp.int32))
    multi = [n for n in graph.nodes if "#" in n.name]
    assert [(n.opcode, str(n.shape)) for n in multi] == [("reduce", "s32[8]")]
    argmax = multi[0]
    assert argmax.name.endswith("#1")        # the indices; the maxima are read by nothing
    assert [str(graph.nodes[o].shape) for o in argmax.operands] == \
        ["f32[8,4]", "s32[8,4]", "f32[]", "s32[]"]
    assert argmax.nbytes == 8 * 4 and graph.users[argmax.id]
    assert not any(n.opcode in ("tuple", "get-tuple-element") for n in graph.nodes)


def test_top_k_gives_one_node_per_result():
    graph = lower_to_graph(_routed_step, jax.ShapeDtypeStruct((16, 4), jnp.float32),
                           jax.ShapeDtypeStruct((8, 16), jnp.float32))
    topk = [n for n in graph.nodes if n.opcode == "topk"]
    assert [(n.name.split("#")[1], str(n.shape)) for n in topk] == \
        [("0", "f32[8,2]"), ("1", "s32[8,2]")]
    assert topk[0].name.split("#")[0] == topk[1].name.split("#")[0]
    assert topk[0].operands == topk[1].operands
    assert str(graph.nodes[topk[0].operands[0]].shape) == "f32[8,4]"
    assert all(n.phase == Phase.FORWARD for n in topk)
    assert graph.users[topk[0].id] and graph.users[topk[1].id]


def test_checkpointed_steps_see_through_the_optimization_barrier():
    def step(x):
        return jax.grad(lambda x: jnp.sum(jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))(x)))(x)

    text = lower_to_hlo(step, jax.ShapeDtypeStruct((4,), jnp.float32))
    assert " opt-barrier(" in text
    graph = graph_from_text(text)
    assert {n.opcode for n in graph.nodes} >= {"sine", "cosine", "multiply"}
    assert not any("barrier" in n.opcode or n.shape.is_tuple for n in graph.nodes)


_NESTED_TUPLE = """HloModule nested
ENTRY main {
  p = f32[4]{0} parameter(0)
  c = ((f32[4]{0}, f32[4]{0}), f32[4]{0}) custom-call(p), custom_call_target="pair"
  ROOT g = f32[4]{0} get-tuple-element(c), index=1
}
"""


def test_nested_tuple_results_are_refused_naming_the_op():
    with pytest.raises(UnsupportedOpError, match="'custom-call' .*nested tuples.*"
                       "compute this 'custom-call' outside the train step") as error:
        graph_from_text(_NESTED_TUPLE)
    assert "argmax" not in str(error.value)


def test_liveness_sets_partition_the_nodes(gpt_graph):
    live = liveness(gpt_graph)
    n = len(gpt_graph)
    forward = np.array([node.phase == Phase.FORWARD for node in gpt_graph.nodes])
    assert live.z.sum() > 0 and not live.z[~forward].any()
    # L_t is defined on forward nodes exactly, so Y_t (the others) is the same whether read
    # from the phases (the problem's sets) or from fwd_last_use < 0.
    assert np.array_equal(live.fwd_last_use >= 0, forward)
    problem = build_problem(gpt_graph, "2x4", "v100-nvlink", merge=False,
                            memory_model="operator").problem
    for field in ("z", "live", "fwd_last_use", "first_bwd_use"):
        assert np.array_equal(getattr(problem, field), getattr(live, field)), field
    x_sets, l_sets, y_sets = problem.sets("X"), problem.sets("L"), problem.sets("Y")
    in_x = sorted(i for v in x_sets.values() for i in v)
    assert in_x == sorted(np.flatnonzero(live.z))          # each recomputable node in one X_t
    assert sorted(i for v in l_sets.values() for i in v) == sorted(np.flatnonzero(forward))
    for t, members in x_sets.items():
        assert gpt_graph.nodes[t].phase in (Phase.BACKWARD, Phase.OPTIMIZER)
        assert all(live.first_bwd_use[i] == t and t in gpt_graph.users[i] for i in members)
    assert all(live.live[i] == n for i in gpt_graph.outputs)
    assert sorted(i for v in y_sets.values() for i in v) == sorted(np.flatnonzero(~forward))
    assert all(live.live[i] == t for t, members in y_sets.items() for i in members)


def test_lowering_allocates_nothing():
    text = lower_to_hlo(lambda x: x * 2, jax.ShapeDtypeStruct((1 << 30,), jnp.float32))
    assert "f32[1073741824]" in text and graph_from_text(text).nodes[-1].opcode == "multiply"


_PRINTED_BY_OUTPUT = """HloModule printed
ENTRY main {
  x = f32[4]{0} parameter(0), metadata={op_name="x"}
  w = f32[4]{0} parameter(1), metadata={op_name="w"}
  late = f32[4]{0} multiply(x, x), metadata={op_name="jit(f)/k2/mul"}
  early = f32[4]{0} add(x, w), metadata={op_name="jit(f)/k0/add"}
  nameless = f32[4]{0} negate(early)
  next = f32[4]{0} sine(nameless), metadata={op_name="jit(f)/k1/sin"}
  ROOT out = (f32[4]{0}, f32[4]{0}) tuple(late, next)
}
"""


def test_nodes_are_numbered_in_program_order_not_in_the_printed_post_order():
    printed = graph_from_text(_PRINTED_BY_OUTPUT)
    assert [n.name for n in printed.nodes] == ["x", "w", "late", "early", "nameless", "next"]
    graph = graph_from_text(_PRINTED_BY_OUTPUT, order=program_order)
    assert [n.name for n in graph.nodes] == ["x", "w", "early", "nameless", "next", "late"]
    assert [graph.nodes[o].name for o in graph.nodes[-1].operands] == ["x", "x"]
    assert graph.outputs == (5, 4)


def test_a_traced_steps_nodes_follow_its_equations(gpt_graph):
    keys = [program_order(n.op_name) for n in gpt_graph.nodes]
    tagged = [k for k in keys if k is not None]
    assert len(tagged) > len(keys) / 2 and tagged == sorted(tagged)
