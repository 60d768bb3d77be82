"""The zoo's scanned models (``nnx.scan`` over ``nnx.vmap``-stacked layers, Linen ``nn.scan``)
through ``kiwi_jax.optimize`` on a 2x4 mesh: planned with one layer per scan iteration,
compiled, and numerically the plain step over three steps."""

import warnings

import jax
import numpy as np
import pytest

import kiwi_jax
from experiments import zoo
from kiwi_jax.step import functionalize
from tests.experiments.test_zoo import FAST_COMPILE, TINY

STEPS = 3
LEARNING_RATE = 1e-3
"""Both scanned models train with Adam at this rate: no update moves a weight further."""


def _steps(step, args, state_out):
    """The train state after ``STEPS`` steps and the losses on the way."""
    args, losses = list(args), []
    for _ in range(STEPS):
        outputs = step(*args)
        args[0] = outputs[state_out]
        losses.append([o for i, o in enumerate(outputs) if i != state_out])
    return jax.device_get(args[0]), jax.device_get(losses)


def _zero_gradient(path) -> bool:
    """Attention key biases: a shift of all of a query's scores does not change its softmax,
    so their gradient is zero up to rounding, and Adam scales that rounding (which any other
    order of the sums changes) to updates of up to the learning rate (docs/benchmarks.md)."""
    names = jax.tree_util.keystr(path)
    return "['key']" in names and "['bias']" in names


@pytest.mark.parametrize("name", zoo.SCANNED)
def test_a_scanned_model_is_planned_per_layer_and_matches_the_plain_step(name, mesh24):
    step, args = zoo.make(name, abstract=False, seed=0, **TINY[name])
    # a budget no plan reaches: the fastest sharding, without the reference plan's solve
    optimized = kiwi_jax.optimize(step, mesh=mesh24, memory_budget="1GiB", cache_dir=False,
                                  time_limit=30.0, mip_gap=1e-2, fit_compiles=1,
                                  recipes=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)     # Linen's SelfAttention
        prepared = optimized.lower(*args)
    graph, problem = prepared.traced.graph, prepared.build.problem
    assert not any(node.opcode == "while" for node in graph.nodes)
    assert sorted({int(v) for v in np.asarray(problem.layer) if v >= 0}) == [0, 1]
    assert any("s1_" in path for path, _ in prepared.traced.representative)

    pure = functionalize(step, args)
    copy = lambda: jax.tree.map(np.array, pure.args)  # noqa: E731
    plain_step = jax.jit(pure.fn).lower(*pure.args).compile(compiler_options=FAST_COMPILE)
    plain = _steps(plain_step, copy(), prepared.state_out)
    applied = _steps(prepared.compiled, jax.device_put(copy(), prepared.in_shardings),
                     prepared.state_out)
    for want, got in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(applied[1]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4)            # the losses
    checked = 0
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(plain[0]),
                                 jax.tree.leaves(applied[0]), strict=True):
        want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
        if _zero_gradient(path):
            assert np.abs(got - want).max() <= STEPS * LEARNING_RATE * 1.01, path
            continue
        scale = max(np.linalg.norm(want), 1e-30)
        assert np.linalg.norm(got - want) / scale < 1e-4, jax.tree_util.keystr(path)
        checked += 1
    assert checked >= len(jax.tree.leaves(plain[0])) * 0.9
