"""The model interface every decode loop uses (layer 2). Loops never know which network they drive.

A `Model` is a pytree: its parameters are leaves (so a jitted loop takes them as arguments, never as
baked-in constants) and everything else is static. The cached path keeps one KV cache per model with a
per-row length:

  cache = model.init_cache(batch_size, cache_length, layout)   # layout `cache_layout(platform)`, kept by the cache
  scored = model.score(cache, tokens)         # [B, n] new tokens at positions lengths[b] + i
  cache = rollback(cache, lengths)            # a length reset; stale entries are masked, never copied

`score` writes the n tokens' keys/values at positions lengths[b] … lengths[b]+n−1 of each row, attends
causally to everything before them in that row, and returns a `Scored` record: the next-token logits after
each of them [B, n, V], the cache with lengths advanced by n, and the last hidden states [B, n, E]. n = 1 is
a decode step, n = γ+1 a verification. Entries at positions ≥ lengths are never read before being
overwritten, which is why a rollback is free.

Multi-draft methods (`decoding.multi_draft`) score a token tree in one call (`score(…, positions=,
tree_mask=)`) and then keep one path of it: they also need

  cache = model.copy_slots(cache, source_rows [B], source_slots [B, n], target_slots [B, n])

(row b's entries at target_slots[b] become row source_rows[b]'s entries at source_slots[b]; lengths stay).

The prompt is the decoder's prefix by default: `prefill` scores it into the cache. An encoder-decoder
(`t5.T5`) reads its prompt as the encoder input instead: it declares `encoder_decoder = True` and supplies its
own `prefill` (encode, pending decoder start token, lengths 0) and `prompt_cache_positions` (1: its decoder
cache never holds the prompt). Capabilities are declared fields of `Model` (`encoder_decoder`,
`scores_trees`, `feature_access`), never guessed from which methods a model happens to have or from its class.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from specdec.models import partitioning

Array = jax.Array

CACHE_LAYOUTS = ("heads", "slots")


def cache_layout(platform: str | None = None) -> str:
  """The KV-cache layout of programs built for `platform` (None: this process's default backend): "slots" for
  TPU — one [C, B, K·D] array per layer, the layout the per-row slot writes want, read in place by
  `attention_kernel` (with XLA's attention dot the TPU compiler relayouts every layer's cache on every call:
  experiments/tpu_v4_plan) — else "heads", [B, K, C, D] (with [B, C, K, D] XLA:CPU transposed the whole cache
  in every layer of every call)."""
  return "slots" if (platform or jax.default_backend()) == "tpu" else "heads"


def check_layout(layout: str) -> str:
  """`layout` if it is one of `CACHE_LAYOUTS`, else ValueError."""
  if layout not in CACHE_LAYOUTS:
    raise ValueError(f"cache layout must be one of {CACHE_LAYOUTS}; got {layout!r}")
  return layout


@struct.dataclass
class Scored:
  """What `Model.score` returns. Inside a jitted program an unused field costs nothing."""
  logits: Array           # [B, n, V] the next-token logits after each scored token
  cache: "Cache"          # lengths advanced by n
  hidden: Array | None    # [B, n, E] the last hidden states (after the final norm); None for a model without


@struct.dataclass
class Cache:
  """Per-model decoding state: the network's key/value arrays and the number of valid entries per row."""
  kv: Any           # network-specific pytree, e.g. keys/values: one array per layer (`empty_cache`'s layouts)
  lengths: Array    # [B] int32: entries [0, lengths[b]) of row b are valid
  # The keys/values' layout (`CACHE_LAYOUTS`), set by `empty_cache`: static, so a program reads it, not ranks.
  layout: str = struct.field(pytree_node=False, default="heads")


def causal(batch_size: int, n: int) -> Array:
  """The causal mask of n tokens among themselves, [B, n, n]: token i sees j ≤ i."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch_size, n, n))


def visible_slots(lengths: Array, n: int, cache_length: int, tree_mask: Array | None = None) -> Array:
  """Which cache slots each of n new tokens sees once they are written at slots lengths[b] + j: [B, n, C].

  Token i of row b sees the committed slots s < lengths[b] and the new token j = s − lengths[b] where
  tree_mask[b, i, j] (default causal: j ≤ i); never a slot at or beyond lengths[b] + n (stale entries).
  A model that writes its new keys into the cache before attending over it reads its mask from here.
  """
  offset = jnp.arange(cache_length, dtype=jnp.int32)[None, None, :] - lengths[:, None, None]     # [B, 1, C]
  if tree_mask is None:
    return offset <= jnp.arange(n, dtype=jnp.int32)[None, :, None]
  b = lengths.shape[0]
  index = jnp.broadcast_to(jnp.clip(offset, 0, n - 1), (b, n, cache_length))
  new = jnp.take_along_axis(jnp.broadcast_to(tree_mask, (b, n, n)), index, axis=2)
  return (offset < 0) | ((offset < n) & new)


def key_positions(lengths: Array, positions: Array, cache_length: int) -> Array:
  """Each cache slot's position id once new tokens at position ids positions [B, n] are written at slots
  lengths[b] + j: a committed slot's id is its index, a new token's the caller's (a token tree gives
  siblings one id); slots beyond the new tokens repeat the last. [B], [B, n] -> [B, C]."""
  offset = jnp.arange(cache_length, dtype=jnp.int32)[None, :] - lengths[:, None]             # [B, C]
  new = jnp.take_along_axis(positions, jnp.clip(offset, 0, positions.shape[1] - 1), axis=1)
  return jnp.where(offset < 0, jnp.arange(cache_length, dtype=jnp.int32)[None, :], new)


def cache_slots(cache: Cache) -> int:
  """C, the slots of an `empty_cache` cache's keys/values in its layout ([B, K, C, D] or [C, B, K·D])."""
  keys = cache.kv["keys"][0]
  return keys.shape[0] if cache.layout == "slots" else keys.shape[2]


