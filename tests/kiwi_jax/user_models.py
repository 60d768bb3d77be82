"""Train steps written the way Flax users write them: no name scopes, nothing for the planner.

``llama`` is an NNX Llama-style decoder (RMSNorm, SwiGLU, rotary embeddings, grouped-query
attention, no biases, blocks in an ``nnx.List``) trained by ``nnx.Optimizer`` with AdamW;
``linen`` is a Linen model whose blocks are ``layers_<i>`` (a list made in ``setup``) or
``MixerBlock_<i>`` (made in an ``@nn.compact`` loop), trained from a ``TrainState``. Each
factory returns ``(train_step, args)`` with abstract arrays: the steps are lowered, never run.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state


class RMSNorm(nnx.Module):
    def __init__(self, dim, eps=1e-6):
        self.weight = nnx.Param(jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight


def rope(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half) / half)
    angles = positions[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, dim, heads, kv_heads, *, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nnx.Linear(dim, heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(heads * self.head_dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x, positions):
        b, s, _ = x.shape
        q = self.wq(x).reshape(b, s, self.heads, self.head_dim)
        k = self.wk(x).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).reshape(b, s, self.kv_heads, self.head_dim)
        q, k = rope(q, positions), rope(k, positions)
        repeat = self.heads // self.kv_heads
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(x.dtype)
        mask = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nnx.Module):
    def __init__(self, dim, hidden, *, rngs):
        self.w1 = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.w2(nnx.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nnx.Module):
    def __init__(self, dim, heads, kv_heads, *, rngs):
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads, rngs=rngs)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim, rngs=rngs)

    def __call__(self, x, positions):
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nnx.Module):
    def __init__(self, vocab=64, dim=32, n_layers=3, heads=4, kv_heads=2, *, rngs):
        self.tok_embeddings = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(dim, heads, kv_heads, rngs=rngs)
                                for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.output(self.norm(x))


def llama_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def llama(n_layers=3, batch=8, seq=16, vocab=64):
    def create():
        model = Llama(vocab=vocab, n_layers=n_layers, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    model, optimizer = nnx.eval_shape(create)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return llama_step, (model, optimizer, {"tokens": tokens, "labels": tokens})


class MixerBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.Dense(2 * self.hidden)(y)
        y = nn.gelu(y)
        y = nn.Dense(self.hidden)(y)
        return x + y


class LinenNet(nn.Module):
    hidden: int = 32
    n_layers: int = 3
    out: int = 10

    def setup(self):
        self.embed = nn.Dense(self.hidden)
        self.layers = [MixerBlock(self.hidden) for _ in range(self.n_layers)]
        self.head = nn.Dense(self.out)

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(axis=1))


class CompactNet(nn.Module):
    hidden: int = 32
    n_layers: int = 3
    out: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.hidden)(x)
        for _ in range(self.n_layers):
            x = MixerBlock(self.hidden)(x)
        return nn.Dense(self.out)(x.mean(axis=1))


def linen_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def linen(module_cls=LinenNet, n_layers=3, batch=8, seq=16, features=24):
    module = module_cls(n_layers=n_layers)
    x = jnp.zeros((batch, seq, features))
    params = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    state = jax.eval_shape(lambda p: train_state.TrainState.create(
        apply_fn=module.apply, params=p, tx=optax.adam(1e-3)), params)
    batch_ = {"x": jax.ShapeDtypeStruct((batch, seq, features), jnp.float32),
              "y": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    return linen_step, (state, batch_)
