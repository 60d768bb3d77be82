"""Parse XLA HLO module text into plain instruction records.

The parser reads the text form printed by ``jax.jit(f).lower(...).as_text(dialect="hlo",
debug_info=True)``: one computation per block, one instruction per line::

    dot_general.15 = f32[2,8,64]{2,1,0} dot(add.121, w.1), lhs_contracting_dims={2}, ...

It does not interpret instructions; :mod:`hlo_tools.graph` turns the entry computation into an
operator graph.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "HloParseError",
    "Shape",
    "Instruction",
    "Computation",
    "HloModule",
    "parse_module",
    "parse_shape",
    "DTYPE_BITS",
]

DTYPE_BITS = {
    "pred": 8, "token": 0, "opaque": 64,
    "s1": 1, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u1": 1, "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
    "f6e2m3fn": 8, "f6e3m2fn": 8,      # jaxlib 0.12: a byte each, not packed (3 B for [3])
}
"""Bits per element of every element type XLA prints in HLO text (``xla::PrimitiveType`` in
lower case, ``OPAQUE_TYPE`` as ``opaque``). ``pred`` is stored in a byte; sub-byte types are
packed (XLA lays them out with ``E(bits)``, e.g. ``s4[3]{0:E(4)}``, 2 bytes); a ``token`` holds
nothing and an ``opaque`` value is a pointer (XLA's ``ShapeUtil::ByteSizeOf``, 64-bit host)."""

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_INSTR_START = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_ARRAY_SHAPE = re.compile(r"^([a-z][a-z0-9]*)\[([0-9,<=]*)\](\{[^}]*\})?")
_COMMENT = re.compile(r"^\s*/\*.*?\*/")
_ANY_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"^([a-z][\w\-]*)\(")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


