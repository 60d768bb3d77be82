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
    # elementwise output, one per reduced element; broadcasts and constants none); a fusion's
    # root is its fused computation's.
    assert kernels(_FUSED) == (
        Kernel("fusion", "fusion", 2 * 8 * 4 * 16 + 8 * 4, (8 * 16 + 16 * 4 + 8 * 4) * F32,
               "jit(f)/dot_general", root="tanh"),
        Kernel("neg", "negate", 8 * 4, 2 * 8 * 4 * F32, root="negate"),
        Kernel("sum", "fusion", 8 * 4 + 8 * 4, (8 * 4 + 8) * F32, root="reduce"),
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
    assert kernels(text) == (Kernel("n", "negate", 8, 2 * 8 * F32, root="negate"),)


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


_SLICED = """\
HloModule sliced

%fused_slice (p: f32[64], i: s32[]) -> f32[8] {
  %p = f32[64]{0} parameter(0)
  %i = s32[] parameter(1)
  %ds = f32[8]{0} dynamic-slice(%p, %i), dynamic_slice_sizes={8}
  ROOT %n = f32[8]{0} negate(%ds)
}

%fused_update (q: f32[64], u: f32[8], j: s32[]) -> f32[64] {
  %q = f32[64]{0} parameter(0)
  %u = f32[8]{0} parameter(1)
  %j = s32[] parameter(2)
  %nu = f32[8]{0} negate(%u)
  ROOT %dus = f32[64]{0} dynamic-update-slice(%q, %nu, %j)
}

ENTRY %main (a: f32[64], k: s32[]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  %k = s32[] parameter(1)
  %s = f32[8]{0} fusion(%a, %k), kind=kLoop, calls=%fused_slice
  %t = f32[16]{0} slice(%a), slice={[0:16]}
  ROOT %w = f32[64]{0} fusion(%a, %s, %k), kind=kLoop, calls=%fused_update
}
"""


def test_a_kernel_that_slices_or_updates_in_place_moves_only_the_slice():
    # XLA's cost analysis: a fused dynamic-slice reads its 8 elements (and its index), not
    # the 64 it slices; a slice reads what it returns; an in-place update writes its 8 and
    # reads nothing of the buffer it updates.
    s, t, w = kernels(_SLICED)
    assert s.bytes == 8 * F32 + 4 + 8 * F32
    assert t.bytes == 2 * 16 * F32
    assert w.bytes == 8 * F32 + 4 + 8 * F32


def test_a_sliced_read_agrees_with_xla_cost_analysis():
    # A shard's update reading a slice of a whole array, as a sharded optimizer update reads
    # an all-reduced gradient: counted whole, the kernel was charged the array 8 times over.
    def update(g, p, i):
        return p - 0.1 * jax.lax.dynamic_slice(g, (i * 1024,), (1024,))

    args = jnp.ones(8 * 1024), jnp.ones(1024), jnp.int32(3)
    compiled = jax.jit(update).lower(*args).compile()
    found = kernels(compiled.as_text())
    total = sum(k.bytes for k in found)
    assert total == pytest.approx(compiled.cost_analysis()["bytes accessed"], rel=0.05)
    assert total < 4 * 1024 * F32


def _mlp_grads(ws, x, scanned: bool):
    def loss(ws):
        if scanned:
            h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
        else:
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
        return (h * h).sum()
    return jax.grad(loss)(ws)


def test_a_loops_body_counts_as_often_as_it_runs():
    # The MLP's layers under a scan: its compiled module runs its forward and backward layers
    # as two loops of 4 trips. Their kernels count 4 times (the condition's 5), so the FLOPs
    # are the unrolled module's and one product more (the backward loop's last trip computes
    # the gradient of the input, which the unrolled gradient leaves out); XLA's own analysis
    # counts each body once. Before, each loop was one kernel of no FLOPs.
    stacked, x = jnp.ones((4, 64, 64)), jnp.ones((128, 64))
    looped = jax.jit(lambda ws, x: _mlp_grads(ws, x, True)).lower(stacked, x).compile()
    unrolled = jax.jit(lambda ws, x: _mlp_grads(ws, x, False)).lower(
        tuple(stacked), x).compile()
    found = kernels(looped.as_text())
    assert {k.runs for k in found} >= {1, 4, 5}
    assert "while" not in {k.opcode for k in found}
    flops = sum(k.flops for k in found)
    input_gradient = 2 * 128 * 64 * 64
    assert flops == pytest.approx(sum(k.flops for k in kernels(unrolled.as_text()))
                                  + input_gradient, rel=0.01)
    assert flops > 2 * looped.cost_analysis()["flops"]
