"""The decoder-only network of the Gemma 2 and Llama families (layer 2): one network, the families' differences
as switches of its config, behind `base.Model`.

A block is RMSNorm → grouped-query attention (`num_kv_heads` key/value heads, each shared by num_heads /
num_kv_heads query heads; RoPE in the rotate-half layout) → residual, then RMSNorm → gated MLP
act(x·W_gate) ⊙ (x·W_up) · W_down → residual; a final RMSNorm and the output projection. The switches
(`DecoderConfig`; the families' values in `models.gemma2` and `models.llama`):

  switch               Llama                  Gemma 2
  norm_offset          0: RMSNorm(x)·w        1: RMSNorm(x)·(1 + w)
  post_norms           no                     RMSNorm after attention and after the MLP, before the residual
  activation           silu (SwiGLU)          gelu_tanh (GeGLU)
  scale_embeddings     no                     input embeddings × √E
  attn_logit_softcap   none                   50: c·tanh(s / c)
  final_logit_softcap  none                   30
  sliding_window       none                   4096 on local layers (alternating with global ones, the first local)
  tie_embeddings       either (an untied `embedder/output_embedding` [V, E])   tied
  query_pre_attn_scalar  head_dim             256 (2B, 9B), 144 (27B): queries scaled by its −½ power

Parameters keep the gemma library's names (embedder/input_embedding [V, E], layer_i/attn/q_einsum/w,
kv_einsum/w, attn_vec_einsum/w, mlp/gating_einsum, mlp/linear, layer_i/pre_attention_norm/scale, …), laid out
input dimension first — q_einsum [E, N, H], kv_einsum [E, 2, K, H], attn_vec_einsum [N, H, E], gating_einsum
[E, 2, F], linear [F, E] — so that every projection is one matrix product of the stored array on XLA:CPU (the
gemma library's [N, E, H] and [2, F, E] made XLA:CPU transpose each weight on every call: a 30-layer
SmolLM2-shaped query projection took 15.4 ms at one token, 0.8 ms laid out this way). Checkpoint loaders
(`training.decoder_checkpoints`, `training.gguf_checkpoints`) lay tensors out so.

The cache is `base.empty_cache`'s: one keys and one values array per layer, written before attending, one length
per row. A key's position is its slot for committed entries and the caller's position id for the tokens of
the current call (token trees give siblings one position), which is what the sliding window compares.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from specdec.models import base, cpu_kernel, partitioning

Array = jax.Array

LOCAL, GLOBAL = "local", "global"
# The gemma library's layouts (and this module's before they were laid out input-first: Gemma 2 exports written
# then) are ours transposed: our parameter path's suffix -> the axes of its array that give ours.
GEMMA_LIBRARY_AXES: dict[str, tuple[int, ...]] = {
    "attn/q_einsum/w": (1, 0, 2),        # [N, E, H] -> [E, N, H]
    "attn/kv_einsum/w": (2, 0, 1, 3),    # [2, K, E, H] -> [E, 2, K, H]
    "mlp/gating_einsum": (2, 0, 1),      # [2, F, E] -> [E, 2, F]
}


def from_gemma_library_layout(path: str, array: Any) -> Any:
  """`array`, stored at parameter `path` in the gemma library's layout, in ours (other parameters as they are)."""
  axes = next((axes for suffix, axes in GEMMA_LIBRARY_AXES.items() if path.endswith(suffix)), None)
  return array if axes is None else array.transpose(axes)
ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": lambda x: nn.gelu(x, approximate=True)}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Hyperparameters (Hugging Face's config names in comments). Frozen: static under jit. The defaults of the
  switches are the plain (Llama) decoder's; `gemma2.config` and `llama.config` set each family's."""
  vocab_size: int                               # vocab_size
  embed_dim: int                                # hidden_size
  hidden_dim: int                               # intermediate_size
  num_layers: int                               # num_hidden_layers
  num_heads: int                                # num_attention_heads
  num_kv_heads: int                             # num_key_value_heads
  head_dim: int                                 # head_dim
  query_pre_attn_scalar: float | None = None    # query_pre_attn_scalar: queries scaled by its −½ power (None: head_dim)
  rope_theta: float = 10_000.0                  # rope_theta
  rms_norm_eps: float = 1e-6                    # rms_norm_eps
  max_len: int = 8192                           # max_position_embeddings: the largest cache length accepted
  norm_offset: float = 0.0                      # RMSNorm's gain is norm_offset + scale (Gemma: 1)
  post_norms: bool = False                      # Gemma 2's norms after attention and after the MLP
  activation: str = "silu"                      # hidden_act of the gated MLP: silu, gelu_tanh
  scale_embeddings: bool = False                # Gemma: input embeddings × √embed_dim
  tie_embeddings: bool = True                   # tie_word_embeddings
  attn_logit_softcap: float | None = None       # attn_logit_softcapping
  final_logit_softcap: float | None = None      # final_logit_softcapping
  sliding_window: int | None = None             # sliding_window of the local layers
  layer_types: tuple[str, ...] = ()             # LOCAL / GLOBAL per layer; (): alternating, the first LOCAL, where
                                                # a sliding window is set, else all GLOBAL
  dtype: Any = jnp.float32                      # weights, activations, cache; norms, softmax, logits: float32
  feature_layers: tuple[int, ...] = ()          # not a checkpoint's: the hidden states the network returns
                                                # (`Decoder.with_feature_layers`)

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even (RoPE rotates pairs); got {self.head_dim}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}; got {self.activation!r}")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))   # hashable when read from JSON
    object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
    if any(not 0 <= layer < self.num_layers - 1 for layer in self.feature_layers) or (
        list(self.feature_layers) != sorted(set(self.feature_layers))):
      raise ValueError(f"feature_layers must be increasing layer indices in [0, {self.num_layers - 1}) (the last "
                       f"layer's state is always returned); got {self.feature_layers}")
    if self.layer_types and (len(self.layer_types) != self.num_layers
                             or set(self.layer_types) - {LOCAL, GLOBAL}):
      raise ValueError(f"layer_types must give {LOCAL!r} or {GLOBAL!r} for each of the {self.num_layers} layers; "
                       f"got {self.layer_types}")
    if LOCAL in self.layer_types and self.sliding_window is None:
      raise ValueError("layer_types names local layers but sliding_window is None")

  @property
  def cache_heads(self) -> int:
    return self.num_kv_heads

  @property
  def attention_types(self) -> tuple[str, ...]:
    if self.layer_types or self.sliding_window is None:
      return self.layer_types or (GLOBAL,) * self.num_layers
    return tuple(LOCAL if i % 2 == 0 else GLOBAL for i in range(self.num_layers))

  @property
  def query_scale(self) -> float:
    return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5


# Partitioning (`models.partitioning`): a regular expression on the "/"-joined parameter path, the logical axes of
# its dimensions; the 2 of kv_einsum / gating_einsum (keys and values; gate and up) is replicated.
LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^embedder/(input|output)_embedding$", ("vocab", "embed")),
    (r"^layer_\d+/attn/q_einsum/w$", ("embed", "heads", "kv")),
    (r"^layer_\d+/attn/kv_einsum/w$", ("embed", "stack", "heads", "kv")),
    (r"^layer_\d+/attn/attn_vec_einsum/w$", ("heads", "kv", "embed")),
    (r"^layer_\d+/mlp/gating_einsum$", ("embed", "stack", "mlp")),
    (r"^layer_\d+/mlp/linear$", ("mlp", "embed")),
    (r"^(layer_\d+/(pre_attention|post_attention|pre_ffw|post_ffw)_norm|final_norm)/scale$", ("embed",)),
)


def soft_cap(x: Array, cap: float | None) -> Array:
  """cap · tanh(x / cap) (no cap: x)."""
  return x if cap is None else cap * jnp.tanh(x / cap)


def rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotary position embedding of x [B, n, heads, H] at position ids [B, n], rotate-half layout: the first
  and second halves of each head are the two coordinates of H/2 rotated pairs."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float32) * 2 / x.shape[-1])
  angles = positions[..., None, None].astype(jnp.float32) * inv_freq           # [B, n, 1, H/2]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


class Einsum(nn.Module):
  """A weight `w` of `shape` applied by one einsum; its input dimension has `fan_in` entries."""
  shape: tuple[int, ...]
  fan_in: int
  dtype: Any

  @nn.compact
  def __call__(self, equation: str, x: Array) -> Array:
    w = self.param("w", nn.initializers.normal(stddev=1.0 / math.sqrt(self.fan_in)), self.shape)
    return cpu_kernel.einsum(equation, x, w.astype(self.dtype))


class Attention(nn.Module):
  """Grouped-query attention of n new tokens over themselves or over a row's cache after writing them."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, visible: Array, cached: tuple[Array, Array, Array, str] | None
               ) -> tuple[Array, Array, Array]:
    """x [B, n, E] at position ids [B, n]; visible [B, n, C]: which keys each query sees (C = n without a
    cache). With cached = (keys, values in an `empty_cache` layout, slots [B, n], the layout) the new keys/values
    are written at slots first. Returns out [B, n, E] and the keys, values."""
    cfg = self.config
    e, heads = cfg.embed_dim, cfg.num_kv_heads
    query = Einsum((e, cfg.num_heads, cfg.head_dim), e, cfg.dtype, name="q_einsum")("bne,eNh->bnNh", x)
    key, value = Einsum((e, 2, heads, cfg.head_dim), e, cfg.dtype, name="kv_einsum")(
        "bne,eckh->cbnkh", x)
    query = rope(query, positions, cfg.rope_theta) * jnp.asarray(cfg.query_scale, cfg.dtype)
    key = rope(key, positions, cfg.rope_theta)
    if cached is None:
      keys, values = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)                      # [B, K, n, H]
      out = base.attend(query, keys, values, visible, soft_cap=cfg.attn_logit_softcap)               # head k·G + g
    else:
      out, keys, values = base.attend_and_write(query, key, value, cached, visible, soft_cap=cfg.attn_logit_softcap)
    out = Einsum((cfg.num_heads, cfg.head_dim, e), cfg.num_heads * cfg.head_dim, cfg.dtype,
                 name="attn_vec_einsum")("bnNh,Nhe->bne", out)
    return out, keys, values


