"""Reference Transformer (GPT decoder / BERT-style encoder) in Flax NNX.

One module covers both architectures; :attr:`TransformerConfig.causal`
switches the attention mask on (GPT) or off (BERT). Blocks are pre-LN::

    x = x + attn(ln1(x))
    x = x + mlp(ln2(x))

Every region the planner needs to locate is wrapped in a ``jax.named_scope``
so that it shows up in the HLO ``op_name`` metadata:

* ``embed`` -- token + learned position embedding,
* ``layer_{i}`` -- the i-th block,
* ``attention_core`` -- scores, mask, softmax and weighted sum (the part
  Megatron's selective recomputation recomputes),
* ``mlp`` -- the feed-forward sub-layer,
* ``head`` -- final LayerNorm, LM head and loss.

The model is deterministic (no dropout), so a train step is a pure function
of its inputs. :attr:`TransformerConfig.remat` puts every block under
``jax.checkpoint`` with one of JAX's policies: the per-layer recomputation
that kiwi's plans are measured against (experiments/remat_baselines.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = [
    "KIWI_LAYER_CONFIG",
    "Transformer",
    "TransformerConfig",
    "transformer_batch",
]


def _check_positive_ints(config: Any, names: tuple[str, ...]) -> None:
    """Raises ValueError unless every named field of ``config`` is an int > 0."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"{type(config).__name__}.{name} must be a positive int, got {value!r}"
            )


def _check_float_dtype(config: Any) -> None:
    """Raises ValueError unless ``config.dtype`` is a floating-point dtype."""
    try:
        dtype = jnp.dtype(config.dtype)
    except TypeError as err:
        raise ValueError(
            f"{type(config).__name__}.dtype is not a dtype: {config.dtype!r}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{type(config).__name__}.dtype must be a floating-point dtype, got {dtype}"
        )


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape hyper-parameters of the reference Transformer and its batch."""

    layers: int
    """Number of Transformer blocks."""
    hidden: int
    """Model (residual stream) width; must be divisible by ``heads``."""
    heads: int
    """Number of attention heads."""
    seq: int
    """Sequence length of a batch (also the size of the position table)."""
    batch: int
    """Number of sequences per batch."""
    vocab: int
    """Vocabulary size (embedding rows and LM-head outputs)."""
    causal: bool
    """True for a GPT decoder (causal mask), False for a BERT encoder."""
    dtype: Any = jnp.float32
    """Parameter and activation dtype; the loss is computed in float32."""
    remat: str | None = None
    """None, or the name of a ``jax.checkpoint_policies`` policy (``"dots_saveable"``,
    ``"nothing_saveable"``, ...) under which every block is checkpointed."""

    def __post_init__(self) -> None:
        _check_positive_ints(self, ("layers", "hidden", "heads", "seq", "batch", "vocab"))
        if not isinstance(self.causal, bool):
            raise ValueError(f"TransformerConfig.causal must be a bool, got {self.causal!r}")
        if self.hidden % self.heads:
            raise ValueError(
                f"TransformerConfig.hidden ({self.hidden}) must be divisible by "
                f"heads ({self.heads})"
            )
        _check_float_dtype(self)
        if self.remat is not None and not callable(
                getattr(jax.checkpoint_policies, str(self.remat), None)):
            raise ValueError(
                f"TransformerConfig.remat must be None or a jax.checkpoint_policies name "
                f"such as 'dots_saveable' or 'nothing_saveable', got {self.remat!r}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


KIWI_LAYER_CONFIG = TransformerConfig(
    layers=1, hidden=5120, heads=40, seq=1024, batch=16, vocab=51200, causal=True
)
"""The GPT layer of the KIWI paper's experiments (one block by default).

