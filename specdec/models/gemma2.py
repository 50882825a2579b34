"""Gemma 2 (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024), decoder-only,
behind `base.Model` (layer 2): the drafter/verifier pairs of the speculative-cascades paper's §6 (2B → 9B,
2B → 27B).

The architecture as the report and the released checkpoints define it:
- token embeddings scaled by √d_model, tied to the output projection;
- blocks of RMSNorm(x)·(1 + w) before and after attention and before and after the MLP, each sublayer's
  normalised output added to the residual stream;
- grouped-query attention (`num_kv_heads` key/value heads, each shared by num_heads / num_kv_heads query
  heads), RoPE (rotate-half layout, θ = 10,000), queries scaled by query_pre_attn_scalar^−½, attention
  logits soft-capped (c · tanh(s / c), c = 50);
- local sliding-window layers (a query at position t sees keys at positions > t − window) alternating with
  global ones, the first layer local;
- a GeGLU MLP: gelu_tanh(x·W_gate) ⊙ (x·W_up) · W_down;
- a final RMSNorm and final-logit soft-capping (c = 30).

Parameters keep the `gemma` library's names and layouts (embedder/input_embedding [V, E], layer_i/attn/
q_einsum/w [N, E, H], kv_einsum/w [2, K, E, H], attn_vec_einsum/w [N, H, E], mlp/gating_einsum [2, F, E]
(its Gemma 2 order: `transpose_gating_einsum`), mlp/linear [F, E], and the four norms' scale [E]), so its checkpoints map one to one; Hugging Face's
`Gemma2ForCausalLM` tensors are transposed into them by `training.load_hf`.

The cache is `transformer.py`'s: one keys and one values array per layer, [B, K, C, H], written before
attending, one length per row. A key's position is its slot for committed entries and the caller's
position id for the tokens of the current call (token trees give siblings one position), which is what the
sliding window compares.
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

from specdec.models import base, partitioning

Array = jax.Array

LOCAL, GLOBAL = "local", "global"


@dataclasses.dataclass(frozen=True)
class Gemma2Config:
  """Hyperparameters (Hugging Face's `Gemma2Config` names in comments). Frozen: static under jit."""
  vocab_size: int                          # vocab_size
  embed_dim: int = 2304                    # hidden_size
  hidden_dim: int = 9216                   # intermediate_size
  num_layers: int = 26                     # num_hidden_layers
  num_heads: int = 8                       # num_attention_heads
  num_kv_heads: int = 4                    # num_key_value_heads
  head_dim: int = 256                      # head_dim
  query_pre_attn_scalar: float = 256.0     # query_pre_attn_scalar: queries are scaled by its −½ power
  sliding_window: int = 4096               # sliding_window
  attn_logit_softcap: float | None = 50.0  # attn_logit_softcapping
  final_logit_softcap: float | None = 30.0  # final_logit_softcapping
  rope_theta: float = 10_000.0             # rope_theta
  rms_norm_eps: float = 1e-6               # rms_norm_eps
  max_len: int = 8192                      # max_position_embeddings: the largest cache length accepted
  layer_types: tuple[str, ...] = ()        # LOCAL / GLOBAL per layer; () alternates, the first LOCAL
  dtype: Any = jnp.float32                 # weights, activations, cache; norms, softmax, logits: float32

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even (RoPE rotates pairs); got {self.head_dim}")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))   # hashable when read from JSON
    if self.layer_types and (len(self.layer_types) != self.num_layers
                             or set(self.layer_types) - {LOCAL, GLOBAL}):
      raise ValueError(f"layer_types must give {LOCAL!r} or {GLOBAL!r} for each of the {self.num_layers} layers; "
                       f"got {self.layer_types}")

  @property
  def cache_heads(self) -> int:
    return self.num_kv_heads

  @property
  def attention_types(self) -> tuple[str, ...]:
    return self.layer_types or tuple(LOCAL if i % 2 == 0 else GLOBAL for i in range(self.num_layers))


# The report's sizes (Table 1; the released configs). The released vocabulary is 256,000 tokens (Hugging Face);
# the gemma library's checkpoints pad the embedding to 256,128 rows.
PRESETS: dict[str, dict[str, Any]] = {
    "gemma2_tiny": dict(embed_dim=32, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        query_pre_attn_scalar=8.0, sliding_window=8),
    "gemma2_2b": dict(embed_dim=2304, hidden_dim=9216, num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256,
                      query_pre_attn_scalar=256.0),
    "gemma2_9b": dict(embed_dim=3584, hidden_dim=14336, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                      query_pre_attn_scalar=256.0),
    "gemma2_27b": dict(embed_dim=4608, hidden_dim=36864, num_layers=46, num_heads=32, num_kv_heads=16,
                       head_dim=128, query_pre_attn_scalar=144.0),
}


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


class RMSNorm(nn.Module):
  """x / rms(x) · (1 + scale), in float32 (scale starts at 0)."""
  eps: float

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class Embedder(nn.Module):
  """The token embedding table [V, E], shared by the input and the output projection."""
  vocab_size: int
  embed_dim: int

  @nn.compact
  def __call__(self) -> Array:
    return self.param("input_embedding", nn.initializers.normal(stddev=1.0), (self.vocab_size, self.embed_dim))


class Einsum(nn.Module):
  """A weight `w` of `shape` applied by one einsum (the gemma library's parameter layout)."""
  shape: tuple[int, ...]
  dtype: Any

  @nn.compact
  def __call__(self, equation: str, x: Array) -> Array:
    w = self.param("w", nn.initializers.normal(stddev=1.0 / math.sqrt(self.shape[-2])), self.shape)
    return jnp.einsum(equation, x, w.astype(self.dtype))


class Attention(nn.Module):
  """Grouped-query attention of n new tokens over themselves or over a row's cache after writing them."""
  config: Gemma2Config

  @nn.compact
  def __call__(self, x: Array, positions: Array, visible: Array, cached: tuple[Array, Array, Array] | None
               ) -> tuple[Array, Array, Array]:
    """x [B, n, E] at position ids [B, n]; visible [B, n, C]: which keys each query sees (C = n without a
    cache). With cached = (keys, values [B, K, C, H], slots [B, n]) the new keys/values are written at slots
    first. Returns out [B, n, E] and the keys, values [B, K, C, H]."""
    cfg = self.config
    heads = cfg.num_kv_heads
    query = Einsum((cfg.num_heads, cfg.embed_dim, cfg.head_dim), cfg.dtype, name="q_einsum")("bne,Neh->bnNh", x)
    key, value = Einsum((2, heads, cfg.embed_dim, cfg.head_dim), cfg.dtype, name="kv_einsum")("bne,ckeh->cbnkh", x)
    query = rope(query, positions, cfg.rope_theta) * jnp.asarray(cfg.query_pre_attn_scalar ** -0.5, cfg.dtype)
    key = rope(key, positions, cfg.rope_theta)
    if cached is None:
      keys, values = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)        # [B, K, n, H]
    else:
      keys, values, slots = cached
      keys, values = base.write_slots(keys, key, slots), base.write_slots(values, value, slots)
    out = base.attend(query, keys, values, visible, soft_cap=cfg.attn_logit_softcap)      # head k·G + g
    out = Einsum((cfg.num_heads, cfg.head_dim, cfg.embed_dim), cfg.dtype, name="attn_vec_einsum")("bnNh,Nhe->bne", out)
    return out, keys, values


