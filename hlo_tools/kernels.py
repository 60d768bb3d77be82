"""The kernels of a compiled module: per kernel, the FLOPs it computes and the bytes it moves.

After fusion every instruction of the entry computation that computes something is one kernel
(a fusion, or an operation XLA left alone); its FLOPs are those of the operations it runs,
counted as the cost model counts them (:func:`hlo_tools.graph.op_flops`, through fused and
called computations), and its bytes are what it reads and writes in memory: its operands and
its result, as XLA's cost analysis charges a fusion (values inside a fusion stay in registers;
a slice reads only what it returns, an in-place update moves only its update).
Collectives are not kernels here: they are priced as communication.

Their sums are close to XLA's own ``compiled.cost_analysis()`` totals (``flops``,
``bytes accessed``), which the tests check; unlike those totals they tell compute-bound kernels
from memory-bound ones, so a roofline can be applied per kernel.

References:
  Williams, Waterman and Patterson, "Roofline: an insightful visual performance model" (CACM
  2009): a kernel takes max(FLOPs / peak, bytes / bandwidth); XLA's HloCostAnalysis (a fusion's
  bytes are its operands' and its result's, less what slices and in-place updates leave
  untouched).
"""

from __future__ import annotations

import dataclasses

from hlo_tools.compiled import KINDS
from hlo_tools.graph import op_flops
from hlo_tools.hlo_text import Computation, HloModule, HloParseError, parse_module

__all__ = ["Kernel", "kernels", "NOT_KERNELS"]

NOT_KERNELS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                         "partition-id", "replica-id", "after-all", "opt-barrier"})
"""Entry instructions that run no kernel: inputs, constants, views and tuple plumbing."""
_NO_FLOPS = frozenset({"tuple", "get-tuple-element", "partition-id", "replica-id",
                       "after-all", "custom-call"})
"""Operations inside a kernel whose work the FLOP count does not see (a custom call's is
unknown to the text, as it is to XLA's cost analysis)."""


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled module's entry computation."""

    name: str
    """The entry instruction, without the leading ``%``."""
    opcode: str
    """Its opcode (``fusion`` for a fused kernel)."""
    flops: float
    """Floating point operations of everything it runs (:func:`hlo_tools.graph.op_flops`),
    over its :attr:`runs`."""
    bytes: int
    """Bytes it reads and writes: its operands' and its result's (see :func:`_bytes`), over
    its :attr:`runs`."""
    op_name: str = ""
    """The instruction's ``op_name`` (the jax source it came from), or ""."""
    runs: int = 1
    """Times it runs per step (a kernel of a loop's body: the loop's trip count); ``flops``
    and ``bytes`` are its totals over them."""
    root: str = ""
    """The opcode of what it computes: a fusion's (or call's) root instruction's, else
    :attr:`opcode`."""


def _is_collective(opcode: str) -> bool:
    return opcode.removesuffix("-start").removesuffix("-done") in KINDS


def _flops(module: HloModule, computation: Computation) -> float:
    """FLOPs of a computation's operations, called computations included (a reduction's
    combiner is not: the reduction counts one per input element)."""
    defined = computation.by_name()
    total = 0.0
    for instr in computation.instructions:
        if instr.opcode in ("fusion", "call"):
            total += _flops(module, _called(module, instr))
        elif instr.opcode in NOT_KERNELS or instr.opcode in _NO_FLOPS \
                or _is_collective(instr.opcode):
            continue
        else:
            total += op_flops(instr.opcode, instr.shape,
                              [defined[o].shape for o in instr.operands],
                              instr.int_list("lhs_contracting_dims"),
                              instr.attrs.get("dim_labels", ""))
    return total


_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
"""Operations that read only what they return of their first operand."""
_FUSED_SLICES = frozenset({"slice", "dynamic-slice"})
"""Those of them that XLA's cost analysis also counts so inside a fusion."""


