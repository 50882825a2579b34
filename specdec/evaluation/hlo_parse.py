"""Optimized HLO text read into a `Program` (pure text analysis; `evaluation.hlo` counts what its scopes do).

`parse(compiled.as_text())` gives the module's computations, each a list of `Instruction`s in text order
(their result `Shape`s with layout, TPU tiling and memory space; the computations each one calls), and marks
each instruction `fused` (it writes no buffer of its own) and `conditional` (it lies in a branch of a
`conditional` within its loop iteration).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

# Attributes naming computations that run on every element or pair of another instruction (reducers,
# comparators, scatter combiners): their instructions write no buffers of their own.
_APPLIED = ("to_apply", "select", "scatter")
# Attributes of a `conditional` naming its branches.
_BRANCHES = ("branch_computations", "true_computation", "false_computation")
# Ops that only rename a buffer (no data written), allowed around the one op of a wrapping fusion.
_ALIASES = ("parameter", "bitcast", "get-tuple-element", "tuple")

# Bits per element of the dtypes whose name does not say it (the others: s4 4, bf16 16, f8e4m3fn 8, c64 64).
_BITS = {"pred": 8, "token": 0, "opaque": 0}

_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OP = re.compile(r"([a-z][\w\-]*)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# `name=%comp` or `name={%a, %b}`; not `control-predecessors={%x}`, which names instructions.
_REFERENCE = re.compile(r"(?<![\w\-])([a-z_]+)=(%[\w.\-]+|\{\s*%[^}]*\})")
_NAME = re.compile(r"%([\w.\-]+)")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_TILE = re.compile(r"T\([\d,]*\)(?:\([\d,]*\))*")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Shape:
  """One array of an instruction's result: dtype, dims, layout (minor-to-major, None when not printed),
  tiling (TPU's `T(8,128)(2,1)`, '' if none) and memory space (0 = the default, HBM on TPU; `S(n)`)."""
  dtype: str
  dims: tuple[int, ...]
  layout: tuple[int, ...] | None = None
  tiling: str = ""
  memory_space: int = 0

  @property
  def elements(self) -> int:
    count = 1
    for size in self.dims:
      count *= size
    return count

  @property
  def bytes(self) -> int:
    return -(-self.elements * dtype_bits(self.dtype) // 8)

  @property
  def padded_bytes(self) -> int:
    """Bytes as the layout's tiling stores it: a TPU tile `T(a,b)` pads the two minor-most physical dims to
    multiples of a and b, `T(n)` the minor-most to a multiple of n (a sub-tiling such as `(2,1)` packs
    narrow elements within the tile, adding nothing); without a tiling, `bytes`."""
    tiles = [tuple(int(x) for x in t.split(",") if x) for t in re.findall(r"\(([\d,]*)\)", self.tiling)]
    if not tiles or not self.dims or self.layout is None:
      return self.bytes
    physical = [self.dims[d] for d in self.layout]        # minor-most first
    for i, multiple in enumerate(tiles[0][::-1][:len(physical)]):   # the tile's sizes, minor-most first
      physical[i] = -(-physical[i] // multiple) * multiple
    count = 1
    for size in physical:
      count *= size
    return -(-count * dtype_bits(self.dtype) // 8)

  def __str__(self) -> str:
    layout = "" if self.layout is None else ",".join(map(str, self.layout))
    extra = self.tiling + (f"S({self.memory_space})" if self.memory_space else "")
    braces = f"{{{layout}:{extra}}}" if extra else (f"{{{layout}}}" if self.layout is not None else "")
    return f"{self.dtype}[{','.join(map(str, self.dims))}]{braces}"


@dataclasses.dataclass(eq=False)
class Instruction:
  """One HLO instruction. `shapes` are the arrays of its result in order (one unless `is_tuple`; nested
  tuples flattened); `calls` maps each attribute naming computations (calls, body, condition, to_apply,
  branch_computations, ...) to their names. `fused` (set by `parse`): it runs inside another instruction —
  a fusion's computation, or a reducer/comparator that one applies — so it writes no buffer of its own;
  the one op of a fusion that merely wraps it (XLA:CPU wraps every copy) is not fused. `conditional` (set
  by `parse`): it lies in a branch of a `conditional` within its scope (between it and the nearest enclosing
  while loop), so an iteration runs it only when that branch is taken. Compared by identity: a computation
  called from several places yields the same instructions at each."""
  name: str
  op: str
  shapes: tuple[Shape, ...]
  is_tuple: bool
  operands: tuple[str, ...]
  calls: dict[str, tuple[str, ...]]
  computation: str
  line: str
  root: bool = False
  op_name: str = ""
  fused: bool = False
  conditional: bool = False

  @property
  def shape(self) -> Shape | None:
    """The result's array, None for a tuple result."""
    return None if self.is_tuple or not self.shapes else self.shapes[0]

  def __str__(self) -> str:
    return self.line


@dataclasses.dataclass
class Program:
  """A parsed HLO module: its computations (name -> instructions in text order), the ENTRY computation's
  name, and every instruction by name (HLO names are unique within a module)."""
  computations: dict[str, list[Instruction]]
  entry: str
  instructions: dict[str, Instruction]


def dtype_bits(dtype: str) -> int:
  """Bits per element of an HLO dtype (pred: 8, as XLA stores it; token: 0)."""
  if dtype in _BITS:
    return _BITS[dtype]
  digits = re.search(r"\d+", dtype)
  if not digits:
    raise ValueError(f"unknown HLO dtype {dtype!r}")
  return int(digits.group())


def parse_shapes(text: str) -> tuple[Shape, ...]:
  """The arrays of an HLO shape (`f32[8,6]{1,0}`, a tuple `(s32[], bf16[2]{0:T(128)S(3)})`), in order."""
  shapes = []
  for match in _SHAPE.finditer(_COMMENT.sub("", text)):
    dtype, dims, layout = match.groups()
    # A dynamic dimension `<=8` counts at its bound; an unknown one `?` is left out.
    sizes = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip() not in ("", "?"))
    minor_to_major, _, attributes = (layout or "").partition(":")
    space = _MEMORY_SPACE.search(attributes)
    shapes.append(Shape(
        dtype=dtype, dims=sizes,
        layout=None if layout is None else tuple(int(d) for d in minor_to_major.split(",") if d.strip()),
        tiling="".join(_TILE.findall(attributes)), memory_space=int(space.group(1)) if space else 0))
  return tuple(shapes)


def _closing(text: str, start: int) -> int:
  """The index of the bracket closing the one at `start`, skipping quoted strings."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, i = [], start
  while i < len(text):
    char = text[i]
    if char == '"':
      string = _STRING.match(text, i)
      i = string.end() if string else len(text)
      continue
    if char in pairs:
      stack.append(pairs[char])
    elif stack and char == stack[-1]:
      stack.pop()
      if not stack:
        return i
    i += 1
  raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 200]!r}")


def _instruction(line: str, computation: str) -> Instruction | None:
  """One instruction line, or None when the line is not one (e.g. a blank line)."""
  head = _INSTRUCTION.match(line)
  if not head:
    return None
  rest = line[head.end():]
  end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    raise ValueError(f"cannot read the shape of HLO instruction {line[:200]!r}")
  shape_text, rest = rest[:end], rest[end:].lstrip()
  op = _OP.match(rest)
  if not op:
    raise ValueError(f"cannot read the op of HLO instruction {line[:200]!r}")
  close = _closing(rest, op.end() - 1)
  operand_text, attributes = rest[op.end():close], rest[close + 1:]
  bare = _STRING.sub('""', attributes)
  calls = {}
  for attribute, value in _REFERENCE.findall(bare):
    calls[attribute] = tuple(_NAME.findall(value))
  op_name = _OP_NAME.search(attributes)
  return Instruction(
      name=head.group(2), op=op.group(1), shapes=parse_shapes(shape_text), is_tuple=shape_text.startswith("("),
      operands=tuple(_NAME.findall(_STRING.sub('""', _COMMENT.sub("", operand_text)))), calls=calls,
      computation=computation, line=line, root=bool(head.group(1)), op_name=op_name.group(1) if op_name else "")


def parse(hlo_text: str) -> Program:
  """The computations and instructions of an HLO module's text (the header, the stack-frame tables and
  anything else outside computations are skipped). Raises ValueError when there is no ENTRY computation."""
  computations: dict[str, list[Instruction]] = {}
  entry, current = None, None
  for raw in hlo_text.splitlines():
    line = raw.strip()
    if current is None:
      header = _HEADER.match(raw) if raw and not raw[0].isspace() else None
      if header and not raw.startswith("HloModule"):
        current = header.group(2)
        computations[current] = []
        if header.group(1):
          entry = current
    elif line == "}":
      current = None
    elif line:
      instruction = _instruction(line, current)
      if instruction is not None:
        computations[current].append(instruction)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text (is it `compiled.as_text()`?)")
  program = Program(computations, entry, {i.name: i for body in computations.values() for i in body})
  for instruction in program.instructions.values():
    instruction.calls = {attribute: names for attribute, names in instruction.calls.items()
                         if all(name in computations for name in names)}
  _mark(program, entry, "fused", False, _fused_inside(program), set())
  _mark(program, entry, "conditional", False, _conditional_inside, set())
  return program


def _wraps_one_op(program: Program, computation: str) -> bool:
  """Whether a fusion computation only wraps one op (besides parameters and renames)."""
  work = [i for i in program.computations.get(computation, ()) if i.op not in _ALIASES]
  return len(work) == 1


def _mark(program: Program, computation: str, field: str, value: bool, inner: Callable[..., bool],
          seen: set[str]) -> None:
  """Sets `field` of the instructions of `computation` to `value`, and of the computations they call, each
  to `inner(instruction, attribute, callee, value)`. A computation is marked on its first visit: one called
  from several places (a shared reducer) is called the same way from each."""
  if computation in seen or computation not in program.computations:
    return
  seen.add(computation)
  for instruction in program.computations[computation]:
    setattr(instruction, field, value)
    for attribute, names in instruction.calls.items():
      for name in names:
        _mark(program, name, field, inner(instruction, attribute, name, value), inner, seen)


def _fused_inside(program: Program) -> Callable[..., bool]:
  def inner(instruction: Instruction, attribute: str, callee: str, fused: bool) -> bool:
    if attribute in _APPLIED and instruction.op != "call":  # a call's to_apply is inlined code
      return True
    if instruction.op == "fusion":
      # A top-level fusion around one op is how XLA:CPU emits that op: it writes its own buffer.
      return fused or not _wraps_one_op(program, callee)
    return fused
  return inner


def _conditional_inside(instruction: Instruction, attribute: str, callee: str, conditional: bool) -> bool:
  # A loop's body and condition run on each of its iterations: a scope of their own, unconditional in it.
  return False if instruction.op == "while" else conditional or attribute in _BRANCHES