class HloParseError(ValueError):
    """The HLO text does not have the structure the parser expects."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape, or a tuple of shapes."""

    dtype: str
    """Element type as HLO spells it (``f32``, ``s32``, ``pred``); ``"tuple"`` for tuples."""
    dims: tuple[int, ...] = ()
    """Dimension sizes (empty for scalars and tuples); a bounded dynamic dimension (``<=8``)
    counts at its bound."""
    elements: tuple["Shape", ...] = ()
    """Element shapes of a tuple (empty for arrays)."""
    layout: str = dataclasses.field(default="", compare=False)
    """The layout as printed after the dimensions, braces included (``{1,0}``,
    ``{1,0:T(8,128)}``, ``{0:E(4)}``); empty when none is printed and for tuples. Not part of
    equality: two shapes with the same type and dimensions are equal."""

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        """Number of elements of an array shape."""
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Bytes of the value, summed over tuple elements; sub-byte elements are packed:
        ``ceil(bits x elements / 8)`` (see :data:`DTYPE_BITS`)."""
        if self.is_tuple:
            return sum(e.nbytes for e in self.elements)
        if self.dtype not in DTYPE_BITS:
            raise HloParseError(f"expected an XLA element type ({', '.join(DTYPE_BITS)}), found "
                                f"{self.dtype!r}; add it to DTYPE_BITS with its width in bits")
        return (DTYPE_BITS[self.dtype] * self.size + 7) // 8

    @property
    def text(self) -> str:
        """The shape with its layouts, as HLO prints it (without tuple index comments)."""
        if self.is_tuple:
            return "(" + ", ".join(e.text for e in self.elements) + ")"
        return f"{self}{self.layout}"

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(e) for e in self.elements) + ")"
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction as written in the text."""

    name: str
    """Instruction name, unique within its computation."""
    opcode: str
    """HLO opcode (``dot``, ``add``, ``parameter`` ...)."""
    shape: Shape
    """Result shape."""
    operands: tuple[str, ...]
    """Names of the operand instructions (for ``constant``: empty)."""
    attrs: dict
    """Raw attribute strings by key (``dimensions``, ``to_apply``, ``lhs_contracting_dims`` ...);
    ``parameter`` keeps its number under ``"number"`` and ``constant`` its literal under
    ``"literal"``; mesh-axes ``replica_groups`` keep their ``device_ids=`` part."""
    is_root: bool = False
    """True for the computation's ROOT instruction."""

    @property
    def op_name(self) -> str:
        """The ``op_name`` from the metadata (empty when absent)."""
        match = re.search(r'op_name="([^"]*)"', self.attrs.get("metadata", ""))
        return match.group(1) if match else ""

    def int_list(self, key: str) -> tuple[int, ...]:
        """An attribute such as ``dimensions={0,2}`` as a tuple of ints (empty if absent)."""
        raw = self.attrs.get(key, "").strip("{} ")
        return tuple(int(v) for v in raw.split(",") if v.strip())

    @property
    def trip_count(self) -> int | None:
        """A ``while`` loop's trip count where XLA's loop analysis found it (its backend
        config's ``known_trip_count``, which the compiled modules carry); None otherwise."""
        match = _TRIP_COUNT.search(self.attrs.get("backend_config", ""))
        return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Computation:
    """A named HLO computation: instructions in text (topological) order."""

    name: str
    """Computation name."""
    instructions: tuple[Instruction, ...]
    """Instructions in the order printed, which is a topological order."""
    is_entry: bool = False
    """True for the module's ENTRY computation."""

    @property
    def root(self) -> Instruction:
        for instr in self.instructions:
            if instr.is_root:
                return instr
        return self.instructions[-1]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed HLO module."""

    name: str
    """Module name from the ``HloModule`` line."""
    computations: dict
    """Computations by name."""
    entry_name: str
    """Name of the ENTRY computation."""

    @property
    def entry(self) -> Computation:
        return self.computations[self.entry_name]

    def executions(self) -> dict[str, int]:
        """Times each computation of the control flow runs per run of the module: the entry
        once; a ``while`` loop's body as many times as its trip count
        (:attr:`Instruction.trip_count`, once where it is unknown) and its condition once
        more, per run of the computation holding the loop; a ``call``'s computation once per
        run of its caller. Computations only reached otherwise (fusions, reducers, the
        branches of a ``conditional``) are not listed."""
        runs: dict[str, int] = {}

        def visit(name: str, times: int) -> None:
            runs[name] = runs.get(name, 0) + times
            for instr in self.computations[name].instructions:
                if instr.opcode == "while":
                    trips = instr.trip_count or 1
                    visit(instr.attrs["body"].lstrip("%"), times * trips)
                    visit(instr.attrs["condition"].lstrip("%"), times * (trips + 1))
                elif instr.opcode == "call" and "to_apply" in instr.attrs:
                    visit(instr.attrs["to_apply"].lstrip("%"), times)

        visit(self.entry_name, 1)
        return runs


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside brackets, braces, parentheses and quotes."""
    parts, depth, quoted, start = [], 0, False, 0
    for pos, char in enumerate(text):
        if char == '"' and (pos == 0 or text[pos - 1] != "\\"):
            quoted = not quoted
        elif quoted:
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == sep and depth == 0:
            parts.append(text[start:pos].strip())
            start = pos + 1
    tail = text[start:].strip()
    if tail:
        parts.append(tail)
    return parts