It is far too large to instantiate on a CPU: use it only with abstract shapes
(``ReferenceStep.abstract_init`` / ``abstract_batch``) for lowering and planning.
"""


class Attention(nnx.Module):
    """Multi-head self-attention with explicit q/k/v/o projections."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        """Creates the four ``hidden -> hidden`` projections.

        Args:
            config: Model configuration.
            rngs: Random streams for parameter initialisation.
        """
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.causal = config.causal
        dense = dict(dtype=config.dtype, param_dtype=config.dtype, rngs=rngs)
        self.q = nnx.Linear(config.hidden, config.hidden, **dense)
        # No key bias: it adds q.b_k to every score of a query, which softmax cancels, so its
        # gradient is zero in exact arithmetic and Adam would turn rounding noise into updates.
        self.k = nnx.Linear(config.hidden, config.hidden, use_bias=False, **dense)
        self.v = nnx.Linear(config.hidden, config.hidden, **dense)
        self.o = nnx.Linear(config.hidden, config.hidden, **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies self-attention to ``x`` of shape (batch, seq, hidden)."""
        b, s, h = x.shape
        split = lambda t: t.reshape(b, s, self.heads, self.head_dim)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        with jax.named_scope("attention_core"):
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
            if self.causal:
                mask = jnp.tril(jnp.ones((s, s), dtype=bool))[None, None]
                scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
            probs = jax.nn.softmax(scores, axis=-1)
            out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.o(out.reshape(b, s, h))


class MLP(nnx.Module):
    """Feed-forward sub-layer: Linear(h, 4h) -> GELU (tanh) -> Linear(4h, h)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        """Creates the up and down projections.

        Args:
            config: Model configuration.
            rngs: Random streams for parameter initialisation.
        """
        dense = dict(dtype=config.dtype, param_dtype=config.dtype, rngs=rngs)
        self.up = nnx.Linear(config.hidden, 4 * config.hidden, **dense)
        self.down = nnx.Linear(4 * config.hidden, config.hidden, **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the feed-forward network to ``x`` (batch, seq, hidden)."""
        with jax.named_scope("mlp"):
            return self.down(jax.nn.gelu(self.up(x), approximate=True))


class Block(nnx.Module):
    """Pre-LN Transformer block."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        """Creates the two LayerNorms, attention and MLP.

        Args:
            config: Model configuration.
            rngs: Random streams for parameter initialisation.
        """
        norm = dict(dtype=config.dtype, param_dtype=config.dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(config.hidden, **norm)
        self.attn = Attention(config, rngs=rngs)
        self.ln2 = nnx.LayerNorm(config.hidden, **norm)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies the block to ``x`` (batch, seq, hidden)."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nnx.Module):
    """GPT decoder (``causal=True``) or BERT-style encoder (``causal=False``)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        """Creates embeddings, ``config.layers`` blocks, final norm and LM head.

        Args:
            config: Model configuration.
            rngs: Random streams for parameter initialisation.
        """
        dense = dict(dtype=config.dtype, param_dtype=config.dtype, rngs=rngs)
        self.token_embed = nnx.Embed(config.vocab, config.hidden, **dense)
        self.pos_embed = nnx.Embed(config.seq, config.hidden, **dense)
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.layers)])
        self.ln_f = nnx.LayerNorm(config.hidden, **dense)
        self.lm_head = nnx.Linear(config.hidden, config.vocab, **dense)
        self.remat = config.remat

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Maps int tokens (batch, seq) to logits (batch, seq, vocab)."""
        with jax.named_scope("embed"):
            positions = jnp.arange(tokens.shape[1])
            x = self.token_embed(tokens) + self.pos_embed(positions)[None]
        apply_block = Block.__call__
        if self.remat is not None:
            policy = getattr(jax.checkpoint_policies, self.remat)
            apply_block = nnx.remat(Block.__call__, policy=policy)
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"layer_{i}"):
                x = apply_block(block, x)
        with jax.named_scope("head"):
            return self.lm_head(self.ln_f(x))

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean token cross-entropy of the batch ``{'tokens', 'labels'}``."""
        logits = self(batch["tokens"])
        with jax.named_scope("head"):
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["labels"]
            ).mean()


def transformer_batch(config: TransformerConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Draws a random batch ``{'tokens': int32[b, s], 'labels': int32[b, s]}``.

    For a causal model the labels are the next tokens of one random stream of
    length ``seq + 1``; for an encoder they are the input tokens themselves.

    Args:
        config: Model configuration giving batch, seq and vocab.
        seed: PRNG seed.

    Returns:
        The batch dict of jax arrays.
    """
    stream = jax.random.randint(
        jax.random.key(seed), (config.batch, config.seq + 1), 0, config.vocab, jnp.int32
    )
    tokens = stream[:, :-1]
    labels = stream[:, 1:] if config.causal else tokens
    return {"tokens": tokens, "labels": labels}
