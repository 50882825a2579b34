"""The tests' small models: a toy model behind the `specdec.models.base` interface, for exact law tests of the
decode loops, a toy drafter that agrees with it often, and the random tiny drafter/verifier pairs of any family
that the decoding, drafter and model tests share.

The toy model's logits after position t depend on (t, x_{t−1}, x_t) through a random table, and it keeps a
real token cache, so a wrong rollback (a stale draft read back), an off-by-one position or a wrongly kept tree
path changes its output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec import models
from specdec.models.base import Cache, Scored


@functools.lru_cache(maxsize=None)
def tiny(seed: int, vocab_size: int, max_length: int, *, scale: float = 1.0, preset: str = "tiny", **fields):
  """`models.build(preset, …)` with every weight multiplied by `scale` (random weights scaled up give
  distributions far from uniform), built once per test process: models are immutable, so the tests that
  ask for the same one share it. Tests that use one configuration (vocabulary, max_length, preset) also
  share the compiled programs of the same calls (the jit cache and the run's persistent compilation cache
  key on shapes, not on weights). `fields` override the preset's config fields (a Gemma 2 of another window)."""
  if fields:
    family = models.families.for_preset(preset)
    config = family.config(vocab_size, max_len=max_length, **{**family.presets[preset], **fields})
    model = family.architecture.init(config, jax.random.PRNGKey(seed))
  else:
    model = models.build(preset, vocab_size=vocab_size, seed=seed, max_length=max_length)
  return model if scale == 1.0 else models.with_params(model, jax.tree.map(lambda w: scale * w, model.params))


def tiny_pair(vocab_size: int, max_length: int, *, seeds: tuple[int, int] = (5, 4), scale: float = 1.0,
              preset: str = "tiny", **fields):
  """(drafter, verifier): two `tiny` models of one configuration, seeds (drafter's, verifier's)."""
  return tuple(tiny(seed, vocab_size, max_length, scale=scale, preset=preset, **fields) for seed in seeds)


@struct.dataclass
class PositionalTrigram:
  table: jax.Array                                  # [max_length, V, V, V] logits
  max_length: int = struct.field(pytree_node=False)

  @classmethod
  def random(cls, seed: int, vocab_size: int, max_length: int = 64, scale: float = 1.5):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(max_length, vocab_size, vocab_size, vocab_size)) * scale
    return cls(table=jnp.asarray(table, jnp.float32), max_length=max_length)

  encoder_decoder = False
  scores_trees = True
  feature_access = False

  @property
  def vocab_size(self) -> int:
    return self.table.shape[-1]

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return prompt_width

  def logits(self, tokens):
    positions = jnp.arange(tokens.shape[1])
    previous = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], axis=1)
    return self.table[positions[None], previous, tokens]

  def init_cache(self, batch_size, cache_length, layout=None):   # its own state: no keys/values to lay out
    return Cache(kv=jnp.zeros((batch_size, cache_length), jnp.int32),
                 lengths=jnp.zeros((batch_size,), jnp.int32))

  def score(self, cache, tokens, *, positions=None, tree_mask=None):
    """As `base.Model.score`, token trees included: a token's previous token is its parent in the tree (the
    visible new token one position before it), else the cached token before the row's length."""
    batch, n = tokens.shape
    slots = cache.lengths[:, None] + jnp.arange(n)
    positions = slots if positions is None else positions
    if tree_mask is None:
      tree_mask = jnp.tril(jnp.ones((n, n), bool))
    rows = jnp.arange(batch)[:, None]
    is_parent = tree_mask & (positions[:, None, :] == positions[:, :, None] - 1)          # [B, n, n]
    parent_token = jnp.sum(jnp.where(is_parent, tokens[:, None, :], 0), axis=-1)
    before = jnp.where(cache.lengths > 0, cache.kv[rows[:, 0], jnp.maximum(cache.lengths - 1, 0)], 0)
    previous = jnp.where(jnp.any(is_parent, axis=-1), parent_token, before[:, None])
    logits = self.table[jnp.minimum(positions, self.max_length - 1), previous, tokens]
    written = cache.kv.at[rows, slots].set(tokens, mode="drop")
    return Scored(logits=logits, cache=Cache(kv=written, lengths=cache.lengths + n), hidden=None)

  def copy_slots(self, cache, source_rows, source_slots, target_slots):
    rows = jnp.arange(cache.lengths.shape[0])[:, None]
    return cache.replace(kv=cache.kv.at[rows, target_slots].set(cache.kv[source_rows[:, None], source_slots],
                                                                mode="drop"))


def agreeing_toys(vocab_size: int, noise: float = 0.7) -> tuple[PositionalTrigram, PositionalTrigram]:
  """(drafter, verifier): a random `PositionalTrigram` and a drafter whose logit table is the verifier's plus
  noise: greedy outputs that change with position and context, drafts often but not always accepted."""
  verifier = PositionalTrigram.random(2, vocab_size)
  table = verifier.table + noise * np.random.default_rng(9).normal(size=verifier.table.shape)
  return verifier.replace(table=jnp.asarray(table, jnp.float32)), verifier
