"""`specdec.evaluation.hlo` on real optimized HLO: small programs compiled for the CPU (nested while loops,
a conditional, transposes, a cache kept alive or updated in place) and, when libtpu is installed, for a
TPU v4 chip and a 2x2 mesh of them (compile-only devices: no TPU needed); plus a module written in the TPU
text format, for what the small programs do not produce (asynchronous collectives, a
`true_computation=` conditional, control predecessors)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from specdec.evaluation import hlo

# In the TPU text format (its lines shortened from libtpu's output): a loop whose body runs an attention
# fusion that relayouts the cache, a conditional whose true branch holds a nested loop, an all-reduce, an
# asynchronous all-gather, a copy to HBM and back; ENTRY copies a broadcast (a new cache's zeros).
TPU_STYLE = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,128,64]{2,0,1:T(8,128)(2,1)})->bf16[8,128,64]{2,0,1:T(8,128)(2,1)}}

FileNames
1 "/tmp/step.py"

StackFrames
1 {file_location_id=1 parent_frame_id=1}


%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[]{:T(128)} parameter(0)
  %y = f32[]{:T(128)} parameter(1)
  ROOT %sum = f32[]{:T(128)} add(%x, %y)
}

%relayout (param_0: bf16[8,128,64]) -> bf16[8,128,64] {
  %param_0 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} parameter(0)
  ROOT %copy.1 = bf16[8,128,64]{2,1,0:T(8,128)(2,1)} copy(%param_0), metadata={op_name="jit(step)/attention/scatter" stack_frame_id=1}
}

%attention (param_0.1: f32[8,64,1], param_1: bf16[8,128,64]) -> f32[8,1,128] {
  %param_0.1 = f32[8,64,1]{1,2,0:T(1,128)S(3)} parameter(0)
  %param_1 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} parameter(1)
  %fusion.1 = bf16[8,128,64]{2,1,0:T(8,128)(2,1)} fusion(%param_1), kind=kLoop, calls=%relayout
  ROOT %convolution.1 = f32[8,1,128]{2,1,0:T(1,128)S(3)} convolution(%param_0.1, %fusion.1), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0fb_0oi->0bf, metadata={op_name="jit(step)/while/body/bd,btd->bt/dot_general" stack_frame_id=1}
}

%inner_body (t.1: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t.1 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i.1 = s32[]{:T(128)} get-tuple-element(%t.1), index=0
  %h.1 = f32[8,64]{1,0:T(8,128)} get-tuple-element(%t.1), index=1
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i.1, %one)
  %transpose.1 = f32[64,8]{1,0:T(8,128)} transpose(%h.1), dimensions={1,0}
  %h.2 = f32[8,64]{1,0:T(8,128)} bitcast(%transpose.1)
  ROOT %t.2 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) tuple(%next, %h.2)
}

%inner_condition (t.3: (s32[], f32[8,64])) -> pred[] {
  %t.3 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i.3 = s32[]{:T(128)} get-tuple-element(%t.3), index=0
  %three = s32[]{:T(128)} constant(3)
  ROOT %lt.1 = pred[]{:T(512)} compare(%i.3, %three), direction=LT
}

%on_true (h.3: f32[8,64]) -> f32[8,64] {
  %h.3 = f32[8,64]{1,0:T(8,128)} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %t.4 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) tuple(%zero, %h.3)
  %while.2 = (s32[]{:T(128)}, f32[8,64]{1,0:T(8,128)}) while(%t.4), condition=%inner_condition, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %h.4 = f32[8,64]{1,0:T(8,128)} get-tuple-element(%while.2), index=1
}

%on_false (h.5: f32[8,64]) -> f32[8,64] {
  %h.5 = f32[8,64]{1,0:T(8,128)} parameter(0)
  %copy.5 = f32[8,64]{0,1:T(8,128)} copy(%h.5)
  ROOT %h.8 = f32[8,64]{1,0:T(8,128)} bitcast(%copy.5)
}

%body (s.1: (s32[], bf16[8,128,64], f32[8,64])) -> (s32[], bf16[8,128,64], f32[8,64]) {
  %s.1 = (s32[]{:T(128)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, /*index=2*/f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i.5 = s32[]{:T(128)} get-tuple-element(%s.1), index=0
  %cache.2 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} get-tuple-element(%s.1), index=1
  %h.6 = f32[8,64]{1,0:T(8,128)} get-tuple-element(%s.1), index=2
  %copy-start.1 = (f32[8,64]{1,0:T(8,128)S(3)}, f32[8,64]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%h.6)
  %copy-done.1 = f32[8,64]{1,0:T(8,128)S(3)} copy-done(%copy-start.1)
  %q = f32[8,64,1]{1,2,0:T(1,128)S(3)} bitcast(%copy-done.1)
  %scores = f32[8,1,128]{2,1,0:T(1,128)S(3)} fusion(%q, %cache.2), kind=kOutput, calls=%attention, metadata={op_name="jit(step)/while/body/dot_general" stack_frame_id=1}
  %all-reduce.1 = f32[8,1,128]{2,1,0:T(1,128)S(3)} all-reduce(%scores), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %all-gather-start.1 = (f32[4,64]{1,0:T(4,128)}, f32[8,64]{1,0:T(8,128)}) all-gather-start(%h.6), channel_id=2, replica_groups=[2,2]<=[4], dimensions={0}, use_global_device_ids=true
  %all-gather-done.1 = f32[8,64]{1,0:T(8,128)} all-gather-done(%all-gather-start.1)
  %positive = pred[]{:T(512)} compare(%i.5, %i.5), direction=EQ
  %h.7 = f32[8,64]{1,0:T(8,128)} conditional(%positive, %all-gather-done.1, %h.6), true_computation=%on_true, false_computation=%on_false
  %copy-start.2 = (f32[8,64]{1,0:T(8,128)}, f32[8,64]{1,0:T(8,128)S(3)}, u32[]{:S(2)}) copy-start(%copy-done.1), control-predecessors={%all-reduce.1}
  %copy-done.2 = f32[8,64]{1,0:T(8,128)} copy-done(%copy-start.2)
  %copy.2 = bf16[8,128,64]{2,1,0:T(8,128)(2,1)} copy(%cache.2)
  %copy.3 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} copy(%copy.2)
  ROOT %s.2 = (s32[]{:T(128)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, /*index=2*/f32[8,64]{1,0:T(8,128)}) tuple(%i.5, %copy.3, %h.7)
}

%condition (s.3: (s32[], bf16[8,128,64], f32[8,64])) -> pred[] {
  %s.3 = (s32[]{:T(128)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, /*index=2*/f32[8,64]{1,0:T(8,128)}) parameter(0)
  %i.6 = s32[]{:T(128)} get-tuple-element(%s.3), index=0
  %five = s32[]{:T(128)} constant(5)
  ROOT %lt.2 = pred[]{:T(512)} compare(%i.6, %five), direction=LT
}

ENTRY %main (cache.1: bf16[8,128,64]) -> bf16[8,128,64] {
  %cache.1 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)} parameter(0), metadata={op_name="cache"}
  %zeros = f32[]{:T(128)} constant(0)
  %broadcast.1 = f32[8,64]{1,0:T(8,128)} broadcast(%zeros), dimensions={}
  %copy.4 = f32[8,64]{1,0:T(8,128)} copy(%broadcast.1)
  %copy-start.3 = (bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%cache.1)
  %copy-done.3 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} copy-done(%copy-start.3)
  %start = s32[]{:T(128)} constant(0)
  %s.4 = (s32[]{:T(128)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, /*index=2*/f32[8,64]{1,0:T(8,128)}) tuple(%start, %copy-done.3, %copy.4)
  %while.1 = (s32[]{:T(128)}, bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, /*index=2*/f32[8,64]{1,0:T(8,128)}) while(%s.4), condition=%condition, body=%body
  ROOT %result = bf16[8,128,64]{2,0,1:T(8,128)(2,1)} get-tuple-element(%while.1), index=1
}
"""
CACHE_DIMS = (8, 128, 64)
CACHE_ELEMENTS = 8 * 128 * 64