class Mlp(nn.Module):
  """GeGLU: gelu_tanh(x·W_gate) ⊙ (x·W_up), projected back (gating_einsum [2, F, E]: gate, up; linear [F, E])."""
  config: Gemma2Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    gating = self.param("gating_einsum", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.embed_dim)),
                        (2, cfg.hidden_dim, cfg.embed_dim))
    linear = self.param("linear", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.hidden_dim)),
                        (cfg.hidden_dim, cfg.embed_dim))
    gate, up = jnp.einsum("bne,cfe->cbnf", x, gating.astype(cfg.dtype))
    return jnp.einsum("bnf,fe->bne", nn.gelu(gate, approximate=True) * up, linear.astype(cfg.dtype))


class Block(nn.Module):
  """x + post_norm(attention(pre_norm(x))), then the same with the MLP."""
  config: Gemma2Config

  @nn.compact
  def __call__(self, x: Array, positions: Array, visible: Array, cached: tuple[Array, Array, Array] | None
               ) -> tuple[Array, Array, Array]:
    eps = self.config.rms_norm_eps
    attended, keys, values = Attention(self.config, name="attn")(RMSNorm(eps, name="pre_attention_norm")(x),
                                                                 positions, visible, cached)
    x = x + RMSNorm(eps, name="post_attention_norm")(attended)
    mlp = Mlp(self.config, name="mlp")(RMSNorm(eps, name="pre_ffw_norm")(x))
    return x + RMSNorm(eps, name="post_ffw_norm")(mlp), keys, values


