"""Tests for hlo_tools.compiled on the (2, 4) simulated CPU mesh."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hlo_tools.compiled import (
    KINDS,
    Collective,
    HloParseError,
    collectives,
    device_memory,
    Held,
    heap_peak,
    live_at_peak,
    parse_replica_groups,
    stored_bytes,
    summarize,
)
from hlo_tools.hlo_text import parse_module

MESH_IDS = np.arange(8).reshape(2, 4)
F32 = 4


def _compile(mesh, fn, args, ins, outs):
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    ins = tuple(shard(s) for s in ins)
    return jax.jit(fn, in_shardings=ins, out_shardings=shard(outs)).lower(*args).compile()


def _kinds(found):
    return [(c.kind, c.axes, c.group_size, c.bytes) for c in found]


# --- replica group parsing -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, x=1", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups={}, to_apply=%add", ()),
        ("replica_groups=[2,4]<=[8], dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=[4,2]<=[2,4]T(1,0), c=1", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups=[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
        # Mesh-axes form, as printed by jax 0.10.2's CPU SPMD partitioner.
        (
            "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, d={1}",
            ((0, 1, 2, 3), (4, 5, 6, 7)),
        ),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4] {'axis_1'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}", (tuple(range(8)),)),
        ("replica_groups=mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("replica_groups=mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,1,2,0) {'a'}", ((3, 2), (1, 0))),
    ],
)
def test_parse_replica_groups(text, groups):
    assert parse_replica_groups(text) == groups


def test_parse_replica_groups_absent_and_malformed():
    assert parse_replica_groups("dimensions={0}, use_global_device_ids=true") is None
    with pytest.raises(HloParseError, match="expected replica_groups"):
        parse_replica_groups("replica_groups=<bogus>")
    with pytest.raises(HloParseError, match="expected a mesh axis"):
        parse_replica_groups("replica_groups=mesh['a'=8] {'z'}")


# --- collectives on literal HLO ---------------------------------------------

_SYNTHETIC = """\
HloModule synthetic, is_scheduled=true, entry_computation_layout={(f32[8,4]{1,0})->f32[8,4]{1,0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

ENTRY %main (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  %q = f32[2]{0} parameter(1)
  %ags = (f32[8,4]{1,0}, f32[8,16]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={1}, use_global_device_ids=true
  %agd = f32[8,16]{1,0} all-gather-done(%ags)
  %rs = f32[2,4]{1,0} reduce-scatter(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %ars = (f32[8,4]{1,0}, f32[2]{0}) all-reduce-start(%p, f32[2]{0} %q), channel_id=3, replica_groups={}, to_apply=%add
  %ard = (f32[8,4]{1,0}, f32[2]{0}) all-reduce-done(%ars)
  %odd = f32[8,4]{1,0} all-reduce(%p), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%p), source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
}
"""


def test_collectives_on_literal_hlo():
    found = collectives(_SYNTHETIC, MESH_IDS)
    assert [c.name for c in found] == ["ags", "rs", "ars", "odd", "cps"]
    assert _kinds(found) == [
        ("all-gather", (1,), 4, 8 * 16 * F32),  # output bytes = operand * group size
        ("reduce-scatter", (0,), 2, 8 * 4 * F32),  # input bytes
        ("all-reduce", (0, 1), 8, (8 * 4 + 2) * F32),  # tuple operands summed; {} = all devices
        ("all-reduce", (), 2, 8 * 4 * F32),  # pairs inside a "model" row: no axis set
        ("collective-permute", (), 0, 8 * 4 * F32),
    ]
    assert found[0].shape == "(f32[8,4]{1,0}, f32[8,16]{1,0})"
    summary = summarize(found)
    assert list(summary) == list(KINDS)
    assert summary["all-reduce"] == {"count": 2, "bytes": (8 * 4 + 2) * F32 + 8 * 4 * F32}
    assert summary["all-to-all"] == {"count": 0, "bytes": 0}


def test_collectives_rejects_undefined_operand():
    text = ("HloModule m\n\nENTRY %m () -> f32[2] {\n"
            "  %a = f32[2]{0} all-reduce(%nowhere), replica_groups={}\n}\n")
    with pytest.raises(HloParseError, match="'nowhere'.*defined in 'm'"):
        collectives(text, MESH_IDS)


_TUPLE_ALL_REDUCE = """\
HloModule combined, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

ENTRY %main (p: f32[16,16], h: bf16[2,16]) -> (f32[16,16], f32[16,16], f32[16,16], f32[16,16], f32[16,16], /*index=5*/f32[16,16], bf16[2,16]) {
  %p = f32[16,16]{1,0} parameter(0)
  %h = bf16[2,16]{1,0} parameter(1)
  ROOT %ar = (f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, f32[16,16]{1,0}, /*index=5*/f32[16,16]{1,0}, bf16[2,16]{1,0}) all-reduce(%p, %p, %p, %p, %p, /*index=5*/%p, %h), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
}
"""


def test_tuple_all_reduce_with_index_comments():
    # The combiner's tuple prints /*index=5*/ before its sixth operand and element: every
    # operand still counts, and mesh-axes groups with device_ids still map onto an axis.
    (found,) = collectives(_TUPLE_ALL_REDUCE, MESH_IDS)
    assert _kinds([found]) == [("all-reduce", (1,), 4, 6 * 16 * 16 * F32 + 2 * 16 * 2)]
    assert found.op_name == "jit(f)/transpose(jvp())/dot_general"
    assert found.shape == "(" + "f32[16,16]{1,0}, " * 6 + "bf16[2,16]{1,0})"


def test_collective_is_frozen():
    c = Collective("all-reduce", (0,), 2, 16, "ar", "f32[4]")
    with pytest.raises(AttributeError):
        c.bytes = 0  # type: ignore[misc]


# --- collectives XLA actually emits ----------------------------------------


def test_all_gather_along_model(mesh24):
    # Per device f32[8,4] -> replicated f32[8,16]: one all-gather over "model".
    compiled = _compile(mesh24, lambda x: x * 2, (jnp.ones((8, 16)),), [P(None, "model")], P())
    found = collectives(compiled.as_text(), mesh24.device_ids)
    assert _kinds(found) == [("all-gather", (1,), 4, 8 * 16 * F32)]


def test_all_reduce_along_data(mesh24):
    # Contracting dim sharded over "data", replicated output: all-reduce of f32[8,4].
    args = (jnp.ones((8, 16)), jnp.ones((16, 4)))
    compiled = _compile(mesh24, jnp.matmul, args, [P(None, "data"), P("data", None)], P())
    found = collectives(compiled.as_text(), mesh24.device_ids)
    assert _kinds(found) == [("all-reduce", (0,), 2, 8 * 4 * F32)]


def test_all_to_all_along_model(mesh24):
    # Rows over "model" -> columns over "model": XLA on CPU emits one tuple-shaped
    # all-to-all of four f32[2,1,4] pieces (= the per-device f32[2,16] block).
    compiled = _compile(mesh24, lambda x: x + 1, (jnp.ones((8, 16)),), [P("model", None)], P(None, "model"))
    found = collectives(compiled.as_text(), mesh24.device_ids)
    assert _kinds(found) == [("all-to-all", (1,), 4, 2 * 16 * F32)]
    assert found[0].shape.count("f32[2,1,4]") == 4


def test_combined_gradient_all_reduce_counts_every_operand(mesh24):
    # Data parallelism over all 8 devices: XLA combines the seven weight gradients into one
    # tuple all-reduce whose text carries /*index=5*/ comments. Its bytes are the operands'
    # parsed shapes, which in turn agree with XLA's own size of the gradients it returns.
    def grads(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return h.sum()
        return jax.grad(loss)(ws)

    ws, x = tuple(jnp.ones((16, 16)) for _ in range(7)), jnp.ones((32, 16))
    replicated, split = NamedSharding(mesh24, P()), NamedSharding(mesh24, P(("data", "model")))
    compiled = jax.jit(grads, in_shardings=((replicated,) * 7, split),
                       out_shardings=replicated).lower(ws, x).compile()
    text = compiled.as_text()
    assert "/*index=5*/%" in text
    found = collectives(text, mesh24.device_ids)
    assert _kinds(found) == [("all-reduce", (0, 1), 8, 7 * 16 * 16 * F32)]
    entry = parse_module(text).entry.by_name()
    operands = entry[found[0].name].operands
    assert len(operands) == 7 and found[0].bytes == sum(entry[o].shape.nbytes for o in operands)
    pointers = 7 * 8                                  # the returned tuple's index table
    assert found[0].bytes == device_memory(compiled).output_bytes - pointers


def test_a_collective_in_a_loops_body_is_listed_once_per_trip(mesh24):
    # Layers under a scan whose weights are split on their rows over "model": each trip's
    # product all-reduces its partial sums, so the loop's one all-reduce runs three times a step.
    def layers(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    args = (jnp.ones((3, 16, 16)), jnp.ones((8, 16)))
    compiled = _compile(mesh24, layers, args, [P(None, "model", None), P(None, "model")], P())
    text = compiled.as_text()
    assert " while(" in text
    found = [c for c in collectives(text, mesh24.device_ids) if c.kind == "all-reduce"]
    assert len(found) == 3 and len({c.name for c in found}) == 1
    assert _kinds(found)[0] == ("all-reduce", (1,), 4, 8 * 16 * F32)


def test_all_reduce_over_both_axes(mesh24):
    args = (jnp.ones((8, 16)), jnp.ones((16, 4)))
    specs = [P(None, ("data", "model")), P(("data", "model"), None)]
    compiled = _compile(mesh24, jnp.matmul, args, specs, P())
    found = collectives(compiled.as_text(), mesh24.device_ids)
    assert _kinds(found) == [("all-reduce", (0, 1), 8, 8 * 4 * F32)]


def test_reduce_scatter_request_on_cpu(mesh24):
    # XLA's CPU pipeline does not form reduce-scatter: it emits an all-reduce over
    # "data" of the f32[4,4] partial block, then a collective-permute to fix rows.
    args = (jnp.ones((8, 16)), jnp.ones((16, 4)))
    compiled = _compile(mesh24, jnp.matmul, args, [P(None, "data"), P("data", None)], P("data", None))
    found = collectives(compiled.as_text(), mesh24.device_ids)
    assert _kinds(found) == [("all-reduce", (0,), 2, 4 * 4 * F32), ("collective-permute", (), 0, 4 * 4 * F32)]


def test_groups_are_partition_ids_not_device_ids(mesh24):
    # With devices in a permuted order the HLO text is unchanged: groups index the
    # flattened device assignment, so axis mapping needs positions, not device ids.
    devices = np.array(jax.devices())[[3, 1, 6, 0, 2, 7, 5, 4]].reshape(2, 4)
    mesh = Mesh(devices, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    text = _compile(mesh, lambda x: x * 2, (jnp.ones((8, 16)),), [P(None, "model")], P()).as_text()
    assert _kinds(collectives(text, np.arange(8).reshape(2, 4))) == [("all-gather", (1,), 4, 512)]
    assert collectives(text, mesh.device_ids)[0].axes == ()


# --- memory ------------------------------------------------------------------


def test_device_memory(mesh24):
    compiled = _compile(mesh24, lambda x: x * 2, (jnp.ones((8, 16)),), [P(None, "model")], P())
    stats = device_memory(compiled)
    raw = compiled.memory_analysis()
    assert stats.argument_bytes == raw.argument_size_in_bytes == 8 * 4 * F32
    assert stats.output_bytes == raw.output_size_in_bytes == 8 * 16 * F32
    assert min(stats.argument_bytes, stats.output_bytes, stats.temp_bytes, stats.alias_bytes) >= 0
    assert stats.peak_bytes == stats.argument_bytes + stats.output_bytes + stats.temp_bytes - stats.alias_bytes


def test_device_memory_with_donation(mesh24):
    shard = NamedSharding(mesh24, P("data", "model"))
    fn = jax.jit(lambda x: x + 1, in_shardings=shard, out_shardings=shard, donate_argnums=0)
    stats = device_memory(fn.lower(jnp.ones((8, 16))).compile())
    assert stats.alias_bytes == 4 * 4 * F32
    assert stats.peak_bytes == stats.argument_bytes + stats.output_bytes + stats.temp_bytes - stats.alias_bytes


def test_live_at_peak_names_the_buffers_and_their_operators():
    def f(x, w):
        h = jnp.tanh(x @ w)
        return (h @ w.T).sum()

    lowered = jax.jit(jax.grad(f, argnums=1)).lower(jnp.ones((64, 128)), jnp.ones((128, 128)))
    live = live_at_peak(lowered)
    stats = device_memory(lowered.compile())
    total = sum(b.nbytes for b in live)
    assert 0.5 * stats.peak_bytes <= total <= stats.peak_bytes
    assert any(b.parameter and b.nbytes == 128 * 128 * F32 for b in live)        # w
    computed = [b for b in live if not b.parameter]
    assert computed and all(b.nbytes > 0 for b in computed)
    assert any("dot_general" in b.op_name or "transpose" in b.op_name for b in computed)


_CACHED = """
import json, pathlib, sys
import jax, jax.numpy as jnp
from hlo_tools.compiled import device_memory, live_at_peak
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
f = lambda x, w: (jnp.tanh(x @ w) @ w.T).sum()
lowered = jax.jit(jax.grad(f, argnums=1)).lower(jnp.ones((64, 128)), jnp.ones((128, 128)))
peak = device_memory(lowered.compile()).peak_bytes           # into the cache
entries = len(list(pathlib.Path(sys.argv[1]).iterdir()))
live = live_at_peak(lowered)
print(json.dumps({"peak": peak, "live": sum(b.nbytes for b in live), "entries": entries,
                  "after": len(list(pathlib.Path(sys.argv[1]).iterdir())),
                  "min_time": jax.config.jax_persistent_cache_min_compile_time_secs}))
"""


def test_live_at_peak_compiles_past_jaxs_persistent_cache(tmp_path):
    # The cache leaves the dump options out of its key: a step compiled before came back from
    # it, XLA wrote no dump, and verify raised CompiledAnalysisError. In a process of its own,
    # as the cache is set up once a process.
    out = subprocess.run([sys.executable, "-c", _CACHED, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=120,
                         cwd=pathlib.Path(__file__).parents[2], check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["entries"] >= 1 and seen["after"] == seen["entries"]     # nothing written
    assert 0.5 * seen["peak"] <= seen["live"] <= seen["peak"] and seen["min_time"] == 0


_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}, maybe-live-out:
 value: <1 p @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 4, thread-local:
 value: <2 t @0> (size=4,offset=0): f32[]
allocation 2: size 96, preallocated-temp:
 value: <3 a @0> (size=32,offset=0): f32[8]{0}
 value: <4 b @0> (size=32,offset=0): f32[8]{0}
 value: <5 g @0> (size=32,offset=32): f32[8]{0}
 value: <6 ar{} @0> (size=16,offset=64): (f32[8], f32[8])
 value: <7 ar{0} @0> (size=32,offset=0): f32[8]{0}
 value: <8 ar{1} @0> (size=32,offset=64): f32[8]{0}
"""
_RANGES = """HloLiveRange (max 6):
  BufferLiveRange:
    p{}:0-6
    t{}:0-6
    a{}:1-2
    b{}:2-3
    g{}:3-5
    ar{}:5-6
    ar{0}:5-6
    ar{1}:5-6
  Live ranges at 3 (peak):
    b{}: 32 bytes (cumulative: 32 bytes)
"""


def test_the_heaps_peak_counts_a_combined_collectives_elements():
    # a and b share a buffer (a bitcast: overlapping ranges, one offset) and count once; the
    # tuple's elements are held at point 5, which XLA's own report (peak at 3) leaves out
    peak, alive = heap_peak(_ASSIGNMENT, _RANGES)
    assert peak == 64 + 32 + 32 + 32          # p; g; ar{0} over a's slot; ar{1} over the tuple
    names = {name + index: (nbytes, parameter) for name, index, nbytes, parameter in alive}
    assert names == {"p{}": (64, True), "g{}": (32, False), "ar{0}": (32, False),
                     "ar{1}": (32, False)}


# --- what a scheduled module holds -----------------------------------------

_HELD = """HloModule m, is_scheduled=true

ENTRY %m (p: f32[4]) -> (f32[4], f32[4], f32[2,4]) {
  %p = f32[4]{0} parameter(0), metadata={op_name="args[0]"}
  %copy = f32[4]{0} copy(%p)
  %a = f32[4]{0} exponential(%p), metadata={op_name="fwd/a"}
  %b = f32[8]{0} broadcast(%a), dimensions={}, metadata={op_name="fwd/a"}
  %c = f32[4]{0} slice(%b), slice={[0:4]}, metadata={op_name="fwd/c"}
  %g = f32[4]{0} negate(%c), metadata={op_name="bwd/g"}
  %i = s32[4]{0} iota(), iota_dimension=0
  %h = f32[4]{0} add(%g, %a), metadata={op_name="bwd/h"}
  %t = f32[4]{0} bitcast(%h)
  %s = f32[2,4]{1,0} broadcast(%p), dimensions={1}, metadata={op_name="bwd/s"}
  %u = f32[4]{0} multiply(%t, %copy), metadata={op_name="bwd/u"}
  %v = f32[2,4]{1,0} multiply(%s, %s), metadata={op_name="bwd/v"}
  ROOT %out = (f32[4]{0}, f32[4]{0}, f32[2,4]{1,0}) tuple(%u, %i, %v)
}
"""


def test_stored_bytes_holds_each_value_to_its_last_reader():
    held = stored_bytes(_HELD, after=lambda name: {"fwd": False, "bwd": True}.get(name[:3]))
    # a (16 B) lives into the backward pass; b (32 B) only while c is made from it; c is
    # read by the backward pass's first instruction
    assert held["fwd/a"] == Held(peak=48, across=16)
    assert held["fwd/c"] == Held(peak=16, across=16)
    # the argument's copy has its operand's name and is read after the split
    # a value with neither a name nor an operand takes its first reader's: the output tuple
    # has its first operand's, u's; both are outputs, held to the end
    assert held["bwd/u"] == Held(peak=32, across=0)
    # h is held through its bitcast until u reads it
    assert held["bwd/h"] == Held(peak=16, across=0)
    # a broadcast is held under the broadcast value's name (bwd/s's under the argument's)
    assert set(held) == {"fwd/a", "fwd/c", "args[0]", "bwd/g", "bwd/h", "bwd/u", "bwd/v"}
    assert held["args[0]"] == Held(peak=48, across=16)
    # ... or grouped apart: here the argument's copies are left out, its broadcasts kept
    apart = stored_bytes(_HELD, key=lambda name: None if name.startswith("args") else name,
                         broadcast_key=lambda name: name)
    assert apart["args[0]"] == Held(peak=32, across=0)
    # without a split nothing is held across it
    assert stored_bytes(_HELD)["fwd/a"] == Held(peak=48, across=0)