def _nested_loops(x, y):
  """x [16, 16] runs through two inner loops (one inside a conditional); y [40, 48] is transposed in place
  on every outer step; the result's y is transposed once more, outside the loops."""
  def inner(carry):
    i, a = carry
    return i + 1, jnp.sin(a) @ a.T

  def outer(carry):
    i, a, b = carry
    _, a = lax.while_loop(lambda c: c[0] < 3, inner, (0, a))
    a = lax.cond(i % 2 == 0, lambda t: lax.while_loop(lambda c: c[0] < 2, inner, (0, t))[1], lambda t: t + 1, a)
    return i + 1, a, b.T.reshape(b.shape) * 2

  _, x, y = lax.while_loop(lambda c: c[0] < 5, outer, (0, x, y))
  return x, y.T + 1


def _cpu_text(f, *args, **jit_kwargs) -> str:
  return jax.jit(f, **jit_kwargs).lower(*args).compile().as_text()


@pytest.fixture(scope="module")
def cpu_program() -> hlo.Program:
  return hlo.parse(_cpu_text(_nested_loops, jnp.ones((16, 16)), jnp.ones((40, 48))))


@pytest.fixture(scope="module")
def tpu_style() -> hlo.Program:
  return hlo.parse(TPU_STYLE)


def test_parse_shapes_reads_dtype_dims_layout_tiling_and_memory_space():
  scalar, cache, context = hlo.parse_shapes(
      "(s32[]{:T(128)}, /*index=1*/bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}, u32[]{:S(2)})")
  assert scalar == hlo.Shape("s32", (), (), "T(128)", 0)
  assert cache == hlo.Shape("bf16", CACHE_DIMS, (2, 0, 1), "T(8,128)(2,1)", 3)
  assert (cache.elements, cache.bytes, str(cache)) == (CACHE_ELEMENTS, 2 * CACHE_ELEMENTS,
                                                       "bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)}")
  assert context.memory_space == 2 and context.elements == 1
  plain, = hlo.parse_shapes("f32[8,6,32000]{2,1,0}")
  assert (plain.dims, plain.layout, plain.memory_space, plain.bytes) == ((8, 6, 32000), (2, 1, 0), 0, 4 * 8 * 6 * 32000)
  assert hlo.parse_shapes("f32[3]")[0].layout is None
  assert [hlo.dtype_bits(d) for d in ("pred", "s8", "bf16", "f16", "f32", "u32", "s64", "f8e4m3fn", "s4", "c64")] == [
      8, 8, 16, 16, 32, 32, 64, 8, 4, 64]
  assert hlo.parse_shapes("s4[3]")[0].bytes == 2