def _matching(text: str, open_pos: int) -> int:
    """Index of the bracket (``(``, ``[`` or ``{``) closing the one at ``open_pos``; quoted
    text is skipped."""
    closing = {"(": ")", "[": "]", "{": "}"}
    stack: list[str] = []
    quoted = False
    for pos in range(open_pos, len(text)):
        char = text[pos]
        if char == '"' and (pos == 0 or text[pos - 1] != "\\"):
            quoted = not quoted
        elif quoted:
            continue
        elif char in closing:
            stack.append(closing[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                return pos
    raise HloParseError(f"expected a bracket closing {text[open_pos:open_pos + 1]!r}, found none "
                        f"in {text[open_pos:open_pos + 80]!r}")


def parse_shape(text: str) -> tuple[Shape, str]:
    """Parse a shape at the start of ``text``; return it and the remaining text.

    A tuple's elements may carry the ``/*index=5*/`` comments XLA prints in long tuples, and
    arrays a layout with tiles (``{1,0:T(8,128)}``), element size (``E(4)``) or memory space.

    Raises:
      HloParseError: ``text`` does not start with a shape.
    """
    text = _COMMENT.sub("", text, count=1) if text.lstrip().startswith("/*") else text
    text = text.lstrip()
    if text.startswith("("):
        close = _matching(text, 0)
        elements = tuple(parse_shape(part)[0] for part in _split_top_level(text[1:close]))
        return Shape("tuple", (), elements), text[close + 1:]
    match = _ARRAY_SHAPE.match(text)
    if not match:
        raise HloParseError(f"expected a shape such as f32[2,3]{{1,0}}, found {text[:60]!r}")
    dims = tuple(int(d.removeprefix("<=")) for d in match.group(2).split(",") if d)
    return Shape(match.group(1), dims, layout=match.group(3) or ""), text[match.end():]


def _parse_instruction(line: str) -> Instruction:
    start = _INSTR_START.match(line)
    if not start:
        raise HloParseError(f"expected 'name = shape opcode(...)', found {line.strip()[:100]!r}")
    shape, rest = parse_shape(line[start.end():])
    rest = rest.lstrip()
    opcode_match = _OPCODE.match(rest)
    if not opcode_match:
        raise HloParseError(f"expected an opcode after the shape in {line.strip()[:100]!r}")
    opcode = opcode_match.group(1)
    open_pos = opcode_match.end() - 1
    close = _matching(rest, open_pos)
    inside = rest[open_pos + 1:close]
    attrs: dict[str, str] = {}
    operands: tuple[str, ...] = ()
    if opcode == "parameter":
        attrs["number"] = inside.strip()
    elif opcode == "constant":
        attrs["literal"] = inside.strip()
    else:
        # Operands may be printed bare (``add.1``) or typed (``f32[2] %add.1``), every fifth
        # after an index comment (``/*index=5*/%add.1``).
        operands = tuple(_ANY_COMMENT.sub("", part).split()[-1].lstrip("%")
                         for part in _split_top_level(inside))
    key = None
    for item in _split_top_level(rest[close + 1:].lstrip(", ")):
        name, _, value = item.partition("=")
        name = name.strip()
        if (name == "device_ids" and key == "replica_groups"
                and attrs[key].startswith("mesh[")):
            # Mesh-axes replica groups span a comma: ``mesh[..], device_ids=(..) {axes}``.
            attrs[key] += f", {item}"
            continue
        key = name
        attrs[key] = value.strip()
    return Instruction(start.group(2), opcode, shape, operands, attrs, bool(start.group(1)))


def parse_module(text: str) -> HloModule:
    """Parse HLO module text.

    Args:
      text: the module as printed by ``Lowered.as_text(dialect="hlo")``.

    Returns:
      The module with every computation parsed.

    Raises:
      HloParseError: the text is not HLO module text.
    """
    lines = text.splitlines()
    if not lines or not lines[0].startswith("HloModule"):
        raise HloParseError("expected text starting with 'HloModule', found "
                            f"{(lines[0] if lines else '')[:60]!r}")
    module_name = lines[0].split()[1].rstrip(",")
    computations: dict[str, Computation] = {}
    entry_name = None
    current: list[Instruction] | None = None
    header = None
    for line in lines[1:]:
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if current is None:
            match = _HEADER.match(stripped)
            if match:
                header, current = match, []
            continue
        if stripped == "}":
            name = header.group(2)
            is_entry = bool(header.group(1))
            computations[name] = Computation(name, tuple(current), is_entry)
            if is_entry:
                entry_name = name
            current = None
            continue
        current.append(_parse_instruction(line))
    if entry_name is None:
        raise HloParseError("the module has no ENTRY computation")
    return HloModule(module_name, computations, entry_name)

