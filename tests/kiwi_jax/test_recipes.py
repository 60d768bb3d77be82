"""The hand-written recipes: every sharding rule compiles on a 2x4 mesh and gives the plain
step's numerics on the zoo Llama and the reference GPT (and a Linen MLP under a policy); the
blocks of a jitted Linen step take a policy; tensor parallelism splits the kernels as Megatron
does; FSDP shards the state 8 ways; a per-block policy changes the compiled program but not
the numerics; ``kiwi-jax compare`` prints its table."""

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import solvers
from experiments import zoo
from kiwi_jax import cli
from kiwi_jax.models import build
from kiwi_jax.recipe_remat import with_scan_policy
from kiwi_jax.recipes import (BlockPolicyError, Recipe, all_recipes, compile_recipe,
                              recipe_step)
from kiwi_jax.step import functionalize

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
"""XLA options that cut the CPU compile of these small steps several-fold."""

LLAMA = {"layers": 2, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 8, "seq": 8, "vocab": 64}
GPT = {"layers": 2, "hidden": 16, "heads": 2, "seq": 8, "batch": 8, "vocab": 64}
MIXER = {"blocks": 2, "hidden_dim": 16, "tokens_mlp_dim": 8, "channels_mlp_dim": 16,
         "batch": 8, "image_size": 16, "patch_size": 8}
LINEN_MLP = {"layers": 4, "width": 16, "batch": 8}
ENCDEC = {"layers": 2, "emb_dim": 16, "heads": 2, "mlp_dim": 32, "batch": 8, "seq": 8,
          "vocab": 64}
DEEP_LLAMA = {"layers": 4, "dim": 32, "heads": 4, "kv_heads": 2, "batch": 16, "seq": 64,
              "vocab": 64}
"""Activations dominate its memory: the case a per-block policy is for."""

STEPS = 3
MODEL = (0, 0)
"""Path prefix of an NNX model's leaves: the state (argument 0), the model (object 0)."""


def _make(model: str):
    if model in ("gpt", "linen_mlp"):
        ref = build(model, **(GPT if model == "gpt" else LINEN_MLP))
        return ref.train_step, (*ref.init(0), ref.batch(0))
    sizes = {"llama": LLAMA, "mixer": MIXER, "encdec": ENCDEC}[model]
    return zoo.make(model, abstract=False, **sizes)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                        tree)


def _losses(compiled, args, state_out) -> list[float]:
    args, losses = list(args), []
    for _ in range(STEPS):
        outputs = compiled(*args)
        metrics = [o for i, o in enumerate(outputs) if i != state_out][0]
        losses.append(float(metrics["loss"] if isinstance(metrics, dict) else metrics))
        args[0] = outputs[state_out]
    return losses


@pytest.fixture(scope="module")
def plain_losses():
    """Per model, the plain jitted step's losses over three steps."""
    found = {}

    def get(model):
        if model not in found:
            step, args = _make(model)
            pure = functionalize(step, args)
            compiled = jax.jit(pure.fn).lower(*pure.args).compile(compiler_options=FAST_COMPILE)
            found[model] = _losses(compiled, _copy(pure.args), 1 if pure.style == "nnx" else 0)
        return found[model]

    return get


@pytest.mark.parametrize("model,recipe", [
    ("llama", "dp"), ("llama", "fsdp/dots_saveable"), ("llama", "tp/nothing_saveable"),
    ("llama", "fsdp+tp"),
    ("gpt", "dp/nothing_saveable"), ("gpt", "fsdp"), ("gpt", "tp"),
    ("gpt", "fsdp+tp/dots_saveable"),
    ("linen_mlp", "fsdp+tp/nothing_saveable"),
])
def test_recipe_compiles_and_matches_the_plain_step(model, recipe, mesh24, plain_losses):
    step, args = _make(model)
    made = recipe_step(step, args, mesh24, recipe)
    assert made.recipe == Recipe.parse(recipe)
    if made.recipe.policy != "none":
        assert len(made.blocks) == 2, made.blocks
    placed = jax.device_put(_copy(made.pure.args), made.in_shardings)
    compiled = made.jitted.lower(*made.pure.args).compile(compiler_options=FAST_COMPILE)
    losses = _losses(compiled, placed, made.state_out)
    expected = plain_losses(model)
    assert np.allclose(losses, expected, rtol=1e-6, atol=0), (losses, expected)


