"""The decoder-only transformer of flax `examples/lm1b`, with an explicit per-row KV cache (layer 2).

One network serves teacher-forced scoring (`TransformerLM.logits`: training, evaluation) and cached
decoding (`TransformerLM.score`). The architecture is lm1b's: a shared input/output embedding
(logits = embedding.attend(y) / √emb_dim), sinusoidal position embeddings of explicit position ids,
pre-LayerNorm blocks (LN → causal self-attention → residual; LN → MLP → residual), a final LN; no dropout.

Unlike lm1b, the cache is not flax's mutable 'cache' collection with one index shared by the batch: it is
a pytree argument with one length per row (`base.Cache`), so rows can accept different numbers of drafts.
Attention splits its keys in two: the cached ones (visible when slot < lengths[b]) and the n new ones
(visible as `tree_mask` says; causal by default). The new keys/values are written to the cache after the
forward pass, so a call never reads what it writes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from specdec.models import base

Array = jax.Array

_ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu}
# lm1b's initialisers.
_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters. Frozen (hashable): the config is static under jit."""
  vocab_size: int
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 512          # the largest cache length (positions) a model accepts
  activation: str = "relu"    # lm1b's; or "gelu"
  dtype: Any = jnp.float32    # activations and cache; parameters, softmax and logits stay float32

  def __post_init__(self):
    if self.qkv_dim % self.num_heads:
      raise ValueError(f"qkv_dim ({self.qkv_dim}) must be a multiple of num_heads ({self.num_heads})")
    if self.emb_dim % 2:
      raise ValueError(f"emb_dim must be even (half sines, half cosines); got {self.emb_dim}")
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}; got {self.activation!r}")

  @property
  def head_dim(self) -> int:
    return self.qkv_dim // self.num_heads


def sinusoidal_embedding(positions: Array, features: int) -> Array:
  """lm1b's sinusoidal position table evaluated at `positions` [B, n] -> [B, n, features].

  Row p is [sin(p·w_0) … sin(p·w_{h−1}), cos(p·w_0) … cos(p·w_{h−1})], h = features/2,
  w_i = 10000^(−i/(h−1)) (lm1b divides by h−1, not h). Computed from the ids instead of gathered from a
  [max_len, features] table, so no such constant is baked into every jitted graph.
  """
  half = features // 2
  freqs = np.exp(-np.log(10_000.0) * np.arange(half) / max(half - 1, 1)).astype(np.float32)
  angles = positions[..., None].astype(jnp.float32) * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class SelfAttention(nn.Module):
  """Multi-head attention of n new tokens over themselves and, when given, a row's cached keys."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, new_mask: Array, cached: tuple[Array, Array, Array] | None
               ) -> tuple[Array, Array, Array]:
    """x [B, n, E]; new_mask [B, n, n]: query i sees new key j; cached: keys, values [B, H, C, D] and
    visible [B, C], or None. Returns out [B, n, E] and the new tokens' keys, values [B, n, H, D]."""
    cfg = self.config
    project = functools.partial(nn.DenseGeneral, features=(cfg.num_heads, cfg.head_dim), use_bias=False,
                                kernel_init=_KERNEL_INIT, dtype=cfg.dtype)
    query = project(name="query")(x) / jnp.sqrt(cfg.head_dim).astype(cfg.dtype)
    key, value = project(name="key")(x), project(name="value")(x)

    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key)                      # [B, H, n, n]
    mask = new_mask[:, None]
    if cached is not None:
      cached_keys, cached_values, visible = cached
      scores = jnp.concatenate([jnp.einsum("bqhd,bhkd->bhqk", query, cached_keys), scores], axis=-1)
      b, n, c = x.shape[0], x.shape[1], cached_keys.shape[2]
      mask = jnp.concatenate([jnp.broadcast_to(visible[:, None, None, :], (b, 1, n, c)), mask], axis=-1)
    # A finite minimum, not −inf: exp gives exactly 0 and a fully masked row cannot produce NaN.
    scores = jnp.where(mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
    if cached is None:
      out = jnp.einsum("bhqk,bkhd->bqhd", weights, value)
    else:
      # Two products instead of concatenating values: no copy of the cache per layer.
      out = (jnp.einsum("bhqk,bhkd->bqhd", weights[..., :c], cached_values)
             + jnp.einsum("bhqk,bkhd->bqhd", weights[..., c:], value))
    out = nn.DenseGeneral(features=cfg.emb_dim, axis=(-2, -1), use_bias=False, kernel_init=_KERNEL_INIT,
                          dtype=cfg.dtype, name="out")(out)
    return out, key, value


class Mlp(nn.Module):
  """Dense → activation → dense, lm1b's MlpBlock without dropout."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = functools.partial(nn.Dense, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, dtype=cfg.dtype)
    return dense(cfg.emb_dim, name="dense_out")(_ACTIVATIONS[cfg.activation](dense(cfg.mlp_dim, name="dense_in")(x)))


class DecoderBlock(nn.Module):
  """Pre-LN block: x + attention(LN(x)), then + MLP(LN(·))."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, new_mask: Array, cached: tuple[Array, Array, Array] | None
               ) -> tuple[Array, Array, Array]:
    cfg = self.config
    attended, key, value = SelfAttention(cfg, name="attention")(
        nn.LayerNorm(dtype=cfg.dtype, name="ln_attention")(x), new_mask, cached)
    x = x + attended
    return x + Mlp(cfg, name="mlp")(nn.LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x)), key, value


