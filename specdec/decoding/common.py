"""Pieces every decode loop shares: the output record, per-row counters, emitting tokens, argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec import checks, sampling
from specdec.models.base import Cache, Model, prefill

Array = jax.Array

STAT_NAMES = ("drafter_calls", "verifier_calls", "drafted", "accepted", "rejected", "deferred", "generated")


@struct.dataclass
class Stats:
  """Per-row cost counters, each [B] int32. A call counts for a row when the row needed it (a row riding
  along in a batched call it did not need, e.g. a TokenCascade catch-up, is not charged)."""
  drafter_calls: Array
  verifier_calls: Array
  drafted: Array
  accepted: Array
  rejected: Array
  deferred: Array
  generated: Array

  @classmethod
  def zeros(cls, batch_size: int) -> "Stats":
    return cls(**{name: jnp.zeros((batch_size,), jnp.int32) for name in STAT_NAMES})

  def add(self, active: Array, **increments: Array | int) -> "Stats":
    """Adds increments (scalars or [B]) to the rows where `active` [B] holds."""
    return self.replace(**{name: getattr(self, name) + jnp.where(active, inc, 0).astype(jnp.int32)
                           for name, inc in increments.items()})


@struct.dataclass
class Output:
  """tokens [B, N] (0 after each row's end), lengths [B], stats (per-row counters), and failed [B]: rows
  that stopped because NaN reached their logits (`generate` raises on them)."""
  tokens: Array
  lengths: Array
  stats: Stats
  failed: Array


@struct.dataclass
class Emitted:
  """Generated tokens so far: a buffer [B, N + slack] (slack absorbs a block's overshoot), counts, done."""
  tokens: Array
  n_generated: Array
  done: Array
  failed: Array

  @classmethod
  def empty(cls, batch_size: int, max_new_tokens: int, slack: int) -> "Emitted":
    return cls(tokens=jnp.zeros((batch_size, max_new_tokens + slack), jnp.int32),
               n_generated=jnp.zeros((batch_size,), jnp.int32),
               done=jnp.zeros((batch_size,), bool), failed=jnp.zeros((batch_size,), bool))


@struct.dataclass
class PairState:
  """Loop state of a drafter/verifier loop: both caches hold the committed tokens but the last one."""
  key: Array
  drafter_cache: Cache
  verifier_cache: Cache
  last: Array              # [B] last emitted token, in neither cache yet
  emitted: Emitted
  stats: Stats

  @classmethod
  def start(cls, key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
            cache_length: int, max_new_tokens: int, slack: int, **extra) -> "PairState":
    """Both models prefilled with the prompts; `extra` fills a subclass's own fields."""
    batch = prompts.shape[0]
    last, drafter_cache = prefill(drafter, drafter.init_cache(batch, cache_length), prompts, prompt_lengths)
    _, verifier_cache = prefill(verifier, verifier.init_cache(batch, cache_length), prompts, prompt_lengths)
    return cls(key=key, drafter_cache=drafter_cache, verifier_cache=verifier_cache, last=last,
               emitted=Emitted.empty(batch, max_new_tokens, slack), stats=Stats.zeros(batch), **extra)


def emit(emitted: Emitted, block: Array, count: Array, *, max_new_tokens: int, eos_id: int | None,
         failed: Array | None = None) -> tuple[Emitted, Array]:
  """Appends block[b, :count[b]] [B, n] to each unfinished row, cut at EOS and at max_new_tokens.

  Returns the new record and the number of tokens actually appended per row [B]. A row is done once it
  has emitted EOS or max_new_tokens tokens; done rows append nothing. Rows in `failed` [B] (NaN reached
  their step) append nothing and stop, flagged: without this a row that can never advance would keep
  the while loop running forever.
  """
  batch, n = block.shape
  index = jnp.arange(n)
  if failed is None:
    failed = jnp.zeros((batch,), bool)
  failed &= ~emitted.done
  count = jnp.where(emitted.done | failed, 0, count)
  if eos_id is not None:
    is_eos = (block == eos_id) & (index < count[:, None])
    first_eos = jnp.argmax(is_eos, axis=-1)
    count = jnp.where(jnp.any(is_eos, axis=-1), jnp.minimum(count, first_eos + 1), count)
    hit_eos = jnp.any(is_eos & (index < count[:, None]), axis=-1)
  else:
    hit_eos = jnp.zeros((batch,), bool)
  count = jnp.minimum(count, max_new_tokens - emitted.n_generated)
  positions = emitted.n_generated[:, None] + index
  # Tokens beyond `count` land at a slot that is overwritten later or cut by the final slice.
  write = jnp.where(index < count[:, None], block, 0)
  tokens = emitted.tokens.at[jnp.arange(batch)[:, None], jnp.where(index < count[:, None], positions,
                                                                   emitted.tokens.shape[1])].set(
      write, mode="drop")
  n_generated = emitted.n_generated + count
  done = emitted.done | hit_eos | (n_generated >= max_new_tokens) | failed
  return Emitted(tokens=tokens, n_generated=n_generated, done=done, failed=emitted.failed | failed), count


def has_nan(x: Array) -> Array:
  """[B, ...] -> [B]: whether a row holds any NaN."""
  return jnp.any(jnp.isnan(x.reshape(x.shape[0], -1)), axis=-1)


def score_prefix(model: Model, cache, tokens: Array, needed: Array, widths: tuple[int, ...]):
  """Scores tokens[:, :w] [B, w] for the smallest static w in `widths` (and tokens.shape[1]) that covers
  every row's `needed` [B] count; returns (logits padded to [B, n, V], cache, w).

  A call's cost grows with its width (scoring 11 tokens costs ~2× one on CPU), so loops that score a
  variable number of tokens per call pick the width at run time with `lax.switch` instead of always
  paying for the maximum.
  """
  full = tokens.shape[1]
  sizes = sorted({w for w in widths if w < full} | {full})

  def branch(width):
    def score(cache):
      logits, cache = model.score(cache, tokens[:, :width])
      return jnp.pad(logits, ((0, 0), (0, full - width), (0, 0))), cache, jnp.int32(width)
    return score

  index = jnp.searchsorted(jnp.asarray(sizes), jnp.max(needed))
  return jax.lax.switch(index, [branch(w) for w in sizes], cache)


def finish(emitted: Emitted, stats: Stats, max_new_tokens: int) -> Output:
  return Output(tokens=emitted.tokens[:, :max_new_tokens], lengths=emitted.n_generated, stats=stats,
                failed=emitted.failed)


def distributions(logits: Array, temperature: Array, top_p: Array, top_k: int) -> tuple[Array, Array]:
  """(raw, transformed): softmax at temperature 1 (for deferral) and S(·) (for sampling/verifying)."""
  return jax.nn.softmax(logits.astype(jnp.float32), axis=-1), sampling.transform(logits, temperature,
                                                                                 top_p, top_k)


def check_models(drafter: Model | None, verifier: Model) -> None:
  if drafter is not None and drafter.vocab_size != verifier.vocab_size:
    raise ValueError(f"drafter and verifier vocabularies differ: drafter vocab_size={drafter.vocab_size}, "
                     f"verifier vocab_size={verifier.vocab_size}")
  # The loops commit both caches to the verifier's lengths: both must hold the same positions.
  if drafter is not None and hasattr(drafter, "prefill") != hasattr(verifier, "prefill"):
    raise ValueError("drafter and verifier must both be decoder-only or both encoder-decoder models: "
                     "one reads the prompt as its decoder prefix, the other as its encoder input")


def check_prompts(prompts, prompt_lengths, cache_length: int, models: list[Model]) -> None:
  """Shapes, lengths ≥ 1, tokens in the vocabulary, and room in every model's cache."""
  if np.ndim(prompts) != 2:
    raise ValueError(f"prompts must be [B, L]; got shape {np.shape(prompts)}")
  batch, width = np.shape(prompts)
  checks.check_shape("prompt_lengths", prompt_lengths, (batch,), "[B]")
  checks.check_count("prompt_lengths", prompt_lengths, 1, width)
  checks.check_count("prompts", prompts, 0, models[0].vocab_size - 1)
  for model in models:
    if cache_length > model.max_length:
      raise ValueError(
          f"prompt (padded to {width}; for an encoder-decoder only its start token) + max_new_tokens + block "
          f"slack needs {cache_length} cache positions, more than the model's max_length={model.max_length}; "
          "shorten the prompt or max_new_tokens")
