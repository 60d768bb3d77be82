"""An encoder-decoder Transformer in Flax Linen, trained from a flax ``TrainState``.

Shaped after the Flax WMT example: one token embedding shared by the encoder, the decoder and
the output projection (``nn.Embed.attend``), learned position embeddings, pre-LayerNorm
blocks; the encoder's self-attention masks padding, the decoder has causal
self-attention and cross-attention to the encoder's output. The loss is the token
cross-entropy over non-padding targets, with the decoder reading the targets shifted right.

``make(...)`` returns ``(train_step, (state, batch))``: abstract arrays by default, or, with
``abstract=False``, a state and batch drawn from ``seed``.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim)(x)
        y = nn.relu(y)
        return nn.Dense(x.shape[-1])(y)


class EncoderLayer(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        x = x + y
        return x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))


class DecoderLayer(nn.Module):
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, y, encoded, self_mask, cross_mask):
        z = nn.LayerNorm()(y)
        z = nn.MultiHeadDotProductAttention(num_heads=self.heads)(z, z, mask=self_mask)
        y = y + z
        z = nn.LayerNorm()(y)
        z = nn.MultiHeadDotProductAttention(num_heads=self.heads)(z, encoded, mask=cross_mask)
        y = y + z
        return y + MlpBlock(self.mlp_dim)(nn.LayerNorm()(y))


class Encoder(nn.Module):
    shared_embedding: Any
    layers: int
    heads: int
    mlp_dim: int
    max_len: int

    @nn.compact
    def __call__(self, inputs):
        mask = nn.make_attention_mask(inputs > 0, inputs > 0)
        x = self.shared_embedding(inputs)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (1, self.max_len, x.shape[-1]))
        x = x + pos[:, :inputs.shape[1]]
        for _ in range(self.layers):
            x = EncoderLayer(self.heads, self.mlp_dim)(x, mask)
        return nn.LayerNorm(name="encoder_norm")(x)


class Decoder(nn.Module):
    shared_embedding: Any
    layers: int
    heads: int
    mlp_dim: int
    max_len: int

    @nn.compact
    def __call__(self, encoded, inputs, targets):
        self_mask = nn.combine_masks(nn.make_attention_mask(targets > 0, targets > 0),
                                     nn.make_causal_mask(targets))
        cross_mask = nn.make_attention_mask(targets > 0, inputs > 0)
        y = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]          # shift right
        y = self.shared_embedding(y)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                         (1, self.max_len, y.shape[-1]))
        y = y + pos[:, :targets.shape[1]]
        for _ in range(self.layers):
            y = DecoderLayer(self.heads, self.mlp_dim)(y, encoded, self_mask, cross_mask)
        y = nn.LayerNorm(name="decoder_norm")(y)
        logits = self.shared_embedding.attend(y)
        return logits / jnp.sqrt(y.shape[-1])


class Transformer(nn.Module):
    vocab_size: int = 64
    emb_dim: int = 32
    heads: int = 4
    enc_layers: int = 2
    dec_layers: int = 2
    mlp_dim: int = 64
    max_len: int = 64

    def setup(self):
        self.shared_embedding = nn.Embed(self.vocab_size, self.emb_dim,
                                         embedding_init=nn.initializers.normal(1.0))
        self.encoder = Encoder(self.shared_embedding, self.enc_layers, self.heads,
                               self.mlp_dim, self.max_len)
        self.decoder = Decoder(self.shared_embedding, self.dec_layers, self.heads,
                               self.mlp_dim, self.max_len)

    def __call__(self, inputs, targets):
        return self.decoder(self.encoder(inputs), inputs, targets)


def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"], batch["targets"])
        weights = (batch["targets"] > 0).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return (losses * weights).sum() / weights.sum()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def make(layers=2, emb_dim=32, heads=4, mlp_dim=64, batch=8, seq=16, vocab=64, *,
         abstract=True, seed=0):
    """``(train_step, (state, batch))`` with ``layers`` encoder and ``layers`` decoder layers;
    abstract arrays unless ``abstract=False``."""
    model = Transformer(vocab_size=vocab, emb_dim=emb_dim, heads=heads, enc_layers=layers,
                        dec_layers=layers, mlp_dim=mlp_dim, max_len=max(64, seq))
    tokens = jnp.ones((batch, seq), jnp.int32)

    def create(key):
        params = model.init(key, tokens, tokens)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adamw(1e-3, b2=0.98))

    if abstract:
        state = jax.eval_shape(create, jax.random.key(seed))
        spec = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return train_step, (state, {"inputs": spec, "targets": spec})
    key_init, key_in, key_out = jax.random.split(jax.random.key(seed), 3)
    # token 0 is padding: the last quarter of every sequence is padded
    keep = jnp.arange(seq) < seq - seq // 4
    inputs = jnp.where(keep, jax.random.randint(key_in, (batch, seq), 1, vocab), 0)
    targets = jnp.where(keep, jax.random.randint(key_out, (batch, seq), 1, vocab), 0)
    return train_step, (jax.jit(create)(key_init), {"inputs": inputs, "targets": targets})
