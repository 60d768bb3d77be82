"""The numerics verdict of ``verify``: the loss within 1e-6 of the plain step, each state leaf
within 1e-5 of it; either, beyond that, within 10x its noise floor (the plain step
data-parallel on the mesh against the plain step on one device, or the plain step from its
arguments moved by an ulp against it)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kiwi_jax.recipes import data_parallel_step
from kiwi_jax.step import functionalize
from kiwi_jax.verify import (FLOOR_FACTOR, LEAF_TOLERANCE, LOSS_TOLERANCE, LeafDiff, Numerics,
                             compare_numerics)


def _step(state, x):
    """Attention scores with a key bias (which softmax cancels: its gradient is rounding noise)
    and a sign-like update that turns that noise into steps of the learning rate, as Adam
    does."""
    def loss_fn(p):
        q, k = x @ p["wq"], x @ p["wk"] + p["key_bias"]
        return -jnp.mean(jnp.diag(jax.nn.log_softmax(q @ k.T, axis=-1)))

    loss, grads = jax.value_and_grad(loss_fn)(state)
    return jax.tree.map(lambda p, g: p - 1e-2 * g / (jnp.abs(g) + 1e-12), state, grads), loss


def _args():
    keys = jax.random.split(jax.random.key(0), 4)
    state = {"wq": jax.random.normal(keys[0], (16, 8)), "wk": jax.random.normal(keys[1], (16, 8)),
             "key_bias": 0.01 * jax.random.normal(keys[2], (8,))}
    return state, jax.random.normal(keys[3], (64, 16))


def _as_prepared(step):
    """What ``compare_numerics`` reads of a prepared step, from a recipe's step."""
    return types.SimpleNamespace(compiled=step.jitted, in_shardings=step.in_shardings,
                                 state_out=step.state_out)


def test_the_verdict_of_a_leaf_and_of_the_loss():
    assert LeafDiff("w", LEAF_TOLERANCE, 0.0).ok
    assert not LeafDiff("w", 2 * LEAF_TOLERANCE, 0.0).ok
    assert LeafDiff("b", 0.5, 0.5 / FLOOR_FACTOR).ok
    assert not LeafDiff("b", 0.5, 0.4 / FLOOR_FACTOR).ok
    noisy, wrong = LeafDiff("b", 0.5, 0.1), LeafDiff("w", 1e-3, 1e-7)
    numerics = Numerics(3, 0.5, LOSS_TOLERANCE, (noisy, wrong))
    assert numerics.failing == (wrong,) and not numerics.ok
    assert "FAILS w" in numerics.summary() and "1 of 2 leaves" in numerics.summary()
    assert Numerics(3, 0.5, LOSS_TOLERANCE, (noisy,)).ok
    assert not Numerics(3, 0.0, 2 * LOSS_TOLERANCE).ok
    assert Numerics(3, 0.0, 0.0).to_dict()["beyond_tolerance"] == []
    # a bfloat16 loss: beyond the tolerance, within 10x what data parallelism alone moves it
    assert Numerics(3, 0.0, 3e-4, loss_floor=1.5e-4).ok
    low = Numerics(3, 0.0, 3e-4, loss_floor=1e-6)
    assert not low.ok and "FAILS: over 10x its noise floor (1.00e-06)" in low.summary()


def test_the_data_parallel_step_is_within_its_own_noise_floor(mesh24):
    pure = functionalize(_step, _args())
    dp = data_parallel_step(pure, mesh24)
    assert dp.specs[-1][0] == ("data", "model")                       # the batch
    numerics = compare_numerics(_as_prepared(dp), pure, 3, mesh24)
    assert numerics.ok, numerics.summary()
    # the key bias moves by rounding noise: beyond the tolerance, and within its floor (the
    # data-parallel step's own difference, or the arguments' ulp's, whichever is larger)
    (leaf,) = [leaf for leaf in numerics.beyond if "key_bias" in leaf.path]
    assert leaf.diff > LEAF_TOLERANCE and leaf.floor >= leaf.diff


