"""What a compiled program does inside its loops, read from XLA's optimized HLO text (pure text analysis).

The text is `jax.jit(f).lower(...).compile().as_text()`: for the decode programs, what the accelerator
runs (on a CPU host too: a TPU topology's compile-only devices). `parse` (`evaluation.hlo_parse`) turns it
into computations of instructions; `loops` finds the while loops (the decode loop, the drafter's loop nested
in it); a *scope* is what one loop iteration (or the program outside every loop) runs itself: its
computation and those it calls — fusions, calls, every branch of a conditional, once per call site — but
not nested loops, which are scopes of their own. Per scope, `count_moves` and `collectives` count, `moves`
lists lines (the check of `tests/decoding/test_compiled.py`), `summary` makes the rows of a report table:

  program = hlo.parse(compiled.as_text())
  for loop in hlo.loops(program):
    hlo.count_moves(program, loop, min_elements=cache_elements, shape_filter=hlo.dims_contain(cache_length))
    hlo.collectives(program, loop)
  hlo.summary(program, min_elements=..., selectors={"cache": hlo.dims_contain(cache_length)})

Moves are the instructions that write data somewhere else without computing on it:
- materialized: a `copy`/`transpose` that writes a buffer of its own (top level of a scope's computations,
  or the one op of a fusion that only wraps it, as XLA:CPU wraps each copy);
- fused: a `copy`/`transpose` inside a fusion with other work (on TPU: a relayout of an operand, e.g. of
  the KV cache inside an attention dot's fusion, read as bfloat16 for the MXU): no buffer, but not free;
- async: `copy-start`/`copy-done` pairs, asynchronous copies between memory spaces (on TPU v4: HBM,
  memory space 0, and the on-chip memory that memory-space assignment uses, `S(3)` in layouts).
A scope's instructions inside a branch of a `conditional` run only on the iterations that take it (a rare
fallback, e.g. the exact top-p search for a nucleus beyond the top-k candidates): `Instruction.conditional`,
and the counters' `branches` (None: all; False: what every iteration runs; True: what only a branch does).
Bytes are logical (elements × element size): TPU tiles pad minor dimensions, so a buffer may take more.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

# The parsed program's records and its reader, read through this module too (`hlo.parse`, `hlo.Shape`, …).
from specdec.evaluation.hlo_parse import Instruction, Program, Shape, dtype_bits, parse, parse_shapes

ShapeFilter = Callable[[tuple[int, ...]], bool]

# Ops that move data between buffers, layouts or memory spaces without computing on it.
MOVE_OPS = ("copy", "transpose")
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Loop:
  """A while loop: its instruction's name, the computation it sits in, its body and condition, its depth
  (0: not inside another loop) and the enclosing loop's name, and XLA's trip count when it knows one."""
  name: str
  computation: str
  body: str
  condition: str
  depth: int
  parent: str | None
  trip_count: int | None


# What the counters read: a computation (ENTRY: the program outside loops) or a loop (its body and condition).
Scope = str | Loop


class Tally(NamedTuple):
  """How many instructions, and the bytes of their arrays."""
  count: int = 0
  bytes: int = 0

  def plus(self, nbytes: int) -> Tally:
    return Tally(self.count + 1, self.bytes + nbytes)


@dataclasses.dataclass(frozen=True)
class MoveCounts:
  """The moves of one scope: materialized and fused copies/transposes, asynchronous copies
  (`copy-start`/`copy-done` pairs), and those by direction ("HBM->S(3)", "S(3)->HBM", ...)."""
  materialized: Tally = Tally()
  fused: Tally = Tally()
  async_copies: Tally = Tally()
  async_directions: dict[str, Tally] = dataclasses.field(default_factory=dict)


def loops(program: Program) -> list[Loop]:
  """Every while loop, in program order (depth first from ENTRY: a loop, then the loops nested in it): a
  while in another's body or condition, reached through any fusion, call or conditional, is nested in it."""
  found: list[Loop] = []

  def visit(computation: str, depth: int, parent: str | None, path: tuple[str, ...]) -> None:
    if computation in path:
      return
    for instruction in program.computations.get(computation, ()):
      if instruction.op == "while":
        body, condition = instruction.calls["body"][0], instruction.calls["condition"][0]
        trip = _TRIP_COUNT.search(instruction.line)
        found.append(Loop(instruction.name, computation, body, condition, depth, parent,
                          int(trip.group(1)) if trip else None))
        visit(condition, depth + 1, instruction.name, path + (computation,))
        visit(body, depth + 1, instruction.name, path + (computation,))
        continue
      for names in instruction.calls.values():
        for name in names:
          visit(name, depth, parent, path + (computation,))

  visit(program.entry, 0, None, ())
  return found