def test_parse_reads_instructions_of_the_tpu_text_format(tpu_style):
  assert tpu_style.entry == "main"
  assert list(tpu_style.computations) == ["add", "relayout", "attention", "inner_body", "inner_condition", "on_true",
                                          "on_false", "body", "condition", "main"]
  i = tpu_style.instructions
  assert (i["while.1"].op, i["while.1"].calls) == ("while", {"condition": ("condition",), "body": ("body",)})
  assert i["while.1"].is_tuple and [s.dims for s in i["while.1"].shapes] == [(), CACHE_DIMS, (8, 64)]
  assert i["h.7"].calls == {"true_computation": ("on_true",), "false_computation": ("on_false",)}
  assert i["h.7"].operands == ("positive", "all-gather-done.1", "h.6")
  # In a branch: the false branch's copy and the true branch's loop; not the loop's own body, nor h.7.
  assert i["copy.5"].conditional and i["while.2"].conditional and not i["h.7"].conditional
  assert not i["transpose.1"].conditional and not i["copy.2"].conditional
  assert i["all-reduce.1"].calls == {"to_apply": ("add",)}          # the mesh replica groups are skipped
  assert i["copy-start.2"].calls == {}                              # control predecessors name no computation
  assert i["copy-start.1"].op == "copy-start" and i["copy-done.1"].operands == ("copy-start.1",)
  assert i["scores"].op_name == "jit(step)/while/body/dot_general" and i["scores"].calls == {"calls": ("attention",)}
  assert i["result"].root and i["result"].computation == "main" and i["result"].shape.dims == CACHE_DIMS
  # Fused: the attention fusion's work and its relayout, the reducer; not the loop body's own copies.
  assert [name for name, x in i.items() if x.fused] == ["x", "y", "sum", "param_0", "copy.1", "param_0.1", "param_1",
                                                        "fusion.1", "convolution.1"]
  with pytest.raises(ValueError, match="ENTRY"):
    hlo.parse("HloModule empty\n")


def test_loops_nest_through_conditionals_in_program_order(tpu_style, cpu_program):
  assert hlo.loops(tpu_style) == [
      hlo.Loop("while.1", "main", "body", "condition", depth=0, parent=None, trip_count=None),
      hlo.Loop("while.2", "on_true", "inner_body", "inner_condition", depth=1, parent="while.1", trip_count=3)]
  outer, *inner = hlo.loops(cpu_program)
  assert (outer.depth, outer.parent, outer.trip_count, outer.computation) == (0, None, 5, cpu_program.entry)
  # One inner loop in the body itself, one in a branch of the conditional: both nested in the outer loop.
  assert sorted((loop.depth, loop.parent, loop.trip_count) for loop in inner) == [
      (1, outer.name, 2), (1, outer.name, 3)]
  assert all(cpu_program.instructions[loop.name].op == "while" for loop in inner)


