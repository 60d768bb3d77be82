"""The compiled cost of a step: what XLA compiled, priced with the cost model's own hardware.

The cost model predicts a plan's step time operator by operator, before XLA fuses, combines
and partitions anything. This estimate prices the executable XLA produced instead, with the
same device and link figures (:class:`~kiwi_jax.cluster.Cluster`) and the same formulas, so
the two are comparable and the difference is what XLA does that the model does not see:

- Compute: the roofline per kernel, ``max(FLOPs / peak, bytes / memory bandwidth)``, summed
  over the kernels of the partitioned, fused entry computation (:func:`hlo_tools.kernels.kernels`).
  It is the model's formula per operator (``kiwi_jax.strategies``), applied to what runs: a
  fused chain of elementwise operations is one kernel that reads its inputs and writes its
  result once. A whole-program roofline ``max(F / peak, B / bw)`` over XLA's totals would be a
  lower bound that lets the memory-bound kernels hide under the compute-bound ones (and vice
  versa), which no kernel does; ``F / peak + B / bw`` is the matching upper bound. Both are kept
  (``compute_lower_seconds``, ``compute_upper_seconds``). The kernels' FLOPs are XLA's to
  about 1%; XLA's bytes also count the collectives' operands and results, which the estimate
  prices as communication instead (``kernel_flops`` vs ``flops``, ``kernel_bytes`` vs
  ``bytes_accessed``), so the per-kernel sum can fall under the whole-program lower bound.
- Collectives: every collective of the partitioned module (after XLA's combiners merged them),
  priced with the alpha-beta formula of its kind (:func:`kiwi_jax.sharding.collective_seconds`)
  on the link of the mesh axes its replica groups span; a collective whose groups are not the
  device sets along mesh axes, and every collective-permute, is priced on the link spanning
  the whole mesh (the slower one).
- The step: compute + collectives, with no overlap between them, as the model assumes.

References:
  Williams, Waterman and Patterson, "Roofline" (CACM 2009); Alpa (Zheng et al., OSDI 2022),
  sec. 4.1 (alpha-beta cost per collective and mesh axis).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from hlo_tools.compiled import CompiledAnalysisError, collectives
from hlo_tools.kernels import kernels
from kiwi_jax.cluster import Cluster, MeshSpec
from kiwi_jax.sharding import Comm, collective_seconds, comm_seconds

__all__ = ["CompiledCost", "compiled_cost", "kernel_seconds", "source_operation",
           "xla_cost_analysis"]


@dataclasses.dataclass(frozen=True)
class CompiledCost:
    """The per-device cost of one compiled, partitioned executable under a cluster's figures."""

    flops: float
    """FLOPs per device by XLA's cost analysis (recomputation included where it survived
    compilation)."""
    bytes_accessed: float
    """Bytes per device XLA's cost analysis counts as read or written (collectives'
    operands and results included)."""
    kernels: int
    """Kernels of the partitioned entry computation (fusions and unfused operations)."""
    kernel_flops: float
    """Their FLOPs, counted as the cost model counts an operator's (close to ``flops``)."""
    kernel_bytes: int
    """Their operands' and results' bytes (``bytes_accessed`` less the collectives')."""
    compute_seconds: float
    """Sum over the kernels of max(FLOPs / peak, bytes / memory bandwidth)."""
    compute_lower_seconds: float
    """max(flops / peak, bytes_accessed / bandwidth): the whole-program roofline."""
    compute_upper_seconds: float
    """flops / peak + bytes_accessed / bandwidth: no kernel overlaps compute and memory."""
    collectives: dict
    """``{kind: {"count", "bytes", "seconds"}}`` of the partitioned module's collectives
    (each instruction once; bytes as :class:`kiwi_jax.sharding.Comm` counts them)."""
    compute_by_operation: dict = dataclasses.field(default_factory=dict)
    """:attr:`compute_seconds` by :func:`source_operation` of each kernel's ``op_name`` (XLA
    gives a fusion its root's; without one, by the opcode of the fusion's root):
    ``{operation: (kernels, seconds)}``."""

    @property
    def collective_seconds(self) -> float:
        """Alpha-beta seconds of every collective."""
        return sum(v["seconds"] for v in self.collectives.values())

    @property
    def step_seconds(self) -> float:
        """Compute + collectives, without overlap (as the cost model)."""
        return self.compute_seconds + self.collective_seconds

    def to_dict(self) -> dict:
        return {
            "flops": float(self.flops), "bytes_accessed": float(self.bytes_accessed),
            "kernels": int(self.kernels), "kernel_flops": float(self.kernel_flops),
            "kernel_bytes": int(self.kernel_bytes), "compute_seconds": self.compute_seconds,
            "compute_lower_seconds": self.compute_lower_seconds,
            "compute_upper_seconds": self.compute_upper_seconds,
            "collective_seconds": self.collective_seconds, "step_seconds": self.step_seconds,
            "collectives": {k: dict(v) for k, v in self.collectives.items()},
            "compute_by_operation": {k: list(v) for k, v in self.compute_by_operation.items()},
        }