def scope_ops(program: Program, computation_name: str) -> list[Instruction]:
  """The instructions a scope runs itself: `computation_name`'s and, recursively, those of the computations
  it calls (fusions, calls, every branch of a conditional, reducers), once per call site; not those of
  nested while loops, which are scopes of their own. `Instruction.fused` tells a fused instruction from one
  that writes its own buffer (materialized)."""
  ops: list[Instruction] = []

  def visit(computation: str, path: tuple[str, ...]) -> None:
    if computation in path:
      return
    for instruction in program.computations.get(computation, ()):
      ops.append(instruction)
      if instruction.op == "while":
        continue
      for names in instruction.calls.values():
        for name in names:
          visit(name, path + (computation,))

  if computation_name not in program.computations:
    raise KeyError(f"no computation {computation_name!r} in the program")
  visit(computation_name, ())
  return ops


def _ops(program: Program, scope: Scope, branches: bool | None = None) -> list[Instruction]:
  """A scope's instructions: a computation's, or a loop's (its body's and its condition's: both run on
  every iteration); `branches`: all (None), those outside conditional branches (False), those in them
  (True)."""
  if isinstance(scope, Loop):
    ops = scope_ops(program, scope.body) + scope_ops(program, scope.condition)
  else:
    ops = scope_ops(program, scope)
  return ops if branches is None else [i for i in ops if i.conditional == branches]


def _selected(shape: Shape | None, min_elements: int, shape_filter: ShapeFilter | None) -> bool:
  return shape is not None and shape.elements >= min_elements and (shape_filter is None or shape_filter(shape.dims))


def _space(memory_space: int) -> str:
  return "HBM" if memory_space == 0 else f"S({memory_space})"


def async_copies(program: Program, scope: Scope, min_elements: int = 0, shape_filter: ShapeFilter | None = None,
                 branches: bool | None = None) -> Iterator[tuple[Instruction, Shape, Shape]]:
  """A scope's asynchronous copies: each `copy-start` (its `copy-done` is the same transfer) with its
  destination and source arrays (the first two of the result tuple, whose third is a context)."""
  for instruction in _ops(program, scope, branches):
    if instruction.op == "copy-start" and len(instruction.shapes) >= 2:
      destination, source = instruction.shapes[:2]
      if _selected(destination, min_elements, shape_filter):
        yield instruction, destination, source


def count_moves(program: Program, scope: Scope, min_elements: int = 0,
                shape_filter: ShapeFilter | None = None, branches: bool | None = None) -> MoveCounts:
  """The copies, transposes and asynchronous copies of a scope (a computation's name or a `Loop`) whose
  array has at least `min_elements` elements and whose dims `shape_filter` accepts (all when None); bytes
  of their results (an asynchronous copy's: its destination). Every copy counts, ENTRY's copies of a
  broadcast too (`moves` can leave those out). `branches`: as `_ops`."""
  materialized, fused, copies, directions = Tally(), Tally(), Tally(), {}
  for instruction in _ops(program, scope, branches):
    if instruction.op in MOVE_OPS and _selected(instruction.shape, min_elements, shape_filter):
      if instruction.fused:
        fused = fused.plus(instruction.shape.bytes)
      else:
        materialized = materialized.plus(instruction.shape.bytes)
  for _, destination, source in async_copies(program, scope, min_elements, shape_filter, branches):
    copies = copies.plus(destination.bytes)
    direction = f"{_space(source.memory_space)}->{_space(destination.memory_space)}"
    directions[direction] = directions.get(direction, Tally()).plus(destination.bytes)
  return MoveCounts(materialized, fused, copies, dict(sorted(directions.items())))


def collectives(program: Program, scope: Scope) -> dict[str, Tally]:
  """The collectives of a scope by op (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute), each (count, bytes of their results): an asynchronous one (`all-reduce-start` …
  `all-reduce-done`) counted once, by the `-done`'s result (the `-start`'s is a tuple with its operands)."""
  found: dict[str, Tally] = {}
  for instruction in _ops(program, scope):
    if instruction.op.endswith("-start"):
      continue
    op = instruction.op.removesuffix("-done")
    if op in COLLECTIVE_OPS:
      found[op] = found.get(op, Tally()).plus(sum(shape.bytes for shape in instruction.shapes))
  return dict(sorted(found.items()))


def entry_parameters(program: Program, *, used_only: bool = False) -> list[Instruction]:
  """The ENTRY computation's parameters in order; `used_only`: those some instruction of ENTRY reads (a
  jitted function's argument it never touches stays a parameter, and is not read from memory)."""
  body = program.computations[program.entry]
  parameters = [i for i in body if i.op == "parameter"]
  if used_only:
    read = {operand for i in body for operand in i.operands}
    parameters = [i for i in parameters if i.name in read]
  return parameters