def test_scopes_split_the_program_and_stop_at_nested_loops(tpu_style, cpu_program):
  body = [x.name for x in hlo.scope_ops(tpu_style, "body")]
  assert "convolution.1" in body and "copy.1" in body and "sum" in body    # fusion, its nested fusion, reducer
  assert "while.2" in body and "h.4" in body                                # the conditional's true branch
  assert "transpose.1" not in body                                          # the nested loop's own scope
  for program in (tpu_style, cpu_program):
    scopes = [program.entry] + [name for loop in hlo.loops(program) for name in (loop.body, loop.condition)]
    seen = [id(x) for scope in scopes for x in hlo.scope_ops(program, scope)]
    assert len(seen) == len(set(seen)) == len(program.instructions)          # every instruction in one scope
  with pytest.raises(KeyError):
    hlo.scope_ops(tpu_style, "nowhere")


def test_count_moves_tells_materialized_fused_and_async_copies_apart(tpu_style):
  outer, inner = hlo.loops(tpu_style)
  cache_bytes = 2 * CACHE_ELEMENTS
  assert hlo.count_moves(tpu_style, outer, CACHE_ELEMENTS) == hlo.MoveCounts(
      materialized=(2, 2 * cache_bytes), fused=(1, cache_bytes))
  small = hlo.count_moves(tpu_style, outer, shape_filter=lambda dims: dims == (8, 64))
  assert small.materialized == (1, 8 * 64 * 4) and small.fused == (0, 0)       # the false branch's copy
  branch = hlo.count_moves(tpu_style, outer, shape_filter=lambda dims: dims == (8, 64), branches=True)
  assert branch == hlo.MoveCounts(materialized=(1, 8 * 64 * 4))
  always = hlo.count_moves(tpu_style, outer, shape_filter=lambda dims: dims == (8, 64), branches=False)
  assert always.materialized == (0, 0) and always.async_copies == small.async_copies
  assert small.async_copies == (2, 2 * 8 * 64 * 4)
  assert small.async_directions == {"HBM->S(3)": (1, 8 * 64 * 4), "S(3)->HBM": (1, 8 * 64 * 4)}
  assert hlo.count_moves(tpu_style, inner).materialized == (1, 64 * 8 * 4)        # the inner loop's transpose
  entry = hlo.count_moves(tpu_style, tpu_style.entry, CACHE_ELEMENTS)
  assert entry.async_directions == {"HBM->S(3)": (1, cache_bytes)} and entry.materialized == (0, 0)
  assert hlo.count_moves(tpu_style, outer, CACHE_ELEMENTS, hlo.dims_contain(129)) == hlo.MoveCounts()


def test_collectives_count_asynchronous_ones_once(tpu_style):
  outer, inner = hlo.loops(tpu_style)
  assert hlo.collectives(tpu_style, outer) == {"all-gather": (1, 8 * 64 * 4), "all-reduce": (1, 8 * 128 * 4)}
  assert hlo.collectives(tpu_style, inner) == {} == hlo.collectives(tpu_style, tpu_style.entry)


def test_moves_on_a_cpu_program_with_loops(cpu_program):
  outer, *inner = hlo.loops(cpu_program)
  transposed, kept = (lambda dims: dims == (48, 40)), (lambda dims: dims == (40, 48))
  # y is transposed on every outer step (a fused transpose) and written back in its layout (a copy).
  in_loop = hlo.count_moves(cpu_program, outer, shape_filter=transposed)
  assert in_loop.fused.count >= 1 and in_loop.fused.bytes == in_loop.fused.count * 40 * 48 * 4
  assert hlo.count_moves(cpu_program, outer, shape_filter=kept).materialized.count >= 1
  assert hlo.count_moves(cpu_program, cpu_program.entry, shape_filter=transposed).materialized.count >= 1
  for loop in inner:   # [16, 16] matmuls only
    assert hlo.moves(cpu_program, 1000, scope=loop) == []
  assert hlo.count_moves(cpu_program, outer).async_copies == (0, 0) and hlo.collectives(cpu_program, outer) == {}


