"""Scanned layers: the interpreter unrolls ``scan``, numbers the iterations as layers, passes
residuals per iteration, recomputes values of a scan body inside the backward iterations and
keeps a model's own ``jax.checkpoint``; loops that are not scans stay rejected."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import zoo
from hlo_tools.graph import Phase, UnsupportedOpError
from hlo_tools.hlo_text import parse_module
from hlo_tools.layers import layer_report
from hlo_tools.lower import lower_to_hlo
from kiwi_jax.apply import applied_function, trace_for_planning
from kiwi_jax.frontend import problem_for_step, trace, trace_step
from kiwi_jax.interpret import Interpreter, is_unit, path_key, tag_of, trace_flat
from kiwi_jax.step import functionalize

SIZES = {
    "llama_scan": {"layers": 2, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 2, "seq": 8,
                   "vocab": 32},
    "linen_scan": {"layers": 2, "dim": 16, "heads": 2, "mlp_dim": 16, "batch": 2, "seq": 8,
                   "vocab": 32},
}


def _loss(params, x, checkpoint=None):
    """A residual MLP whose blocks (stacked weights ``[L, d, d]``) run under ``lax.scan``;
    ``checkpoint``: ``"body"`` (``jax.checkpoint`` on each block) or ``"stack"`` (around the
    whole scan)."""
    def block(h, w):
        return h + jnp.tanh(h @ w)

    body = jax.checkpoint(block) if checkpoint == "body" else block

    def stack(x, blocks):
        return jax.lax.scan(lambda h, w: (body(h, w), None), x, blocks)[0]

    h = (jax.checkpoint(stack) if checkpoint == "stack" else stack)(x, params["blocks"])
    return jnp.mean((h @ params["head"]) ** 2)


def _sgd_step(params, x, checkpoint=None):
    loss, grads = jax.value_and_grad(_loss)(params, x, checkpoint)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def _mlp_args(layers=3, d=8, abstract=False):
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"blocks": 0.3 * jax.random.normal(keys[0], (layers, d, d)),
              "head": jax.random.normal(keys[1], (d, 4))}
    x = jax.random.normal(keys[2], (4, d))
    args = (params, x)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args) if abstract \
        else args


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options that cut the CPU compile of these one-off steps several-fold."""


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _interpreted(fn, args, **options):
    """``fn`` run by the interpreter (with ``options``: a plan), as a function of ``args``."""
    closed = trace_flat(fn, *args)
    out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
    interpreter = Interpreter(closed, **options)
    return lambda *a: jax.tree.unflatten(out_tree, interpreter(*jax.tree.leaves(a)))


def _assert_close(got, want, tol=1e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(SIZES))
def test_the_interpreted_scanned_step_computes_the_plain_step(name):
    step, args = zoo.make(name, abstract=False, **SIZES[name])
    pure = functionalize(step, args)
    want = _run(pure.fn, *pure.args)
    got = _run(_interpreted(pure.fn, pure.args), *pure.args)
    _assert_close(got, want)


@pytest.mark.parametrize("name", list(SIZES))
def test_iterations_are_layers_and_residuals_pass_one_layer_at_a_time(name):
    step, args = zoo.make(name, **SIZES[name])
    traced = trace(step, *args)
    graph = traced.graph
    assert not any(n.opcode == "while" for n in graph.nodes)
    report = layer_report(graph)
    assert report.layers == SIZES[name]["layers"] == 2
    for layer in (0, 1):                          # one forward and one backward pass per layer
        assert report.nodes[layer]["forward"] > 50 and report.nodes[layer]["backward"] > 50
    iterations = {re.match(r"\d+s(\d+)_", tag_of(n.op_name)).group(1) for n in graph.nodes
                  if n.layer >= 0 and tag_of(n.op_name) and "s" in tag_of(n.op_name)}
    assert iterations == {"0", "1"}
    assert any(is_unit(path) and "s" in path for path, _ in traced.representative)
    # The only stacks a scan makes are the gradients of the stacked parameters, which the
    # optimizer reads; the forward scan's residuals reach the backward scan per iteration.
    stacked = [n for n in graph.nodes if n.opcode == "concatenate"
               and re.fullmatch(r"\d+", tag_of(n.op_name) or "")]
    leaves = jax.tree.leaves(args[0] if name == "linen_scan" else functionalize(step, args).args)
    stacked_params = sorted(leaf.shape for leaf in leaves if leaf.shape[:1] == (2,)
                            and len(leaf.shape) >= 2)
    assert stacked and all(n.phase == Phase.BACKWARD for n in stacked)
    assert {n.shape.dims for n in stacked} <= set(stacked_params)
    assert all(graph.nodes[u].phase == Phase.OPTIMIZER for n in stacked for u in graph.users[n.id])


