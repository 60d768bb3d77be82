"""Tests for hlo_tools.kernels: per-kernel FLOPs and bytes of a compiled module."""

import jax
import jax.numpy as jnp
import pytest

from hlo_tools.hlo_text import HloParseError
from hlo_tools.kernels import Kernel, kernels

F32 = 4

_FUSED = """\
HloModule fused, num_partitions=2

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

%fused_dot (p0: f32[8,16], p1: f32[16,4]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %dot = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh = f32[8,4]{1,0} tanh(%dot)
}

%fused_sum (q: f32[8,4]) -> f32[8] {
  %q = f32[8,4]{1,0} parameter(0)
  %zero = f32[] constant(0)
  %b = f32[8,4]{1,0} broadcast(%zero), dimensions={}
  %m = f32[8,4]{1,0} multiply(%q, %b)
  ROOT %r = f32[8]{0} reduce(%m, %zero), dimensions={1}, to_apply=%add
}

ENTRY %main (a: f32[8,16], w: f32[16,4]) -> f32[8] {
  %a = f32[8,16]{1,0} parameter(0)
  %w = f32[16,4]{1,0} parameter(1)
  %fusion = f32[8,4]{1,0} fusion(%a, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(f)/dot_general"}
  %ar = f32[8,4]{1,0} all-reduce(%fusion), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %view = f32[8,4]{1,0} bitcast(%ar)
  %neg = f32[8,4]{1,0} negate(%view)
  ROOT %sum = f32[8]{0} fusion(%neg), kind=kInput, calls=%fused_sum
}
"""


def test_kernels_of_literal_hlo():
    # Parameters, the bitcast and the all-reduce are no kernels; each kernel moves its operands
    # and its result once; FLOPs are the cost model's (dot 2 x out x contracted, one per
    # elementwise output, one per reduced element; broadcasts and constants none).
    assert kernels(_FUSED) == (
        Kernel("fusion", "fusion", 2 * 8 * 4 * 16 + 8 * 4, (8 * 16 + 16 * 4 + 8 * 4) * F32,
               "jit(f)/dot_general"),
        Kernel("neg", "negate", 8 * 4, 2 * 8 * 4 * F32),
        Kernel("sum", "fusion", 8 * 4 + 8 * 4, (8 * 4 + 8) * F32),
    )


def test_an_optimization_barrier_is_no_kernel():
    # Its outputs alias its operands: it moves nothing. Counted, a plan's recomputations
    # (one barrier each) were priced at the bytes of every value they tie.
    text = ("HloModule m\n\nENTRY %m (a: f32[8]) -> f32[8] {\n"
            "  %a = f32[8]{0} parameter(0)\n"
            "  %t = (f32[8]{0}) tuple(%a)\n"
            "  %ob = (f32[8]{0}) opt-barrier(%t)\n"
            "  %g = f32[8]{0} get-tuple-element(%ob), index=0\n"
            "  ROOT %n = f32[8]{0} negate(%g)\n}\n")
    assert kernels(text) == (Kernel("n", "negate", 8, 2 * 8 * F32),)


def test_kernel_reading_an_undefined_operand_is_refused():
    text = ("HloModule m\n\nENTRY %m () -> f32[2] {\n"
            "  ROOT %n = f32[2]{0} negate(%nowhere)\n}\n")
    with pytest.raises(HloParseError, match="'nowhere'.*defined in the entry"):
        kernels(text)


def test_kernels_agree_with_xla_cost_analysis():
    # A small MLP's gradient: the kernels' FLOPs and bytes are XLA's totals up to what XLA
    # counts differently (a fusion's partly read operands, transcendental ops).
    def grads(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return (h * h).sum()
        return jax.grad(loss)(ws)

    ws, x = tuple(jnp.ones((64, 64)) for _ in range(3)), jnp.ones((128, 64))
    compiled = jax.jit(grads).lower(ws, x).compile()
    analysis = compiled.cost_analysis()
    found = kernels(compiled.as_text())
    dots = 2 * 128 * 64 * 64 * (3 + 3 + 2)   # forward, weight gradients, input gradients
    flops = sum(k.flops for k in found)
    assert dots <= flops <= 1.05 * dots
    assert flops == pytest.approx(analysis["flops"], rel=0.01)
    assert sum(k.bytes for k in found) == pytest.approx(analysis["bytes accessed"], rel=0.05)