def test_linen_blocks_run_under_the_policy(mesh24):
    """A Linen model (a jitted step): the blocks are found by scope path and intercepted;
    tracing the recipe's step raises when no block ran under the policy."""
    step, args = _make("mixer")
    made = recipe_step(step, args, mesh24, "fsdp+tp/nothing_saveable")
    assert made.blocks == (("MixerBlock_0",), ("MixerBlock_1",))
    text = str(jax.make_jaxpr(made.pure.fn)(*made.pure.args))
    assert len(re.findall(r"\b(?:checkpoint|remat2?)\[", text)) >= 2


def test_an_encoders_and_a_decoders_blocks_all_run_under_the_policy(mesh24, plain_losses):
    step, args = _make("encdec")
    made = recipe_step(step, args, mesh24, "dp/dots_saveable")
    assert made.blocks == (("decoder", "DecoderLayer_0"), ("decoder", "DecoderLayer_1"),
                           ("encoder", "EncoderLayer_0"), ("encoder", "EncoderLayer_1"))
    text = str(jax.make_jaxpr(made.pure.fn)(*made.pure.args))
    assert len(re.findall(r"\b(?:checkpoint|remat2?)\[", text)) >= 4
    placed = jax.device_put(_copy(made.pure.args), made.in_shardings)
    compiled = made.jitted.lower(*made.pure.args).compile(compiler_options=FAST_COMPILE)
    losses = _losses(compiled, placed, made.state_out)
    assert np.allclose(losses, plain_losses("encdec"), rtol=1e-6, atol=0)


def _only(found: dict):
    assert len(found) == 1, found
    return next(iter(found.values()))


def test_tensor_parallel_splits_llama_kernels_as_megatron(mesh24):
    step, args = zoo.make("llama", **LLAMA)
    for sharding in ("tp", "fsdp+tp"):
        made = recipe_step(step, args, mesh24, sharding)
        fsdp = "data" if sharding == "fsdp+tp" else None
        for layer in range(LLAMA["layers"]):
            for name in ("wq", "wk", "wv", "w1", "w3"):          # q/k/v, gate, up: columns
                spec = _only(made.spec_of("layers", layer, name, "kernel", prefix=MODEL))
                assert spec == P(fsdp, "model"), (sharding, name, spec)
            for name in ("wo", "w2"):                            # o, down: rows
                spec = _only(made.spec_of("layers", layer, name, "kernel", prefix=MODEL))
                assert spec == P("model", fsdp), (sharding, name, spec)
            # optimizer moments follow their parameter
            assert _only(made.spec_of("mu", "layers", layer, "wo", "kernel", prefix=(0, 1))) == \
                P("model", fsdp)
        assert _only(made.spec_of("tok_embeddings", "embedding", prefix=MODEL)) == P("model", fsdp)
        assert _only(made.spec_of("layers", 0, "ffn_norm", "weight", prefix=MODEL)) == \
            P(fsdp if sharding == "fsdp+tp" else None)
        assert _only(made.spec_of("tokens", prefix=(1,))) == P("data", None)
        # the activations at block boundaries are put on the data axis, as by hand
        text = str(jax.make_jaxpr(made.pure.fn)(*made.pure.args))
        assert text.count("sharding_constraint") >= 2 * LLAMA["layers"]


def test_gpt_biases_follow_their_kernels(mesh24):
    ref = build("gpt", **GPT)
    made = recipe_step(ref.train_step, (*ref.abstract_init(), ref.abstract_batch()), mesh24,
                       "tp")
    assert _only(made.spec_of("blocks", 0, "mlp", "up", "bias", prefix=MODEL)) == P("model")
    assert _only(made.spec_of("blocks", 0, "mlp", "down", "bias", prefix=MODEL)) == P(None)
    assert _only(made.spec_of("blocks", 0, "attn", "o", "kernel", prefix=MODEL)) == P("model", None)


