"""Random keys for a batch: one key for all rows, or one key per row.

The decode loops hold one key per row (`per_row`), so a row's draws depend only on the caller's key and
the row's id: the same prompt with the same key and id samples the same text alone or anywhere in any
batch. The layer-1 functions that draw (`sampling.sample`, `verify.verify_block`, `spectr`, `tree`) take
either form through `split` and `uniform`. A key is a raw uint32 key ([..., 2], `jax.random.PRNGKey`) or
a typed one (`jax.random.key`); its batch shape is the leading dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def batch_shape(key: Array) -> tuple[int, ...]:
  """The rows a key array holds keys for: () for a single key."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return tuple(key.shape)
  return tuple(key.shape[:-1])


def per_row(key: Array, row_ids: Array) -> Array:
  """One key per row [B, ...] from one key: row b's is fold_in(key, row_ids[b])."""
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(row_ids, jnp.uint32))


def expand(key: Array, copies: int) -> Array:
  """[B·copies] keys from row keys [B] (the layout of `IIDDrafts`' replicated rows): row b·copies is key[b]
  itself, so one copy draws as its row would, and row b·copies + c is fold_in(key[b], c). One key for all
  rows stays that key."""
  if not batch_shape(key):
    return key
  def copies_of(k: Array) -> Array:
    return jnp.concatenate([k[None], per_row(k, jnp.arange(1, copies))])
  return jax.vmap(copies_of)(key).reshape((-1,) + key.shape[1:])


def _rowwise(fn, key: Array, batch: tuple[int, ...]) -> Array:
  """fn(one key) for every key of a batch of keys, stacked on the batch shape."""
  flat = key.reshape((-1,) + key.shape[len(batch):])
  out = jax.vmap(fn)(flat)
  return out.reshape(batch + out.shape[1:])


def split(key: Array, num: int = 2) -> Array:
  """`jax.random.split` of each row's key: [num, *batch, ...], so `a, b = split(key)` works for both forms."""
  batch = batch_shape(key)
  if not batch:
    return jax.random.split(key, num)
  return jnp.moveaxis(_rowwise(lambda k: jax.random.split(k, num), key, batch), len(batch), 0)


def uniform(key: Array, shape: Sequence[int], dtype=jnp.float32) -> Array:
  """U[0, 1) of `shape`; with row keys [*batch], `shape` starts with the batch shape and row b's values
  come from key[b] alone."""
  batch, shape = batch_shape(key), tuple(shape)
  if not batch:
    return jax.random.uniform(key, shape, dtype)
  if shape[:len(batch)] != batch:
    raise ValueError(f"a draw of shape {shape} with keys for rows {batch}: the shape must start with the rows")
  return _rowwise(lambda k: jax.random.uniform(k, shape[len(batch):], dtype), key, batch)
