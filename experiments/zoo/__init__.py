"""A zoo of train steps written the way Flax users write them.

Each module is one model with its train step, in the idiom of the Flax examples and guides
(NNX with ``nnx.Optimizer``, or Linen with a ``TrainState``), and a factory
``make(**sizes, abstract=True, seed=0) -> (train_step, args)``: abstract arguments
(``jax.ShapeDtypeStruct`` leaves, nothing allocated) for planning and lowering, or concrete
ones drawn from ``seed`` for running. Defaults are small enough for a step to compile in
seconds on a CPU; the size arguments scale them.

- ``llama``: Llama-style decoder (NNX): RoPE, grouped-query attention, RMSNorm, SwiGLU.
- ``vit``: Vision Transformer (NNX): convolutional patches, class token, MultiHeadAttention.
- ``mixer``: MLP-Mixer (Linen).
- ``resnet``: ResNet with BatchNorm statistics carried in the train state (Linen).
- ``encdec``: encoder-decoder Transformer with a tied embedding (Linen).
- ``moe``: Transformer with top-2 mixture-of-experts feed-forward blocks (NNX).
- ``llama_scan``: the Llama with its layers under ``nnx.vmap`` + ``nnx.scan``.
- ``linen_scan``: a GPT-style decoder with its blocks under ``nn.scan`` (Linen).
"""

import importlib
import inspect

__all__ = ["MODELS", "SCANNED", "make"]

MODELS = ("llama", "vit", "mixer", "resnet", "encdec", "moe", "llama_scan", "linen_scan")
"""The zoo's models, one module each."""

SCANNED = ("llama_scan", "linen_scan")
"""Models whose layers run inside a ``scan``."""


def make(name: str, *, abstract: bool = True, seed: int = 0, **sizes):
    """``(train_step, args)`` of the zoo model ``name`` (see the module docstring).

    Raises:
      ValueError: an unknown model name, or a size the model does not take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}: expected one of {', '.join(MODELS)}")
    module = importlib.import_module(f"experiments.zoo.{name}")
    taken = [p.name for p in inspect.signature(module.make).parameters.values()
             if p.kind == p.POSITIONAL_OR_KEYWORD]
    unknown = sorted(set(sizes) - set(taken))
    if unknown:
        raise ValueError(f"the zoo {name} takes no size {', '.join(unknown)}; its sizes are "
                         f"{', '.join(taken)}")
    return module.make(abstract=abstract, seed=seed, **sizes)
