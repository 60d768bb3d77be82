"""The compiled-cost estimate: XLA's kernels and collectives priced with a cluster's figures."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlo_tools.kernels import kernels
from kiwi_jax.cluster import PRESETS
from kiwi_jax.estimate import CompiledCost, compiled_cost, source_operation

F32 = 4


def _grads(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return h.sum()
    return jax.grad(loss)(ws)


@pytest.fixture(scope="module")
def data_parallel(mesh24):
    """Data parallelism over the "data" axis: the batch split in two, the weights replicated;
    the five weight gradients leave in one combined all-reduce over "data"."""
    ws, x = tuple(jnp.ones((32, 32)) for _ in range(5)), jnp.ones((64, 32))
    replicated = NamedSharding(mesh24, P())
    return jax.jit(_grads, in_shardings=((replicated,) * 5, NamedSharding(mesh24, P("data"))),
                   out_shardings=replicated).lower(ws, x).compile()


@pytest.mark.parametrize("preset,latency,bandwidth", [
    ("v100-2node", 20e-6, 4e9),      # 4 devices per node: "data" pairs devices 0 and 4
    ("v100-nvlink", 5e-6, 150e9),    # 8 per node: the same pairs on NVLink
])
def test_one_combined_all_reduce_priced_on_its_axis(data_parallel, mesh24, preset, latency,
                                                    bandwidth):
    cost = compiled_cost(data_parallel, mesh24, preset)
    grads = 5 * 32 * 32 * F32
    n = 2
    assert cost.collectives == {"all-reduce": {
        "count": 1, "bytes": grads,
        "seconds": pytest.approx(latency + 2 * (n - 1) / n * grads / bandwidth, rel=1e-12)}}
    assert cost.collective_seconds == pytest.approx(latency + grads / bandwidth, rel=1e-12)
    assert cost.step_seconds == pytest.approx(cost.compute_seconds + cost.collective_seconds)


def test_compute_is_the_roofline_per_kernel(data_parallel, mesh24):
    device = PRESETS["v100-nvlink"].device
    cost = compiled_cost(data_parallel, mesh24, "v100-nvlink")
    found = kernels(data_parallel.as_text())
    assert cost.kernels == len(found) > 0
    assert cost.compute_seconds == pytest.approx(sum(
        max(k.flops / device.flops, k.bytes / device.memory_bandwidth) for k in found))
    # per device: 32 rows; 5 forward dots, 5 weight-gradient dots, 4 input-gradient dots
    dots = 2 * 32 * 32 * 32 * (5 + 5 + 4)
    assert dots <= cost.flops <= 1.05 * dots
    assert cost.kernel_flops == pytest.approx(cost.flops, rel=0.01)
    # XLA's bytes accessed also count the all-reduce's operand and result, which the estimate
    # prices as communication instead
    grads = 5 * 32 * 32 * F32
    assert cost.bytes_accessed == pytest.approx(cost.kernel_bytes + 2 * grads, rel=1e-3)
    assert cost.compute_lower_seconds == pytest.approx(max(
        cost.flops / device.flops, cost.bytes_accessed / device.memory_bandwidth))
    assert cost.compute_upper_seconds == pytest.approx(
        cost.flops / device.flops + cost.bytes_accessed / device.memory_bandwidth)


@pytest.mark.parametrize("op_name,opcode,operation", [
    ("jit(step)/jvp(Block)/dot_general", "dot", "dot_general"),
    ("jit(step)/transpose(jvp(Block))/dot_general", "dot", "dot_general (backward)"),
    ("jit(_grads)/transpose(jvp(_grads))/tanh[accuracy=None]", "tanh", "tanh (backward)"),
    ("jit(step)/add_any", "", "add_any"),
    ("", "copy", "copy (no op_name)"),
])
def test_the_source_operation_is_the_primitive_and_the_pass(op_name, opcode, operation):
    assert source_operation(op_name, opcode) == operation


def test_the_compute_by_operation_adds_up_to_the_kernels(data_parallel, mesh24):
    cost = compiled_cost(data_parallel, mesh24, "v100-nvlink")
    table = cost.compute_by_operation
    assert sum(n for n, _ in table.values()) == cost.kernels
    assert sum(s for _, s in table.values()) == pytest.approx(cost.compute_seconds)
    # the forward dots and both kinds of gradient dots are kernels of their own
    assert table["dot_general"][0] >= 5 and table["dot_general (backward)"][0] >= 9


def test_to_dict_and_frozen(data_parallel, mesh24):
    cost = compiled_cost(data_parallel, "2x4", PRESETS["v100-nvlink"])   # mesh as shorthand
    assert cost == compiled_cost(data_parallel, mesh24, "v100-nvlink")
    row = cost.to_dict()
    assert row["step_seconds"] == cost.step_seconds
    assert row["collectives"]["all-reduce"]["count"] == 1
    with pytest.raises(AttributeError):
        cost.flops = 0.0  # type: ignore[misc]
    assert isinstance(cost, CompiledCost)


def test_collective_permute_is_priced_on_the_whole_mesh_link(mesh24):
    # Rolling rows split over "model" sends one boundary row to the neighbour: a permute has
    # pairs, not groups along an axis, so it is priced once on the slower (inter-node) link.
    split = NamedSharding(mesh24, P("model"))
    compiled = jax.jit(lambda x: jnp.roll(x, 1, axis=0), in_shardings=split,
                       out_shardings=split).lower(jnp.ones((16, 8))).compile()
    cost = compiled_cost(compiled, mesh24, "v100-2node")
    row = 8 * F32
    assert cost.collectives == {"collective-permute": {
        "count": 1, "bytes": row, "seconds": pytest.approx(20e-6 + row / 4e9, rel=1e-12)}}
    assert cost.flops == 0.0                  # XLA reports no "flops" key: no arithmetic