def test_moves_finds_a_cache_kept_alive_not_one_updated_in_place():
  """The check `tests/decoding/test_compiled.py` makes of decode programs, on a cache [2, 2, 64, 16]."""
  cache, row = jnp.zeros((2, 2, 64, 16)), jnp.ones((2, 2, 1, 16))

  def keep_both(cache, row):
    return cache, lax.dynamic_update_slice(cache, row, (0, 0, 3, 0))

  def update(cache, row):
    return lax.dynamic_update_slice(cache, row, (0, 0, 3, 0))

  kept = hlo.parse(_cpu_text(keep_both, cache, row))
  lines = hlo.moves(kept, cache.size)
  assert lines and all(" copy(" in line or " transpose(" in line for line in lines)
  assert hlo.moves(kept, cache.size + 1) == []
  assert hlo.moves(hlo.parse(_cpu_text(update, cache, row, donate_argnums=0)), cache.size) == []


def test_moves_leaves_out_copies_of_an_initial_value(tpu_style):
  def two_zero_caches(x):
    zeros = jnp.zeros((64, 64))
    return zeros, zeros + 0, x

  program = hlo.parse(_cpu_text(two_zero_caches, jnp.ones(3)))
  assert hlo.moves(program, 64 * 64) == [] and len(hlo.moves(program, 64 * 64, skip_initial_values=False)) == 1
  everywhere = hlo.moves(tpu_style, 8 * 64)
  assert "%copy.4 = f32[8,64]{1,0:T(8,128)} copy(%broadcast.1)" not in everywhere
  assert len(everywhere) == 5 and len(hlo.moves(tpu_style, 8 * 64, include_fused=False)) == 4
  outer = hlo.loops(tpu_style)[0]
  assert hlo.moves(tpu_style, CACHE_ELEMENTS, scope=outer, include_fused=False) == [
      "%copy.2 = bf16[8,128,64]{2,1,0:T(8,128)(2,1)} copy(%cache.2)",
      "%copy.3 = bf16[8,128,64]{2,0,1:T(8,128)(2,1)S(3)} copy(%copy.2)"]


def test_summary_rows_are_json_scope_by_scope(tpu_style, cpu_program):
  rows = hlo.summary(tpu_style, min_elements=8 * 64, selectors={"cache": hlo.dims_contain(128),
                                                                "rows": hlo.dims_end_with((8, 64))})
  assert json.loads(json.dumps(rows)) == rows
  assert [(r["scope"], r["depth"], r["parent"], r["trip_count"]) for r in rows] == [
      ("outside loops", -1, None, None), ("while.1", 0, None, None), ("while.2", 1, "while.1", 3)]
  loop = rows[1]
  assert (loop["cache"]["materialized"], loop["cache"]["fused"], loop["cache"]["async"]) == (2, 1, 0)
  assert loop["rows"]["async_directions"] == {"HBM->S(3)": {"count": 1, "bytes": 2048},
                                              "S(3)->HBM": {"count": 1, "bytes": 2048}}
  assert loop["collectives"]["all-reduce"] == {"count": 1, "bytes": 4096}
  assert (loop["rows"]["materialized"], loop["rows"]["in_branches"]["materialized"]) == (1, 1)
  assert loop["cache"]["in_branches"]["materialized"] == 0
  assert rows[0]["rows"]["materialized"] == 1                  # ENTRY's copy of a broadcast counts here
  assert [r["scope"] for r in hlo.summary(cpu_program)][:2] == ["outside loops", hlo.loops(cpu_program)[0].name]
  with pytest.raises(ValueError, match="clash"):
    hlo.summary(tpu_style, selectors={"depth": hlo.dims_contain(8)})


# --- TPU v4, compile-only (libtpu) ---------------------------------------------------------------------------

def _decode_like(cache, w):
  """A loop like the decode loop: an inner loop of matmuls, attention over a bf16 cache [B, T, D], one slot
  of the cache written per step, a conditional."""
  def inner(carry):
    i, h = carry
    return i + 1, jnp.tanh(h @ w)

  def outer(carry):
    i, cache, h = carry
    _, h = lax.while_loop(lambda c: c[0] < 3, inner, (0, h))
    scores = jnp.einsum("bd,btd->bt", h, cache)
    cache = lax.dynamic_update_slice(cache, h[:, None, :].astype(cache.dtype), (0, i, 0))
    h = lax.cond(i % 2 == 0, lambda t: t * 2, lambda t: t + scores.sum(), h)
    return i + 1, cache, h

  _, cache, h = lax.while_loop(lambda c: c[0] < 5, outer, (0, cache, cache[:, 0, :].astype(jnp.float32)))
  return cache, h