def xla_cost_analysis(compiled) -> dict:
    """``compiled.cost_analysis()`` as one dict (older jax returned a list of one); a program
    without arithmetic has no ``flops`` key.

    Raises:
      CompiledAnalysisError: the backend gives no cost analysis.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis:
        raise CompiledAnalysisError("expected compiled.cost_analysis() to give 'flops' and "
                                    f"'bytes accessed', found {analysis!r}")
    return dict(analysis)


def compiled_cost(compiled, mesh, cluster) -> CompiledCost:
    """Price a compiled, partitioned step with a cluster's figures (see the module docstring).

    Args:
      compiled: a ``jax.stages.Compiled`` of the step on ``mesh``.
      mesh: its mesh: a ``jax.sharding.Mesh``, a :class:`MeshSpec` or ``"2x4"``; collectives'
        replica groups are read as positions in the mesh (see :mod:`hlo_tools.compiled`).
      cluster: a :class:`Cluster` or a preset name.

    Raises:
      CompiledAnalysisError: the backend gives no cost analysis.
    """
    spec, cluster = MeshSpec.parse(mesh), Cluster.parse(cluster)
    device = cluster.device
    analysis = xla_cost_analysis(compiled)
    flops = float(analysis.get("flops", 0.0))
    nbytes = float(analysis.get("bytes accessed", 0.0))
    text = compiled.as_text()
    found = kernels(text)
    whole_mesh = cluster.axis_link(spec, (0, 1))
    table = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "seconds": 0.0})
    for c in collectives(text, np.arange(spec.num_devices).reshape(spec.shape)):
        seconds = (comm_seconds(Comm(c.kind, c.axes, c.bytes), spec, cluster) if c.axes else
                   collective_seconds(c.kind, c.group_size, c.bytes, whole_mesh))
        row = table[c.kind]
        row["count"] += 1
        row["bytes"] += int(c.bytes)
        row["seconds"] += seconds
    rooflines = [kernel_seconds(k, device) for k in found]
    by_operation: dict[str, tuple[int, float]] = {}
    for k, roofline in zip(found, rooflines):
        key = source_operation(k.op_name, k.root)
        count, seconds = by_operation.get(key, (0, 0.0))
        by_operation[key] = (count + 1, seconds + roofline)
    return CompiledCost(
        flops=flops, bytes_accessed=nbytes, kernels=len(found),
        kernel_flops=float(sum(k.flops for k in found)),
        kernel_bytes=int(sum(k.bytes for k in found)),
        compute_seconds=float(sum(rooflines)),
        compute_lower_seconds=max(flops / device.flops, nbytes / device.memory_bandwidth),
        compute_upper_seconds=flops / device.flops + nbytes / device.memory_bandwidth,
        collectives=dict(table), compute_by_operation=by_operation)


def kernel_seconds(kernel, device) -> float:
    """The roofline of one kernel (a :class:`hlo_tools.kernels.Kernel`, or anything with
    ``flops`` and ``bytes``) on a :class:`~kiwi_jax.cluster.Device`: the cost model's formula
    per operator, ``max(FLOPs / peak, bytes / memory bandwidth)``."""
    return max(kernel.flops / device.flops, kernel.bytes / device.memory_bandwidth)


def source_operation(op_name: str, opcode: str = "") -> str:
    """The JAX operation an instruction or an operator comes from, by its ``op_name``
    metadata: the primitive (its last path component, without parameters), marked
    ``(backward)`` when JAX's autodiff made it by transposing the forward pass
    (``transpose(jvp(...))`` in the path). The key on which the model's operators and the
    compiled kernels are set side by side (:attr:`CompiledCost.compute_by_operation`); the
    scopes before the primitive differ between the plain step and the applied one, the
    primitive does not.
    Without an ``op_name`` (copies XLA adds, and kernels whose metadata XLA's CPU passes drop),
    the HLO ``opcode`` marked ``(no op_name)``.

    ``"jit(step)/transpose(jvp(Block))/dot_general"`` -> ``"dot_general (backward)"``;
    ``("", "copy")`` -> ``"copy (no op_name)"``.
    """
    if not op_name:
        return f"{opcode or '?'} (no op_name)"
    primitive = op_name.rsplit("/", 1)[-1].split("[", 1)[0]
    return f"{primitive} (backward)" if "transpose(" in op_name else primitive

