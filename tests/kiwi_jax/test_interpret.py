"""The interpreter's recomputation runs where the backward pass reaches its reader: the
optimization barrier it sits behind is tied to values of the backward pass, and XLA keeps the
tie (a barrier's outputs that nothing reads are dropped, and with them the tie)."""

import jax
import numpy as np
from jax.extend.core import Literal

from experiments import zoo
from kiwi_jax.compile import compiler_options
from kiwi_jax.interpret import Interpreter, is_backward, is_unit, trace_flat
from kiwi_jax.step import functionalize


def _attention_probabilities(closed) -> dict[str, int]:
    """``{path: bytes}`` of the forward equations that make the softmax's output (the
    ``div`` of its normalisation, 4 or more dimensions), which the backward pass reads."""
    eqns = closed.jaxpr.eqns
    read_by_backward = {v for e in eqns if is_backward(str(e.source_info.name_stack))
                        for v in e.invars if not isinstance(v, Literal)}
    return {str(i): int(np.prod(e.outvars[0].aval.shape)) * 4 for i, e in enumerate(eqns)
            if e.primitive.name == "div" and is_unit(str(i)) and e.outvars[0].aval.ndim >= 4
            and not is_backward(str(e.source_info.name_stack))
            and e.outvars[0] in read_by_backward}


def test_recomputed_attention_probabilities_are_not_held_from_the_forward_pass():
    step, args = zoo.make("vit", abstract=True, seed=0)
    pure = functionalize(step, args)
    closed = trace_flat(pure.fn, *pure.args)
    dropped = _attention_probabilities(closed)
    assert len(dropped) == 3                              # one per layer

    def temp_bytes(recompute) -> int:
        interpreter = Interpreter(closed, recompute=frozenset(recompute))
        lowered = jax.jit(lambda *a: interpreter(*a)).lower(*jax.tree.leaves(pure.args))
        compiled = lowered.compile(compiler_options=compiler_options())
        return compiled.memory_analysis().temp_size_in_bytes

    kept, recomputed = temp_bytes(()), temp_bytes(dropped)
    # the first two layers' probabilities are freed at the end of the forward pass (the
    # last layer's is recomputed as soon as the backward pass starts)
    largest = max(dropped.values())
    assert recomputed <= kept - 2 * largest, (kept, recomputed, largest)