@pytest.fixture(scope="module")
def tpu_programs(v4_8) -> dict[str, hlo.Program]:
  """The decode-like loop compiled for one TPU v4 chip and for a (2, 2) mesh of four."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
  devices = v4_8.devices
  one = SingleDeviceSharding(devices[0])
  mesh = Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
  layouts = {"chip": (one, one), "mesh": (NamedSharding(mesh, PartitionSpec("data", None, "model")),
                                          NamedSharding(mesh, PartitionSpec("model", None)))}
  programs = {}
  for label, (cache_sharding, w_sharding) in layouts.items():
    cache = jax.ShapeDtypeStruct(CACHE_DIMS, jnp.bfloat16, sharding=cache_sharding)
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=w_sharding)
    programs[label] = hlo.parse(jax.jit(_decode_like).lower(cache, w).compile().as_text())
  return programs


def test_tpu_program_relayouts_the_cache_in_its_attention_fusion(tpu_programs):
  program = tpu_programs["chip"]
  outer, inner = hlo.loops(program)
  assert (outer.depth, inner.depth, inner.parent) == (0, 1, outer.name)
  cache = hlo.count_moves(program, outer, CACHE_ELEMENTS, hlo.dims_contain(128))
  # No copy of the cache to a buffer of its own: one relayout inside the attention dot's fusion.
  assert cache.materialized == (0, 0) and cache.fused.count >= 1
  assert hlo.moves(program, CACHE_ELEMENTS, scope=outer, include_fused=False) == []
  # Memory-space assignment moves arrays between HBM and S(3) with copy-start/copy-done pairs.
  directions = {d for scope in [program.entry, outer, inner]
                for d in hlo.count_moves(program, scope).async_directions}
  assert "HBM->S(3)" in directions
  starts = [x for x in program.instructions.values() if x.op == "copy-start"]
  assert starts and all(len(x.shapes) == 3 and x.shapes[0].dims == x.shapes[1].dims for x in starts)


def test_tpu_mesh_program_reduces_inside_both_loops(tpu_programs):
  program = tpu_programs["mesh"]
  outer, inner = hlo.loops(program)
  assert hlo.collectives(program, inner)["all-reduce"].count >= 1       # w split over 'model' in h @ w
  assert hlo.collectives(program, outer)["all-reduce"].count >= 1       # the einsum over the split D
  rows = hlo.summary(program, min_elements=CACHE_ELEMENTS // 4, selectors={"cache": hlo.dims_contain(128)})
  assert json.loads(json.dumps(rows)) == rows and rows[1]["cache"]["materialized"] == 0


def test_padded_bytes_follow_the_tpu_tiling():
  """A tile T(a,b) pads the two minor-most physical dims (the layout's first two) to multiples of a, b."""
  def padded(text):
    return hlo.parse_shapes(text)[0].padded_bytes
  assert padded("bf16[8,2,134,128]{3,2,1,0:T(8,128)(2,1)}") == 8 * 2 * 136 * 128 * 2
  assert padded("bf16[8,2,134,128]{3,1,2,0:T(2,128)(2,1)}") == 8 * 2 * 134 * 128 * 2     # H=2 is the tiled dim
  assert padded("bf16[8,4,134,64]{3,2,1,0:T(8,128)(2,1)}") == 8 * 4 * 136 * 128 * 2      # head_dim 64: 2x
  assert padded("u32[8]{0:T(128)}") == 128 * 4
  assert padded("f32[8,6]{1,0}") == 8 * 6 * 4                                               # no tiling


def test_entry_parameters_tell_the_arguments_a_program_reads():
  import jax
  import jax.numpy as jnp
  # keep_unused: jit would drop the unused argument itself (a program may still keep parameters it never
  # reads, e.g. under donation or a sharding annotation).
  text = jax.jit(lambda used, unused: used * 2, keep_unused=True).lower(jnp.ones((4, 8)), jnp.ones((16,)))
  text = text.compile().as_text()
  program = hlo.parse(text)
  assert [p.shapes[0].dims for p in hlo.entry_parameters(program)] == [(4, 8), (16,)]
  assert [p.shapes[0].dims for p in hlo.entry_parameters(program, used_only=True)] == [(4, 8)]