class Transformer(nn.Module):
  """The network: tokens -> next-token logits, optionally attending to a KV cache."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array, new_mask: Array,
               cache: tuple[Array, Array, Array] | None = None) -> tuple[Array, tuple[Array, Array], Array]:
    """Logits of tokens [B, n] at position ids [B, n].

    new_mask [B, n, n]: which new tokens each new token attends to (itself included). cache: keys,
    values [layers, B, H, C, D] and lengths [B]; row b's slots < lengths[b] are visible to all its
    new tokens. Returns logits [B, n, V] (float32), the new tokens' keys, values
    [layers, B, n, H, D] (the caller writes them to the cache) and the last hidden states [B, n, E]
    (after the final LayerNorm: what the output projection reads).
    """
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
    y = (embed(tokens) + sinusoidal_embedding(positions, cfg.emb_dim)).astype(cfg.dtype)
    if cache is not None:
      keys, values, lengths = cache
      visible = jnp.arange(keys.shape[3])[None, :] < lengths[:, None]        # [B, C]
    new_keys, new_values = [], []
    for layer in range(cfg.num_layers):
      cached = None if cache is None else (keys[layer], values[layer], visible)
      y, key, value = DecoderBlock(cfg, name=f"block_{layer}")(y, new_mask, cached)
      new_keys.append(key)
      new_values.append(value)
    y = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(y)
    # lm1b's normalisation of logits through the shared embedding.
    logits = embed.attend(y.astype(jnp.float32)) / np.sqrt(cfg.emb_dim)
    return logits, (jnp.stack(new_keys), jnp.stack(new_values)), y


def _causal(batch_size: int, n: int) -> Array:
  return jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (batch_size, n, n))


@struct.dataclass
class TransformerLM:
  """A `Transformer` bound to its parameters; implements `base.Model`.

  A pytree: `params` are leaves (a jitted loop takes them as arguments), the config is static.
  """
  params: Any
  config: TransformerConfig = struct.field(pytree_node=False)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def max_length(self) -> int:
    return self.config.max_len

  def logits(self, tokens: Array, *, return_hidden: bool = False) -> Array | tuple[Array, Array]:
    """Teacher-forced logits [B, L, V] of tokens [B, L] at positions 0 … L−1 (and with `return_hidden`
    the last hidden states [B, L, E], what SpecDec++'s acceptance head reads)."""
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    logits, _, hidden = Transformer(self.config).apply({"params": self.params}, tokens, positions,
                                                       _causal(b, length))
    return (logits, hidden) if return_hidden else logits

  def init_cache(self, batch_size: int, cache_length: int) -> base.Cache:
    """An empty cache: keys, values [layers, B, heads, cache_length, head_dim], lengths [B] = 0.

    Head-major, so attention reads each head's keys contiguously: with [.., C, H, D] XLA:CPU transposed the
    whole cache in every layer of every call (a decode step of the 15m at 300 cached slots took 1.7× the
    step at 32 slots)."""
    cfg = self.config
    if not 1 <= cache_length <= cfg.max_len:
      raise ValueError(f"cache_length must lie in [1, max_length={cfg.max_len}]; got {cache_length}")
    zeros = jnp.zeros((cfg.num_layers, batch_size, cfg.num_heads, cache_length, cfg.head_dim), cfg.dtype)
    return base.Cache(kv={"keys": zeros, "values": zeros}, lengths=jnp.zeros((batch_size,), jnp.int32))

  def score(self, cache: base.Cache, tokens: Array, *, positions: Array | None = None,
            tree_mask: Array | None = None, return_hidden: bool = False
            ) -> tuple[Array, base.Cache] | tuple[Array, base.Cache, Array]:
    """Scores tokens [B, n] after each row's cache; returns logits [B, n, V] and the advanced cache.

    Token i of row b is written at slot lengths[b] + i and sees the row's slots < lengths[b] plus the
    new tokens j with tree_mask[b, i, j] (default causal: j ≤ i; a tree mask must include i itself).
    positions [B, n] are the position ids (default lengths[b] + i; a token tree gives siblings the
    same id). lengths advance by n. The caller keeps lengths + n ≤ cache_length: slots beyond are
    dropped (this call's logits stay right, later calls would not see those tokens). With
    `return_hidden` also returns the last hidden states [B, n, E] (SpecDec++'s acceptance head reads them).
    """
    b, n = tokens.shape
    keys, values = cache.kv["keys"], cache.kv["values"]
    if n > keys.shape[3]:
      raise ValueError(f"cannot score {n} tokens with a cache of length {keys.shape[3]}")
    slots = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)          # [B, n]
    positions = slots if positions is None else positions
    new_mask = _causal(b, n) if tree_mask is None else jnp.broadcast_to(tree_mask, (b, n, n))
    logits, (new_keys, new_values), hidden = Transformer(self.config).apply(
        {"params": self.params}, tokens, positions, new_mask, (keys, values, cache.lengths))
    rows = jnp.arange(b)[:, None]
    # keys[:, rows, :, slots] is [B, n, layers, H, D] (numpy puts the broadcast index dimensions first).
    keys = keys.at[:, rows, :, slots].set(new_keys.transpose(1, 2, 0, 3, 4).astype(keys.dtype), mode="drop")
    values = values.at[:, rows, :, slots].set(new_values.transpose(1, 2, 0, 3, 4).astype(values.dtype), mode="drop")
    cache = base.Cache(kv={"keys": keys, "values": values}, lengths=cache.lengths + n)
    return (logits, cache, hidden) if return_hidden else (logits, cache)

  def copy_slots(self, cache: base.Cache, source_rows: Array, source_slots: Array, target_slots: Array
                 ) -> base.Cache:
    """Row b's keys/values at target_slots[b] [B, n] become row source_rows[b]'s at source_slots[b] (all read
    before any is written); lengths unchanged. Multi-draft loops keep one path of a scored token tree."""
    rows, source_rows = jnp.arange(cache.lengths.shape[0])[:, None], source_rows[:, None]
    # x[:, rows, :, slots] is [B, n, layers, H, D], as in `score`.
    kv = {name: x.at[:, rows, :, target_slots].set(x[:, source_rows, :, source_slots], mode="drop")
          for name, x in cache.kv.items()}
    return cache.replace(kv=kv)


def init(config: TransformerConfig, key: Array) -> TransformerLM:
  """A randomly initialised model (lm1b's initialisers)."""
  one = jnp.zeros((1, 1), jnp.int32)
  variables = Transformer(config).init(key, one, one, jnp.ones((1, 1, 1), bool))
  return TransformerLM(params=variables["params"], config=config)