def attend(query: Array, keys: Array, values: Array, visible: Array, *, layout: str = "heads",
           bias: Array | None = None, soft_cap: float | None = None) -> Array:
  """Masked softmax attention of n queries over a cache: query [B, n, H, D], keys and values [B, K, C, D]
  (`layout` "heads") or [C, B, K·D] ("slots": `attention_kernel` on TPU) with H = K·G (G query heads per key
  head, grouped as head k·G + g), visible [B, n, C] (which keys each query sees), `bias` [B|1, H, n, C] added
  to the logits (T5's relative positions), `soft_cap` c: logits → c·tanh(logits / c) (Gemma 2). Logits and
  softmax in float32, weights in the values' dtype. Returns [B, n, H, D]. The query carries its own scale
  (models differ: 1/√D, a config scalar, or none)."""
  if check_layout(layout) == "slots":
    return _attend_slot_major(query, keys, values, visible, bias=bias, soft_cap=soft_cap)
  return _attend_head_major(query, [(keys, values, visible, bias)], soft_cap)


def attend_and_write(query: Array, key: Array, value: Array, cached: tuple[Array, Array, Array, str],
                     visible: Array, *, bias: Array | None = None, soft_cap: float | None = None
                     ) -> tuple[Array, Array, Array]:
  """n new tokens' attention over a cache with their own entries in it: key, value [B, n, K, D] are written at
  slots [B, n] of the cache (cached = (keys, values, slots, layout), `write_slots`: dropped beyond C) and query
  [B, n, H, D] attends as `attend` does over the written cache (visible [B, n, C], bias [B|1, H, n, C] index its
  slots). Returns (out [B, n, H, D], the written keys, values).

  In the "heads" layout the queries read the cache as it was, its new slots masked, and the new entries apart
  (softmax over both at once, the same sums), and the cache is written after: the written cache then has one
  reader, the loop that carries it, so XLA:CPU updates it in place (read after its write, it copied every
  layer's keys and values two to five times at every step of a decode loop: 4.1 ms of SmolLM2's 33 ms step on a
  2-core Xeon; `decoding.CPU_COMPILER_OPTIONS` removes the copies left)."""
  keys, values, slots, layout = cached
  if check_layout(layout) == "slots":
    written = write_slots(keys, key, slots, layout), write_slots(values, value, slots, layout)
    return attend(query, *written, visible, layout=layout, bias=bias, soft_cap=soft_cap), *written
  b, n = slots.shape
  cache_length = keys.shape[2]
  visible = jnp.broadcast_to(visible, (b, n, cache_length))
  is_new = jnp.any(jnp.arange(cache_length, dtype=slots.dtype)[None, None, :] == slots[:, :, None], axis=1)
  at_slots = jnp.broadcast_to(jnp.clip(slots, 0, cache_length - 1)[:, None, :], (b, n, n))
  new_visible = jnp.take_along_axis(visible, at_slots, axis=2) & (slots < cache_length)[:, None, :]   # [B, n, n]
  new_bias = None if bias is None else jnp.take_along_axis(
      jnp.broadcast_to(bias, (b,) + bias.shape[1:]), jnp.broadcast_to(at_slots[:, None], (b, bias.shape[1], n, n)),
      axis=3)
  parts = [(keys, values, visible & ~is_new[:, None, :], bias),
           (key.transpose(0, 2, 1, 3).astype(keys.dtype), value.transpose(0, 2, 1, 3).astype(values.dtype),
            new_visible, new_bias)]
  return (_attend_head_major(query, parts, soft_cap), write_slots(keys, key, slots, layout),
          write_slots(values, value, slots, layout))


