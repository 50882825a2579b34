"""What every decode loop shares: the loop driver (`decode_loop`), the output record, per-row counters,
emitting tokens with EOS / max_new_tokens per row, NaN rows, argument checks.

A method supplies a start state and a step; `decode_loop` owns the `lax.while_loop`:

  state, emission = step(state, done)     # done [B]: rows that finished before this step
  # emission.block [B, n], emission.count [B] tokens of it to emit, emission.failed [B] rows NaN reached,
  # emission.counters {Stats field: [B] increments}, emission.deferred [B, n] (δ, or π ≠ q, at that token)

The driver appends each row's tokens (cut at EOS and max_new_tokens), charges the counters to the rows
that were live (not done, not failed), counts `generated` and `deferred` over the tokens actually emitted,
and stops when every row is done.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec import checks
from specdec.decoding.drafters import Drafter
from specdec.models import base
from specdec.models.base import Model

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Program:
  """What a decode program is built for, chosen once where it is built (`decoding.generate`, `decoding.lower`)
  and passed to the loop as a static argument (it keys the compiled program): the platform ("cpu", "gpu", "tpu";
  a TPU program lowered on a CPU host is a TPU program) and the layout of the KV caches the loop makes
  (`base.CACHE_LAYOUTS`)."""
  platform: str
  cache_layout: str

  @classmethod
  def of(cls, platform: str | None = None, cache_layout: str | None = None) -> "Program":
    """`platform`'s (None: this process's backend), its caches in `cache_layout` (None: the platform's,
    `base.cache_layout`)."""
    platform = platform or jax.default_backend()
    return cls(platform, base.cache_layout(platform) if cache_layout is None else base.check_layout(cache_layout))

  @property
  def narrow_calls(self) -> bool:
    """`narrow_calls` for this platform."""
    return narrow_calls(self.platform)


STAT_NAMES = ("drafter_calls", "verifier_calls", "verifier_positions", "drafted", "accepted", "rejected", "deferred",
              "generated")


@struct.dataclass
class Stats:
  """Per-row cost counters, each [B] int32. A call counts for a row when the row needed it (a row riding
  along in a batched call it did not need, e.g. a TokenCascade catch-up, is not charged).

  drafter_calls, verifier_calls  serial model calls (a model drafter: γ per speculative block, plus the call
                                 scoring the last draft where the block accepted every draft or the target
                                 reads q at the bonus position);
  verifier_positions             positions the verifier's calls scored (a call's width: γ+1 for a block,
                                 1 + K·γ tree slots for K drafts), the compute the verifier spent;
  drafted, accepted              draft tokens proposed to the verifier's acceptance test and accepted by
                                 it (speculative methods, BiLD); 0 for the sequential cascades, whose tokens
                                 are never tested: each is the drafter's or, where `deferred`, the verifier's;
  rejected                       blocks in which a draft was rejected;
  deferred                       emitted tokens deferred to the verifier: a deferral rule's decision δ = 1
                                 (even where p = q, e.g. greedy p and q that agree), any other target's
                                 π ≠ q (lossless SpecDecode: wherever p ≠ q beyond float noise);
  generated                      emitted tokens.
  """
  drafter_calls: Array
  verifier_calls: Array
  verifier_positions: Array
  drafted: Array
  accepted: Array
  rejected: Array
  deferred: Array
  generated: Array

  @classmethod
  def zeros(cls, batch_size: int) -> "Stats":
    return cls(**{name: jnp.zeros((batch_size,), jnp.int32) for name in STAT_NAMES})

  @property
  def acceptance_rate(self) -> Array:
    """accepted / drafted per row [B] (float32; NaN where nothing was drafted)."""
    drafted = self.drafted.astype(jnp.float32)
    return jnp.where(drafted > 0, self.accepted / jnp.where(drafted > 0, drafted, 1.0), jnp.nan)

  def add(self, active: Array, **increments: Array | int) -> "Stats":
    """Adds increments (scalars or [B]) to the rows where `active` [B] holds."""
    counts = vars(self)
    return self.replace(**{name: counts[name] + jnp.where(active, inc, 0).astype(jnp.int32)
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
  """Generated tokens so far: a buffer [B, N], counts, done (`emit` drops what a step emits beyond N)."""
  tokens: Array
  n_generated: Array
  done: Array
  failed: Array

  @classmethod
  def empty(cls, batch_size: int, max_new_tokens: int) -> "Emitted":
    return cls(tokens=jnp.zeros((batch_size, max_new_tokens), jnp.int32),
               n_generated=jnp.zeros((batch_size,), jnp.int32),
               done=jnp.zeros((batch_size,), bool), failed=jnp.zeros((batch_size,), bool))


@struct.dataclass
class Emission:
  """What one step of a method emits (module docstring)."""
  block: Array                           # [B, n]
  count: Array                           # [B] tokens of block to emit
  failed: Array                          # [B] NaN reached the row: it stops, flagged, emitting nothing
  counters: dict[str, Array]             # Stats field -> [B] (or scalar) increments
  deferred: Array | None = None          # [B, n]


def decode_loop(state: Any, step: Callable[[Any, Array], tuple[Any, Emission]], *, batch_size: int,
                max_new_tokens: int, eos_id: int | None, active: Array | None = None
                ) -> tuple[Output, Any]:
  """Runs `step` until every row has emitted EOS or max_new_tokens tokens (or failed); rows where
  `active` [B] is False emit nothing. Returns the output and the method's final state."""
  emitted = Emitted.empty(batch_size, max_new_tokens)
  if active is not None:
    emitted = emitted.replace(done=~active)

  def body(carry):
    state, emitted, stats = carry
    state, emission = step(state, emitted.done)
    live = ~emitted.done & ~emission.failed
    emitted, count = emit(emitted, emission.block, emission.count, max_new_tokens=max_new_tokens, eos_id=eos_id,
                          failed=emission.failed)
    deferred = 0
    if emission.deferred is not None:
      index = jnp.arange(emission.block.shape[1])
      deferred = jnp.sum(emission.deferred & (index < count[:, None]), axis=-1)
    stats = stats.add(live, **emission.counters, deferred=deferred, generated=count)
    return state, emitted, stats

  carry = (state, emitted, Stats.zeros(batch_size))
  state, emitted, stats = jax.lax.while_loop(lambda c: jnp.any(~c[1].done), body, carry)
  return finish(emitted, stats), state


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
  positions = jnp.where(index < count[:, None], emitted.n_generated[:, None] + index, emitted.tokens.shape[1])
  # Row by row (`vmap`: under a mesh each device writes its own rows); tokens beyond `count` are dropped.
  tokens = jax.vmap(lambda row, at, new: row.at[at].set(new, mode="drop"))(emitted.tokens, positions, block)
  n_generated = emitted.n_generated + count
  done = emitted.done | hit_eos | (n_generated >= max_new_tokens) | failed
  return Emitted(tokens=tokens, n_generated=n_generated, done=done, failed=emitted.failed | failed), count


