"""Tests of the reference models package (tiny shapes, CPU)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kiwi_jax.models import (
    KIWI_LAYER_CONFIG,
    MLPConfig,
    ReferenceStep,
    TransformerConfig,
    build,
    known_models,
)

TINY = {
    "gpt": dict(layers=2, hidden=32, heads=4, seq=8, batch=2, vocab=64),
    "bert": dict(layers=2, hidden=32, heads=4, seq=8, batch=2, vocab=64),
    "mlp": dict(layers=7, width=32, batch=4, in_dim=16, out_dim=8),
    "linen_mlp": dict(layers=3, width=32, batch=4, in_dim=16, out_dim=8),
}


def _run_steps(ref: ReferenceStep, steps: int) -> list[float]:
    """Runs ``steps`` train steps on one fixed batch; returns the losses.

    The step is compiled from the *abstract* state and batch and then executed
    on concrete ones, which also checks that their structures agree.
    """
    pure, abstract_flat = _pure_step(ref, ref.abstract_init())
    step = jax.jit(pure).lower(abstract_flat, ref.abstract_batch()).compile()
    _, flat = _pure_step(ref, ref.init(seed=0))
    batch = ref.batch(seed=0)
    losses = []
    for _ in range(steps):
        if ref.style == "nnx":
            loss, flat = step(flat, batch)
        else:
            flat, metrics = step(flat, batch)
            loss = metrics["loss"]
        losses.append(float(loss))
    return losses


def _pure_step(ref: ReferenceStep, state: tuple):
    """A pure ``(state, batch) -> outputs`` wrapper and its state argument."""
    if ref.style == "linen":
        return ref.train_step, state[0]
    graphdef, flat = nnx.split(state)

    def pure(flat, batch):
        model, optimizer = nnx.merge(graphdef, flat)
        loss = ref.train_step(model, optimizer, batch)
        return loss, nnx.state((model, optimizer))

    return pure, flat


def _hlo(ref: ReferenceStep) -> str:
    pure, flat = _pure_step(ref, ref.abstract_init())
    lowered = jax.jit(pure).lower(flat, ref.abstract_batch())
    return lowered.as_text(dialect="hlo", debug_info=True)


def test_known_models():
    assert set(known_models()) == set(TINY)


@pytest.mark.parametrize("name", sorted(TINY))
def test_train_steps_reduce_loss(name):
    ref = build(name, **TINY[name])
    losses = _run_steps(ref, steps=3)
    assert np.all(np.isfinite(losses))
    assert losses[2] < losses[1] < losses[0]


def test_eager_nnx_step_updates_in_place():
    ref = build("mlp", **TINY["mlp"])
    model, optimizer = ref.init(seed=0)
    batch = ref.batch(seed=0)
    before = np.asarray(model.linears[0].kernel.get_value())
    first = float(ref.train_step(model, optimizer, batch))
    second = float(ref.train_step(model, optimizer, batch))
    assert np.isfinite([first, second]).all() and second < first
    assert int(optimizer.step.get_value()) == 2
    assert not np.allclose(before, model.linears[0].kernel.get_value())


@pytest.mark.parametrize("name", sorted(TINY))
def test_abstract_init_allocates_nothing(name):
    ref = build(name, **TINY[name])
    state = ref.abstract_init()
    tree = nnx.state(state) if ref.style == "nnx" else state
    leaves = jax.tree.leaves(tree)
    assert leaves
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    concrete = ref.init()
    concrete_tree = nnx.state(concrete) if ref.style == "nnx" else concrete
    assert jax.tree.structure(concrete_tree) == jax.tree.structure(tree)
    concrete_leaves = [jnp.asarray(x) for x in jax.tree.leaves(concrete_tree)]
    assert [(x.shape, x.dtype) for x in concrete_leaves] == [(x.shape, x.dtype) for x in leaves]
    if ref.style == "nnx":
        assert nnx.graphdef(concrete) == nnx.graphdef(state)


@pytest.mark.parametrize("name", sorted(TINY))
def test_batch_matches_abstract_batch(name):
    ref = build(name, **TINY[name])
    concrete = ref.batch(seed=3)
    abstract = ref.abstract_batch()
    assert set(concrete) == set(abstract)
    for key, spec in abstract.items():
        assert isinstance(spec, jax.ShapeDtypeStruct)
        assert (concrete[key].shape, concrete[key].dtype) == (spec.shape, spec.dtype)


def test_gpt_batch_labels_are_next_tokens():
    batch = build("gpt", **TINY["gpt"]).batch()
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])


def test_gpt_is_causal_and_bert_is_not():
    def logits(name, tokens):
        model, _ = build(name, **TINY[name]).init(seed=0)
        return nnx.jit(lambda m, t: m(t))(model, tokens)

    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    changed = tokens.at[0, -1].set(63)
    for name, prefix_equal in (("gpt", True), ("bert", False)):
        a, b = logits(name, tokens), logits(name, changed)
        assert np.allclose(a[:, :-1], b[:, :-1]) == prefix_equal


def test_gpt_hlo_has_layer_scopes():
    hlo = _hlo(build("gpt", **TINY["gpt"]))
    op_names = re.findall(r'op_name="([^"]*)"', hlo)
    for scope in ("layer_0", "layer_1", "attention_core", "mlp", "embed", "head"):
        assert any(scope in op for op in op_names), scope
    assert not any("layer_2" in op for op in op_names)


@pytest.mark.parametrize("name", ["mlp", "linen_mlp"])
def test_mlp_hlo_has_layer_scopes(name):
    ref = build(name, **TINY[name])
    op_names = re.findall(r'op_name="([^"]*)"', _hlo(ref))
    for i in range(ref.config.layers):
        assert any(f"layer_{i}" in op for op in op_names), i


def test_kiwi_preset_with_override():
    ref = build("gpt", preset="kiwi", layers=4)
    assert ref.config == TransformerConfig(**{**vars(KIWI_LAYER_CONFIG), "layers": 4})
    model, _ = ref.abstract_init()
    kernel = model.blocks[3].attn.q.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct)
    assert kernel.shape == (5120, 5120)
    assert ref.abstract_batch()["tokens"].shape == (16, 1024)
    assert not build("bert", preset="kiwi").config.causal


def test_defaults():
    assert build("gpt").config == TransformerConfig(
        layers=2, hidden=64, heads=4, seq=16, batch=4, vocab=128, causal=True
    )
    assert not build("bert").config.causal
    assert build("mlp").config == MLPConfig()
    assert MLPConfig().layers == 7


def test_build_unknown_name():
    with pytest.raises(ValueError, match=r"unknown reference model 'resnet'.*gpt.*bert"):
        build("resnet")


def test_build_unknown_field():
    with pytest.raises(ValueError, match=r"unknown config field.*depth.*valid fields: layers"):
        build("gpt", depth=3)


def test_build_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown preset 'huge'.*small.*kiwi"):
        build("gpt", preset="huge")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden=30, heads=4), r"hidden \(30\) must be divisible by heads \(4\)"),
        (dict(layers=0), r"layers must be a positive int"),
        (dict(vocab=2.5), r"vocab must be a positive int"),
        (dict(dtype=jnp.int32), r"floating-point dtype"),
        (dict(remat="dots"), r"remat must be None or a jax.checkpoint_policies name"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        build("gpt", **overrides)


def test_mlp_config_validation():
    with pytest.raises(ValueError, match=r"MLPConfig.width must be a positive int"):
        MLPConfig(width=-1)


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable"])
def test_remat_policy_recomputes_per_block_and_keeps_the_numbers(policy):
    plain = build("gpt", layers=2, hidden=32, heads=2, seq=64, batch=4, vocab=64)
    remat = build("gpt", layers=2, hidden=32, heads=2, seq=64, batch=4, vocab=64, remat=policy)
    assert _run_steps(remat, steps=2) == pytest.approx(_run_steps(plain, steps=2), rel=1e-6)
    # per block: the backward pass recomputes the block's non-saved values (CPU: with the
    # compiler option that keeps recomputation, see DESIGN.md), so fewer bytes stay alive
    temp = {}
    for name, ref in (("plain", plain), (policy, remat)):
        pure, flat = _pure_step(ref, ref.abstract_init())
        compiled = jax.jit(pure).lower(flat, ref.abstract_batch()).compile(
            compiler_options={"xla_disable_hlo_passes": "cse_barrier_expander"})
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[policy] < temp["plain"]