@pytest.mark.parametrize("name", list(SIZES))
def test_the_second_iteration_is_tied_to_the_first(name):
    step, args = zoo.make(name, **SIZES[name])
    problem = problem_for_step(step, *args, mesh="2x4")[0].problem
    second = np.flatnonzero(problem.layer == 1)
    tied = second[problem.ties[second] != second]
    assert len(tied) / len(second) > 0.95
    assert (problem.layer[problem.ties[tied]] == 0).mean() > 0.95


def test_two_scans_of_layers_number_their_layers_one_after_the_other():
    def loss(params, x):
        for name in ("encoder", "decoder"):
            x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params[name])
        return jnp.sum(x ** 2)

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {"encoder": jax.ShapeDtypeStruct((2, 8, 8), jnp.float32),
              "decoder": jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)}
    graph = trace_step(step, params, jax.ShapeDtypeStruct((4, 8), jnp.float32))[1]
    report = layer_report(graph)
    assert report.layers == 5
    for layer in range(5):
        dots = [n for n in graph.nodes if n.layer == layer and n.opcode == "dot"]
        assert {n.phase for n in dots} == {Phase.FORWARD, Phase.BACKWARD}, layer


def _residuals(traced, layer=None):
    """``{path: node}`` of the forward scan-body values (dots aside) that a backward node of
    their own layer reads: the residuals the forward iteration stacks for its backward
    iteration. Which ones they are is the derivative rules' choice (jax 0.10 stacks ``tanh``
    and ``1 - tanh``, jax 0.11 the ``1 - tanh**2`` of its ``one_minus_square``)."""
    graph = traced.graph
    found = {}
    for (path, k), node in traced.representative.items():
        n = graph.nodes[node]
        if k == 0 and re.fullmatch(r"\d+s\d_\d+", path) and n.phase == Phase.FORWARD \
                and n.opcode != "dot" and (layer is None or n.layer == layer) \
                and any(graph.nodes[u].phase == Phase.BACKWARD and graph.nodes[u].layer == n.layer
                        for u in graph.users[n.id]):
            found[path] = node
    return found


def _backward_layers(text: str, path: str) -> list[set[int]]:
    """For each instruction of the lowered ``text`` tagged with ``path``: the layers of the
    backward instructions it depends on (through the barriers too). Empty: computed in the
    forward pass; the layers of a backward iteration and those after it: recomputed there."""
    entry = parse_module(text).entry
    by_name = {instr.name: instr for instr in entry.instructions}

    def before(instr):
        seen, stack, layers = set(), [instr.name], set()
        while stack:
            for operand in by_name[stack.pop()].operands:
                if operand not in seen:
                    seen.add(operand)
                    stack.append(operand)
                    found = re.search(r"transpose\(jvp\(layer_(\d+)", by_name[operand].op_name)
                    layers |= {int(found.group(1))} if found else set()
        return layers

    return [before(i) for i in entry.instructions if tag_of(i.op_name) == path]


def _computed_where(text: str, traced, path: str) -> None:
    """Assert that the value at ``path`` (layer ``l`` of three) is recomputed in its backward
    iteration, after the later layers' (its recomputation waits behind a barrier tied to its
    reader's other inputs), and computed in the forward pass only where the forward pass
    reads it (otherwise that computation is dead once the value is dropped)."""
    graph, node = traced.graph, traced.representative[(path, 0)]
    forward_readers = any(graph.nodes[u].phase == Phase.FORWARD for u in graph.users[node])
    layer = int(re.match(r"\d+s(\d+)_", path).group(1))
    where = {frozenset(layers) for layers in _backward_layers(text, path)}
    assert where == {frozenset(range(layer, 3))} | ({frozenset()} if forward_readers else set()), \
        (path, where)


def test_a_value_of_a_scan_body_is_recomputed_inside_its_backward_iteration():
    args = _mlp_args()
    traced = trace_for_planning(functionalize(_sgd_step, args))
    residuals = _residuals(traced, layer=0)
    assert residuals                              # layer 0's residuals, forward
    plain = lower_to_hlo(_interpreted(_sgd_step, args), *args)
    for path in residuals:
        assert {frozenset(s) for s in _backward_layers(plain, path)} == {frozenset()}
        fn = _interpreted(_sgd_step, args, recompute=frozenset([path]))
        _assert_close(_run(fn, *args), _run(_sgd_step, *args))
        _computed_where(lower_to_hlo(fn, *args), traced, path)


