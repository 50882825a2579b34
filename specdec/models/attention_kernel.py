"""Attention over a slot-major KV cache by a Pallas TPU kernel: the cache is read where it lies.

The per-row slot writes of a decode loop want a slot's K × D entries together: the cache is kept slot-major,
one [C, B, K·D] array per layer (`base.empty_cache`, layout "slots"). XLA's attention dot wants each key
head's [C, D] as whole tiles, so with it the TPU compiler relayouts every layer's keys and values inside the
attention fusion on every call with more than one query per key head (a verification, or any call of a model
with grouped queries; experiments/tpu_v4_plan). This kernel reads a key head's keys and values as a column
block of the array seen as [C, B·K·D] (heads narrower than 128 lanes a few at a time, so a block is whole lanes):
there is no layout for XLA to change, and no padding of narrow heads to 128 lanes.

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


def vmem_bytes(n: int, cache_length: int, *, key_heads: int, groups: int, head_dim: int, itemsize: int,
               has_bias: bool) -> int:
  """What one grid step of `attend` holds in VMEM for n queries per query head over `cache_length` slots, as
  Mosaic stores it (sublanes rounded up to whole tiles: 8 rows of 32 bits, 16 of 16; lanes to 128): its blocks
  (queries, output, keys, values, the visible mask, the bias), each double-buffered by Pallas's pipeline, and
  one head's intermediates over [G·n, C] — the repeated mask and its booleans, the float32 scores, masked
  scores, exponentials and weights, the weights in the values' dtype — and its keys transposed."""
  per_block = heads_per_block(key_heads, head_dim)
  sublanes = 32 // (8 * itemsize) * 8        # rows per tile of this dtype: 8 (float32), 16 (bfloat16)
  rows, wide_rows = _tiled(groups * n, 8), _tiled(groups * n, sublanes)
  slots, lanes = _tiled(cache_length, sublanes), _tiled(cache_length, 128)
  blocks = (2 * per_block * wide_rows * head_dim * itemsize + 2 * slots * per_block * head_dim * itemsize
            + _tiled(n, 8) * lanes * 4 + (per_block * rows * lanes * 4 if has_bias else 0))
  intermediates = rows * lanes * (4 + 1 + 4 * 4) + wide_rows * lanes * itemsize + head_dim * lanes * itemsize
  return 2 * blocks + intermediates


def takes(n: int, cache_length: int, *, key_heads: int, groups: int, head_dim: int, itemsize: int,
          has_bias: bool) -> bool:
  """Whether `attend` takes this call: its heads have a block of whole lanes (`reads_in_place`) and a grid
  step fits `VMEM_BUDGET`. A decode step or a verification does; a long prompt's prefill (2,048 queries over
  2,370 slots: 39 MB of visible mask alone) does not, and is attended by XLA (the kernel does not tile the
  queries: it is built for the loop's few)."""
  return reads_in_place(key_heads, head_dim) and vmem_bytes(
      n, cache_length, key_heads=key_heads, groups=groups, head_dim=head_dim, itemsize=itemsize,
      has_bias=has_bias) <= VMEM_BUDGET


def attend(query: Array, keys: Array, values: Array, visible: Array, *, key_heads: int, bias: Array | None = None,
           soft_cap: float | None = None, interpret: bool = False) -> Array:
  """Masked softmax attention over a slot-major cache: query [B, n, H, D], keys and values [C, B, K·D] (K =
  `key_heads`; H = K·G: query head k·G + g reads key head k), visible [B, n, C], `bias` [B|1, H, n, C] added to
  the logits, `soft_cap` c: logits → c·tanh(logits / c). Returns [B, n, H, D], as `base.attend` on the same
  cache in the head-major layout."""
  b, n, h, d = query.shape
  c, k = keys.shape[0], key_heads
  g = h // k
  per_block = heads_per_block(k, d)
  # Per key head, its G query heads' n queries as rows g·n + i: [B, K, G·n, D] (small arrays: the queries).
  grouped = query.reshape(b, n, k, g, d).transpose(0, 2, 3, 1, 4).reshape(b, k, g * n, d)
  rows = pl.BlockSpec((None, per_block, g * n, d), lambda i, j: (i, j, 0, 0))
  # [C, B, K·D] seen as [C, B·K·D]: row i's head block j is column block i·(K / per_block) + j.
  blocks = k // per_block
  cache = pl.BlockSpec((c, per_block * d), lambda i, j: (0, i * blocks + j))
  inputs = [grouped, keys.reshape(c, b * k * d), values.reshape(c, b * k * d), visible.astype(jnp.int32)]
  specs = [rows, cache, cache, pl.BlockSpec((None, n, c), lambda i, j: (i, 0, 0))]
  if bias is not None:
    shared = bias.shape[0] == 1
    inputs.append(bias.astype(jnp.float32).reshape(bias.shape[0], k, g * n, c))
    specs.append(pl.BlockSpec((None, per_block, g * n, c), lambda i, j: (0 if shared else i, j, 0, 0)))
  kernel = functools.partial(_kernel, per_block=per_block, head_dim=d, groups=g, soft_cap=soft_cap,
                             has_bias=bias is not None)
  out = pl.pallas_call(kernel, grid=(b, k // per_block), in_specs=specs, out_specs=rows,
                       out_shape=jax.ShapeDtypeStruct((b, k, g * n, d), values.dtype), interpret=interpret)(*inputs)
  return out.reshape(b, k, g, n, d).transpose(0, 3, 1, 2, 4).reshape(b, n, h, d)


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
  """One row's `per_block` key heads: q_ref [per_block, G·n, D], k_ref and v_ref [C, per_block·D] (the heads'
  columns), visible_ref [n, C], a bias_ref [per_block, G·n, C] if `has_bias`, o_ref [per_block, G·n, D]."""
  bias_ref, o_ref = refs if has_bias else (None, refs[0])
  visible = visible_ref[...]
  if groups > 1:   # row g·n + i sees what query i sees (int32: Mosaic does not concatenate boolean vectors)
    visible = jnp.concatenate([visible] * groups, axis=0)
  visible = visible > 0
  for j in range(per_block):
    columns = slice(j * head_dim, (j + 1) * head_dim)
    scores = jax.lax.dot_general(q_ref[j], k_ref[:, columns], (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)             # [G·n, C]
    if has_bias:
      scores = scores + bias_ref[j]
    if soft_cap is not None:
      scores = jnp.tanh(scores / soft_cap) * soft_cap
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    values = v_ref[:, columns]
    o_ref[j] = jnp.dot(weights.astype(values.dtype), values, preferred_element_type=jnp.float32).astype(o_ref.dtype)
