"""A Llama-style decoder in Flax NNX, trained with ``nnx.Optimizer`` and AdamW.

Pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query causal attention and a
SwiGLU feed-forward; no biases anywhere; the blocks live in an ``nnx.List``. The step is the
usual NNX one: ``nnx.value_and_grad`` of the next-token cross-entropy, then
``optimizer.update``.

``make(...)`` returns ``(train_step, (model, optimizer, batch))``: abstract arrays by default,
or, with ``abstract=False``, a model, optimizer and batch drawn from ``seed``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


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


def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make(layers=3, dim=32, heads=4, kv_heads=2, batch=8, seq=16, vocab=64, *,
         abstract=True, seed=0):
    """``(train_step, (model, optimizer, batch))``; abstract arrays unless ``abstract=False``."""
    def create():
        model = Llama(vocab=vocab, dim=dim, n_layers=layers, heads=heads, kv_heads=kv_heads,
                      rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    if abstract:
        model, optimizer = nnx.eval_shape(create)
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return train_step, (model, optimizer, {"tokens": tokens, "labels": tokens})
    model, optimizer = nnx.jit(create)()
    text = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, vocab)
    return train_step, (model, optimizer, {"tokens": text[:, :-1], "labels": text[:, 1:]})