def _attend_head_major(query: Array, parts: list[tuple[Array, Array, Array, Array | None]],
                       soft_cap: float | None) -> Array:
  """`attend` in the "heads" layout over the keys of one or more parts (keys, values [B, K, C_i, D], visible
  [B, n, C_i], bias [B|1, H, n, C_i] or None), one softmax over all of them."""
  b, n, h, d = query.shape
  k = parts[0][0].shape[1]
  g = h // k
  # Scores stay [B, K, C, G·n], slots before queries, from a dot over D with the cache on the left, and the
  # weights multiply the values in that layout: XLA:CPU then reads the keys and values as stored (with
  # head-major scores it wrote every layer's cache, or the scores, transposed on every call).
  grouped = query.reshape(b, n, k, g, d).transpose(0, 2, 4, 3, 1).reshape(b, k, d, g * n)
  scores = []
  for keys, _, visible, bias in parts:
    dtype = jnp.promote_types(keys.dtype, query.dtype)
    part = jax.lax.dot_general(keys.astype(dtype), grouped.astype(dtype), (((3,), (2,)), ((0, 1), (0, 1))))
    part = part.reshape(b, k, -1, g, n).astype(jnp.float32)                                      # [B, K, C, G, n]
    if bias is not None:
      part = part + jnp.moveaxis(bias.reshape(bias.shape[0], k, g, n, -1), -1, 2)
    if soft_cap is not None:
      part = jnp.tanh(part / soft_cap) * soft_cap
    # A finite minimum, not −inf: exp gives exactly 0 and a fully masked row cannot produce NaN.
    scores.append(jnp.where(jnp.moveaxis(visible, 1, 2)[:, None, :, None], part, jnp.finfo(jnp.float32).min))
  weights = jax.nn.softmax(jnp.concatenate(scores, axis=2), axis=2)
  # Each part's weighted sum in float32 and the output rounded once to the values' dtype (bfloat16 caches).
  attended, start = 0.0, 0
  for _, values, _, _ in parts:
    size = values.shape[2]
    part = weights[:, :, start:start + size].astype(values.dtype).reshape(b, k, size, g * n)
    attended = attended + jax.lax.dot_general(part, values, (((2,), (2,)), ((0, 1), (0, 1))),
                                              preferred_element_type=jnp.float32)               # [B, K, G·n, D]
    start += size
  attended = attended.astype(parts[0][1].dtype)
  return jnp.moveaxis(attended.reshape(b, k, g, n, d), 3, 1).reshape(b, n, h, d)


