"""A decoder whose blocks name their values with ``checkpoint_name``, as MaxText-style models
do, so that a ``jax.checkpoint`` names policy can say which to save.

``Block.policy`` is None (no ``jax.checkpoint``) until a test sets it: the block then runs under
``nnx.remat(policy=...)``, as a hand-written step would put a plan's exported policy on it.
``make(...)`` returns ``(train_step, (model, optimizer, tokens))``, abstract unless
``abstract=False``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

NAMES = ("norm1", "qkv", "probs", "context", "attn_out", "norm2", "mlp_up", "mlp_act",
         "mlp_out")


class Block(nnx.Module):
    def __init__(self, dim, heads, *, rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.out = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.policy = None

    def __call__(self, x):
        if self.policy is None:
            return self.forward(x)
        return nnx.remat(type(self).forward, policy=self.policy)(self, x)

    def forward(self, x):
        b, s, d = x.shape
        h = checkpoint_name(self.norm1(x), "norm1")
        qkv = checkpoint_name(self.qkv(h), "qkv").reshape(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.heads)
        mask = jnp.tril(jnp.ones((s, s), bool))
        probs = checkpoint_name(jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1), "probs")
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d)
        x = x + checkpoint_name(self.out(checkpoint_name(ctx, "context")), "attn_out")
        h = checkpoint_name(self.norm2(x), "norm2")
        u = checkpoint_name(self.up(h), "mlp_up")
        a = checkpoint_name(nnx.gelu(u), "mlp_act")
        return x + checkpoint_name(self.down(a), "mlp_out")


class Decoder(nnx.Module):
    def __init__(self, vocab, dim, heads, layers, seq, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, dim)))
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def train_step(model, optimizer, tokens):
    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def make(vocab=64, dim=32, heads=4, layers=3, seq=32, batch=8, *, abstract=True, seed=0):
    def create():
        model = Decoder(vocab, dim, heads, layers, seq, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    shape = (batch, seq + 1)
    if abstract:
        model, optimizer = nnx.eval_shape(create)
        return train_step, (model, optimizer, jax.ShapeDtypeStruct(shape, jnp.int32))
    model, optimizer = create()
    return train_step, (model, optimizer,
                        jax.random.randint(jax.random.key(seed + 1), shape, 0, vocab))