class Gemma2Network(nn.Module):
  """Tokens -> soft-capped next-token logits, optionally attending to a KV cache."""
  config: Gemma2Config

  @nn.compact
  def __call__(self, tokens: Array, positions: Array, visible: Array, key_positions: Array,
               cache: tuple[list[Array], list[Array], Array] | None = None
               ) -> tuple[Array, tuple[list[Array], list[Array]] | None, Array]:
    """Logits [B, n, V] (float32) of tokens [B, n] at position ids [B, n]. visible [B, n, C]: the keys each
    token may see (causal, tree, committed slots); key_positions [B, C]: each key's position id, which
    the local layers' sliding window compares. With cache = (keys, values: one [B, K, C, H] per layer,
    slots [B, n]) each layer writes the new entries at slots first. Also returns the updated (keys, values)
    lists (None without a cache) and the last hidden states [B, n, E] (after the final norm)."""
    cfg = self.config
    embedding = Embedder(cfg.vocab_size, cfg.embed_dim, name="embedder")()
    x = embedding.astype(cfg.dtype)[tokens] * jnp.asarray(math.sqrt(cfg.embed_dim), cfg.dtype)
    in_window = key_positions[:, None, :] > positions[:, :, None] - cfg.sliding_window      # [B, n, C]
    new_keys, new_values = [], []
    for layer, kind in enumerate(cfg.attention_types):
      cached = None if cache is None else (cache[0][layer], cache[1][layer], cache[2])
      seen = visible & in_window if kind == LOCAL else visible
      x, keys, values = Block(cfg, name=f"layer_{layer}")(x, positions, seen, cached)
      new_keys.append(keys)
      new_values.append(values)
    x = RMSNorm(cfg.rms_norm_eps, name="final_norm")(x)
    logits = soft_cap(jnp.einsum("bne,ve->bnv", x.astype(jnp.float32), embedding.astype(jnp.float32)),
                      cfg.final_logit_softcap)
    return logits, None if cache is None else (new_keys, new_values), x


@struct.dataclass
class Gemma2(base.DecoderOnly):
  """A `Gemma2Network` bound to its parameters; implements `base.Model` (decoder-only: the prompt is the
  decoder's prefix). A pytree: `params` are leaves, the config is static."""
  params: Any
  config: Gemma2Config = struct.field(pytree_node=False)

  def _apply(self, *args) -> tuple[Array, Any, Array]:
    return Gemma2Network(self.config).apply({"params": self.params}, *args)

  # What a feature drafter reads (`decoding.feature_drafter`): the tied embedding, as the network uses it.
  @property
  def hidden_size(self) -> int:
    return self.config.embed_dim

  def output_table(self) -> Array:
    """The output layer's [V, E] table (the tied input embedding)."""
    return self.params["embedder"]["input_embedding"]

  def token_embeddings(self, tokens: Array) -> Array:
    """The network's input of tokens [B, n] -> [B, n, E]: the embedding scaled by √E."""
    return jnp.take(self.output_table(), tokens, axis=0).astype(jnp.float32) * math.sqrt(self.config.embed_dim)

  def output_logits(self, hidden: Array) -> Array:
    """Soft-capped next-token logits [B, n, V] of last hidden states [B, n, E] (after the final norm), as
    `score` computes them from its own."""
    logits = jnp.einsum("bne,ve->bnv", hidden.astype(jnp.float32), self.output_table().astype(jnp.float32))
    return partitioning.gather_vocab(soft_cap(logits, self.config.final_logit_softcap))

  def logits(self, tokens: Array, *, return_hidden: bool = False) -> Array | tuple[Array, Array]:
    """Teacher-forced logits [B, L, V] of tokens [B, L] at positions 0 … L−1 (and with `return_hidden`
    the last hidden states [B, L, E])."""
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    logits, _, hidden = self._apply(tokens, positions, base.causal(b, length), positions)
    return (logits, hidden) if return_hidden else logits

  def score(self, cache: base.Cache, tokens: Array, *, positions: Array | None = None,
            tree_mask: Array | None = None) -> base.Scored:
    """Scores tokens [B, n] after each row's cache: `base.Scored` (`transformer.TransformerLM.score`: slots
    lengths[b] + i, `tree_mask` [B, n, n], position ids `positions` [B, n], default the slots)."""
    n, cache_length = tokens.shape[1], base.cache_slots(cache.kv["keys"][0])
    slots, positions, visible = base.new_entries(cache, tokens, positions, tree_mask)
    key_positions = base.key_positions(cache.lengths, positions, cache_length)
    logits, (keys, values), hidden = self._apply(tokens, positions, visible, key_positions,
                                                 (cache.kv["keys"], cache.kv["values"], slots))
    cache = base.Cache(kv={"keys": keys, "values": values}, lengths=cache.lengths + n)
    logits = partitioning.gather_vocab(logits)
    return base.Scored(logits=logits, cache=cache, hidden=hidden)


def init(config: Gemma2Config, key: Array) -> Gemma2:
  """A randomly initialised model (norm scales 0, i.e. RMSNorm's gain 1)."""
  one = jnp.zeros((1, 1), jnp.int32)
  variables = Gemma2Network(config).init(key, one, one, jnp.ones((1, 1, 1), bool), one)
  return Gemma2(params=variables["params"], config=config)


def build(preset: str, *, vocab_size: int, seed: int = 0, max_length: int = 8192) -> Gemma2:
  """A randomly initialised model of a preset (`PRESETS`)."""
  return init(Gemma2Config(vocab_size=vocab_size, max_len=max_length, **PRESETS[preset]), jax.random.PRNGKey(seed))
