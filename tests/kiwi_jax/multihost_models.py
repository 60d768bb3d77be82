"""The small concrete models of the multi-process tests: the user-style NNX Llama of the zoo
(``experiments.zoo.llama``) and the reference MLP, each a factory of ``(train_step, concrete
args)`` that gives the same values in every process (fixed seeds)."""

from experiments.zoo import llama as zoo_llama
from kiwi_jax.models import build

LLAMA = dict(layers=2, vocab=64, batch=8, seq=16)
MLP = dict(layers=2, width=32, in_dim=16, out_dim=16, batch=16)


def llama():
    return zoo_llama.make(**LLAMA, abstract=False, seed=0)


def mlp():
    ref = build("mlp", **MLP)
    return ref.train_step, (*ref.init(0), ref.batch(0))


MODELS = {"llama": llama, "mlp": mlp}