def rms_normalize(x: Array, eps: float = 1e-6) -> Array:
  """x / rms(x) over the last axis, in float32 (RMSNorm without a gain)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
  """x / rms(x) · (offset + scale), in float32, returned in `dtype` (None: x's); the scale starts where the gain is 1.
  T5's layer norm (offset 0, ε 1e-6), Llama's (offset 0) and Gemma's (offset 1: (1 + w))."""
  eps: float = 1e-6
  offset: float = 0.0
  dtype: Any = None

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.constant(1.0 - self.offset), (x.shape[-1],), jnp.float32)
    return (rms_normalize(x, self.eps) * (self.offset + scale)).astype(self.dtype or x.dtype)


def _attend_slot_major(query: Array, keys: Array, values: Array, visible: Array, *, bias: Array | None,
                       soft_cap: float | None) -> Array:
  """`attend` over [C, B, K·D] caches: the Pallas kernel where the program is lowered for TPU and the kernel
  takes the call (`attention_kernel.takes`: decode steps and verifications whole, a long prompt's prefill in
  blocks of queries), XLA's head-major attention over a transposed view elsewhere (heads with no block of whole
  lanes; the layout decoded on a CPU: tests)."""
  from specdec.models import attention_kernel   # Pallas: imported only by programs that use the layout
  b, n, h, d = query.shape
  c, k = keys.shape[0], keys.shape[2] // d

  def on_tpu(query, keys, values, visible, bias):
    return attention_kernel.on_mesh(query, keys, values, visible, bias=bias, soft_cap=soft_cap)

  def elsewhere(query, keys, values, visible, bias):
    head_major = lambda x: x.reshape(c, b, k, d).transpose(1, 2, 0, 3)  # noqa: E731
    return attend(query, head_major(keys), head_major(values), visible, bias=bias, soft_cap=soft_cap)

  if not attention_kernel.takes(n, c, key_heads=attention_kernel.local_key_heads(k), groups=h // k, head_dim=d,
                                itemsize=keys.dtype.itemsize, has_bias=bias is not None):
    return elsewhere(query, keys, values, visible, bias)
  return jax.lax.platform_dependent(query, keys, values, visible, bias, tpu=on_tpu, default=elsewhere)


def write_slots(cache: Array, new: Array, slots: Array, layout: str) -> Array:
  """cache [B, K, C, D] (`layout` "heads") or [C, B, K·D] ("slots") with row b's new entries new[b] [n, K, D]
  written at slots[b] [n] (dropped beyond C). Slots are a row's next n (`new_entries`: lengths[b] + 0 … n−1).

  One row at a time under `vmap`: a scatter whose rows are a batch dimension, which the SPMD partitioner
  keeps on each row's device (a scatter indexed by row ids gathers every row's updates onto every device).
  At batch 1 in the "heads" layout, one `dynamic_update_slice` of the n slots' window instead: XLA:CPU turns
  the scatter into a select over the whole cache (for the slots it drops), which it cannot update in place."""
  if check_layout(layout) == "heads" and cache.shape[0] == 1:
    n, cache_length = slots.shape[1], cache.shape[2]
    start = slots[0, 0]
    at = jnp.clip(start, 0, cache_length - n)   # dynamic_update_slice's own clamp; a window that overhangs
    offset = jnp.arange(n, dtype=slots.dtype) + at - start   # the cache keeps its old slots before `start`
    entries = jnp.take(new.transpose(0, 2, 1, 3).astype(cache.dtype), jnp.clip(offset, 0, n - 1), axis=2)
    window = jnp.where((offset >= 0)[None, None, :, None], entries,
                       jax.lax.dynamic_slice_in_dim(cache, at, n, axis=2))
    return jax.lax.dynamic_update_slice_in_dim(cache, window, at, axis=2)

  def write_row(row: Array, entries: Array, row_slots: Array) -> Array:
    if layout == "slots":   # a slot's K·D entries are one row
      return row.at[row_slots].set(entries.reshape(entries.shape[0], -1).astype(row.dtype), mode="drop")
    return row.at[:, row_slots].set(entries.transpose(1, 0, 2).astype(row.dtype), mode="drop")
  if layout == "slots":   # [C, B, K·D]: rows are axis 1
    return jax.vmap(write_row, in_axes=(1, 0, 0), out_axes=1)(cache, new, slots)
  return jax.vmap(write_row)(cache, new, slots)


