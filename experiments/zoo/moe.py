"""A small mixture-of-experts Transformer in Flax NNX, trained with ``nnx.Optimizer``.

Every block is pre-LayerNorm causal self-attention followed by a mixture-of-experts
feed-forward: a linear router scores the experts, a softmax gives their probabilities, each
token goes to its top-2 experts with the two gates renormalised, and the experts (stacked
weights, one GELU MLP each) are evaluated densely with ``einsum`` and combined with the
one-hot gate matrix. A Switch-style load-balancing loss is added to the language-model loss.

``make(...)`` returns ``(train_step, (model, optimizer, batch))``: abstract arrays by default,
or, with ``abstract=False``, a model, optimizer and batch drawn from ``seed``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MoE(nnx.Module):
    def __init__(self, dim, hidden, num_experts, top_k=2, *, rngs):
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nnx.Linear(dim, num_experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_in = nnx.Param(init(rngs.params(), (num_experts, dim, hidden)))
        self.w_out = nnx.Param(init(rngs.params(), (num_experts, hidden, dim)))

    def __call__(self, x):
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = jax.nn.softmax(self.router(tokens), axis=-1)
        gates, experts = jax.lax.top_k(probs, self.top_k)
        gates = gates / gates.sum(axis=-1, keepdims=True)
        dispatch = jax.nn.one_hot(experts, self.num_experts)            # (t, k, e)
        combine = jnp.einsum("tk,tke->te", gates, dispatch)
        h = nnx.gelu(jnp.einsum("td,edh->teh", tokens, self.w_in[...]))
        out = jnp.einsum("teh,ehd->ted", h, self.w_out[...])
        y = jnp.einsum("te,ted->td", combine, out)
        # Switch Transformer's auxiliary loss: fraction routed x mean probability, per expert
        routed = dispatch.sum(axis=1).mean(axis=0) / self.top_k
        aux = self.num_experts * jnp.sum(routed * probs.mean(axis=0))
        return y.reshape(b, s, d), aux


class Block(nnx.Module):
    def __init__(self, dim, heads, hidden, num_experts, *, rngs):
        self.ln1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                           rngs=rngs)
        self.ln2 = nnx.LayerNorm(dim, rngs=rngs)
        self.moe = MoE(dim, hidden, num_experts, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoETransformer(nnx.Module):
    def __init__(self, vocab, dim, depth, heads, hidden, num_experts, max_len, *, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, hidden, num_experts, rngs=rngs)
                                for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        mask = nnx.make_causal_mask(tokens)
        aux_total = 0.0
        for block in self.blocks:
            x, aux = block(x, mask)
            aux_total = aux_total + aux
        return self.lm_head(self.ln_f(x)), aux_total / len(self.blocks)


def train_step(model, optimizer, batch, aux_weight=0.01):
    def loss_fn(model):
        logits, aux = model(batch["tokens"])
        lm = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return lm + aux_weight * aux, lm

    (loss, lm), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {"loss": loss, "lm_loss": lm}


def make(layers=2, dim=32, heads=4, hidden=64, experts=4, batch=8, seq=16, vocab=64, *,
         abstract=True, seed=0):
    """``(train_step, (model, optimizer, batch))``; abstract arrays unless ``abstract=False``."""
    def create():
        model = MoETransformer(vocab, dim, layers, heads, hidden, experts, max(64, seq),
                               rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    if abstract:
        model, optimizer = nnx.eval_shape(create)
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return train_step, (model, optimizer, {"tokens": tokens, "labels": tokens})
    model, optimizer = nnx.jit(create)()
    text = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, vocab)
    return train_step, (model, optimizer, {"tokens": text[:, :-1], "labels": text[:, 1:]})
