"""The feature head of a feature drafter (EAGLE, Li et al., ICML 2024): one transformer layer that reads
the verifier's own hidden states (layer 2).

At position t it takes the verifier's feature f_{t−1} (its last hidden state after token t − 1, what its
output layer reads to predict token t) and the verifier's embedding of token t, and predicts f_t:

  f̂_t = LN(Block(W [f_{t−1}; e(x_t)] + pos(t)))          (EAGLE §3.1: fc over the concatenation, one layer)

The drafter reads f̂_t through the verifier's own output layer (`output_logits`), so the head has no
embedding or output matrix of its own: both are the verifier's, shared, never copied. Drafting feeds f̂
back in (f̂_t, e(x̂_{t+1})) → f̂_{t+1}; after verification the committed positions are re-read with the
verifier's real features (`decoding.feature_drafter`).

A `FeatureHead` is a pytree (params are leaves) with a static config, like the models: `score` appends
positions to its own one-layer KV cache (`base.Cache`), `predict` is the teacher-forced form (training).
It records the fingerprint of the verifier it was trained for (`verifier_fingerprint`): a head read
through another verifier's output layer would draft from the wrong space, and is refused.

A draft vocabulary (FR-Spec, EAGLE-3; ACL 2025): `draft_ids` [k], the k tokens the head drafts among (the most
frequent of its training data, EOS and the chat's special tokens always in), so that a draft step reads k rows of
the verifier's output layer instead of all V (SmolLM2: 8k of 49k rows, a sixth of the 28M-parameter table). The
head's q over the full vocabulary is then its softmax over those k logits, 0 elsewhere
(`decoding.feature_drafter`): the distribution actually sampled from, so every verification rule stays exact.

Fused features (EAGLE-3, Li et al., 2025, §3.2): a head with `feature_layers` reads, in place of f_{t−1}, the
verifier's low and middle layers' outputs (RMS-normalised) beside f_{t−1}, g_{t−1} [(k + 1)·E]
(`Decoder.with_feature_layers`), reduced to E by a linear map of its own (`reduce`, W_r g) before its fc. Its later
drafts read its own predictions f̂ [E] in that place, which only EAGLE-3's training-time test teaches it
(`predict_unrolled`, `training.feature_head`'s unroll ≥ 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec.models import base, transformer

Array = jax.Array


# Partitioning (`models.partitioning`): the head's "fc" over [features; embeddings] (its "block" is
# transformer.py's, covered by that module's rules).
LOGICAL_AXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"^(fc|reduce)/kernel$", ("embed", "embed")),
    (r"^fc/bias$", ("embed",)),
)


@dataclasses.dataclass(frozen=True)
class FeatureHeadConfig:
  """embed_dim: the verifier's hidden size (features and embeddings); vocab_size: the verifier's vocabulary;
  fingerprint: `verifier_fingerprint` of the verifier it reads (checked by the drafter); feature_layers: the
  verifier's layers whose outputs it reads beside the last hidden state (EAGLE-3's fused features; (): the last
  hidden state alone)."""
  embed_dim: int
  vocab_size: int
  num_heads: int = 4
  hidden_dim: int = 1024
  max_len: int = 2048
  fingerprint: str = ""
  dtype: Any = jnp.float32
  feature_layers: tuple[int, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "feature_layers", tuple(self.feature_layers))   # hashable when read from JSON

  @property
  def feature_width(self) -> int:
    """F, the width of the verifier's features it reads: (k + 1)·E with k feature layers."""
    return (len(self.feature_layers) + 1) * self.embed_dim

  def block_config(self) -> transformer.TransformerConfig:
    return transformer.TransformerConfig(vocab_size=self.vocab_size, embed_dim=self.embed_dim,
                                         num_heads=self.num_heads, num_layers=1, qkv_dim=self.embed_dim,
                                         hidden_dim=self.hidden_dim, max_len=self.max_len, dtype=self.dtype)