@pytest.fixture(scope="module")
def deep_llama(mesh24):
    """The deep Llama's recipes compiled (abstract arguments), memoised per recipe."""
    step, args = zoo.make("llama", **DEEP_LLAMA)
    found = {}

    def get(recipe):
        if recipe not in found:
            found[recipe] = compile_recipe(step, args, mesh24, recipe, options=FAST_COMPILE)
        return found[recipe]

    return get


def test_fsdp_shards_the_state_eight_ways(deep_llama):
    dp, fsdp = deep_llama("dp").memory, deep_llama("fsdp").memory
    batch = 2 * DEEP_LLAMA["batch"] * DEEP_LLAMA["seq"] * 4 // 8      # tokens + labels
    state = dp.argument_bytes - batch
    assert fsdp.argument_bytes - batch == pytest.approx(state / 8, rel=0.02)


def test_policy_changes_the_compiled_program(deep_llama):
    none = deep_llama("dp")
    saved = deep_llama("dp/nothing_saveable")
    assert saved.memory.temp_bytes < 0.6 * none.memory.temp_bytes
    assert saved.cost.flops > none.cost.flops                  # the blocks' forward again
    assert saved.memory.argument_bytes == none.memory.argument_bytes


SCANNED = {"llama_scan": {"layers": 2, "dim": 16, "heads": 2, "kv_heads": 1, "batch": 8,
                          "seq": 8, "vocab": 32},
           "linen_scan": {"layers": 2, "dim": 16, "heads": 2, "batch": 8, "seq": 8,
                          "vocab": 32}}


@pytest.mark.parametrize("model,recipe", [("llama_scan", "dp/nothing_saveable"),
                                          ("linen_scan", "fsdp+tp/dots_saveable")])
def test_scanned_layers_run_their_body_under_the_policy(model, recipe, mesh24):
    """``nnx.scan`` and ``nn.scan``: the scan's body runs under the policy (a checkpoint inside
    the forward scan), and the step computes what the plain step computes."""
    step, args = zoo.make(model, abstract=False, **SCANNED[model])
    pure = functionalize(step, args)
    plain = jax.jit(pure.fn).lower(*pure.args).compile(compiler_options=FAST_COMPILE)
    expected = _losses(plain, _copy(pure.args), 1 if pure.style == "nnx" else 0)
    made = recipe_step(step, args, mesh24, recipe)
    assert made.blocks == ()
    scans = [e for e in jax.make_jaxpr(made.pure.fn)(*made.pure.args).jaxpr.eqns
             if e.primitive.name == "scan"]
    assert scans and any(re.search(r"\b(?:checkpoint|remat2?)\[", str(e.params["jaxpr"]))
                         for e in scans)
    placed = jax.device_put(_copy(made.pure.args), made.in_shardings)
    compiled = made.jitted.lower(*made.pure.args).compile(compiler_options=FAST_COMPILE)
    losses = _losses(compiled, placed, made.state_out)
    assert np.allclose(losses, expected, rtol=1e-6, atol=0), (losses, expected)


def test_a_scanned_bodys_policy_frees_its_activations(mesh24):
    step, args = zoo.make("linen_scan", layers=4, dim=32, heads=4, batch=16, seq=64, vocab=64)
    none = compile_recipe(step, args, mesh24, "dp", options=FAST_COMPILE).memory
    saved = compile_recipe(step, args, mesh24, "dp/nothing_saveable", options=FAST_COMPILE).memory
    assert saved.temp_bytes < 0.8 * none.temp_bytes, (saved, none)
    assert saved.argument_bytes == none.argument_bytes