def test_a_wrong_leaf_fails_and_is_named(mesh24):
    pure = functionalize(_step, _args())
    dp = data_parallel_step(pure, mesh24)

    def off(state, x):
        state, loss = dp.jitted(state, x)
        return {**state, "wq": state["wq"] * (1 + 1e-3)}, loss

    wrong = types.SimpleNamespace(compiled=off, in_shardings=dp.in_shardings, state_out=0)
    numerics = compare_numerics(wrong, pure, 3, mesh24)
    assert [leaf.path for leaf in numerics.failing] == ["['wq']"]
    assert not numerics.ok and numerics.max_param_rel_diff == pytest.approx(
        max(leaf.diff for leaf in numerics.beyond))


def test_one_device_data_parallel_is_the_plain_step(mesh_factory):
    pure = functionalize(_step, _args())
    one = mesh_factory((1, 1))
    numerics = compare_numerics(_as_prepared(data_parallel_step(pure, one)), pure, 3, one)
    assert numerics.ok and numerics.beyond == ()
    assert np.isclose(numerics.max_param_rel_diff, 0.0)


def test_on_one_device_the_floor_is_measured_on_the_local_devices(mesh24, mesh_factory):
    # another program on one device (here: the sharded one stands for it) moves the key bias
    # by rounding noise; its floor comes from the local devices, not the one-device step
    # against itself (zero)
    pure = functionalize(_step, _args())
    other = _as_prepared(data_parallel_step(pure, mesh24))
    numerics = compare_numerics(other, pure, 3, mesh_factory((1, 1)))
    (leaf,) = [leaf for leaf in numerics.beyond if "key_bias" in leaf.path]
    assert leaf.diff > LEAF_TOLERANCE and leaf.floor > LEAF_TOLERANCE
    assert numerics.ok, numerics.summary()


def _twin_step(state, x, split=False):
    """A student against an EMA teacher initialised to it: the gradient is zero in exact
    arithmetic, and the sign-like update turns its rounding into steps. ``split``: the teacher's
    contraction summed in two halves, as a plan that splits it rounds it."""
    teacher = state["teacher"]
    logits = x[:, :8] @ teacher[:8] + x[:, 8:] @ teacher[8:] if split else x @ teacher
    target = jax.nn.softmax(jax.lax.stop_gradient(logits))

    def loss_fn(w):
        return -jnp.mean(jnp.sum(target * jax.nn.log_softmax(x @ w), axis=-1))

    loss, grad = jax.value_and_grad(loss_fn)(state["student"])
    student = state["student"] - 1e-2 * grad / (jnp.abs(grad) + 1e-12)
    return {"student": student, "teacher": 0.99 * teacher + 0.01 * student}, loss


def test_a_gradient_zero_in_exact_arithmetic_has_the_floor_of_its_rounding(mesh24):
    # data parallelism computes the teacher as the plain step does (a floor of zero); the
    # split teacher rounds apart from the student, and the ulp-moved arguments show that any
    # rounding moves the student that far
    w = jax.random.normal(jax.random.key(0), (16, 8))
    args = ({"student": w, "teacher": w}, jax.random.normal(jax.random.key(1), (64, 16)))
    pure = functionalize(_twin_step, args)
    split = functionalize(functools.partial(_twin_step, split=True), args)
    dp = data_parallel_step(split, mesh24)
    numerics = compare_numerics(_as_prepared(dp), pure, 3, mesh24)
    (leaf,) = [leaf for leaf in numerics.beyond if "student" in leaf.path]
    assert leaf.diff > 100 * LEAF_TOLERANCE and leaf.floor * FLOOR_FACTOR >= leaf.diff
    assert numerics.ok, numerics.summary()
    # the data-parallel floor alone: the plain step data-parallel, within the tolerance
    same = compare_numerics(_as_prepared(data_parallel_step(pure, mesh24)), pure, 3, mesh24)
    assert same.beyond == () and same.max_param_rel_diff * FLOOR_FACTOR < leaf.diff