class FeatureHeadNet(nn.Module):
  """(features [B, n, E], token embeddings [B, n, E], positions [B, n]) -> predicted features [B, n, E]."""
  config: FeatureHeadConfig

  @nn.compact
  def __call__(self, features: Array, embeddings: Array, positions: Array, mask: Array,
               cached: tuple[Array, Array, Array, str] | None = None):
    cfg = self.config
    x = jnp.concatenate([features, embeddings], axis=-1).astype(cfg.dtype)
    x = nn.Dense(cfg.embed_dim, use_bias=True, dtype=cfg.dtype, name="fc")(x)
    x = x + transformer.sinusoidal_embedding(positions, cfg.embed_dim).astype(cfg.dtype)
    x, keys, values = transformer.DecoderBlock(cfg.block_config(), name="block")(x, mask, cached)
    return nn.LayerNorm(dtype=cfg.dtype, name="final_norm")(x).astype(jnp.float32), keys, values


@struct.dataclass
class FeatureHead:
  """A `FeatureHeadNet` bound to its parameters (module docstring); `draft_ids` [k] int32: its draft vocabulary
  (None: the verifier's whole vocabulary). Not trained: an optimizer sees `params` only."""
  params: Any
  config: FeatureHeadConfig = struct.field(pytree_node=False)
  draft_ids: Array | None = None

  def with_draft_vocabulary(self, ids: Any) -> "FeatureHead":
    """This head drafting among the token ids `ids` only (sorted, unique, within the vocabulary; ValueError
    otherwise); None: among all."""
    if ids is None:
      return self.replace(draft_ids=None)
    ids = np.asarray(ids)
    if (ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer) or np.any(np.diff(ids) <= 0)
        or ids[0] < 0 or ids[-1] >= self.config.vocab_size):
      raise ValueError(f"a draft vocabulary is a non-empty increasing list of token ids in [0, {self.config.vocab_size})"
                       f"; got {ids.shape[0] if ids.ndim == 1 else ids.shape} ids")
    return self.replace(draft_ids=jnp.asarray(ids, jnp.int32))

  @property
  def max_length(self) -> int:
    return self.config.max_len

  def init_cache(self, batch_size: int, cache_length: int, layout: str | None = None) -> base.Cache:
    cfg = self.config.block_config()
    return base.empty_cache(batch_size, cache_length, max_length=cfg.max_len, num_layers=1,
                            heads=cfg.num_heads, head_dim=cfg.head_dim, dtype=cfg.dtype, layout=layout)

  def reduce(self, features: Array) -> Array:
    """The verifier's features [..., F] as the head's input [..., E] (float32): W_r g with fused features, f itself
    otherwise. ValueError where F is not the head's `feature_width` (a verifier returning other layers)."""
    if features.shape[-1] != self.config.feature_width:
      raise ValueError(f"the feature head reads the verifier's features of width {self.config.feature_width} "
                       f"(layers {self.config.feature_layers} and the last); got width {features.shape[-1]}: decode "
                       "with FeatureDrafter.decoding_verifier(verifier), which returns them")
    features = features.astype(jnp.float32)
    if not self.config.feature_layers:
      return features
    return _reduction(self.config).apply({"params": self.params["reduce"]}, features.astype(self.config.dtype)
                                         ).astype(jnp.float32)

  def predict(self, features: Array, embeddings: Array) -> Array:
    """Teacher-forced f̂ [B, L, E] from the verifier's features [B, L, F] (f_{t−1} at t) and embeddings [B, L, E]
    (of x_t)."""
    return self.predict_unrolled(features, embeddings, 1)[0]

  def predict_unrolled(self, features: Array, embeddings: Array, steps: int) -> Array:
    """Training-time test (EAGLE-3 §3.3): `steps` passes over the sequence [steps, B, L, E], as drafting runs.

    Pass 1 is `predict`'s teacher-forced f̂ (reading the verifier's features [B, L, F] at t − 1, `reduce`d). Pass s
    reads at t the prediction of pass s − 1 at t − 1, as draft step s reads the head's own previous output, and
    attends where that draft step would: to pass 1's entries at positions ≤ t − s + 1 (written from the verifier's
    features) and to pass r's entry at t − s + r for r = 2 … s (the drafts before it). Pass s is meaningful at
    t ≥ s − 1 (0-based)."""
    b, length = features.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    cfg = self.config.block_config()
    cache = base.empty_cache(b, steps * length, max_length=steps * length, num_layers=1, heads=cfg.num_heads,
                             head_dim=cfg.head_dim, dtype=cfg.dtype)
    keys, values = cache.kv["keys"][0], cache.kv["values"][0]
    query = jnp.arange(length)[:, None]
    key = jnp.arange(length)[None, :]
    features = self.reduce(features)
    net, inputs, passes = FeatureHeadNet(self.config), features, []
    for step in range(steps):
      blocks = [key <= query - step] + [key == query - step + r for r in range(1, step + 1)]
      blocks += [jnp.zeros((length, length), bool)] * (steps - step - 1)
      mask = jnp.broadcast_to(jnp.concatenate(blocks, axis=1), (b, length, steps * length))
      slots = step * length + positions
      predicted, keys, values = net.apply({"params": self._net_params}, inputs, embeddings, positions, mask,
                                          (keys, values, slots, cache.layout))
      passes.append(predicted)
      inputs = jnp.concatenate([features[:, :1], predicted[:, :-1].astype(features.dtype)], axis=1)
    return jnp.stack(passes)

  @property
  def _net_params(self) -> Any:
    return {name: value for name, value in self.params.items() if name != "reduce"}

  def score(self, cache: base.Cache, features: Array, embeddings: Array) -> tuple[Array, base.Cache]:
    """Appends positions [B, n] (features: the verifier's `reduce`d or the head's own predictions, and
    embeddings, [B, n, E]) at each row's length; returns f̂ [B, n, E]."""
    tokens = jnp.zeros(features.shape[:2], jnp.int32)        # only the shape: slots and masks
    slots, positions, mask = base.new_entries(cache, tokens, None, None)
    predicted, keys, values = FeatureHeadNet(self.config).apply(
        {"params": self._net_params}, features, embeddings, positions, mask,
        (cache.kv["keys"][0], cache.kv["values"][0], slots, cache.layout))
    return predicted, cache.replace(kv={"keys": [keys], "values": [values]}, lengths=cache.lengths + features.shape[1])


