"""The decoder-only transformer of flax `examples/lm1b`, with an explicit per-row KV cache (layer 2).

One network serves teacher-forced scoring (`TransformerLM.logits`: training, evaluation) and cached
decoding (`TransformerLM.score`). The architecture is lm1b's: a shared input/output embedding
(logits = embedding.attend(y) / √embed_dim), sinusoidal position embeddings of explicit position ids,
pre-LayerNorm blocks (LN → causal self-attention → residual; LN → MLP → residual), a final LN; no dropout.

Unlike lm1b, the cache is not flax's mutable 'cache' collection with one index shared by the batch: it is
a pytree argument with one length per row (`base.Cache`), so rows can accept different numbers of drafts.
Each layer writes its new keys/values into its own cache array first and then attends over that array
(`base.visible_slots` says which slots each new token sees: the row's committed slots, and the new tokens as
`tree_mask` says, causal by default). Nothing reads the cache before the write, so XLA updates it in
place: no cache-sized copy per call, as there is when the new entries are attended apart and written
after the forward pass.
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

from specdec.models import base, partitioning

Array = jax.Array

_ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu}
# lm1b's initialisers.
_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyperparameters. Frozen (hashable): the config is static under jit."""
  vocab_size: int
  embed_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  hidden_dim: int = 2048
  max_len: int = 512          # the largest cache length (positions) a model accepts
  activation: str = "relu"    # lm1b's; or "gelu"
  dtype: Any = jnp.float32    # weights (`models.with_dtype`), activations, cache; norms, softmax, logits: float32

  def __post_init__(self):
    if self.qkv_dim % self.num_heads:
      raise ValueError(f"qkv_dim ({self.qkv_dim}) must be a multiple of num_heads ({self.num_heads})")
    if self.embed_dim % 2:
      raise ValueError(f"embed_dim must be even (half sines, half cosines); got {self.embed_dim}")
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}; got {self.activation!r}")

  @property
  def head_dim(self) -> int:
    return self.qkv_dim // self.num_heads

  @property
  def cache_heads(self) -> int:
    return self.num_heads


# flax lm1b-style presets (SpecTr's LM1B models: `models` module docstring).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(embed_dim=32, num_layers=2, num_heads=2, qkv_dim=32, hidden_dim=64),
    "2m": dict(embed_dim=64, num_layers=2, num_heads=2, qkv_dim=64, hidden_dim=512),
    "6m": dict(embed_dim=128, num_layers=4, num_heads=4, qkv_dim=128, hidden_dim=1024),
    "15m": dict(embed_dim=256, num_layers=8, num_heads=8, qkv_dim=256, hidden_dim=1024),
    "20m": dict(embed_dim=256, num_layers=8, num_heads=8, qkv_dim=256, hidden_dim=2048),
    "97m": dict(embed_dim=768, num_layers=10, num_heads=12, qkv_dim=768, hidden_dim=3072),
}

# Partitioning (`models.partitioning`): a regular expression on the "/"-joined parameter path, the logical axes of
# its dimensions ([E, H, D] projections, LayerNorm scale and bias). "block" without a number: a feature drafter's
# one-layer head (models/feature_head.py), made of this module's block.
LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^embed/embedding$", ("vocab", "embed")),
    (r"^block(_\d+)?/attention/(query|key|value)/kernel$", ("embed", "heads", "kv")),
    (r"^block(_\d+)?/attention/out/kernel$", ("heads", "kv", "embed")),
    (r"^block(_\d+)?/mlp/dense_in/kernel$", ("embed", "mlp")),
    (r"^block(_\d+)?/mlp/dense_in/bias$", ("mlp",)),
    (r"^block(_\d+)?/mlp/dense_out/kernel$", ("mlp", "embed")),
    (r"^(block(_\d+)?/)?(ln_attention|ln_mlp|final_norm|mlp/dense_out)/(scale|bias)$", ("embed",)),
)


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
  """Multi-head attention of n new tokens, over themselves or over a row's cache after writing them to it."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array, cached: tuple[Array, Array, Array, str] | None
               ) -> tuple[Array, Array | None, Array | None]:
    """x [B, n, E]. Without a cache, mask [B, n, n]: query i sees new key j. With cached = (keys, values
    in an `empty_cache` layout, slots [B, n], the layout), the new keys/values are written at slots (dropped
    beyond C) and mask [B, n, C] says which slots each query sees. Returns out [B, n, E] and the updated keys,
    values."""
    cfg = self.config
    project = functools.partial(nn.DenseGeneral, features=(cfg.num_heads, cfg.head_dim), use_bias=False,
                                kernel_init=_KERNEL_INIT, dtype=cfg.dtype)
    query = project(name="query")(x) / jnp.sqrt(cfg.head_dim).astype(cfg.dtype)
    key, value = project(name="key")(x), project(name="value")(x)              # [B, n, H, D]
    if cached is None:
      keys, values = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)                      # [B, H, n, D]
      out = base.attend(query, keys, values, mask)
    else:
      out, keys, values = base.attend_and_write(query, key, value, cached, mask)
    out = nn.DenseGeneral(features=cfg.embed_dim, axis=(-2, -1), use_bias=False, kernel_init=_KERNEL_INIT,
                          dtype=cfg.dtype, name="out")(out)
    return (out, None, None) if cached is None else (out, keys, values)


class Mlp(nn.Module):
  """Dense → activation → dense, lm1b's MlpBlock without dropout."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = functools.partial(nn.Dense, kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT, dtype=cfg.dtype)
    return dense(cfg.embed_dim, name="dense_out")(_ACTIVATIONS[cfg.activation](dense(cfg.hidden_dim, name="dense_in")(x)))


