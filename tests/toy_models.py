"""A tiny model behind the `specdec.models.base` interface, for exact law tests of the decode loops.

Its logits after position t depend on (t, x_{t−1}, x_t) through a random table, and it keeps a real
token cache, so a wrong rollback (a stale draft read back) or an off-by-one position changes its output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec.models.base import Cache


@struct.dataclass
class PositionalTrigram:
  table: jax.Array                                  # [max_length, V, V, V] logits
  max_length: int = struct.field(pytree_node=False)

  @classmethod
  def random(cls, seed: int, vocab_size: int, max_length: int = 64, scale: float = 1.5):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(max_length, vocab_size, vocab_size, vocab_size)) * scale
    return cls(table=jnp.asarray(table, jnp.float32), max_length=max_length)

  @property
  def vocab_size(self) -> int:
    return self.table.shape[-1]

  def logits(self, tokens):
    positions = jnp.arange(tokens.shape[1])
    previous = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
    return self.table[positions[None], previous, tokens]

  def init_cache(self, batch_size, cache_length):
    return Cache(kv=jnp.zeros((batch_size, cache_length), jnp.int32),
                 lengths=jnp.zeros((batch_size,), jnp.int32))

  def score(self, cache, tokens):
    batch, n = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(n)
    rows = jnp.arange(batch)[:, None]
    written = cache.kv.at[rows, positions].set(tokens, mode="drop")
    previous = jnp.where(positions > 0, written[rows, jnp.maximum(positions - 1, 0)], 0)
    logits = self.table[jnp.minimum(positions, self.max_length - 1), previous, tokens]
    return logits, Cache(kv=written, lengths=cache.lengths + n)