def has_nan(x: Array) -> Array:
  """[B, ...] -> [B]: whether a row holds any NaN."""
  return jnp.any(jnp.isnan(x.reshape(x.shape[0], -1)), axis=-1)


def score_prefix(model: Model, cache, tokens: Array, needed: Array, widths: tuple[int, ...], *, narrow: bool,
                 positions: Array | None = None, tree_mask: Array | None = None, return_hidden: bool = False):
  """Scores tokens[:, :w] [B, w] for the smallest static w in `widths` (and tokens.shape[1]) that covers
  every row's `needed` [B] count; returns (`Scored` with logits padded to [B, n, V] and, with
  `return_hidden`, the last hidden states padded to [B, n, E], else None; w). A token tree (`positions`
  [B, n], `tree_mask` [B, n, n]) is cut to its first w nodes the same way.

  A call's cost grows with its width on the CPU (experiments/model_costs/README.md), so there loops that
  score a variable number of tokens per call pick the width at run time with `lax.switch` (`narrow`:
  `Program.narrow_calls`) instead of always paying for the maximum; elsewhere every call takes the full width.
  """
  full = tokens.shape[1]
  sizes = _sizes(widths, full) if narrow else [full]

  def branch(width):
    def score(cache):
      tree = {} if positions is None else dict(positions=positions[:, :width], tree_mask=tree_mask[:, :width, :width])
      scored = model.score(cache, tokens[:, :width], **tree)
      pad = ((0, 0), (0, full - width), (0, 0))
      hidden = jnp.pad(scored.hidden, pad) if return_hidden else None
      return scored.replace(logits=jnp.pad(scored.logits, pad), hidden=hidden), jnp.int32(width)
    return score

  if len(sizes) == 1:
    return branch(full)(cache)
  index = jnp.searchsorted(jnp.asarray(sizes), jnp.max(needed))
  return jax.lax.switch(index, [branch(w) for w in sizes], cache)


