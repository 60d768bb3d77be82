"""A GPT-style decoder in Flax Linen whose blocks are applied with ``nn.scan``.

One pre-LayerNorm block (causal ``nn.SelfAttention``, a GELU MLP) is lifted with ``nn.scan``
over a stacked ``params`` axis, so the model holds one set of block weights with a leading
``layers`` dimension and the forward pass is a loop over it. Token and learned position
embeddings in, a final LayerNorm and a linear head out; Adam from a ``TrainState``.

``make(...)`` returns ``(train_step, (state, batch))``: abstract arrays by default, or, with
``abstract=False``, a state and batch drawn from ``seed``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class Block(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.LayerNorm()(x)
        x = x + nn.SelfAttention(num_heads=self.heads)(y, mask=mask)
        y = nn.LayerNorm()(x)
        y = nn.Dense(self.mlp_dim)(y)
        y = nn.gelu(y)
        return x + nn.Dense(x.shape[-1])(y), None


class GPT(nn.Module):
    vocab: int = 64
    dim: int = 32
    layers: int = 3
    heads: int = 4
    mlp_dim: int = 128
    max_len: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim)(tokens)
        x = x + nn.Embed(self.max_len, self.dim)(jnp.arange(tokens.shape[1]))[None]
        Blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        x, _ = Blocks(self.heads, self.mlp_dim, name="blocks")(x, None)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab, use_bias=False)(x)


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def make(layers=3, dim=32, heads=4, mlp_dim=128, batch=8, seq=16, vocab=64, *,
         abstract=True, seed=0):
    """``(train_step, (state, batch))``; abstract arrays unless ``abstract=False``."""
    model = GPT(vocab=vocab, dim=dim, layers=layers, heads=heads, mlp_dim=mlp_dim,
                max_len=max(64, seq))

    def create(key):
        params = model.init(key, jnp.zeros((batch, seq), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))

    if abstract:
        state = jax.eval_shape(create, jax.random.key(seed))
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return train_step, (state, {"tokens": tokens, "labels": tokens})
    key_init, key_text = jax.random.split(jax.random.key(seed))
    text = jax.random.randint(key_text, (batch, seq + 1), 0, vocab)
    return train_step, (jax.jit(create)(key_init), {"tokens": text[:, :-1], "labels": text[:, 1:]})