class Mlp(nn.Module):
  """act(x·W_gate) ⊙ (x·W_up), projected back (gating_einsum [E, 2, F]: gate, up; linear [F, E])."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    gating = self.param("gating_einsum", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.embed_dim)),
                        (cfg.embed_dim, 2, cfg.hidden_dim))
    linear = self.param("linear", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.hidden_dim)),
                        (cfg.hidden_dim, cfg.embed_dim))
    gated = cpu_kernel.einsum("bne,ecf->bncf", x, gating.astype(cfg.dtype))
    hidden = ACTIVATIONS[cfg.activation](gated[:, :, 0]) * gated[:, :, 1]
    return cpu_kernel.einsum("bnf,fe->bne", hidden, linear.astype(cfg.dtype))


class Block(nn.Module):
  """x + [post_norm](attention(pre_norm(x))), then the same with the MLP."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, x: Array, positions: Array, visible: Array, cached: tuple[Array, Array, Array, str] | None
               ) -> tuple[Array, Array, Array]:
    cfg = self.config

    def norm(name: str) -> base.RMSNorm:
      return base.RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, name=name)

    def post(name: str, y: Array) -> Array:
      return norm(name)(y) if cfg.post_norms else y

    attended, keys, values = Attention(cfg, name="attn")(norm("pre_attention_norm")(x), positions, visible, cached)
    x = x + post("post_attention_norm", attended)
    return x + post("post_ffw_norm", Mlp(cfg, name="mlp")(norm("pre_ffw_norm")(x))), keys, values


