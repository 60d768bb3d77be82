"""The small concrete models of the multi-process test: the reference GPT and the user-style
NNX Llama (``user_models.Llama``), each a factory of ``(train_step, concrete args)`` that gives
the same values in every process (fixed seeds)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from kiwi_jax.models import build
from user_models import Llama, llama_step

GPT = dict(layers=2, hidden=32, heads=2, seq=16, batch=8, vocab=64)
LLAMA = dict(n_layers=2, vocab=64, batch=8, seq=16)
MLP = dict(layers=2, width=32, in_dim=16, out_dim=16, batch=16)


def gpt():
    ref = build("gpt", **GPT)
    return ref.train_step, (*ref.init(0), ref.batch(0))


def llama():
    model = Llama(vocab=LLAMA["vocab"], n_layers=LLAMA["n_layers"], rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    stream = jax.random.randint(jax.random.key(1), (LLAMA["batch"], LLAMA["seq"] + 1), 0,
                                LLAMA["vocab"], jnp.int32)
    return llama_step, (model, optimizer, {"tokens": stream[:, :-1], "labels": stream[:, 1:]})


def mlp():
    ref = build("mlp", **MLP)
    return ref.train_step, (*ref.init(0), ref.batch(0))


MODELS = {"gpt": gpt, "llama": llama, "mlp": mlp}
