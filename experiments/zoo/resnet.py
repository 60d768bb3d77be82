"""A ResNet in Flax Linen with BatchNorm, trained the way the Flax ImageNet example trains it.

Bottleneck-free ResNet blocks (conv-BN-ReLU, conv-BN, projection shortcut where the shape
changes) after a 7x7 strided stem and a max-pool; global average pooling and a linear head.
BatchNorm's running statistics are the ``batch_stats`` collection: the ``TrainState`` subclass
carries them, the step applies the model with ``mutable=["batch_stats"]`` and stores the
updated statistics with the gradient update. SGD with Nesterov momentum on a warm-up + cosine
schedule, plus L2 weight decay in the loss, as in the example.

``make(...)`` returns ``(train_step, (state, batch))``: abstract arrays by default, or, with
``abstract=False``, a state and batch drawn from ``seed``.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class ResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = nn.relu(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    stage_sizes: tuple
    num_classes: int
    num_filters: int = 16

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2**i, conv=conv, norm=norm,
                                strides=strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class TrainState(train_state.TrainState):
    batch_stats: Any


def cross_entropy_loss(logits, labels):
    one_hot = jax.nn.one_hot(labels, logits.shape[-1])
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))


def train_step(state, batch, weight_decay=1e-4):
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"],
            mutable=["batch_stats"])
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        loss = loss + weight_decay * 0.5 * weight_l2
        return loss, (new_model_state, logits)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (new_model_state, logits)), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    metrics = {"loss": loss,
               "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"])}
    return state, metrics


def make(stage_sizes=(2, 2), num_filters=16, batch=8, image_size=32, num_classes=10, *,
         abstract=True, seed=0):
    """``(train_step, (state, batch))``; abstract arrays unless ``abstract=False``."""
    model = ResNet(stage_sizes=tuple(stage_sizes), num_classes=num_classes,
                   num_filters=num_filters)
    shape = (batch, image_size, image_size, 3)

    def create(key):
        variables = model.init(key, jnp.ones(shape), train=False)
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, 0.1, 5), optax.cosine_decay_schedule(0.1, 1000)], [5])
        return TrainState.create(apply_fn=model.apply, params=variables["params"],
                                 tx=optax.sgd(schedule, momentum=0.9, nesterov=True),
                                 batch_stats=variables["batch_stats"])

    if abstract:
        state = jax.eval_shape(create, jax.random.key(seed))
        return train_step, (state, {"image": jax.ShapeDtypeStruct(shape, jnp.float32),
                                    "label": jax.ShapeDtypeStruct((batch,), jnp.int32)})
    key_init, key_x, key_y = jax.random.split(jax.random.key(seed), 3)
    return train_step, (jax.jit(create)(key_init), {
        "image": jax.random.normal(key_x, shape),
        "label": jax.random.randint(key_y, (batch,), 0, num_classes)})