class Embedder(nn.Module):
  """The token embedding table [V, E] and, untied, the output projection's own [V, E] table."""
  config: DecoderConfig

  @nn.compact
  def __call__(self) -> tuple[Array, Array]:
    cfg = self.config
    shape = (cfg.vocab_size, cfg.embed_dim)
    table = self.param("input_embedding", nn.initializers.normal(stddev=1.0), shape)
    if cfg.tie_embeddings:
      return table, table
    return table, self.param("output_embedding", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.embed_dim)), shape)


class DecoderNetwork(nn.Module):
  """Tokens -> next-token logits, optionally attending to a KV cache."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, tokens: Array, positions: Array, visible: Array, key_positions: Array,
               cache: tuple[list[Array], list[Array], Array, str] | None = None
               ) -> tuple[Array, tuple[list[Array], list[Array]] | None, Array]:
    """Logits [B, n, V] (float32) of tokens [B, n] at position ids [B, n]. visible [B, n, C]: the keys each
    token may see (causal, tree, committed slots); key_positions [B, C]: each key's position id, which
    the local layers' sliding window compares. With cache = (keys, values: one array per layer, slots [B, n],
    their layout) each layer writes the new entries at slots first. Also returns the updated (keys, values)
    lists (None without a cache) and the last hidden states [B, n, E] (after the final norm); with
    `feature_layers` [B, n, (k + 1)·E], the outputs of those k layers, each RMS-normalised without a gain, before
    them (EAGLE-3's fused features)."""
    cfg = self.config
    embedding, output = Embedder(cfg, name="embedder")()
    x = embedding.astype(cfg.dtype)[tokens]
    if cfg.scale_embeddings:
      x = x * jnp.asarray(math.sqrt(cfg.embed_dim), cfg.dtype)
    in_window = None
    if cfg.sliding_window is not None:
      in_window = key_positions[:, None, :] > positions[:, :, None] - cfg.sliding_window      # [B, n, C]
    new_keys, new_values, features = [], [], []
    for layer, kind in enumerate(cfg.attention_types):
      cached = None if cache is None else (cache[0][layer], cache[1][layer], cache[2], cache[3])
      seen = visible & in_window if kind == LOCAL else visible
      x, keys, values = Block(cfg, name=f"layer_{layer}")(x, positions, seen, cached)
      new_keys.append(keys)
      new_values.append(values)
      if layer in cfg.feature_layers:
        features.append(base.rms_normalize(x, cfg.rms_norm_eps).astype(jnp.float32))
    x = base.RMSNorm(cfg.rms_norm_eps, cfg.norm_offset, name="final_norm")(x)
    hidden = jnp.concatenate(features + [x.astype(jnp.float32)], axis=-1) if features else x
    return output_logits(cfg, output, x), None if cache is None else (new_keys, new_values), hidden


def output_logits(config: DecoderConfig, table: Array, hidden: Array) -> Array:
  """Soft-capped next-token logits [B, n, V] (float32) of last hidden states [B, n, E] through the output
  table [V, E]."""
  logits = cpu_kernel.einsum("bne,ve->bnv", hidden.astype(jnp.float32), table.astype(jnp.float32))
  return soft_cap(logits, config.final_logit_softcap)


@struct.dataclass
class Decoder(base.DecoderOnly):
  """A `DecoderNetwork` bound to its parameters; implements `base.Model` (decoder-only: the prompt is the
  decoder's prefix). A pytree: `params` are leaves, the config is static."""
  params: Any
  config: DecoderConfig = struct.field(pytree_node=False)

  def _apply(self, *args) -> tuple[Array, Any, Array]:
    return DecoderNetwork(self.config).apply({"params": self.params}, *args)

  # What a feature drafter reads (`decoding.feature_drafter`, `base.Features`): the verifier's own embedding and
  # output layer.
  feature_access = True

  @property
  def hidden_size(self) -> int:
    return self.config.embed_dim

  def with_feature_layers(self, layers: tuple[int, ...]) -> "Decoder":   # `base.Features`
    """This model (the same parameters, logits and cache) returning as its hidden states [B, n, (k + 1)·E] the
    outputs of the k `layers` (0-based, RMS-normalised without a gain) before its last hidden state: the fused
    features an EAGLE-3 head reads. ValueError for indices outside [0, num_layers − 1)."""
    return self.replace(config=dataclasses.replace(self.config, feature_layers=tuple(layers)))

  def output_table(self) -> Array:
    """The output layer's [V, E] table (the input embedding where they are tied)."""
    embedder = self.params["embedder"]
    return embedder["input_embedding"] if self.config.tie_embeddings else embedder["output_embedding"]

  def token_embeddings(self, tokens: Array) -> Array:
    """The network's input of tokens [B, n] -> [B, n, E] (float32): the embedding, × √E where it scales."""
    x = jnp.take(self.params["embedder"]["input_embedding"], tokens, axis=0).astype(jnp.float32)
    return x * math.sqrt(self.config.embed_dim) if self.config.scale_embeddings else x

  def output_logits(self, hidden: Array, table: Array | None = None) -> Array:
    """Next-token logits [B, n, V] of last hidden states [B, n, E] (after the final norm), as `score` computes
    them from its own; through `table` [k, E] (rows of `output_table()`: a draft vocabulary) the logits of those
    k tokens [B, n, k]."""
    table = self.output_table() if table is None else table
    return partitioning.gather_vocab(output_logits(self.config, table, hidden))


def init(config: DecoderConfig, key: Array) -> Decoder:
  """A randomly initialised model (RMSNorm gains 1)."""
  one = jnp.zeros((1, 1), jnp.int32)
  variables = DecoderNetwork(config).init(key, one, one, jnp.ones((1, 1, 1), bool), one)
  return Decoder(params=variables["params"], config=config)


MODEL = Decoder
