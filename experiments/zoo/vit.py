"""A Vision Transformer in Flax NNX, trained with ``nnx.Optimizer`` and AdamW.

Images are cut into patches by a strided ``nnx.Conv``, a learned class token and position
embedding are added, and pre-norm encoder blocks (LayerNorm, ``nnx.MultiHeadAttention``, a GELU
MLP) follow; the class token's final LayerNorm output goes through a linear head. The step
minimises softmax cross-entropy and reports the accuracy too.

``make(...)`` returns ``(train_step, (model, optimizer, batch))``: abstract arrays by default,
or, with ``abstract=False``, a model, optimizer and batch drawn from ``seed``.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class EncoderBlock(nnx.Module):
    def __init__(self, dim, heads, mlp_dim, *, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False,
                                           rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp_dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_dim, dim, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class ViT(nnx.Module):
    def __init__(self, image_size=32, patch_size=8, channels=3, dim=32, depth=3, heads=4,
                 mlp_dim=64, num_classes=10, *, rngs):
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nnx.Conv(channels, dim, kernel_size=(patch_size, patch_size),
                                    strides=(patch_size, patch_size), padding="VALID",
                                    rngs=rngs)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos_embed = nnx.Param(
            0.02 * jax.random.normal(rngs.params(), (1, num_patches + 1, dim)))
        self.blocks = nnx.List([EncoderBlock(dim, heads, mlp_dim, rngs=rngs)
                                for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, images):
        x = self.patch_embed(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, c))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    accuracy = (logits.argmax(-1) == batch["label"]).mean()
    return {"loss": loss, "accuracy": accuracy}


def make(depth=3, dim=32, heads=4, mlp_dim=64, batch=8, image_size=32, patch_size=8,
         num_classes=10, *, abstract=True, seed=0):
    """``(train_step, (model, optimizer, batch))``; abstract arrays unless ``abstract=False``."""
    def create():
        model = ViT(image_size=image_size, patch_size=patch_size, dim=dim, depth=depth,
                    heads=heads, mlp_dim=mlp_dim, num_classes=num_classes, rngs=nnx.Rngs(seed))
        tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000),
                         weight_decay=0.05)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    shape = (batch, image_size, image_size, 3)
    if abstract:
        model, optimizer = nnx.eval_shape(create)
        return train_step, (model, optimizer, {
            "image": jax.ShapeDtypeStruct(shape, jnp.float32),
            "label": jax.ShapeDtypeStruct((batch,), jnp.int32)})
    model, optimizer = nnx.jit(create)()
    key_x, key_y = jax.random.split(jax.random.key(seed + 1))
    return train_step, (model, optimizer, {
        "image": jax.random.normal(key_x, shape),
        "label": jax.random.randint(key_y, (batch,), 0, num_classes)})