class DecoderBlock(nn.Module):
  """Pre-LN block: x + attention(LN(x)), then + MLP(LN(·))."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array, cached: tuple[Array, Array, Array, str] | None
               ) -> tuple[Array, Array | None, Array | None]:
    cfg = self.config
    attended, keys, values = SelfAttention(cfg, name="attention")(
        nn.LayerNorm(dtype=cfg.dtype, name="ln_attention")(x), mask, cached)
    x = x + attended
    return x + Mlp(cfg, name="mlp")(nn.LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x)), keys, values


class Transformer(nn.Module):
  """The network: tokens -> next-token logits, optionally attending to a KV cache."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array, mask: Array,
               cache: tuple[list[Array], list[Array], Array, str] | None = None
               ) -> tuple[Array, tuple[list[Array], list[Array]] | None, Array]:
    """Logits of tokens [B, n] at position ids [B, n].

    Without a cache, mask [B, n, n]: which tokens each token attends to (itself included). With cache =
    (keys, values: one array per layer in an `empty_cache` layout, slots [B, n], the layout), each layer writes
    the tokens' keys, values at slots and attends over its cache as mask [B, n, C] says (`base.visible_slots`).
    Returns logits [B, n, V] (float32), the updated (keys, values) lists (None without a cache) and the last
    hidden states [B, n, E] (after the final LayerNorm: what the output projection reads).
    """
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.embed_dim, embedding_init=nn.initializers.normal(stddev=1.0), name="embed")
    y = (embed(tokens) + sinusoidal_embedding(positions, cfg.embed_dim)).astype(cfg.dtype)
    new_keys, new_values = [], []
    for layer in range(cfg.num_layers):
      cached = None if cache is None else (cache[0][layer], cache[1][layer], cache[2], cache[3])
      y, layer_keys, layer_values = DecoderBlock(cfg, name=f"block_{layer}")(y, mask, cached)
      new_keys.append(layer_keys)
      new_values.append(layer_values)
    y = nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(y)
    # lm1b's normalisation of logits through the shared embedding.
    logits = embed.attend(y.astype(jnp.float32)) / np.sqrt(cfg.embed_dim)
    return logits, None if cache is None else (new_keys, new_values), y


@struct.dataclass
class TransformerLM(base.DecoderOnly):
  """A `Transformer` bound to its parameters; implements `base.Model`.

  A pytree: `params` are leaves (a jitted loop takes them as arguments), the config is static.
  """
  params: Any
  config: TransformerConfig = struct.field(pytree_node=False)

  def _apply(self, tokens: Array, positions: Array, visible: Array, key_positions: Array,
             cache: tuple[list[Array], list[Array], Array, str] | None) -> tuple[Array, Any, Array]:
    """`base.DecoderOnly`'s network call (lm1b's absolute positions need no key positions)."""
    del key_positions
    return Transformer(self.config).apply({"params": self.params}, tokens, positions, visible, cache)

  # What a feature drafter (`models.feature_head`) reads through (`base.Features`): the verifier's own input
  # embedding and output layer (lm1b's tied embedding), shared with the drafter, never copied.
  feature_access = True

  @property
  def hidden_size(self) -> int:
    return self.config.embed_dim

  def with_feature_layers(self, layers: tuple[int, ...]) -> Any:
    return base.no_feature_layers(self, layers)

  def output_table(self) -> Array:
    """The output layer's [V, E] table (the tied embedding)."""
    return self.params["embed"]["embedding"]

  def token_embeddings(self, tokens: Array) -> Array:
    """The embedding of tokens [B, n] -> [B, n, E] (without positions)."""
    return jnp.take(self.output_table(), tokens, axis=0).astype(jnp.float32)

  def output_logits(self, hidden: Array, table: Array | None = None) -> Array:
    """Next-token logits [B, n, V] of last hidden states [B, n, E], as `score` computes them from its own; through
    `table` [k, E] (rows of `output_table()`: a draft vocabulary) the logits of those k tokens [B, n, k]."""
    table = self.output_table() if table is None else table
    return partitioning.gather_vocab(hidden.astype(jnp.float32) @ table.astype(jnp.float32).T
                                     / np.sqrt(self.config.embed_dim))


def init(config: TransformerConfig, key: Array) -> TransformerLM:
  """A randomly initialised model (lm1b's initialisers)."""
  one = jnp.zeros((1, 1), jnp.int32)
  variables = Transformer(config).init(key, one, one, jnp.ones((1, 1, 1), bool))
  return TransformerLM(params=variables["params"], config=config)


def config(vocab_size: int, **fields: Any) -> TransformerConfig:
  """A `TransformerConfig` (the family's constructor: `models.families`)."""
  return TransformerConfig(vocab_size=vocab_size, **fields)


MODEL = TransformerLM
