"""T5 v1.1, the encoder-decoder of the speculative-cascades T5 experiments, with a per-row decoder cache
(layer 2).

The network is T5X's `t5x/examples/t5/network.py` with the v1.1 configuration: gated-GELU MLP (tanh
approximation, HF's "gelu_new"), T5's RMS layer norm (no mean subtraction, no bias, ε = 1e-6), relative
position buckets (32 buckets, max distance 128; bidirectional in the encoder, causal in the decoder) added
to the attention logits of every layer of a stack, no biases, no 1/√d scaling of the logits (T5 folds it
into the query initialiser), no dropout, and an untied output projection without rescaling.

The parameter tree is T5X's, so a T5X checkpoint maps one to one (`specdec.training.convert`). T5X's
DenseGeneral stores its kernels flattened to two axes; so does this file:

  token_embedder/embedding                                  [V, E]  (encoder and decoder inputs)
  encoder/relpos_bias/rel_embedding                         [H, buckets]  (one table per stack)
  encoder/layers_N/pre_attention_layer_norm/scale           [E]
  encoder/layers_N/attention/{query,key,value}/kernel       [E, H·D];  .../out/kernel  [H·D, E]
  encoder/layers_N/pre_mlp_layer_norm/scale                 [E]
  encoder/layers_N/mlp/{wi_0,wi_1}/kernel                   [E, F];    .../wo/kernel   [F, E]
  encoder/encoder_norm/scale                                [E]
  decoder/relpos_bias/rel_embedding                         [H, buckets]
  decoder/layers_N/{pre_self_attention_layer_norm, self_attention, pre_cross_attention_layer_norm,
                    encoder_decoder_attention, pre_mlp_layer_norm, mlp}   (shapes as above)
  decoder/decoder_norm/scale                                [E]
  decoder/logits_dense/kernel                               [E, V]

Decoding (`base.Model`): the prompt is the ENCODER input. `prefill` encodes it once (prompt_lengths give
the encoder mask), stores every decoder layer's cross-attention keys/values in the cache, and returns
T5's decoder start token 0 as the pending token with decoder lengths 0. From there `score` and `rollback`
work as for the decoder-only model: n decoder tokens at per-row positions lengths[b] + i, the cache a
pytree argument, a rollback a length reset; each decoder layer writes its new keys/values into its cache
array first and attends over the array (no cache-sized copy per call). Committed decoder positions equal
cache slots, so the causal relative position of a cached key is (slot − query position); a token tree's
new keys take their own position ids.
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

VOCAB_SIZE = 32128          # T5's SentencePiece vocabulary, padded to a multiple of 128
DECODER_START_TOKEN = 0     # T5 starts decoding from the pad id

# T5X's initialisers (t5x/examples/t5/layers.py).
_ATTENTION_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
_DENSE_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
_RELPOS_INIT = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyperparameters (T5X's T5Config names, but embed_dim and hidden_dim, T5X's emb_dim and mlp_dim: named as
  every family names them). Frozen (hashable): the config is static under jit."""
  vocab_size: int = VOCAB_SIZE
  embed_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  hidden_dim: int = 1024
  num_buckets: int = 32
  max_distance: int = 128
  max_len: int = 512          # the largest decoder cache (positions); the encoder input has no limit
  dtype: Any = jnp.float32    # weights (`models.with_dtype`), activations, cache; norms, softmax, logits: float32

  @property
  def cache_heads(self) -> int:
    return self.num_heads


# T5 v1.1 sizes (HF's google/t5-v1_1-*), plus three small ones for tests and the CPU (t5_25m: the
# verifier of the trained Debian T5 pair, t5_mini at twice the width and four times the MLP).
PRESETS: dict[str, dict[str, int]] = {
    "t5_tiny": dict(embed_dim=32, num_heads=2, num_encoder_layers=2, num_decoder_layers=2, head_dim=16, hidden_dim=64),
    "t5_mini": dict(embed_dim=128, num_heads=4, num_encoder_layers=4, num_decoder_layers=4, head_dim=32, hidden_dim=256),
    "t5_25m": dict(embed_dim=256, num_heads=4, num_encoder_layers=4, num_decoder_layers=4, head_dim=64, hidden_dim=1024),
    "t5_small": dict(embed_dim=512, num_heads=6, num_encoder_layers=8, num_decoder_layers=8, head_dim=64, hidden_dim=1024),
    "t5_base": dict(embed_dim=768, num_heads=12, num_encoder_layers=12, num_decoder_layers=12, head_dim=64,
                    hidden_dim=2048),
    "t5_large": dict(embed_dim=1024, num_heads=16, num_encoder_layers=24, num_decoder_layers=24, head_dim=64,
                     hidden_dim=2816),
    "t5_xl": dict(embed_dim=2048, num_heads=32, num_encoder_layers=24, num_decoder_layers=24, head_dim=64,
                  hidden_dim=5120),
}

