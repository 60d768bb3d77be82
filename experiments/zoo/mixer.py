"""An MLP-Mixer in Flax Linen, trained from a ``TrainState`` with Adam.

As in the MLP-Mixer paper's reference code: a strided convolution cuts the image into patch
tokens, each block mixes across tokens (LayerNorm, transpose, a GELU MLP over the token axis)
and then across channels (LayerNorm, a GELU MLP over the channel axis), both with residuals; a
final LayerNorm, mean pooling over tokens and a zero-initialised linear head give the logits.

``make(...)`` returns ``(train_step, (state, batch))``: abstract arrays by default, or, with
``abstract=False``, a state and batch drawn from ``seed``.
"""

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
        y = nn.gelu(y)
        return nn.Dense(x.shape[-1])(y)


class MixerBlock(nn.Module):
    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = jnp.swapaxes(y, 1, 2)
        y = MlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
        y = jnp.swapaxes(y, 1, 2)
        x = x + y
        y = nn.LayerNorm()(x)
        return x + MlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)


class MlpMixer(nn.Module):
    num_classes: int
    num_blocks: int
    patch_size: int
    hidden_dim: int
    tokens_mlp_dim: int
    channels_mlp_dim: int

    @nn.compact
    def __call__(self, inputs):
        x = nn.Conv(self.hidden_dim, (self.patch_size, self.patch_size),
                    strides=(self.patch_size, self.patch_size), name="stem")(inputs)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        for _ in range(self.num_blocks):
            x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
        x = nn.LayerNorm(name="pre_head_layer_norm")(x)
        x = jnp.mean(x, axis=1)
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x)


@jax.jit
def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        one_hot = jax.nn.one_hot(batch["label"], logits.shape[-1])
        return optax.softmax_cross_entropy(logits, one_hot).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    return state, metrics


def make(blocks=3, hidden_dim=32, tokens_mlp_dim=32, channels_mlp_dim=64, batch=8,
         image_size=32, patch_size=4, num_classes=10, *, abstract=True, seed=0):
    """``(train_step, (state, batch))``; abstract arrays unless ``abstract=False``."""
    model = MlpMixer(num_classes=num_classes, num_blocks=blocks, patch_size=patch_size,
                     hidden_dim=hidden_dim, tokens_mlp_dim=tokens_mlp_dim,
                     channels_mlp_dim=channels_mlp_dim)
    shape = (batch, image_size, image_size, 3)

    def create(key):
        params = model.init(key, jnp.zeros(shape))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))

    if abstract:
        state = jax.eval_shape(create, jax.random.key(seed))
        return train_step, (state, {"image": jax.ShapeDtypeStruct(shape, jnp.float32),
                                    "label": jax.ShapeDtypeStruct((batch,), jnp.int32)})
    key_init, key_x, key_y = jax.random.split(jax.random.key(seed), 3)
    return train_step, (jax.jit(create)(key_init), {
        "image": jax.random.normal(key_x, shape),
        "label": jax.random.randint(key_y, (batch,), 0, num_classes)})
