"""Linen train steps written the way Flax users write them: no name scopes, nothing for the
planner (the NNX Llama of these tests is ``experiments.zoo.llama``).

``linen`` is a Linen model whose blocks are ``layers_<i>`` (a list made in ``setup``) or
``MixerBlock_<i>`` (made in an ``@nn.compact`` loop), trained from a ``TrainState``. Each
factory returns ``(train_step, args)`` with abstract arrays: the steps are lowered, never run.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


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