# Partitioning (`models.partitioning`): a regular expression on the "/"-joined parameter path (T5X's names), the
# logical axes of its dimensions.
LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^token_embedder/embedding$", ("vocab", "embed")),
    (r"^(en|de)coder/layers_\d+/(attention|self_attention|encoder_decoder_attention)/(query|key|value)/kernel$",
     ("embed", "joined_kv")),
    (r"^(en|de)coder/layers_\d+/(attention|self_attention|encoder_decoder_attention)/out/kernel$",
     ("joined_kv", "embed")),
    (r"^(en|de)coder/layers_\d+/mlp/wi(_\d)?/kernel$", ("embed", "mlp")),
    (r"^(en|de)coder/layers_\d+/mlp/wo/kernel$", ("mlp", "embed")),
    (r"^(en|de)coder/relpos_bias/rel_embedding$", ("heads", "relpos_buckets")),
    (r"^decoder/logits_dense/kernel$", ("embed", "vocab")),
    (r"^(en|de)coder/.*/scale$", ("embed",)),
)


@functools.lru_cache(maxsize=None)
def _bucket_table(bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
  """T5's bucket of each relative position d = key − query position, d ∈ [−max_distance, max_distance].

  T5X's `_relative_position_bucket` (float32 and its ε, so borderline distances land where T5X and HF
  put them): |d| < num_buckets/4 (bidirectional; num_buckets/2 causal) exactly, then logarithmic bins up
  to max_distance; every |d| ≥ max_distance shares its side's last bucket, hence the clipped table.
  Causal: keys after the query (d > 0) share bucket 0 with d = 0; the mask hides them anyway.
  """
  n = -np.arange(-max_distance, max_distance + 1)
  bucket = np.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket += (n < 0) * num_buckets
    n = np.abs(n)
  else:
    n = np.maximum(n, 0)
  max_exact = num_buckets // 2
  large = max_exact + (np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
                       / np.log(max_distance / max_exact) * (num_buckets - max_exact)).astype(np.int32)
  return (bucket + np.where(n < max_exact, n, np.minimum(large, num_buckets - 1))).astype(np.int32)


def relative_position_bucket(relative_position: Array, *, bidirectional: bool, num_buckets: int = 32,
                             max_distance: int = 128) -> Array:
  """Buckets [...] int32 of relative positions [...] (key − query), by table lookup."""
  table = jnp.asarray(_bucket_table(bidirectional, num_buckets, max_distance))
  return table[jnp.clip(relative_position, -max_distance, max_distance) + max_distance]


class RelativePositionBias(nn.Module):
  """One stack's table of learned attention-logit biases per (head, bucket)."""
  config: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, relative_position: Array) -> Array:
    """relative_position [B, q, k] (key − query) -> biases [B, H, q, k] (float32)."""
    cfg = self.config
    table = self.param("rel_embedding", _RELPOS_INIT, (cfg.num_heads, cfg.num_buckets), jnp.float32)
    buckets = relative_position_bucket(relative_position, bidirectional=self.bidirectional,
                                       num_buckets=cfg.num_buckets, max_distance=cfg.max_distance)
    return jnp.moveaxis(table.T[buckets], -1, 1)


def _head_major(x: Array) -> Array:
  """[B, K, H, D] -> [B, H, K, D], the layout attention reads keys and values in (and the caches keep)."""
  return x.transpose(0, 2, 1, 3)


