"""Attention over a slot-major KV cache by a Pallas TPU kernel: the cache is read where it lies.

The per-row slot writes of a decode loop want a slot's K × D entries together: the cache is kept slot-major,
one [C, B, K·D] array per layer (`base.empty_cache`, layout "slots"). XLA's attention dot wants each key
head's [C, D] as whole tiles, so with it the TPU compiler relayouts every layer's keys and values inside the
attention fusion on every call with more than one query per key head (a verification, or any call of a model
with grouped queries; experiments/tpu_v4_plan). This kernel reads a key head's keys and values as a column
block of the array seen as [C, B·K·D] (heads narrower than 128 lanes a few at a time, so a block is whole lanes):
there is no layout for XLA to change, and no padding of narrow heads to 128 lanes. A grid step takes one row's
block of key heads for all of a call's queries, or for a block of them where that would not fit a chip's VMEM
(a long prompt's prefill: `query_block`).

`attend` computes what `models.base.attend` computes (float32 logits and softmax, weights in the values'
dtype) for the slot-major layout, with Pallas's interpreter on any backend (`interpret=True`: the tests) and
compiled by Mosaic for TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

Array = jax.Array
LANES = 128   # a TPU vector register's lane count: a block's minor dimension is a multiple of it, or all of it


def heads_per_block(key_heads: int, head_dim: int) -> int:
  """Key heads one grid step reads, so that its block of a row's K·D columns is whole 128-lane vregs: one head
  of 128·m lanes, or 128 / D heads narrower than that. Raises ValueError where no block is (3 heads of 64, 2 of
  32): `reads_in_place` says so beforehand."""
  if head_dim % LANES == 0:
    return 1
  if LANES % head_dim == 0 and key_heads % (LANES // head_dim) == 0:
    return LANES // head_dim
  raise ValueError(f"{key_heads} key heads of {head_dim} cannot be read in blocks of {LANES} lanes")


def reads_in_place(key_heads: int, head_dim: int) -> bool:
  """Whether the kernel takes caches of `key_heads` heads of `head_dim` (per device): `heads_per_block` has a
  block. Narrower caches (test models') are attended by XLA."""
  try:
    heads_per_block(key_heads, head_dim)
  except ValueError:
    return False
  return True


# Of the 16 MiB of VMEM a v4 kernel may use by default (libtpu's scoped limit), what a grid step's blocks and
# intermediates may take, the rest left to Mosaic.
VMEM_BUDGET = 12 * 2**20


def _tiled(size: int, tile: int) -> int:
  return -(-size // tile) * tile


def vmem_bytes(q: int, cache_length: int, *, key_heads: int, groups: int, head_dim: int, itemsize: int,
               has_bias: bool) -> int:
  """What one grid step of `attend` holds in VMEM for a block of q queries per query head over `cache_length`
  slots, as Mosaic stores it (sublanes rounded up to whole tiles: 8 rows of 32 bits, 16 of 16; lanes to 128):
  its blocks (queries, output, keys, values, the visible mask, the bias), each double-buffered by Pallas's
  pipeline, and one (head, group)'s intermediates over [q, C] — the mask and its booleans, the float32 scores,
  masked scores, exponentials and weights, the weights in the values' dtype — and its keys transposed."""
  per_block = heads_per_block(key_heads, head_dim)
  sublanes = 32 // (8 * itemsize) * 8        # rows per tile of this dtype: 8 (float32), 16 (bfloat16)
  rows, wide_rows = _tiled(q, 8), _tiled(q, sublanes)
  slots, lanes = _tiled(cache_length, sublanes), _tiled(cache_length, 128)
  blocks = (2 * per_block * groups * wide_rows * head_dim * itemsize + 2 * slots * per_block * head_dim * itemsize
            + rows * lanes * 4 + (per_block * groups * rows * lanes * 4 if has_bias else 0))
  intermediates = rows * lanes * (4 + 1 + 4 * 4) + wide_rows * lanes * itemsize + head_dim * lanes * itemsize
  return 2 * blocks + intermediates


def query_block(n: int, cache_length: int, *, key_heads: int, groups: int, head_dim: int, itemsize: int,
                has_bias: bool) -> int | None:
  """The queries a grid step of `attend` takes of a call's n: all of them where that fits `VMEM_BUDGET` (a
  decode step, a verification), else the most that do among the multiples of 8 that divide n (a long prompt's
  prefill: GSM8K's 2,048 tokens over 2,370 slots in blocks of 64 for Gemma 2's heads); None where no block
  fits, or where the heads have no block of whole lanes (`reads_in_place`): XLA attends that call."""
  if not reads_in_place(key_heads, head_dim):
    return None
  shape = dict(key_heads=key_heads, groups=groups, head_dim=head_dim, itemsize=itemsize, has_bias=has_bias)
  for q in [n] + [q for q in range(n - n % 8, 0, -8) if n % q == 0]:
    if vmem_bytes(q, cache_length, **shape) <= VMEM_BUDGET:
      return q
  return None


def takes(n: int, cache_length: int, *, key_heads: int, groups: int, head_dim: int, itemsize: int,
          has_bias: bool) -> bool:
  """Whether `attend` takes a call of n queries: `query_block` has a block for it."""
  return query_block(n, cache_length, key_heads=key_heads, groups=groups, head_dim=head_dim, itemsize=itemsize,
                     has_bias=has_bias) is not None


def attend(query: Array, keys: Array, values: Array, visible: Array, *, key_heads: int, bias: Array | None = None,
           soft_cap: float | None = None, block: int | None = None, interpret: bool = False) -> Array:
  """Masked softmax attention over a slot-major cache: query [B, n, H, D], keys and values [C, B, K·D] (K =
  `key_heads`; H = K·G: query head k·G + g reads key head k), visible [B, n, C], `bias` [B|1, H, n, C] added to
  the logits, `soft_cap` c: logits → c·tanh(logits / c). Returns [B, n, H, D], as `base.attend` on the same
  cache in the head-major layout. `block`: the queries per grid step (default `query_block`'s; it divides n)."""
  b, n, h, d = query.shape
  c, k = keys.shape[0], key_heads
  g = h // k
  per_block = heads_per_block(k, d)
  if block is None:
    block = query_block(n, c, key_heads=k, groups=g, head_dim=d, itemsize=keys.dtype.itemsize,
                        has_bias=bias is not None) or n
  if n % block:
    raise ValueError(f"a block of {block} queries does not divide the call's {n}")
  # Grid (row, block of key heads, block of queries). Queries as [B, K, G, n, D]: a step takes its heads' G
  # query heads for its queries.
  grouped = query.reshape(b, n, k, g, d).transpose(0, 2, 3, 1, 4)
  rows = pl.BlockSpec((None, per_block, g, block, d), lambda i, j, t: (i, j, 0, t, 0))
  # [C, B, K·D] seen as [C, B·K·D]: row i's head block j is column block i·(K / per_block) + j, the same for
  # every block of queries (the pipeline reads it once per (row, heads)).
  blocks = k // per_block
  cache = pl.BlockSpec((c, per_block * d), lambda i, j, t: (0, i * blocks + j))
  inputs = [grouped, keys.reshape(c, b * k * d), values.reshape(c, b * k * d), visible.astype(jnp.int32)]
  specs = [rows, cache, cache, pl.BlockSpec((None, block, c), lambda i, j, t: (i, t, 0))]
  if bias is not None:
    shared = bias.shape[0] == 1
    inputs.append(bias.astype(jnp.float32).reshape(bias.shape[0], k, g, n, c))
    specs.append(pl.BlockSpec((None, per_block, g, block, c), lambda i, j, t: (0 if shared else i, j, 0, t, 0)))
  kernel = functools.partial(_kernel, per_block=per_block, head_dim=d, groups=g, soft_cap=soft_cap,
                             has_bias=bias is not None)
  # What XLA's cost analysis (and so a plan's flops) counts for the call: the two products per query and slot,
  # the exponentials (and the soft cap's tanh), and every input and the output read or written once.
  scored = b * h * n * c
  moved = sum(x.size * x.dtype.itemsize for x in inputs) + query.size * values.dtype.itemsize
  cost = pl.CostEstimate(flops=4 * scored * d, transcendentals=scored * (1 if soft_cap is None else 2),
                         bytes_accessed=moved)
  out = pl.pallas_call(kernel, grid=(b, blocks, n // block), in_specs=specs, out_specs=rows,
                       out_shape=jax.ShapeDtypeStruct((b, k, g, n, d), values.dtype), cost_estimate=cost,
                       interpret=interpret)(*inputs)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, n, h, d)


def local_key_heads(key_heads: int) -> int:
  """Key heads per device in a program traced on a mesh (`on_mesh` splits them over 'model' where it
  divides them)."""
  from specdec.models.partitioning import MODEL
  mesh = jax.sharding.get_abstract_mesh()
  split = not mesh.empty and MODEL in mesh.shape and key_heads % mesh.shape[MODEL] == 0
  return key_heads // mesh.shape[MODEL] if split else key_heads


def on_mesh(query: Array, keys: Array, values: Array, visible: Array, *, bias: Array | None = None,
            soft_cap: float | None = None) -> Array:
  """`attend` (caches [C, B, K·D]) in a program traced on a mesh (`jax.sharding.use_abstract_mesh`): a
  Mosaic kernel is not partitioned by XLA, so each device runs it on its rows (over 'data') and key heads
  (over 'model') under `shard_map`, where the mesh divides them (else that axis holds them whole)."""
  from specdec.models.partitioning import DATA, MODEL
  d = query.shape[3]
  key_heads = keys.shape[2] // d
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend(query, keys, values, visible, key_heads=key_heads, bias=bias, soft_cap=soft_cap)
  rows = DATA if DATA in mesh.shape and query.shape[0] % mesh.shape[DATA] == 0 else None
  heads = MODEL if MODEL in mesh.shape and key_heads % mesh.shape[MODEL] == 0 else None
  specs = [P(rows, None, heads, None), P(None, rows, heads), P(None, rows, heads), P(rows, None, None)]
  if bias is not None:
    specs.append(P(rows if bias.shape[0] > 1 else None, heads, None, None))

  def local(query, keys, values, visible, bias=None):
    return attend(query, keys, values, visible, key_heads=keys.shape[2] // d, bias=bias, soft_cap=soft_cap)
  args = (query, keys, values, visible) + (() if bias is None else (bias,))
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=P(rows, None, heads, None),
                       check_vma=False)(*args)


def _kernel(q_ref, k_ref, v_ref, visible_ref, *refs, per_block: int, head_dim: int, groups: int,
            soft_cap: float | None, has_bias: bool) -> None:
  """One row's `per_block` key heads, q queries of each of their G query heads: q_ref [per_block, G, q, D],
  k_ref and v_ref [C, per_block·D] (the heads' columns), visible_ref [q, C], a bias_ref [per_block, G, q, C] if
  `has_bias`, o_ref [per_block, G, q, D]."""
  bias_ref, o_ref = refs if has_bias else (None, refs[0])
  visible = visible_ref[...] > 0
  for j in range(per_block):
    columns = slice(j * head_dim, (j + 1) * head_dim)
    keys, values = k_ref[:, columns], v_ref[:, columns]
    for group in range(groups):
      scores = jax.lax.dot_general(q_ref[j, group], keys, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)             # [q, C]
      if has_bias:
        scores = scores + bias_ref[j, group]
      if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
      scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
      weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
      o_ref[j, group] = jnp.dot(weights.astype(values.dtype), values,
                                preferred_element_type=jnp.float32).astype(o_ref.dtype)