# Digests by the output table they were taken of (id → (weak reference, digest)): hashing SmolLM2's 113 MB table
# took 63 ms, paid by every decode that checks its pair. A jax array never changes (a NumPy one can: not kept), and
# an entry goes with its array.
_FINGERPRINTS: dict[int, tuple[weakref.ref, str]] = {}


def verifier_fingerprint(verifier) -> str:
  """A short digest of the verifier's output layer (its embedding, which the head reads through) and shape,
  computed once per table array."""
  table = verifier.output_table()
  known = _FINGERPRINTS.get(id(table))
  if known is not None and known[0]() is table:
    return known[1]
  values = np.asarray(jax.device_get(table), np.float32)
  digest = hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]
  fingerprint = f"{values.shape[0]}x{values.shape[1]}:{digest}"
  if isinstance(table, jax.Array):
    _FINGERPRINTS[id(table)] = (weakref.ref(table, lambda _, key=id(table): _FINGERPRINTS.pop(key, None)),
                                fingerprint)
  return fingerprint


def _reduction(config: FeatureHeadConfig) -> nn.Dense:
  return nn.Dense(config.embed_dim, use_bias=False, dtype=config.dtype)


def init(verifier, key: Array, *, num_heads: int = 4, hidden_dim: int | None = None,
         feature_layers: tuple[int, ...] = ()) -> FeatureHead:
  """A randomly initialised head for `verifier` (its hidden size, vocabulary and fingerprint), reading the outputs
  of its `feature_layers` beside its last hidden state."""
  embed_dim = verifier.hidden_size
  return init_from_config(FeatureHeadConfig(embed_dim=embed_dim, vocab_size=verifier.vocab_size, num_heads=num_heads,
                                            hidden_dim=hidden_dim or 4 * embed_dim, max_len=verifier.max_length,
                                            fingerprint=verifier_fingerprint(verifier),
                                            feature_layers=tuple(feature_layers)), key)


def init_from_config(config: FeatureHeadConfig, key: Array) -> FeatureHead:
  one = jnp.zeros((1, 1, config.embed_dim), jnp.float32)
  params = FeatureHeadNet(config).init(key, one, one, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1, 1), bool))
  params = dict(params["params"])
  if config.feature_layers:
    fused = jnp.zeros((1, 1, config.feature_width), jnp.float32)
    params["reduce"] = _reduction(config).init(jax.random.fold_in(key, 1), fused)["params"]
  return FeatureHead(params=params, config=config)