def empty_cache(batch_size: int, cache_length: int, *, max_length: int, num_layers: int, heads: int, head_dim: int,
                dtype: Any, layout: str | None = None) -> Cache:
  """An empty decoder cache (lengths 0): keys and values, one array per layer (an encoder-decoder adds its
  encoder's entries) in `layout` (None: `cache_layout()`, this process's backend's), kept as the cache's field:
  [B, heads, cache_length, head_dim] ("heads") or [cache_length, B, heads·head_dim] ("slots", TPU).

  One array per layer, so a layer's attention reads and updates its own buffer (a stacked [layers, …]
  array is sliced per layer, a copy on XLA:CPU)."""
  if not 1 <= cache_length <= max_length:
    raise ValueError(f"cache_length must lie in [1, max_length={max_length}]; got {cache_length}")
  layout = cache_layout() if layout is None else check_layout(layout)
  if layout == "slots":
    shape = (cache_length, batch_size, heads * head_dim)
  else:
    shape = (batch_size, heads, cache_length, head_dim)
  kv = {name: [jnp.zeros(shape, dtype) for _ in range(num_layers)] for name in ("keys", "values")}
  return Cache(kv=kv, lengths=jnp.zeros((batch_size,), jnp.int32), layout=layout)


def new_entries(cache: Cache, tokens: Array, positions: Array | None, tree_mask: Array | None
                ) -> tuple[Array, Array, Array]:
  """Where a decoder-only `score` of tokens [B, n] writes and what each token sees, for a cache of
  `empty_cache`'s layout: slots lengths[b] + i [B, n], position ids [B, n] (default the slots; a token tree
  gives siblings one id) and the visible slots [B, n, C] (`visible_slots`). Raises ValueError when n
  exceeds the cache."""
  n, cache_length = tokens.shape[1], cache_slots(cache)
  if n > cache_length:
    raise ValueError(f"cannot score {n} tokens with a cache of length {cache_length}")
  slots = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
  return slots, slots if positions is None else positions, visible_slots(cache.lengths, n, cache_length, tree_mask)


def copy_slots(cache: Cache, source_rows: Array, source_slots: Array, target_slots: Array) -> Cache:
  """Row b's entries at target_slots[b] [B, n] become row source_rows[b]'s at source_slots[b] (all read
  before any is written), in the per-slot keys and values of an `empty_cache` layout (an encoder-decoder's
  per-row encoder entries stay); lengths unchanged. What a model's `copy_slots` does (multi-draft loops
  keep one path of a scored token tree)."""
  rows, source_rows = jnp.arange(cache.lengths.shape[0])[:, None], source_rows[:, None]

  def copy(x: Array) -> Array:
    if cache.layout == "slots":   # x[slots, rows] is [B, n, K·D]
      # The n entries gathered apart, before the scatter: fused into it, the TPU compiler copied the whole cache
      # (twice per multi-draft block at batch 1; tests/tpu/test_plan.py).
      entries = jax.lax.optimization_barrier(x[source_slots, source_rows])
      return x.at[target_slots, rows].set(entries, mode="drop")
    return x.at[rows, :, target_slots].set(x[source_rows, :, source_slots], mode="drop")   # [B, n, K, D]
  copied = {name: [copy(x) for x in cache.kv[name]] for name in ("keys", "values")}
  return cache.replace(kv={**cache.kv, **copied})


class Configured:
  """`vocab_size` and `max_length` read from a model's `config` (its `vocab_size` and `max_len`)."""

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_length(self) -> int:
    return self.config.max_len


