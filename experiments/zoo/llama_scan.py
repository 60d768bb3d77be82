"""The Llama decoder of :mod:`experiments.zoo.llama` with its layers scanned, the NNX way.

The decoder layers are created once, stacked along a leading axis by ``nnx.vmap`` over split
RNG streams, and applied with ``nnx.scan`` (the carry is the hidden state, the stacked layer
is scanned over), as in the Flax NNX guide's "scan over layers". Same step, optimizer and
batch as the unscanned model.

``make(...)`` returns ``(train_step, (model, optimizer, batch))``: abstract arrays by default,
or, with ``abstract=False``, a model, optimizer and batch drawn from ``seed``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from experiments.zoo.llama import DecoderLayer, RMSNorm, train_step

__all__ = ["ScannedLlama", "make", "train_step"]


class ScannedLlama(nnx.Module):
    def __init__(self, vocab=64, dim=32, n_layers=3, heads=4, kv_heads=2, *, rngs):
        self.tok_embeddings = nnx.Embed(vocab, dim, rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_layer(rngs):
            return DecoderLayer(dim, heads, kv_heads, rngs=rngs)

        self.layers = create_layer(rngs)
        self.norm = RMSNorm(dim)
        self.output = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[1])
        x = self.tok_embeddings(tokens)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, layer):
            return layer(x, positions)

        x = forward(x, self.layers)
        return self.output(self.norm(x))


def make(layers=3, dim=32, heads=4, kv_heads=2, batch=8, seq=16, vocab=64, *,
         abstract=True, seed=0):
    """``(train_step, (model, optimizer, batch))``; abstract arrays unless ``abstract=False``."""
    def create():
        model = ScannedLlama(vocab=vocab, dim=dim, n_layers=layers, heads=heads,
                             kv_heads=kv_heads, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    if abstract:
        model, optimizer = nnx.eval_shape(create)
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        return train_step, (model, optimizer, {"tokens": tokens, "labels": tokens})
    model, optimizer = nnx.jit(create)()
    text = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, vocab)
    return train_step, (model, optimizer, {"tokens": text[:, :-1], "labels": text[:, 1:]})