class Attention(nn.Module):
  """Multi-head attention over one block of keys (a decoder cache, the new tokens, the encoder's)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    dense = functools.partial(nn.Dense, use_bias=False, dtype=cfg.dtype)
    joined = cfg.num_heads * cfg.head_dim
    # No 1/√D on the logits: T5X folds it into the query initialiser.
    self.query = dense(joined, kernel_init=lambda *a: _ATTENTION_INIT(*a) / np.sqrt(cfg.head_dim))
    self.key = dense(joined, kernel_init=_ATTENTION_INIT)
    self.value = dense(joined, kernel_init=_ATTENTION_INIT)
    self.out = dense(cfg.embed_dim, kernel_init=_ATTENTION_INIT)

  def _heads(self, x: Array) -> Array:
    return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)

  def keys_values(self, x: Array) -> tuple[Array, Array]:
    """x [B, K, E] -> keys, values [B, K, H, D]."""
    return self._heads(self.key(x)), self._heads(self.value(x))

  def __call__(self, x: Array, keys: Array, values: Array, bias: Array | None, visible: Array,
               layout: str = "heads") -> Array:
    """Queries from x [B, n, E] attend to keys, values [B, H, K, D] (or a cache's in `layout`) with logit bias
    [B|1, H, n, K] (or None) where visible [B, n|1, K] (`base.attend`); returns [B, n, E]."""
    out = base.attend(self._heads(self.query(x)), keys, values, visible, layout=layout, bias=bias)
    return self.out(out.reshape(*out.shape[:-2], -1))

  def attend_and_write(self, x: Array, key: Array, value: Array, cached: tuple[Array, Array, Array, str],
                       bias: Array, visible: Array) -> tuple[Array, Array, Array]:
    """The queries of x [B, n, E] over a cache with the new tokens' keys, values [B, n, H, D] written at its slots
    (cached = (keys, values, slots, layout), `base.attend_and_write`); returns [B, n, E] and the written keys,
    values."""
    out, keys, values = base.attend_and_write(self._heads(self.query(x)), key, value, cached, visible, bias=bias)
    return self.out(out.reshape(*out.shape[:-2], -1)), keys, values


class GatedMlp(nn.Module):
  """T5 v1.1's MLP: wo(gelu(wi_0 x) · wi_1 x), GELU's tanh approximation."""
  config: T5Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    dense = functools.partial(nn.Dense, use_bias=False, dtype=cfg.dtype, kernel_init=_DENSE_INIT)
    hidden = nn.gelu(dense(cfg.hidden_dim, name="wi_0")(x), approximate=True) * dense(cfg.hidden_dim, name="wi_1")(x)
    return dense(cfg.embed_dim, name="wo")(hidden)


class EncoderLayer(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, bias: Array, visible: Array) -> Array:
    """x [B, L, E]; bias [1, H, L, L]; visible [B, 1, L] (the unpadded inputs)."""
    cfg = self.config
    attention = Attention(cfg, name="attention")
    h = base.RMSNorm(dtype=cfg.dtype, name="pre_attention_layer_norm")(x)
    keys, values = attention.keys_values(h)
    x = x + attention(h, _head_major(keys), _head_major(values), bias, visible)
    return x + GatedMlp(cfg, name="mlp")(base.RMSNorm(dtype=cfg.dtype, name="pre_mlp_layer_norm")(x))


class Encoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x: Array, mask: Array) -> Array:
    """Embedded inputs x [B, L, E], mask [B, L] (True on the input, False on padding) -> [B, L, E]."""
    cfg = self.config
    positions = jnp.arange(x.shape[1])
    bias = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")(
        (positions[None, :] - positions[:, None])[None])
    for layer in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, name=f"layers_{layer}")(x, bias, mask[:, None, :])
    return base.RMSNorm(dtype=cfg.dtype, name="encoder_norm")(x)


class DecoderLayer(nn.Module):
  config: T5Config

  def setup(self):
    cfg = self.config
    self.pre_self_attention_layer_norm = base.RMSNorm(dtype=cfg.dtype)
    self.self_attention = Attention(cfg)
    self.pre_cross_attention_layer_norm = base.RMSNorm(dtype=cfg.dtype)
    self.encoder_decoder_attention = Attention(cfg)
    self.pre_mlp_layer_norm = base.RMSNorm(dtype=cfg.dtype)
    self.mlp = GatedMlp(cfg)

  def cross_keys_values(self, encoded: Array) -> tuple[Array, Array]:
    """The encoder output's keys, values [B, H, L, D] for this layer's cross-attention."""
    keys, values = self.encoder_decoder_attention.keys_values(encoded)
    return _head_major(keys), _head_major(values)

  def __call__(self, y: Array, bias: Array, visible: Array, cached: tuple[Array, Array, Array, str] | None,
               cross: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
    """y [B, n, E]; bias [B, H, n, K] and visible [B, n, K]: the self-attention's keys (K = n without a
    cache, C with one); cached: this layer's keys, values (an `empty_cache` layout), the new tokens' slots
    [B, n] and the layout, or None; cross: the encoder's keys, values [B, H, L, D] and visible [B, 1, L].
    Returns y and the self-attention's keys, values (the updated cache, or the new tokens' own [B, H, n, D])."""
    h = self.pre_self_attention_layer_norm(y)
    keys, values = self.self_attention.keys_values(h)                      # [B, n, H, D]
    if cached is None:
      keys, values = _head_major(keys), _head_major(values)
      y = y + self.self_attention(h, keys, values, bias, visible)
    else:
      attended, keys, values = self.self_attention.attend_and_write(h, keys, values, cached, bias, visible)
      y = y + attended
    y = y + self.encoder_decoder_attention(self.pre_cross_attention_layer_norm(y), *cross[:2], None, cross[2])
    return y + self.mlp(self.pre_mlp_layer_norm(y)), keys, values


class Decoder(nn.Module):
  config: T5Config

  def setup(self):
    cfg = self.config
    self.relpos_bias = RelativePositionBias(cfg, bidirectional=False)
    self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers)]   # named layers_0, layers_1, …
    self.decoder_norm = base.RMSNorm(dtype=cfg.dtype)
    self.logits_dense = nn.Dense(cfg.vocab_size, use_bias=False, dtype=jnp.float32, kernel_init=_DENSE_INIT)

  def cross_keys_values(self, encoded: Array) -> tuple[list[Array], list[Array]]:
    """encoded [B, L, E] -> every layer's cross-attention keys, values, one [B, H, L, D] per layer."""
    keys, values = zip(*(layer.cross_keys_values(encoded) for layer in self.layers))
    return list(keys), list(values)

  def __call__(self, y: Array, positions: Array, key_positions: Array, mask: Array,
               cache: tuple[list[Array], list[Array], Array, str] | None,
               cross: tuple[list[Array], list[Array], Array]) -> tuple[Array, tuple[list, list] | None, Array]:
    """Logits of embedded tokens y [B, n, E] at decoder positions [B, n].

    Without a cache, the keys are the new tokens: key_positions = positions and mask [B, n, n]. With
    cache = (keys, values: one per layer in an `empty_cache` layout, slots [B, n], the layout) each layer writes
    the new keys/values at slots and attends over its cache: key_positions [B, C] are the slots' position ids, mask [B, n, C]
    (`base.visible_slots`). cross: keys, values (one [B, H, L, D] per layer) and encoder_mask [B, L].
    Returns logits [B, n, V] (float32), the updated (keys, values) lists (None without a cache) and the last
    hidden states [B, n, E] (after the final norm).
    """
    bias = self.relpos_bias(key_positions[:, None, :] - positions[:, :, None])       # [B, H, n, K]
    cross_keys, cross_values, encoder_mask = cross
    new_keys, new_values = [], []
    for i, layer in enumerate(self.layers):
      cached = None if cache is None else (cache[0][i], cache[1][i], cache[2], cache[3])
      y, keys, values = layer(y, bias, mask, cached, (cross_keys[i], cross_values[i], encoder_mask[:, None, :]))
      new_keys.append(keys)
      new_values.append(values)
    hidden = self.decoder_norm(y)
    return (self.logits_dense(hidden.astype(jnp.float32)), None if cache is None else (new_keys, new_values),
            hidden)