class DecoderOnly(Configured):
  """A decoder-only model whose cache is `empty_cache`'s (its config names num_layers, cache_heads, head_dim,
  max_len, dtype): `init_cache` and `copy_slots` are the module's functions; it scores token trees. A subclass
  supplies its network as `_apply(tokens [B, n], positions [B, n], visible [B, n, C], key_positions [B, C],
  cache)` -> (logits [B, n, V] float32, (keys, values) or None, last hidden states [B, n, E]), where cache is
  None (teacher forcing: C = n) or (keys, values, slots [B, n], the cache's layout) and each layer writes its new
  entries at the slots before attending; key_positions are each key's position id (a sliding window compares them)."""

  encoder_decoder = False
  scores_trees = True

  def logits(self, tokens: Array, *, return_hidden: bool = False) -> Array | tuple[Array, Array]:
    """Teacher-forced logits [B, L, V] of tokens [B, L] at positions 0 … L−1 (and with `return_hidden` the last
    hidden states [B, L, E], what SpecDec++'s acceptance head and a feature drafter's training read)."""
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    logits, _, hidden = self._apply(tokens, positions, causal(b, length), positions, None)
    return (logits, hidden) if return_hidden else logits

  def score(self, cache: Cache, tokens: Array, *, positions: Array | None = None,
            tree_mask: Array | None = None) -> Scored:
    """Scores tokens [B, n] after each row's cache: `Scored` (logits [B, n, V], the advanced cache, the last
    hidden states [B, n, E], which SpecDec++'s acceptance head and a feature drafter read).

    Token i of row b is written at slot lengths[b] + i and sees the row's slots < lengths[b] plus the new tokens
    j with tree_mask[b, i, j] (default causal: j ≤ i; a tree mask must include i itself). positions [B, n] are
    the position ids (default lengths[b] + i; a token tree gives siblings the same id). lengths advance by n.
    The caller keeps lengths + n ≤ cache_length: slots beyond are dropped (no token sees them, in this call or
    later)."""
    n, cache_length = tokens.shape[1], cache_slots(cache)
    slots, positions, visible = new_entries(cache, tokens, positions, tree_mask)
    keys_at = key_positions(cache.lengths, positions, cache_length)
    logits, (keys, values), hidden = self._apply(tokens, positions, visible, keys_at,
                                                 (cache.kv["keys"], cache.kv["values"], slots, cache.layout))
    cache = cache.replace(kv={"keys": keys, "values": values}, lengths=cache.lengths + n)
    return Scored(logits=partitioning.gather_vocab(logits), cache=cache, hidden=hidden)

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return prompt_width

  def init_cache(self, batch_size: int, cache_length: int, layout: str | None = None) -> Cache:
    cfg = self.config
    return empty_cache(batch_size, cache_length, max_length=cfg.max_len, num_layers=cfg.num_layers,
                       heads=cfg.cache_heads, head_dim=cfg.head_dim, dtype=cfg.dtype, layout=layout)

  def copy_slots(self, cache: Cache, source_rows: Array, source_slots: Array, target_slots: Array) -> Cache:
    return copy_slots(cache, source_rows, source_slots, target_slots)


def row_axes(cache: Cache) -> Cache:
  """The axis of each of the cache's arrays that holds its rows (a pytree of ints shaped like `cache`): 1 for
  the keys and values of a "slots" cache ([C, B, K·D]), 0 for every other array."""
  if not isinstance(cache.kv, dict):   # a network's own state (the tests' toy models): rows first
    return cache.replace(kv=jax.tree.map(lambda _: 0, cache.kv), lengths=0)
  slot_major = 1 if cache.layout == "slots" else 0
  kv = {name: jax.tree.map(lambda _: slot_major if name in ("keys", "values") else 0, value)
        for name, value in cache.kv.items()}
  return cache.replace(kv=kv, lengths=0)


# Config fields every family names alike now, by their names in exports written before (model.json, head.json).
RENAMED_FIELDS = {"emb_dim": "embed_dim", "mlp_dim": "hidden_dim"}


def current_fields(fields: dict[str, Any]) -> dict[str, Any]:
  """A config's fields as read from an export's JSON, under today's names (`RENAMED_FIELDS`)."""
  return {RENAMED_FIELDS.get(name, name): value for name, value in fields.items()}


def rollback(cache: Cache, lengths: Array) -> Cache:
  """Resets every row's length (KV-cache rollback is a length reset, not a copy)."""
  return cache.replace(lengths=jnp.asarray(lengths, jnp.int32))