def _accumulating_step(state, batch):
    """The mixer's step with its gradient accumulated over two micro-batches by a scan."""
    def loss_fn(params, micro_batch):
        logits = state.apply_fn({"params": params}, micro_batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, micro_batch["label"]).mean()

    def micro(total, micro_batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, micro_batch)
        return jax.tree.map(jnp.add, total, grads), loss

    halves = jax.tree.map(lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:]), batch)
    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, state.params), halves)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g / 2, grads)), losses.mean()


@pytest.mark.parametrize("recipe", ["dp", "dp/nothing_saveable"])
def test_blocks_called_in_a_micro_batch_scan_are_block_modules(recipe, mesh24):
    """The step reads every parameter inside a loop (the accumulation scan), but its blocks
    are modules of the parameter tree: they take the policy, as without the scan."""
    _, args = zoo.make("mixer", **MIXER)
    made = recipe_step(_accumulating_step, args, mesh24, recipe)
    assert made.blocks == (("MixerBlock_0",), ("MixerBlock_1",))
    text = str(jax.make_jaxpr(made.pure.fn)(*made.pure.args))
    found = len(re.findall(r"\b(?:checkpoint|remat2?)\[", text))
    assert found >= 2 if recipe.endswith("saveable") else found == 0


def _layers(weights, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, weights)[0]


def test_only_the_scan_over_stacked_layers_is_wrapped():
    """A scan over micro-batches that closes over the layers is run as written; the scan over
    the stacked weights inside it runs its body under the policy, once."""
    weights = jnp.ones((3, 4, 4)) / 4

    def loss(weights, batches):
        total = jax.lax.scan(lambda acc, x: (acc + _layers(weights, x).sum(), None), 0.0,
                             batches)[0]
        return total

    batches = jnp.ones((2, 5, 4))
    stacked = frozenset({((3, 4, 4), "float32")})
    wrapped = with_scan_policy(loss, stacked, "nothing_saveable")
    text = str(jax.make_jaxpr(wrapped)(weights, batches))
    assert len(re.findall(r"\b(?:checkpoint|remat2?)\[", text)) == 1, text
    assert float(wrapped(weights, batches)) == pytest.approx(float(loss(weights, batches)))
    with pytest.raises(BlockPolicyError, match="not scanned through jax.lax.scan"):
        with_scan_policy(loss, frozenset({((7, 4, 4), "float32")}), "dots_saveable")(
            weights, batches)
    with pytest.raises(BlockPolicyError, match="reads no parameters inside a scan"):
        with_scan_policy(loss, frozenset(), "dots_saveable")
    assert with_scan_policy(loss, stacked, "none") is loss


def test_recipe_names():
    assert len(all_recipes()) == 12
    assert Recipe.parse("fsdp+tp/dots_saveable") == Recipe("fsdp+tp", "dots_saveable")
    assert Recipe("tp").name == "tp"
    with pytest.raises(ValueError, match="unknown recipe sharding 'zero'.*dp, fsdp"):
        Recipe.parse("zero")
    with pytest.raises(ValueError, match="unknown recipe policy 'full'.*nothing_saveable"):
        Recipe.parse("dp/full")


def test_cli_compare_prints_a_table(capsys):
    code = cli.main(["compare", "--model", "mlp", "--layers", "2", "--width", "16", "--batch",
                     "8", "--recipes", "dp", "--budgets", "4MiB", "--fit-compiles", "1",
                     "--json"])
    out = capsys.readouterr().out
    assert code == 0
    assert "compiled MiB" in out and "est. step ms" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert [r["name"] for r in result["recipes"]] == ["dp"]
    assert result["recipes"][0]["compiled_bytes"] > 0
    (kiwi,) = result["kiwi"]
    assert kiwi["budget_bytes"] == 4 * 2**20 and kiwi["fits"] is True