class T5Network(nn.Module):
  """The network: `encode` (once per prompt), `decode` (cached or teacher-forced), `__call__` (both)."""
  config: T5Config

  def setup(self):
    cfg = self.config
    self.token_embedder = nn.Embed(cfg.vocab_size, cfg.embed_dim, embedding_init=nn.initializers.normal(stddev=1.0))
    self.encoder = Encoder(cfg)
    self.decoder = Decoder(cfg)

  def encode(self, encoder_tokens: Array, encoder_mask: Array) -> tuple[list[Array], list[Array]]:
    """encoder_tokens, encoder_mask [B, L] -> cross-attention keys, values (one [B, H, L, D] per layer)."""
    encoded = self.encoder(self.token_embedder(encoder_tokens).astype(self.config.dtype), encoder_mask)
    return self.decoder.cross_keys_values(encoded)

  def decode(self, tokens: Array, positions: Array, key_positions: Array, mask: Array,
             cache: tuple[list[Array], list[Array], Array, str] | None, cross: tuple[list[Array], list[Array], Array]
             ) -> tuple[Array, tuple[list, list] | None, Array]:
    """`Decoder.__call__` on the embedded decoder tokens [B, n]."""
    return self.decoder(self.token_embedder(tokens).astype(self.config.dtype), positions, key_positions, mask,
                        cache, cross)

  def __call__(self, encoder_tokens: Array, encoder_mask: Array, decoder_tokens: Array) -> Array:
    """Teacher forcing: logits [B, n, V] of decoder_tokens [B, n] at positions 0 … n−1."""
    keys, values = self.encode(encoder_tokens, encoder_mask)
    b, n = decoder_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    logits, _, _ = self.decode(decoder_tokens, positions, positions, base.causal(b, n), None,
                               (keys, values, encoder_mask))
    return logits