def _initial_value(program: Program, instruction: Instruction) -> bool:
  """Whether a copy in ENTRY copies a broadcast: it materializes an initial value (the zeros of a new
  cache, one buffer per layer) and moves no data."""
  if instruction.computation != program.entry or instruction.op != "copy":
    return False
  for operand in instruction.operands:
    source = program.instructions.get(operand)
    if source is None:
      continue
    if source.op == "broadcast" or (source.op == "fusion" and any(
        i.root and i.op == "broadcast" for name in source.calls.get("calls", ()) for i in program.computations[name])):
      return True
  return False


def moves(program: Program, min_elements: int, *, scope: Scope | None = None, include_fused: bool = True,
          skip_initial_values: bool = True, shape_filter: ShapeFilter | None = None) -> list[str]:
  """The lines of the copy/transpose instructions with at least `min_elements` elements (and dims that
  `shape_filter` accepts): in `scope`, or anywhere in the program when None. `include_fused=False` keeps
  only materialized ones (what a TPU program can be held to: its attention fusions relayout the cache);
  `skip_initial_values` leaves out ENTRY's copies of a broadcast (`tests/decoding/test_compiled.py`'s rule)."""
  if scope is None:
    candidates = [i for body in program.computations.values() for i in body]
  else:
    candidates = _ops(program, scope)
  return [i.line for i in candidates
          if i.op in MOVE_OPS and _selected(i.shape, min_elements, shape_filter)
          and (include_fused or not i.fused) and not (skip_initial_values and _initial_value(program, i))]


def summary(program: Program, *, min_elements: int = 0,
            selectors: Mapping[str, ShapeFilter] | None = None) -> list[dict[str, Any]]:
  """One JSON-serialisable row per scope for a report table: "outside loops" (ENTRY and what it calls
  outside every while), then every loop in program order. Each row:

    scope        "outside loops" or the while's name
    computation  ENTRY's name, or the loop's body
    depth        -1 outside loops, else the loop's (0: the outermost)
    parent       the enclosing loop's name, or None
    trip_count   XLA's, when it knows it, else None
    <selector>   for each of `selectors` (shape filters on the dims; default {"all": every shape}), the
                 moves of at least `min_elements` elements it accepts: {"materialized", "fused", "async"
                 (counts), "materialized_bytes", "fused_bytes", "async_bytes", "async_directions":
                 {"HBM->S(3)": {"count", "bytes"}, ...}, "in_branches": the same counts of those moves
                 that lie in a conditional's branch (run only on the iterations that take it)}
    collectives  {"all-reduce": {"count", "bytes"}, ...}, the ops found only
  """
  selectors = {"all": lambda dims: True} if selectors is None else dict(selectors)
  clash = set(selectors) & {"scope", "computation", "depth", "parent", "trip_count", "collectives"}
  if clash:
    raise ValueError(f"selector names {sorted(clash)} clash with the row's own keys")
  scopes: list[tuple[Scope, dict[str, Any]]] = [(program.entry, dict(
      scope="outside loops", computation=program.entry, depth=-1, parent=None, trip_count=None))]
  scopes += [(loop, dict(scope=loop.name, computation=loop.body, depth=loop.depth, parent=loop.parent,
                         trip_count=loop.trip_count)) for loop in loops(program)]
  rows = []
  for scope, row in scopes:
    for label, accept in selectors.items():
      row[label] = _counts_row(count_moves(program, scope, min_elements, accept))
      row[label]["in_branches"] = _counts_row(count_moves(program, scope, min_elements, accept, branches=True))
    row["collectives"] = {op: tally._asdict() for op, tally in collectives(program, scope).items()}
    rows.append(row)
  return rows


def _counts_row(counts: MoveCounts) -> dict[str, Any]:
  return {"materialized": counts.materialized.count, "materialized_bytes": counts.materialized.bytes,
          "fused": counts.fused.count, "fused_bytes": counts.fused.bytes,
          "async": counts.async_copies.count, "async_bytes": counts.async_copies.bytes,
          "async_directions": {k: tally._asdict() for k, tally in counts.async_directions.items()}}


def dims_contain(size: int) -> ShapeFilter:
  """A shape filter: the dims include `size` (e.g. the cache length)."""
  return lambda dims: size in dims


def dims_end_with(trailing: Sequence[int]) -> ShapeFilter:
  """A shape filter: the dims end with `trailing` (e.g. (γ+1, V) for a block's distributions)."""
  trailing = tuple(trailing)
  return lambda dims: tuple(dims[len(dims) - len(trailing):]) == trailing if len(dims) >= len(trailing) else False