def test_a_plan_that_recomputes_a_scan_body_value_is_applied(mesh24):
    args = _mlp_args()
    traced = trace_for_planning(functionalize(_sgd_step, args))
    graph = traced.graph
    residuals = _residuals(traced)
    assert sorted(graph.nodes[n].layer for n in residuals.values()) \
        == sorted(list(range(3)) * (len(residuals) // 3))     # the same in every layer
    replicated = [((),) * len(node.shape.dims) for node in graph.nodes]
    fn, in_shardings, out_shardings = applied_function(traced, replicated, residuals.values(),
                                                       mesh24)
    text = lower_to_hlo(fn, *args)
    for path in residuals:
        _computed_where(text, traced, path)
    applied = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
    _assert_close(applied(*args), _run(_sgd_step, *args))


@pytest.mark.parametrize("where", ["body", "stack"])
def test_a_checkpoint_in_or_around_the_scan_is_kept_as_the_model_wrote_it(where):
    args = _mlp_args()
    step = jax.tree_util.Partial(_sgd_step, checkpoint=where)
    closed = trace_flat(step, *args)
    scans = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    remat = [e for e in (scans[-1].params["jaxpr"].jaxpr if where == "body" else closed.jaxpr).eqns
             if e.primitive.name == "remat2"]
    assert remat                                  # the model's checkpoint, after autodiff
    traced = trace_for_planning(functionalize(step, args))
    graph = traced.graph
    assert not any(n.opcode == "while" for n in graph.nodes)
    tanh = [n for n in graph.nodes if n.opcode == "tanh"]
    # each layer's tanh: in the forward pass, and again in the backward pass where the
    # model's checkpoint recomputes it, in the same layer
    assert len(tanh) == 6 and len({tag_of(n.op_name) for n in tanh}) == 6
    assert sorted(n.layer for n in tanh) == [0, 0, 1, 1, 2, 2]
    assert sum("transpose(" in n.op_name for n in tanh) == 3
    fn = _interpreted(step, args)
    assert "opt-barrier" in lower_to_hlo(fn, *args)
    _assert_close(_run(fn, *args), _run(step, *args))


@pytest.mark.parametrize("loop", ["while_loop", "fori_loop"])
def test_a_loop_that_is_not_a_scan_is_rejected_with_what_to_do(loop):
    def step(w, x):
        grad = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
        if loop == "while_loop":        # e.g. an update clipped by repeated halving
            grad = jax.lax.while_loop(lambda g: jnp.max(jnp.abs(g)) > 1.0, lambda g: g / 2, grad)
        else:                           # a fori_loop whose trip count depends on the data
            grad = jax.lax.fori_loop(0, 1 + (x[0, 0] > 0), lambda i, g: g / 2, grad)
        return w - 0.1 * grad

    args = (jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32))
    with pytest.raises(UnsupportedOpError,
                       match="'while'.*write it as lax.scan.*depends on the data"):
        trace_step(step, *args)


def test_paths_sort_and_units():
    assert sorted(["12s10_3", "12s2_3", "3"], key=path_key) == ["3", "12s2_3", "12s10_3"]
    assert [is_unit(p) for p in ("12", "12s4_3", "12s4_3s0_2", "12_3", "12s4_3_1", "12s4")] \
        == [True, True, True, False, False, False]


@pytest.mark.parametrize("name", list(SIZES))
def test_a_backward_iteration_slices_the_stacked_weights_anew(name):
    # Sliced from the same array, the backward iteration's slice of a stacked weight is the
    # forward iteration's to XLA, which then holds it from the forward pass to the backward
    # pass: a copy of every layer's weights that the user's scan does not make.
    from kiwi_jax.compile import compiler_options

    step, args = zoo.make(name, abstract=False, **SIZES[name])
    pure = functionalize(step, args)

    def temp(fn):
        compiled = jax.jit(fn).lower(*pure.args).compile(compiler_options=compiler_options())
        return compiled.memory_analysis().temp_size_in_bytes

    # Measured at these sizes: 57,924 -> 42,752 B (llama_scan), 22,404 -> 21,560 B (linen_scan)
    resliced = _interpreted(pure.fn, pure.args, reslice=True)
    assert temp(resliced) < temp(_interpreted(pure.fn, pure.args))
    _assert_close(_run(resliced, *pure.args), _run(pure.fn, *pure.args))
