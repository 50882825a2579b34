"""The model interface every decode loop uses (layer 2). Loops never know which network they drive.

A `Model` is a pytree: its parameters are leaves (so a jitted loop takes them as arguments, never as
baked-in constants) and everything else is static. The cached path keeps one KV cache per model with a
per-row length:

  cache = model.init_cache(batch_size, cache_length)
  logits, cache = model.score(cache, tokens)     # [B, n] new tokens at positions lengths[b] + i
  cache = rollback(cache, lengths)               # a length reset; stale entries are masked, never copied

`score` writes the n tokens' keys/values at positions lengths[b] … lengths[b]+n−1 of each row, attends
causally to everything before them in that row, returns the next-token logits after each of them
[B, n, V], and advances lengths by n. n = 1 is a decode step, n = γ+1 a verification. Entries at
positions ≥ lengths are never read before being overwritten, which is why a rollback is free.

Multi-draft methods (`decoding.multi_draft`) score a token tree in one call (`score(…, positions=,
tree_mask=)`) and then keep one path of it: they also need

  cache = model.copy_slots(cache, source_rows [B], source_slots [B, n], target_slots [B, n])

(row b's entries at target_slots[b] become row source_rows[b]'s entries at source_slots[b]; lengths stay).

The prompt is the decoder's prefix by default: `prefill` scores it into the cache. An encoder-decoder
(`t5.T5`) reads its prompt as the encoder input instead: it supplies its own `prefill` (encode, pending
decoder start token, lengths 0) and a `prompt_cache_positions` (1: its decoder cache never holds the prompt).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class Cache:
  """Per-model decoding state: the network's key/value arrays and the number of valid entries per row."""
  kv: Any           # network-specific pytree, e.g. keys/values [layers, B, cache_length, heads, head_dim]
  lengths: Array    # [B] int32: entries [0, lengths[b]) of row b are valid


def rollback(cache: Cache, lengths: Array) -> Cache:
  """Resets every row's length (KV-cache rollback is a length reset, not a copy)."""
  return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


class Model(Protocol):
  """What a decode loop needs from a drafter or a verifier (decoder-only or encoder-decoder)."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def max_length(self) -> int:
    """The largest cache length (positions) the network supports."""
    ...

  def logits(self, tokens: Array) -> Array:
    """Teacher-forced logits [B, L, V] of tokens [B, L]: logits[:, t] is the next-token distribution
    after tokens[:, :t+1]."""
    ...

  def init_cache(self, batch_size: int, cache_length: int) -> Cache:
    """An empty cache (lengths 0) holding up to `cache_length` positions per row."""
    ...

  def score(self, cache: Cache, tokens: Array) -> tuple[Array, Cache]:
    """Appends tokens [B, n] at each row's length; returns their next-token logits [B, n, V]."""
    ...


def prefill(model: Model, cache: Cache, prompts: Array, prompt_lengths: Array) -> tuple[Array, Cache]:
  """Writes each row's prompt[:prompt_lengths[b] − 1] into an empty cache. [B, L], [B] -> (last [B], cache).

  The last prompt token is returned as the row's pending token: the decode loops keep the last emitted
  token out of the cache and score it first, so every step's logits come from one `score` call. Prompts
  are scored padded to L (one call for the batch) and rolled back to their own lengths. A model with its
  own `prefill` (an encoder-decoder) does it its way.
  """
  if hasattr(model, "prefill"):
    return model.prefill(cache, prompts, prompt_lengths)
  _, cache = model.score(cache, prompts)
  rows = jnp.arange(prompts.shape[0])
  last = prompts[rows, prompt_lengths - 1]
  return last.astype(jnp.int32), rollback(cache, prompt_lengths - 1)


def prompt_cache_positions(model: Model, prompt_width: int) -> int:
  """Cache positions that prompts padded to `prompt_width` take: the width, or the model's own
  `prompt_cache_positions` (an encoder-decoder's prompt is its encoder input)."""
  return getattr(model, "prompt_cache_positions", prompt_width)