class Model(Protocol):
  """What a decode loop needs from a drafter or a verifier (decoder-only or encoder-decoder).

  Declared capabilities: `encoder_decoder`, the prompt is an encoder input (the model has its own
  `prefill(cache, prompts, prompt_lengths) -> (pending token [B], cache)`); `scores_trees`, `score` takes
  `positions=` and `tree_mask=` and the model has `copy_slots` (multi-draft methods); `feature_access`, the
  model is also a `Features` (what a feature drafter and an acceptance head read).
  """

  encoder_decoder: bool
  scores_trees: bool
  feature_access: bool

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

  def init_cache(self, batch_size: int, cache_length: int, layout: str | None = None) -> Cache:
    """An empty cache (lengths 0) holding up to `cache_length` positions per row, its keys and values in
    `layout` (`CACHE_LAYOUTS`; None: `cache_layout()`, this process's backend's)."""
    ...

  def score(self, cache: Cache, tokens: Array) -> Scored:
    """Appends tokens [B, n] at each row's length; returns their next-token logits [B, n, V], the advanced
    cache and the last hidden states (`Scored`)."""
    ...

  def prompt_cache_positions(self, prompt_width: int) -> int:
    """Cache positions that prompts padded to `prompt_width` take: the width for a decoder-only model, 1
    for an encoder-decoder (its decoder cache holds only the start token)."""
    ...


class Features(Model, Protocol):
  """A model that declares `feature_access`: its last hidden states (`Scored.hidden` [B, n, E]; a decoder-only
  one's `logits(tokens, return_hidden=True)` -> (logits [B, L, V], hidden [B, L, E])), its input embedding and its
  output layer, read by a feature drafter (`decoding.feature_drafter`) and SpecDec++'s acceptance head."""

  @property
  def hidden_size(self) -> int:
    """E, the width of the last hidden states."""
    ...

  def output_table(self) -> Array:
    """The output layer's [V, E] table."""
    ...

  def token_embeddings(self, tokens: Array) -> Array:
    """The network's input of tokens [B, n] -> [B, n, E] (float32)."""
    ...

  def output_logits(self, hidden: Array, table: Array | None = None) -> Array:
    """Next-token logits [B, n, V] of last hidden states [B, n, E]; through `table` [k, E] (rows of
    `output_table()`) those of its k tokens [B, n, k]."""
    ...

  def with_feature_layers(self, layers: tuple[int, ...]) -> "Features":
    """This model returning the outputs of its `layers` before its last hidden state (EAGLE-3's fused features,
    [B, n, (k + 1)·E]); itself for (); ValueError naming the model where it cannot."""
    ...


def no_feature_layers(model: Model, layers: tuple[int, ...]) -> Model:
  """`Features.with_feature_layers` of a model that returns its last hidden state only."""
  if layers:
    raise ValueError(f"{type(model).__name__} does not return its layers' outputs (EAGLE-3's fused features, asked "
                     f"for layers {tuple(layers)}); a decoder of the Llama or Gemma 2 family does")
  return model


def prefill(model: Model, cache: Cache, prompts: Array, prompt_lengths: Array, *, return_hidden: bool = False
            ) -> tuple[Array, Cache] | tuple[Array, Cache, Array]:
  """Writes each row's prompt[:prompt_lengths[b] − 1] into an empty cache. [B, L], [B] -> (last [B], cache).

  The last prompt token is returned as the row's pending token: the decode loops keep the last emitted
  token out of the cache and score it first, so every step's logits come from one `score` call. Prompts
  are scored padded to L (one call for the batch) and rolled back to their own lengths. A model with its
  own `prefill` (an encoder-decoder) does it its way. With `return_hidden` also the last hidden states
  after each prompt token [B, L, E] (a feature drafter reads them; decoder-only models).
  """
  if model.encoder_decoder:
    if return_hidden:
      raise ValueError(f"{type(model).__name__} reads its prompt as an encoder input: it has no hidden states "
                       "after the prompt's tokens for a feature drafter")
    return model.prefill(cache, prompts, prompt_lengths)
  scored = model.score(cache, prompts)
  rows = jnp.arange(prompts.shape[0])
  last = prompts[rows, prompt_lengths - 1].astype(jnp.int32)
  cache = rollback(scored.cache, prompt_lengths - 1)
  return (last, cache, scored.hidden) if return_hidden else (last, cache)