def narrow_calls(platform: str) -> bool:
  """Whether `score_prefix` picks a call's width at run time in programs built for `platform`: for the CPU,
  where a call's cost grows with its width. Not for TPU/GPU, where a memory-bound call of 1 or γ+1 tokens costs
  about the same and XLA copies the KV cache inside a `lax.switch` whose branches all update it."""
  return platform == "cpu"


def covering_width(needed: Array, widths: tuple[int, ...], full: int) -> Array:
  """Per row [B]: the width `score_prefix` would pick for that row alone (what the row is charged in
  `Stats.verifier_positions`, so a row's counters do not depend on the rows batched with it)."""
  sizes = jnp.asarray(_sizes(widths, full))
  return sizes[jnp.searchsorted(sizes, needed)]


def _sizes(widths: tuple[int, ...], full: int) -> list[int]:
  return sorted({w for w in widths if w < full} | {full})


def finish(emitted: Emitted, stats: Stats) -> Output:
  return Output(tokens=emitted.tokens, lengths=emitted.n_generated, stats=stats,
                failed=emitted.failed)


def check_models(drafter: Model | Drafter | None, verifier: Model) -> None:
  """The same vocabulary, and the prompt read the same way (both decoder-only or both encoder-decoder)."""
  if drafter is not None and drafter.vocab_size != verifier.vocab_size:
    raise ValueError(f"drafter and verifier vocabularies differ: drafter vocab_size={drafter.vocab_size}, "
                     f"verifier vocab_size={verifier.vocab_size}")
  # The loops commit both caches to the verifier's lengths: both must hold the same positions.
  if drafter is not None and drafter.encoder_decoder != verifier.encoder_decoder:
    raise ValueError("drafter and verifier must both be decoder-only or both encoder-decoder models: "
                     "one reads the prompt as its decoder prefix, the other as its encoder input")
  if isinstance(drafter, Drafter):
    drafter.check_verifier(verifier)


def check_prompts(prompts, prompt_lengths, cache_length: int, models: list[Model]) -> None:
  """Shapes, lengths ≥ 1, tokens in the vocabulary, and room in every model's cache (shapes only for
  `jax.ShapeDtypeStruct`s: a program lowered without data)."""
  if np.ndim(prompts) != 2:
    raise ValueError(f"prompts must be [B, L]; got shape {np.shape(prompts)}")
  batch, width = np.shape(prompts)
  checks.check_shape("prompt_lengths", prompt_lengths, (batch,), "[B]")
  if not isinstance(prompt_lengths, jax.ShapeDtypeStruct):
    checks.check_count("prompt_lengths", prompt_lengths, 1, width)
  if not isinstance(prompts, jax.ShapeDtypeStruct):
    checks.check_count("prompts", prompts, 0, models[0].vocab_size - 1)
  for model in models:
    if cache_length > model.max_length:
      raise ValueError(
          f"prompt (padded to {width}; for an encoder-decoder only its start token) + max_new_tokens + block "
          f"overhang needs {cache_length} cache positions, more than the model's max_length={model.max_length}; "
          "shorten the prompt or max_new_tokens")