def _bytes(module: HloModule, instr, operands: list) -> int:
    """Bytes a kernel reads and writes, by the rules of XLA's ``HloCostAnalysis``.

    An operand is read whole once, except where a kernel reads only part of it: a slice
    (dynamic or not, or a gather) reads what it returns (and its indices), and a
    dynamic-update-slice writes its update into its first operand in place, so that operand
    is neither read nor written whole. In a fusion the same holds for each use of a fused
    parameter by a slice or dynamic slice (not by a gather), and for a root (or root tuple
    element) that is an in-place update; other uses of a fused parameter share one whole
    read (XLA charges a fused broadcast or reshape one whole read each).

    Counted whole, a step that slices its replicated gradients for a sharded optimizer
    update was charged every gradient's full size in each update kernel.
    """
    if instr.opcode in _SLICES:
        return 2 * instr.shape.nbytes + sum(s.nbytes for s in operands[1:])
    if instr.opcode == "dynamic-update-slice":
        return 2 * operands[1].nbytes + sum(s.nbytes for s in operands[2:])
    if instr.opcode != "fusion":
        return instr.shape.nbytes + sum(s.nbytes for s in operands)
    computation = _called(module, instr)
    defined = computation.by_name()
    users: dict[str, list] = {}
    for inner in computation.instructions:
        for name in inner.operands:
            users.setdefault(name, []).append(inner)
    read = 0
    for param in computation.instructions:
        if param.opcode == "parameter":
            read += _parameter_read(param, users.get(param.name, ()))
    root = computation.root
    outputs = ([defined[o] for o in root.operands] if root.opcode == "tuple" else [root])
    written = sum(defined[o.operands[1]].shape.nbytes if o.opcode == "dynamic-update-slice"
                  else o.shape.nbytes for o in outputs)
    return read + written


def _parameter_read(param, users) -> int:
    """Bytes a fused parameter is read with: each slice of it reads its result, an in-place
    update of it reads nothing, and every other use shares one whole read."""
    read, whole = 0, False
    for user in users:
        first = user.operands[0] == param.name
        if user.opcode in _FUSED_SLICES and first:
            read += user.shape.nbytes
        elif user.opcode == "dynamic-update-slice" and first:
            continue
        elif not whole:
            read, whole = read + param.shape.nbytes, True
    return read


def _called(module: HloModule, instr) -> Computation:
    name = instr.attrs.get("calls", instr.attrs.get("to_apply", "")).lstrip("%")
    if name not in module.computations:
        raise HloParseError(f"expected {instr.opcode} {instr.name!r} to call a computation of "
                            f"the module, found calls={name!r}")
    return module.computations[name]


def kernels(hlo_text: str) -> tuple[Kernel, ...]:
    """The kernels of a compiled module, in schedule order.

    A ``while`` loop of the entry computation (a scan) is not one kernel: the kernels of its
    body count as many times as the loop runs (:meth:`HloModule.executions`: XLA's known trip
    count), those of its condition once more, nested loops alike; each such kernel's FLOPs
    and bytes are its totals over the step (:attr:`Kernel.runs`). Before, a scanned model's
    loop was one kernel of no FLOPs, and its layers' compute was left out of the estimate.

    Args:
      hlo_text: the compiled, partitioned module (``compiled.as_text()``).

    Returns:
      One :class:`Kernel` per instruction of the entry computation and of the loops' bodies
      and conditions that is neither in :data:`NOT_KERNELS` nor a collective.

    Raises:
      HloParseError: the text is not an HLO module, or a kernel reads an operand its
        computation does not define.
    """
    module = parse_module(hlo_text)
    return tuple(_kernels(module, module.entry, module.executions()))


def _kernels(module: HloModule, computation: Computation, runs: dict) -> list[Kernel]:
    defined = computation.by_name()
    times = runs.get(computation.name, 1)
    out = []
    for instr in computation.instructions:
        if instr.opcode in NOT_KERNELS or _is_collective(instr.opcode):
            continue
        if instr.opcode == "while":
            for part in ("body", "condition"):
                out += _kernels(module, module.computations[instr.attrs[part].lstrip("%")],
                                runs)
            continue
        missing = [o for o in instr.operands if o not in defined]
        if missing:
            where = "the entry computation" if computation.is_entry \
                else f"computation {computation.name!r}"
            raise HloParseError(f"expected the operands {missing} of {instr.name!r} to be "
                                f"defined in {where}, found no definition")
        operands = [defined[o].shape for o in instr.operands]
        root = instr.opcode
        if instr.opcode in ("fusion", "call"):
            called = _called(module, instr)
            flops, root = _flops(module, called), called.root.opcode
        elif instr.opcode in _NO_FLOPS:
            flops = 0.0
        else:
            flops = op_flops(instr.opcode, instr.shape, operands,
                             instr.int_list("lhs_contracting_dims"),
                             instr.attrs.get("dim_labels", ""))
        out.append(Kernel(instr.name, instr.opcode, flops * times,
                          _bytes(module, instr, operands) * times, instr.op_name, times, root))
    return out