def test_a_solver_failure_at_one_budget_is_a_row_of_the_comparison(monkeypatch, capsys):
    # The recipes' rows are not lost to it (the study at hidden 1024 on one device lost them).
    # On the per-operator model: with "auto" the reference plan fits 4 MiB and runs unsolved.
    optimize_module = sys.modules["kiwi_jax.optimize"]     # the package exports the function

    def failing(*args, **kwargs):
        raise solvers.SolverError("kiwi: backend highs failed (error)")

    monkeypatch.setattr(optimize_module, "solve_plan", failing)
    code = cli.main(["compare", "--model", "mlp", "--layers", "2", "--width", "16", "--batch",
                     "8", "--recipes", "dp", "--budgets", "4MiB", "--fit-compiles", "1",
                     "--memory-model", "operator", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["recipes"][0]["compiled_bytes"] > 0
    (kiwi,) = result["kiwi"]
    assert kiwi["error"] == "SolverError: kiwi: backend highs failed (error)"


@pytest.mark.parametrize("argv,message", [
    (["--recipes", "zero"], "unknown recipe sharding 'zero'"),
    (["--budgets", "lots"], "lots"),
])
def test_cli_compare_rejects_bad_options(argv, message, capsys):
    assert cli.main(["compare", "--model", "gpt", *argv]) == 2
    assert message in capsys.readouterr().err


class _KeywordBlock(nnx.Module):
    """A block as Flax examples write them: a keyword-only flag with a default, a keyword
    argument the model passes, and a module shared by the blocks, passed by keyword."""

    def __init__(self, dim, *, rngs):
        self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, x, *, scale=1.0, shared=None, deterministic: bool = True):
        h = nnx.gelu(self.up(shared(x)))
        if not deterministic:
            h = h * 0.5
        return x + scale * self.down(h)


class _KeywordModel(nnx.Module):
    def __init__(self, dim=16, *, rngs):
        self.blocks = nnx.List([_KeywordBlock(dim, rngs=rngs) for _ in range(2)])
        self.shared = nnx.Linear(dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x, scale=0.5, shared=self.shared)
        return self.head(x)


def _keyword_nnx():
    model = _KeywordModel(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(
            lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(1), (8, 16))
    return train_step, (model, optimizer, {"x": x, "y": x[:, :1]})


class _LinenKeywordBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.gelu(nn.Dense(2 * x.shape[-1])(x))
        return x + nn.Dense(x.shape[-1])(h * (0.5 if train else 1.0))


class _LinenKeywordModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        for _ in range(2):
            x = _LinenKeywordBlock()(x, train=train)
        return nn.Dense(1)(x)


def _keyword_linen():
    model = _LinenKeywordModel()
    x = jax.random.normal(jax.random.key(1), (8, 16))
    state = train_state.TrainState.create(apply_fn=model.apply,
                                          params=model.init(jax.random.key(0), x)["params"],
                                          tx=optax.adam(1e-2))

    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"], train=True)
            return jnp.mean((out - batch["y"]) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step, (state, {"x": x, "y": x[:, :1]})


@pytest.mark.parametrize("make", [_keyword_nnx, _keyword_linen], ids=["nnx", "linen"])
def test_blocks_called_with_keyword_arguments_run_under_the_policy(make, mesh24):
    """Keyword-only flags, keyword arguments and Python flags stay out of the remat transform
    (``nnx.remat`` refuses a keyword it cannot put in a position, and a flag traced as an array
    cannot steer Python control flow); the step is the plain one's."""
    step, args = make()
    pure = functionalize(step, args)
    plain = jax.jit(pure.fn).lower(*pure.args).compile(compiler_options=FAST_COMPILE)
    state_out = 1 if pure.style == "nnx" else 0
    expected = _losses(plain, _copy(pure.args), state_out)
    made = recipe_step(*make(), mesh24, "dp/nothing_saveable")
    assert len(made.blocks) == 2, made.blocks
    text = str(jax.make_jaxpr(made.pure.fn)(*made.pure.args))
    assert len(re.findall(r"\b(?:checkpoint|remat2?)\[", text)) >= 2
    placed = jax.device_put(_copy(made.pure.args), made.in_shardings)
    compiled = made.jitted.lower(*made.pure.args).compile(compiler_options=FAST_COMPILE)
    losses = _losses(compiled, placed, made.state_out)
    assert np.allclose(losses, expected, rtol=1e-6, atol=0), (losses, expected)