@struct.dataclass
class T5(base.Configured):
  """A `T5Network` bound to its parameters; implements `base.Model` with the prompt as encoder input.

  A pytree: `params` are leaves (a jitted loop takes them as arguments), the config is static. The cache
  (`init_cache`, then `prefill`) holds kv = {keys, values (decoder self-attention, one per layer in the cache's
  `layout`), cross_keys, cross_values (one [B, H, L_enc, D] per layer), encoder_mask [B, L_enc]}.
  """
  params: Any
  config: T5Config = struct.field(pytree_node=False)

  encoder_decoder = True
  scores_trees = True

  def prompt_cache_positions(self, prompt_width: int) -> int:
    """Decoder cache positions a prompt takes: only the start token (the prompt is the encoder's input)."""
    return 1

  def logits(self, decoder_tokens: Array, *, encoder_tokens: Array, encoder_lengths: Array | None = None
             ) -> Array:
    """Teacher-forced logits [B, L, V] (training, evaluation, exact laws in tests).

    decoder_tokens [B, L] are the decoder inputs, starting with the decoder start token 0 (HF's
    decoder_input_ids, T5X's decoder_input_tokens): logits[:, t] is the next-token distribution after
    decoder_tokens[:, :t+1]. Row b's encoder input is encoder_tokens[b, :encoder_lengths[b]] [B, L_enc]
    (default: the whole row).
    """
    mask = _encoder_mask(encoder_tokens, encoder_lengths)
    return T5Network(self.config).apply({"params": self.params}, encoder_tokens, mask, decoder_tokens)

  def init_cache(self, batch_size: int, cache_length: int, layout: str | None = None) -> base.Cache:
    """An empty decoder cache (lengths 0) of `cache_length` positions in `layout` (`base.empty_cache`); `prefill`
    adds the encoder's part."""
    cfg = self.config
    cache = base.empty_cache(batch_size, cache_length, max_length=cfg.max_len, num_layers=cfg.num_decoder_layers,
                             heads=cfg.num_heads, head_dim=cfg.head_dim, dtype=cfg.dtype, layout=layout)
    def empty() -> list[Array]:   # `prefill` writes the encoder's entries
      return [jnp.zeros((batch_size, cfg.num_heads, 0, cfg.head_dim), cfg.dtype) for _ in range(cfg.num_decoder_layers)]
    return cache.replace(kv={**cache.kv, "cross_keys": empty(), "cross_values": empty(),
                             "encoder_mask": jnp.zeros((batch_size, 0), bool)})

  def prefill(self, cache: base.Cache, prompts: Array, prompt_lengths: Array) -> tuple[Array, base.Cache]:
    """Encodes prompts [B, L] (row b: prompts[b, :prompt_lengths[b]]) into an empty cache.

    Returns the pending token [B] (the decoder start token 0, scored by the loop's first step) and the
    cache with the encoder's cross-attention keys/values and mask, decoder lengths 0.
    """
    mask = _encoder_mask(prompts, prompt_lengths)
    cross_keys, cross_values = T5Network(self.config).apply({"params": self.params}, prompts, mask,
                                                            method=T5Network.encode)
    dtype = self.config.dtype
    kv = {**cache.kv, "cross_keys": [k.astype(dtype) for k in cross_keys],
          "cross_values": [v.astype(dtype) for v in cross_values], "encoder_mask": mask}
    batch = prompts.shape[0]
    return (jnp.full((batch,), DECODER_START_TOKEN, jnp.int32),
            cache.replace(kv=kv, lengths=jnp.zeros((batch,), jnp.int32)))

  def score(self, cache: base.Cache, tokens: Array, *, positions: Array | None = None,
            tree_mask: Array | None = None) -> base.Scored:
    """Scores decoder tokens [B, n] after each row's cache: `base.Scored` (logits [B, n, V], the advanced
    cache, the decoder's last hidden states [B, n, E]).

    As `TransformerLM.score`: token i of row b is written at slot lengths[b] + i and sees the row's
    slots < lengths[b] plus the new tokens j with tree_mask[b, i, j] (default causal); positions [B, n]
    (default lengths[b] + i) set the relative position biases; lengths advance by n. The cache must
    have been prefilled (it holds the encoder input).
    """
    kv = cache.kv
    slots, positions, visible = base.new_entries(cache, tokens, positions, tree_mask)
    key_positions = base.key_positions(cache.lengths, positions, base.cache_slots(cache))
    logits, (keys, values), hidden = T5Network(self.config).apply(
        {"params": self.params}, tokens, positions, key_positions, visible,
        (kv["keys"], kv["values"], slots, cache.layout), (kv["cross_keys"], kv["cross_values"], kv["encoder_mask"]),
        method=T5Network.decode)
    cache = cache.replace(kv={**kv, "keys": keys, "values": values}, lengths=cache.lengths + tokens.shape[1])
    logits = partitioning.gather_vocab(logits)
    return base.Scored(logits=logits, cache=cache, hidden=hidden)

  # What a feature drafter (`models.feature_head`) reads through (`base.Features`): the decoder's input
  # embedding (shared with the encoder) and its untied output layer, shared with the drafter, never copied.
  feature_access = True

  @property
  def hidden_size(self) -> int:
    return self.config.embed_dim

  def with_feature_layers(self, layers: tuple[int, ...]) -> Any:
    return base.no_feature_layers(self, layers)

  def output_table(self) -> Array:
    """The output layer's [V, E] table (`decoder/logits_dense/kernel` [E, V], transposed)."""
    return self.params["decoder"]["logits_dense"]["kernel"].T

  def token_embeddings(self, tokens: Array) -> Array:
    """The decoder's input of tokens [B, n] -> [B, n, E] (T5 adds no positions and no scale)."""
    return jnp.take(self.params["token_embedder"]["embedding"], tokens, axis=0).astype(jnp.float32)

  def output_logits(self, hidden: Array, table: Array | None = None) -> Array:
    """Next-token logits [B, n, V] of the decoder's last hidden states [B, n, E] (after the final norm), as
    `score` computes them from its own; through `table` [k, E] (rows of `output_table()`: a draft vocabulary)
    the logits of those k tokens [B, n, k]."""
    kernel = self.params["decoder"]["logits_dense"]["kernel"] if table is None else table.T
    return partitioning.gather_vocab(hidden.astype(jnp.float32) @ kernel.astype(jnp.float32))

  def copy_slots(self, cache: base.Cache, source_rows: Array, source_slots: Array, target_slots: Array
                 ) -> base.Cache:
    """`base.copy_slots` on the decoder's self-attention keys/values (the encoder's part is per row, not per
    slot: multi-draft loops copy only between rows of one prompt)."""
    return base.copy_slots(cache, source_rows, source_slots, target_slots)


def _encoder_mask(encoder_tokens: Array, encoder_lengths: Array | None) -> Array:
  """[B, L] True on each row's first encoder_lengths[b] positions (all of them when None)."""
  b, length = encoder_tokens.shape
  if encoder_lengths is None:
    return jnp.ones((b, length), bool)
  return jnp.arange(length)[None, :] < jnp.asarray(encoder_lengths)[:, None]


def init(config: T5Config, key: Array) -> T5:
  """A randomly initialised model (T5X's initialisers)."""
  one = jnp.zeros((1, 1), jnp.int32)
  variables = T5Network(config).init(key, one, jnp.ones((1, 1), bool), one)
  return T5(params=variables["params"], config=config)


def config(vocab_size: int = VOCAB_SIZE, **fields: Any) -> T5Config:
  """A `T5Config` (the family's constructor: `models.families`)."""
  return T5Config(vocab_size=vocab_size, **fields)


MODEL = T5
