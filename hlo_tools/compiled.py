"""Analysis of compiled, SPMD-partitioned XLA modules on a device mesh.

Extracts the collectives of a partitioned module from its HLO text
(``compiled.as_text()``, read with :func:`hlo_tools.hlo_text.parse_module`, whose
shapes give the bytes), maps their replica groups onto the axes of the device mesh,
and reads per-device memory statistics.

Id-space assumption: in an SPMD-partitioned module (``num_partitions`` > 1,
one replica) replica groups are partition ids, whether the collective is in
cross-partition mode (``channel_id`` without ``use_global_device_ids``) or in
flattened-id mode (``use_global_device_ids=true``).  A partition id is the
position in the flattened mesh device assignment, so the ids in
``mesh_device_ids`` must be those positions: ``mesh.device_ids`` qualifies
whenever the mesh's devices are in id order (always the case for
``jax.make_mesh`` on simulated CPU devices); for any other mesh pass
``np.arange(mesh.size).reshape(mesh.devices.shape)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import pathlib
import re
import secrets
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hlo_tools.hlo_text import HloParseError, _matching, _split_top_level, parse_module

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_IOTA_RE = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH_RE = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>[^()]*(?:\([^()]*\))?)\))?\s*\{(?P<refs>[^}]*)\}"
)
_MESH_AXIS_RE = re.compile(r"'?(?P<name>[^'=,\s]+)'?=(?P<size>\d+)")
_AXIS_REF_RE = re.compile(r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_DEVICE_IOTA_RE = re.compile(r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


class CompiledAnalysisError(ValueError):
    """Raised when a compiled module cannot be analysed."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a partitioned module."""

    kind: str
    """Normalised opcode, one of ``KINDS`` (async ``-start`` suffix dropped)."""
    axes: tuple[int, ...]
    """Mesh axis indices the replica groups span; ``()`` if the groups are not
    exactly the device sets along some mesh axes (always for permutes)."""
    group_size: int
    """Devices per replica group; 0 for collective-permute (pairs, no groups)."""
    bytes: int
    """Per-device bytes of the full buffer, as in Alpa's cost formulas: output
    for all-gather, input for reduce-scatter, operand(s) otherwise."""
    name: str
    """Instruction name, without the leading ``%``."""
    shape: str
    """Result shape with its layouts, as the HLO text prints it (``Shape.text``)."""
    op_name: str = ""
    """The instruction's ``metadata={op_name=...}`` (the jax source it came from), or ""."""


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Per-device memory of a compiled executable, from XLA's buffer assignment."""

    argument_bytes: int
    """Bytes of the entry computation's parameters."""
    output_bytes: int
    """Bytes of the entry computation's outputs."""
    temp_bytes: int
    """Bytes of temporaries (intermediates, scratch)."""
    alias_bytes: int
    """Bytes of outputs aliased with (donated) arguments, counted in both."""

    @property
    def peak_bytes(self) -> int:
        """Upper bound on live bytes: argument + output + temp - alias."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(shape: Sequence[int], dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(dims)).reshape(dims)
    return arr.transpose(perm if perm else range(len(dims))).reshape(shape)


def _mesh_groups(m: re.Match) -> tuple[tuple[int, ...], ...]:
    axes = [(a["name"], int(a["size"])) for a in _MESH_AXIS_RE.finditer(m["axes"])]
    names, sizes = [n for n, _ in axes], [s for _, s in axes]
    ids_text = (m["ids"] or "").strip()
    if not ids_text:
        devices = np.arange(math.prod(sizes)).reshape(sizes)
    elif iota := _DEVICE_IOTA_RE.fullmatch(ids_text):
        devices = _iota(sizes, _ints(iota["dims"]), iota["perm"] and _ints(iota["perm"]))
    else:
        devices = np.array(_ints(ids_text)).reshape(sizes)
    refs = []  # (mesh dim, stride of the digit, digit size)
    for r in _AXIS_REF_RE.finditer(m["refs"]):
        if r["name"] not in names:
            raise HloParseError(f"expected a mesh axis of {names}, found {r['name']!r} in {m[0]!r}")
        dim = names.index(r["name"])
        pre, size = (int(r["pre"]), int(r["size"])) if r["pre"] else (1, sizes[dim])
        refs.append((dim, sizes[dim] // (pre * size), size))
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for coord in itertools.product(*map(range, sizes)):
        key, order = list(coord), []
        for dim, stride, size in refs:
            digit = (coord[dim] // stride) % size
            order.append(digit)
            key[dim] -= digit * stride
        groups.setdefault(tuple(key), []).append((tuple(order), int(devices[coord])))
    return tuple(tuple(d for _, d in sorted(g)) for _, g in sorted(groups.items()))


def parse_replica_groups(attrs: str) -> tuple[tuple[int, ...], ...] | None:
    """Parses the ``replica_groups=`` attribute in an instruction's text.

    Supports explicit lists (``{{0,1},{2,3}}``), the iota form
    (``[G,S]<=[dims]T(perm)``) and the mesh-axes form
    (``mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}``, sub-axes
    ``'b':(pre)size`` included).

    Args:
      attrs: Instruction text containing the attribute.

    Returns:
      The groups, each a tuple of ids; ``()`` for ``{}`` (all devices in one
      group); ``None`` if there is no ``replica_groups`` attribute.

    Raises:
      HloParseError: If the attribute value has none of the supported forms.
    """
    pos = attrs.find("replica_groups=")
    if pos < 0:
        return None
    return _replica_groups(attrs[pos + len("replica_groups="):])


def _replica_groups(value: str) -> tuple[tuple[int, ...], ...]:
    """The groups of a ``replica_groups`` value (see :func:`parse_replica_groups`)."""
    if value.startswith("{"):
        inner = value[1:_matching(value, 0)]
        return tuple(tuple(_ints(g.strip("{}"))) for g in _split_top_level(inner))
    if iota := _IOTA_RE.match(value):
        arr = _iota(_ints(iota["shape"]), _ints(iota["dims"]), iota["perm"] and _ints(iota["perm"]))
        return tuple(tuple(int(d) for d in row) for row in arr)
    if mesh := _MESH_RE.match(value):
        return _mesh_groups(mesh)
    raise HloParseError(
        f"expected replica_groups as {{{{..}}}}, [G,S]<=[dims]T(perm) or mesh[..] {{axes}}, found {value[:80]!r}"
    )


def _axes_of(groups: Iterable[Iterable[int]], mesh_ids: np.ndarray) -> tuple[int, ...]:
    """Smallest axis set whose device sets along it equal ``groups``; else ``()``."""
    target = {frozenset(g) for g in groups}
    for r in range(mesh_ids.ndim + 1):
        for axes in itertools.combinations(range(mesh_ids.ndim), r):
            rest = [a for a in range(mesh_ids.ndim) if a not in axes]
            size = math.prod(mesh_ids.shape[a] for a in axes)
            rows = mesh_ids.transpose(rest + list(axes)).reshape(-1, size)
            if {frozenset(int(d) for d in row) for row in rows} == target:
                return axes
    return ()


def collectives(hlo_text: str, mesh_device_ids: np.ndarray) -> tuple[Collective, ...]:
    """Lists the collectives of a partitioned module, in text order, once per run.

    Every computation is scanned. A collective in a ``while`` loop's body (a scan) is listed
    as many times as the body runs (:meth:`HloModule.executions`: XLA's known trip count),
    since each run is priced on its own; any other once (before, a loop's body counted once
    whatever its trip count).  Async pairs count at their ``-start``; ``-done`` halves are
    skipped.  See the module docstring for the id space of ``mesh_device_ids``.

    Args:
      hlo_text: Text of the whole partitioned module (``compiled.as_text()``).
      mesh_device_ids: Mesh device id array, e.g. ``mesh.device_ids``.

    Returns:
      One ``Collective`` per collective instruction.

    Raises:
      HloParseError: If the text is not an HLO module, or a collective is malformed or reads
        an operand its computation does not define.
    """
    mesh_ids = np.asarray(mesh_device_ids)
    found = []
    module = parse_module(hlo_text)
    runs = module.executions()
    for computation in module.computations.values():
        defined = computation.by_name()
        times = runs.get(computation.name, 1)
        for instr in computation.instructions:
            kind = instr.opcode.removesuffix("-start")  # "-done" halves never match KINDS
            if kind not in KINDS:
                continue
            missing = [op for op in instr.operands if op not in defined]
            if missing:
                raise HloParseError(f"expected the operands {missing} of {instr.name!r} to be "
                                    f"defined in {computation.name!r}, found no definition")
            operand_bytes = [defined[op].shape.nbytes for op in instr.operands]
            if kind == "collective-permute":      # the buffer sent (later operands: in place)
                found += [Collective(kind, (), 0, operand_bytes[0], instr.name,
                                     instr.shape.text, instr.op_name)] * times
                continue
            value = instr.attrs.get("replica_groups")
            groups = (_replica_groups(value) if value is not None else None) \
                or (tuple(sorted(int(d) for d in mesh_ids.flat)),)
            sizes = {len(g) for g in groups}
            if len(sizes) != 1:
                raise HloParseError(f"expected equal-sized replica groups in {instr.name!r}, "
                                    f"found sizes {sorted(sizes)}")
            group_size = sizes.pop()
            nbytes = sum(operand_bytes) * (group_size if kind == "all-gather" else 1)
            found += [Collective(kind, _axes_of(groups, mesh_ids), group_size, nbytes,
                                 instr.name, instr.shape.text, instr.op_name)] * times
    return tuple(found)


def summarize(collectives_: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """Counts and byte totals per kind; every kind in ``KINDS`` is present.

    Args:
      collectives_: Collectives, e.g. from ``collectives``.

    Returns:
      ``{kind: {"count": n, "bytes": total}}``.
    """
    summary = {kind: {"count": 0, "bytes": 0} for kind in KINDS}
    for c in collectives_:
        summary[c.kind]["count"] += 1
        summary[c.kind]["bytes"] += c.bytes
    return summary


def device_memory(compiled: Any) -> MemoryStats:
    """Reads per-device memory from ``compiled.memory_analysis()``.

    ``peak_memory_in_bytes`` is deliberately ignored (misleading on CPU).

    Args:
      compiled: A ``jax.stages.Compiled``.

    Returns:
      The executable's ``MemoryStats``.

    Raises:
      CompiledAnalysisError: If the backend provides no memory analysis.
    """
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        raise CompiledAnalysisError("expected compiled.memory_analysis() to return statistics, found None")
    return MemoryStats(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                       int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a tagged instruction sits in the entry computation's schedule."""

    index: int
    """Position in the scheduled entry computation."""
    name: str
    """The instruction (a fusion when the tagged operation was fused)."""
    collective: str | None
    """The next collective at or after it carrying the anchor tag (None: none)."""
    collective_index: int | None
    """Its position."""
    between: int
    """Collectives scheduled strictly between the two (0: nothing else is communicated
    between the recomputation and its collective)."""


def placements(hlo_text: str, scope: str, anchor_tags: Iterable[str]) -> list[Placement]:
    """For each scheduled instruction whose op_name (or a fused one's) contains ``scope``: the
    next collective whose op_name carries one of ``anchor_tags`` (e.g. ``/k715/``), and how
    many collectives lie between.

    Args:
      hlo_text: the compiled, scheduled module (``compiled.as_text()``).
      scope: the name scope of the instructions to place (``lynx_overlap``).
      anchor_tags: substrings identifying the anchors' collectives.
    """
    module = parse_module(hlo_text)
    schedule = module.entry.instructions

    def op_names(instr) -> list[str]:        # a fusion's own and its fused instructions'
        called = _called(module, instr)
        return [instr.op_name, *(i.op_name for i in (called.instructions if called else ()))]

    names = [op_names(instr) for instr in schedule]
    tags = tuple(anchor_tags)
    is_collective = [instr.opcode.removesuffix("-start") in KINDS for instr in schedule]
    anchored = [c and any(t in n for t in tags for n in ns)
                for c, ns in zip(is_collective, names)]
    out = []
    for k, instr in enumerate(schedule):
        if not any(scope in n for n in names[k]):
            continue
        j = next((j for j in range(k, len(schedule)) if anchored[j]), None)
        between = sum(is_collective[k + 1:j]) if j is not None else 0
        out.append(Placement(k, instr.name, None if j is None else schedule[j].name, j,
                             between))
    return out


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """A buffer alive at the peak of the executable's heap (:func:`live_at_peak`)."""

    instruction: str
    """The entry instruction defining it, with its shape index (``all-reduce.57{3}``: the
    fourth element of a tuple-shaped collective; ``{}`` for the whole value)."""
    nbytes: int
    """Its size per device."""
    op_name: str
    """The instruction's ``op_name``; without one, its fused root's or (a copy XLA inserted)
    its first operand's; empty when none has one."""
    parameter: bool
    """An entry parameter (an argument of the step)."""


_ALLOCATION_RE = re.compile(r"^allocation (?P<id>\d+): size (?P<size>\d+), (?:page \d+, )?"
                            r"(?P<kinds>.*):$")          # jax 0.12 names the page first
_VALUE_RE = re.compile(r"<\d+ (?P<name>[\w.\-]+)(?P<index>\{[\d,]*\})? @[^>]*> "
                       r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\)")
_RANGE_RE = re.compile(r"^\s+(?P<value>[\w.\-]+\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)$", re.M)


@contextlib.contextmanager
def _past_the_cache(options: dict):
    """``options`` for a compile that XLA runs, with JAX's persistent compilation cache on.

    That cache leaves the dump options out of its key, so a step compiled before (by the user,
    or by the planner a moment earlier) came back from it and XLA wrote no dump: with
    ``jax_compilation_cache_dir`` set, ``verify`` explaining a plan's memory per operator
    raised :class:`CompiledAnalysisError`. Where the cache is on, a debug option that changes
    nothing XLA compiles or dumps (how many buffers a debug print of the buffer assignment
    lists; the dumps read here were the same with it) keys this compile apart, and nothing is
    written to the cache while it runs."""
    import jax

    if not (jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache):
        yield options
        return
    written_after = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
    try:
        yield {**options, "xla_debug_buffer_assignment_show_max":
               UNCACHED_SHOW_MAX + secrets.randbelow(UNCACHED_SHOW_MAX)}
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", written_after)


UNCACHED_SHOW_MAX = 1 << 30
"""The least of :func:`_past_the_cache`'s ``xla_debug_buffer_assignment_show_max`` values (a
random one each compile, so no two compiles share a cache key)."""


def live_at_peak(lowered: Any, compiler_options: dict | None = None) -> tuple[LiveBuffer, ...]:
    """The buffers alive at the peak of ``lowered``'s heap: ``lowered`` is compiled once more
    with XLA's dumps on (a few seconds; the dump goes to a temporary directory), and at each
    point of its schedule the buffers its values occupy are summed (:func:`heap_peak`): the
    buffer assignment's values, each alive over the live-range report's range, an entry
    parameter's buffer throughout. Their sum is ``memory_analysis``'s peak but for the heap's
    packing.

    XLA's report names a peak of its own, which leaves out the elements of tuple-shaped values:
    on the zoo Linen scan's plan at 80% of 2x4 it named 444,320 B, where the combined
    all-reduce of the gradients holds 161,316 B of reduced gradients beside them and the heap
    peaks at 522,348 B (``memory_analysis``: 524,908 B).

    Args:
      lowered: a ``jax.stages.Lowered``.
      compiler_options: the options the step is compiled with (the dump is added to them).

    Raises:
      CompiledAnalysisError: the backend wrote no buffer assignment or live-range report.
    """
    with tempfile.TemporaryDirectory(prefix="hlo-dump-") as directory, \
            _past_the_cache({**(compiler_options or {}), "xla_dump_to": directory}) as options:
        lowered.compile(compiler_options=options)
        folder = pathlib.Path(directory)
        reports = sorted(folder.glob("*after_optimizations-live-range.txt"))
        if not reports:
            raise CompiledAnalysisError(f"XLA wrote no live-range report to {directory}")
        report = reports[-1].read_text()
        stem = str(reports[-1]).removesuffix("-live-range.txt")
        module_text = pathlib.Path(stem + ".txt").read_text()
        assignment = pathlib.Path(stem + "-buffer-assignment.txt")
        if not assignment.exists():
            raise CompiledAnalysisError(f"XLA wrote no buffer assignment to {directory}")
        _, alive = heap_peak(assignment.read_text(), report)
    module = parse_module(module_text)
    entry = module.entry.by_name()

    def op_name(name: str, index: str) -> str:
        """Its own, a fusion's root's, or (a copy XLA inserted) its operand's; an element of
        a combined collective, the operand it reduces."""
        instr = entry.get(name)
        if instr is None:
            return ""
        element = index.strip("{}")
        if instr.opcode in KINDS and element.isdigit() and 1 < len(instr.operands) \
                and int(element) < len(instr.operands):     # element k: operand k's result
            source = entry.get(instr.operands[int(element)])
            if source is not None:
                return _own_op_name(module, source)
        source = entry.get(instr.operands[0]) if instr.operands else None
        return _own_op_name(module, instr) or (source.op_name if source else "")

    return tuple(LiveBuffer(name + index, nbytes, op_name(name, index), parameter)
                 for name, index, nbytes, parameter in alive)


def heap_peak(assignment: str, ranges: str) -> tuple[int, list[tuple[str, str, int, bool]]]:
    """The most bytes a compiled module's buffers hold at once, and who holds them then:
    ``(name, shape index, bytes, is a parameter)`` per buffer. ``assignment``: XLA's
    buffer-assignment dump (each allocation's values with their offsets and sizes);
    ``ranges``: its live-range report (each value's first and last point in the schedule).
    A parameter's allocation is held throughout; thread-local and constant ones are left
    out, as ``memory_analysis`` leaves them; values at one offset of one allocation whose
    ranges overlap share one buffer (a bitcast, a tuple's element) and count once."""
    span = {m["value"]: (int(m["start"]), int(m["end"])) for m in _RANGE_RE.finditer(ranges)}
    end = max((last for _, last in span.values()), default=0)
    slots: dict[tuple[int, int], list[tuple[int, int, int, str, str]]] = {}
    parameters: list[tuple[str, str, int]] = []
    allocation, kinds = -1, ""
    for line in assignment.splitlines():
        head = _ALLOCATION_RE.match(line)
        if head is not None:
            allocation, kinds = int(head["id"]), head["kinds"]
            if kinds.startswith("parameter"):
                parameters.append(("", "", int(head["size"])))
            continue
        value = _VALUE_RE.search(line)
        if value is None or allocation < 0 or "thread-local" in kinds or "constant" in kinds:
            continue
        index = value["index"] or "{}"
        if kinds.startswith("parameter"):
            if not parameters[-1][0]:
                parameters[-1] = (value["name"], index, parameters[-1][2])
            continue
        first, last = span.get(value["name"] + index, (0, end))
        slots.setdefault((allocation, int(value["offset"])), []).append(
            (first, last, int(value["size"]), value["name"], index))
    held = np.zeros(end + 2, np.int64)
    groups = []                                   # one buffer: (first, last, bytes, holder)
    for values in slots.values():
        values.sort()
        group = list(values[0])
        for first, last, size, name, index in values[1:]:
            if first <= group[1]:                 # overlaps: the same buffer
                group[1] = max(group[1], last)
                if size > group[2]:
                    group[2:] = [size, name, index]
            else:
                groups.append(tuple(group))
                group = [first, last, size, name, index]
        groups.append(tuple(group))
    for first, last, size, _, _ in groups:
        held[first] += size
        held[last + 1] -= size
    timeline = np.cumsum(held)[:end + 1]
    peak = int(np.argmax(timeline)) if len(timeline) else 0
    alive = [(name, index, size, True) for name, index, size in parameters]
    alive += [(name, index, size, False) for first, last, size, name, index in groups
              if first <= peak <= last]
    parameter_bytes = sum(size for _, _, size in parameters)
    return parameter_bytes + int(timeline[peak] if len(timeline) else 0), alive


_NOT_STORED = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant"})
_ALIASING = frozenset({"tuple", "get-tuple-element", "bitcast"})


def _called(module, instr):
    """The computation an instruction calls (a fusion's fused computation), or None."""
    return module.computations.get(instr.attrs.get("calls", "").lstrip("%"))


def _is_broadcast(module, instr) -> bool:
    """A broadcast, or a fusion that only broadcasts (and bitcasts) its operand."""
    if instr.opcode == "broadcast":
        return True
    called = _called(module, instr)
    return (instr.opcode == "fusion" and called is not None
            and called.root.opcode == "broadcast"
            and all(i.opcode in ("parameter", "bitcast", "reshape", "broadcast")
                    for i in called.instructions))


def _own_op_name(module, instr) -> str:
    """An instruction's ``op_name``, or its fused root's."""
    called = _called(module, instr)
    return instr.op_name or (called.root.op_name if called else "")


@dataclasses.dataclass(frozen=True)
class Held:
    """What a compiled step holds under one group of ``op_name``: :func:`stored_bytes`."""

    peak: int
    """The most bytes held at once."""
    across: int
    """The bytes held across the split point, in values made before it and read after it (0
    without one)."""


def stored_bytes(hlo_text: str, key: Callable[[str], str | None] = lambda name: name,
                 after: Callable[[str], bool | None] | None = None,
                 broadcast_key: Callable[[str], str | None] | None = None) -> dict[str, Held]:
    """Per ``key(op_name)``, what an optimized, scheduled module's entry computation holds in
    the values it stores under those names (its instructions other than parameters, tuples,
    bitcasts and constants): the values XLA did not fuse into their readers, and what it makes
    to compute them. An instruction's name is its own or its fused root's; one with none (what
    XLA's expanders and copies add) takes its first operand's, or else its first reader's;
    ``key`` groups names (``None``: left out). A value is held from its instruction to its
    last reader in the schedule (through tuples, bitcasts and get-tuple-elements; a step
    output to the end). ``after`` says of a name whether it belongs after the split point
    (True), before it (False) or either (None): the split is where the instructions before
    outnumber those after the most (XLA schedules some of the backward pass's instructions
    among the forward pass's, and recomputes some forward values in the backward pass).

    A broadcast is held under the broadcast value's name: on the CPU backend a norm's
    ``rsqrt(var) * scale`` keeps both operands broadcast to the activation's shape for the
    backward pass, which recomputing the product does not free. One equation can hold more
    than its value: a max-pool's gradient pads its input and builds four index arrays of
    that size. ``hlo_text``: the compiled executable's ``as_text()``."""
    module = parse_module(hlo_text)
    instructions = module.entry.instructions
    entry = module.entry.by_name()
    position = {instr.name: i for i, instr in enumerate(instructions)}
    readers: dict[str, list[str]] = {}
    for instr in instructions:
        for operand in instr.operands:
            readers.setdefault(operand, []).append(instr.name)
    names: dict[str, str] = {}

    def name_of(instr, seen=frozenset()) -> str:
        """Its own name, or its first operand's, or its first reader's; a broadcast's is the
        broadcast value's."""
        if instr.name not in names:
            seen = seen | {instr.name}
            own = "" if _is_broadcast(module, instr) else _own_op_name(module, instr)
            for other in () if own else [*instr.operands[:1], *readers.get(instr.name, [])[:1]]:
                if other in entry and other not in seen:
                    own = name_of(entry[other], seen)
                    if own:
                        break
            names[instr.name] = own
        return names[instr.name]

    def last_read(name: str) -> int:
        """The last position reading ``name``'s buffer, through the instructions that alias it."""
        last = len(instructions) if name == module.entry.root.name else position[name]
        for reader in readers.get(name, []):
            aliasing = entry[reader].opcode in _ALIASING
            last = max(last, last_read(reader) if aliasing else position[reader])
        return last

    at = None
    if after is not None:
        sides = [after(_own_op_name(module, instr)) for instr in instructions]
        lead = np.cumsum([0] + [{False: 1, True: -1}.get(side, 0) for side in sides])
        at = int(np.argmax(lead))
    events: dict[str, list[tuple[int, int]]] = {}
    across: dict[str, int] = {}
    for instr in instructions:
        grouping = key if broadcast_key is None or not _is_broadcast(module, instr) \
            else broadcast_key
        group = grouping(name_of(instr) or "") if instr.opcode not in _NOT_STORED else None
        if group:
            nbytes, first, last = instr.shape.nbytes, position[instr.name], last_read(instr.name)
            events.setdefault(group, []).extend([(first, nbytes), (last + 1, -nbytes)])
            if at is not None and first < at <= last:
                across[group] = across.get(group, 0) + nbytes
    out = {}
    for group, changes in events.items():
        held = most = 0
        for _, change in sorted(changes):
            held += change
            most = max(most, held)
        out[group] = Held(most, across.get(group, 0))
    return out
