"""Drafters: what proposes the tokens a verifier checks (layer 3).

A drafter keeps its own state (a model's KV cache, a statistical drafter's history) and answers three
calls. Every lossless method keeps the verifier's law whatever the drafter proposes: only the verifier's
acceptance test decides what is emitted, so a new way to draft is a new `Drafter`, not a new loop.

  state, last = drafter.start(prompts [B, L], prompt_lengths [B], cache_length, layout)   # a KV cache's layout
  draft = drafter.propose(key, state, last, max_drafts=γ, sampling=…, keep_drafting=None)
  state = drafter.verified(draft.state, Verified(…))      # after verification (default: a rollback)
  state = drafter.rollback(draft.state, lengths [B])     # keep the first lengths[b] positions of row b

`verified` receives the record of the verified block (`Verified`: what the verifier scored, how much of it
each row committed, the next token, the committed lengths and, for drafters that read the verifier
(`reads_verifier`: a feature drafter), the verifier's hidden states there); after the prefill too.

After `propose` the state holds `last` and the drafts (it may be rolled back to any length up to the old one
+ max_drafts + 1). A `ModelDrafter(…, bonus_q=False)` (for callers that do not need q after a row's last
draft) leaves that draft out of its cache (`Draft.pending`: a γ+1-th call saved whenever a draft is
rejected); the caller then completes the rows that commit it:

  draft = drafter.catch_up(draft, rows [B], sampling)   # only when draft.pending is not None

A drafter that `keeps_copies` (K copies of each row, for the multi-draft methods) also takes `beam=` (a
`BeamSearch`) in `propose`: the copies then become beams that choose their tokens jointly (EAGLE-2's dynamic
tree), not samples.

Drafters that can join a horizontal cascade also read tokens without drafting:

  state = drafter.observe(state, tokens [B, W], counts [B])  # consume tokens[b, :counts[b]] (not `last`)

`ModelDrafter` wraps any `models.base.Model` (the default: `generate` wraps a model it is given);
`MaxGram` is CS Drafting's statistical drafter (no model calls); `feature_drafter.FeatureDrafter` (EAGLE)
drafts from the verifier's own hidden states.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec import rng
from specdec import sampling as sampling_lib
from specdec.models.base import Cache, Model, prefill, rollback, row_axes

Array = jax.Array


@struct.dataclass
class Draft:
  """A block of drafts [B, γ] with the drafter's distributions at the γ+1 positions [B, γ+1, V] (q at
  the bonus position γ is what cascade targets T(q, p) need there), the number of drafts each row made
  [B], the drafter calls each row needed [B], and the drafter's state after drafting. `pending` [B] (None:
  no row): rows whose last draft the state does not hold yet and whose q after it is not computed
  (`ModelDrafter.catch_up`)."""
  tokens: Array
  q: Array
  q_raw: Array
  n_drafted: Array
  calls: Array
  state: Any
  pending: Array | None = None


@struct.dataclass
class Verified:
  """One verified block (or the prefill), as the loop hands it to the drafter (`Drafter.verified`).

  tokens [B, W]: what the verifier consumed in the call (the pending token and the drafts; the prompt);
  count [B]: how many of them each row committed (n_accepted + 1; the prompt length − 1; 0 for a finished
  row); next_token [B]: the row's new pending token; lengths [B]: the committed lengths; hidden [B, W, E]:
  the verifier's last hidden states after each of `tokens` (None unless the drafter `reads_verifier`).
  """
  tokens: Array
  count: Array
  next_token: Array
  lengths: Array
  hidden: Array | None = None


@struct.dataclass
class BeamSearch:
  """EAGLE-2's expansion of a dynamic draft tree (Li et al., EMNLP 2024, §4.1) as a beam search over K
  copies of each row (rows b·K … b·K + K − 1 of a [B·K] drafter state, `multi_draft.IIDDrafts`' layout).

  A node's value is the product of the drafter's confidences along its path, Π_j q_raw(x_j | x_<j) (q at
  temperature 1, the drafter's own confidence, whatever the target's sampling). At each depth the K
  highest-valued children of the K current beams (K·V candidates) become the next beams: copy k takes its
  parent's state and appends its token. The drafts are a deterministic function of the drafter's state, not
  samples: a verifier must treat each as a proposal q = δ_x (`multi_draft`'s `dynamic_tree`)."""
  num_beams: int = struct.field(pytree_node=False)

  def start(self, rows: int) -> Array:
    """Log values [rows] of the K copies of each row before drafting: 0 for copy 0, −∞ for the others (the
    copies are identical, so only copy 0's children are candidates at depth 1)."""
    return jnp.where(jnp.arange(rows) % self.num_beams == 0, 0.0, -jnp.inf).astype(jnp.float32)

  def step(self, log_values: Array, q_raw: Array) -> tuple[Array, Array, Array]:
    """The next beams from log values [B·K] and each beam's q_raw [B·K, V]: (tokens [B·K], the copy of its
    row each new beam extends, in [0, K) [B·K], their log values [B·K])."""
    rows_k, vocab = q_raw.shape
    k = self.num_beams
    candidates = (log_values[:, None] + jnp.log(q_raw)).reshape(rows_k // k, k * vocab)
    top_values, top = jax.lax.top_k(candidates, k)                                 # [B, K]
    return ((top % vocab).reshape(rows_k).astype(jnp.int32), (top // vocab).reshape(rows_k).astype(jnp.int32),
            top_values.reshape(rows_k))

  def reorder(self, tree: Any, parent: Array) -> Any:
    """Every leaf of a pytree of [B·K, …] arrays with copy k of row b taken from copy parent[b·K + k] of the
    same row. Per row under `vmap`, so that a data-sharded batch stays on its devices (a gather by global row
    ids would collect every row on every device)."""
    k = self.num_beams
    local = parent.reshape(-1, k)

    def take(x: Array, axis: int) -> Array:   # rows on `axis` (a cache's: `base.row_axes`)
      rows = jnp.moveaxis(x, axis, 0)
      grouped = rows.reshape(local.shape[0], k, *rows.shape[1:])
      taken = jax.vmap(lambda copies, sources: copies[sources])(grouped, local).reshape(rows.shape)
      return jnp.moveaxis(taken, 0, axis)
    is_cache = lambda x: isinstance(x, Cache)  # noqa: E731
    axes = jax.tree.map(lambda x: row_axes(x) if is_cache(x) else 0, tree, is_leaf=is_cache)
    return jax.tree.map(take, tree, axes)


class Drafter:
  """What speculative methods need from whatever proposes drafts (module docstring). A subclass (a
  `flax.struct.dataclass`) implements `vocab_size`, `start`, `propose` and `rollback`; the other members
  have defaults that a drafter overrides where it differs (a property, or a field given its own default:
  a bare field annotation would take the class default below and reorder the dataclass's fields)."""

  # Whether rows may draft fewer than max_drafts tokens in a block (`Draft.n_drafted`): the verifier then
  # scores only the longest row's block.
  variable_length: bool = False
  # Cache positions the drafter writes beyond the verified block (a vertical cascade's review call).
  cache_overhang: int = 0
  # The longest cache it supports (a model's max_length; a drafter without a network: any).
  max_length: int = 1 << 30
  # Whether it reads the prompt as an encoder input (a T5 model): its positions then match a T5 verifier's.
  encoder_decoder: bool = False
  # Whether the loop must hand it the verifier's hidden states (`Verified.hidden`): a feature drafter.
  reads_verifier: bool = False

  vocab_size: int

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[Any, Array]:
    """The state after reading the prompts, and each row's last prompt token [B] (not yet consumed); its KV caches
    (if any) of `cache_length` slots in `layout` (`Model.init_cache`)."""
    raise NotImplementedError

  def decoding_verifier(self, verifier: Any) -> Any:
    """The verifier as the loop runs it for this drafter (`generate` decodes with it): a feature drafter whose
    head reads fused features needs one that returns them; itself otherwise."""
    return verifier

  def propose(self, key: Array, state: Any, last: Array, *, max_drafts: int, sampling: sampling_lib.Sampling,
              keep_drafting: Callable[[Array], Array] | None = None, beam: BeamSearch | None = None) -> Draft:
    """Up to `max_drafts` drafts after `last` [B]; `keep_drafting(q_raw_j) -> [B]` may stop rows early (q_raw_j
    [B, V], or [B, k] over a feature drafter's draft vocabulary);
    `beam` (drafters that `keeps_copies`): the copies draft as beams, not samples."""
    raise NotImplementedError

  def rollback(self, state: Any, lengths: Array) -> Any:
    """The state holding only the first lengths[b] committed positions of each row."""
    raise NotImplementedError

  def verified(self, state: Any, block: Verified) -> Any:
    """The state after a verified block or the prefill (`Verified`): by default, rolled back to the
    committed lengths."""
    return self.rollback(state, block.lengths)

  def check_verifier(self, verifier: Model) -> None:
    """Raises ValueError where this drafter cannot serve `verifier` (beyond the vocabulary, checked apart)."""

  def prompt_cache_positions(self, prompt_width: int) -> int:
    """Cache positions its caches give prompts padded to `prompt_width` (`Model.prompt_cache_positions`;
    a drafter without a network: the width)."""
    return prompt_width

  def observe(self, state: Any, tokens: Array, counts: Array) -> Any:
    """The state after reading tokens[b, :counts[b]] [B, W] drafted by others (a horizontal cascade)."""
    raise NotImplementedError(f"{type(self).__name__} cannot read tokens it did not draft, so it cannot be a "
                              "HorizontalCascade stage")

  def catch_up(self, draft: Draft, rows: Array, sampling: sampling_lib.Sampling) -> Draft:
    """`draft` with its `pending` last drafts scored for `rows` [B] (only for drafters that leave some)."""
    if draft.pending is not None:
      raise NotImplementedError(f"{type(self).__name__} left drafts pending but cannot catch up on them")
    return draft

  # Whether it can draft K copies of each row and keep one (`keep_copy`): the multi-draft methods.
  keeps_copies: bool = False

  def keep_copy(self, state: Any, source_rows: Array, start: Array, width: int) -> Any:
    """The state where each row r takes row source_rows[r]'s entries at its positions start[r] …
    start[r] + width − 1 (a kept draft's, multi-draft: `multi_draft.IIDDrafts`) [B·K]."""
    raise NotImplementedError(f"{type(self).__name__} cannot keep one of K drafts")


@struct.dataclass
class _DraftCarry:
  step: Array                 # [] drafter calls made so far in this block
  cache: Cache
  token: Array                # [B] the token the next call scores
  tokens: Array               # [B, γ] drafts
  q: Array                    # [B, γ+1, V] S(q_j)
  q_raw: Array                # [B, γ+1, V] q_j at temperature 1
  drafting: Array             # [B] the row is still drafting
  n_drafted: Array            # [B]
  all_accepted: Array         # [B] SpecDec++: Π_i P̂(draft i accepted) over this block's drafts
  log_values: Array           # [B] a beam's log value (`BeamSearch`; unused when sampling)


@struct.dataclass
class ModelDrafter(Drafter):
  """A model drafting one token per call, x_{j+1} ~ S(q_j) (its KV cache is the drafter state).

  With an acceptance `head` (SpecDec++, `models.acceptance_head`) it drafts a variable number of tokens:
  after each draft x_i the head reads the hidden state at x_i and the row stops once the predicted
  probability that some draft of the block is rejected, 1 − Π_i P̂(x_i accepted), exceeds
  `stop_threshold` h (at least one draft, at most max_drafts; SpecDec++ Alg. 1). Only how many drafts
  are made changes: the verification is the usual exact one.

  `bonus_q` False: a row that drafts all max_drafts tokens makes max_drafts calls, not max_drafts + 1; its
  last draft stays `pending` until `catch_up` (for targets that do not read q at the bonus position).
  """
  model: Model
  head: Any = None
  stop_threshold: Array | float = 1.0
  bonus_q: bool = struct.field(pytree_node=False, default=True)

  @property
  def variable_length(self) -> bool:
    return self.head is not None

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  @property
  def max_length(self) -> int:
    return self.model.max_length

  @property
  def encoder_decoder(self) -> bool:
    return self.model.encoder_decoder

  @property
  def keeps_copies(self) -> bool:
    return self.model.scores_trees and self.head is None and self.bonus_q

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return self.model.prompt_cache_positions(prompt_width)

  def keep_copy(self, state: Cache, source_rows: Array, start: Array, width: int) -> Cache:
    slots = start[:, None] + jnp.arange(width)
    return self.model.copy_slots(state, source_rows, slots, slots)

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[Cache, Array]:
    last, cache = prefill(self.model, self.model.init_cache(prompts.shape[0], cache_length, layout), prompts,
                          prompt_lengths)
    return cache, last

  def rollback(self, state: Cache, lengths: Array) -> Cache:
    return rollback(state, lengths)

  def observe(self, state: Cache, tokens: Array, counts: Array) -> Cache:
    """One call scoring tokens [B, W] (skipped when no row has any), kept up to counts [B]."""
    def score(cache: Cache) -> Cache:
      return rollback(self.model.score(cache, tokens).cache, cache.lengths + counts)
    return jax.lax.cond(jnp.any(counts > 0), score, lambda cache: cache, state)

  def propose(self, key: Array, state: Cache, last: Array, *, max_drafts: int, sampling: sampling_lib.Sampling,
              keep_drafting: Callable[[Array], Array] | None = None, beam: BeamSearch | None = None) -> Draft:
    """Scores `last` then each new draft, up to `max_drafts` drafts. A row that stops (keep_drafting
    False, BiLD's fallback; the head) drafts no more, and the loop ends when every row has stopped, so at
    batch size 1 no call is wasted. A row makes n_drafted + 1 calls, the last one scoring its final draft
    (q after it, and the decision to stop); with `bonus_q` False a row that drafts all `max_drafts` makes
    max_drafts calls and leaves its last draft `pending` (`catch_up`), since only a full acceptance
    commits it. With `beam` the copies draft as beams: after each call every copy takes its parent beam's
    cache (a gather of the [B·K] cache per draft: a cost of beams over samples)."""
    batch, vocab = last.shape[0], self.model.vocab_size
    keys = rng.split(key, max_drafts + 1)
    last_step = max_drafts if self.bonus_q else max_drafts - 1

    def cond(c: _DraftCarry) -> Array:
      return (c.step <= last_step) & jnp.any(c.drafting)

    def body(c: _DraftCarry) -> _DraftCarry:
      all_accepted = c.all_accepted
      scored = self.model.score(c.cache, c.token[:, None])
      logits, cache = scored.logits, scored.cache
      if self.head is not None:   # the call scores the block's latest draft (from step 1 on): the head judges it
        all_accepted *= jnp.where(c.step > 0, self.head.probability(scored.hidden[:, 0]), 1.0)
      q_raw_j, q_j = sampling.distributions(logits[:, 0])
      keep = c.drafting[:, None]
      q = c.q.at[:, c.step].set(jnp.where(keep, q_j, c.q[:, c.step]))
      q_raw = c.q_raw.at[:, c.step].set(jnp.where(keep, q_raw_j, c.q_raw[:, c.step]))
      go_on = c.drafting & (c.step < max_drafts)
      if self.head is not None:
        go_on &= 1.0 - all_accepted <= self.stop_threshold
      if keep_drafting is not None:
        go_on &= keep_drafting(q_raw_j)
      log_values, tokens = c.log_values, c.tokens
      if beam is None:
        x = sampling_lib.sample(keys[c.step], q_j)
      else:   # every copy drafts in step with the others (no head, no keep_drafting): go_on is the same for all
        x, parent, log_values = beam.step(c.log_values, q_raw_j)
        parent = jnp.where(go_on, parent, jnp.arange(batch) % beam.num_beams)
        cache, tokens, q, q_raw = beam.reorder((cache, tokens, q, q_raw), parent)
      slot = jnp.minimum(c.step, max_drafts - 1)
      tokens = tokens.at[:, slot].set(jnp.where(go_on, x, tokens[:, slot]))
      # Rows that stopped keep being scored (static batch) but the rollback after verification resets them.
      return _DraftCarry(step=c.step + 1, cache=cache, token=jnp.where(go_on, x, c.token), tokens=tokens,
                         q=q, q_raw=q_raw, drafting=go_on, n_drafted=c.n_drafted + go_on,
                         all_accepted=all_accepted, log_values=log_values)

    zeros = jnp.zeros((batch, max_drafts + 1, vocab), jnp.float32)
    start = _DraftCarry(step=jnp.int32(0), cache=state, token=last,
                        tokens=jnp.zeros((batch, max_drafts), jnp.int32), q=zeros, q_raw=zeros,
                        drafting=jnp.ones((batch,), bool), n_drafted=jnp.zeros((batch,), jnp.int32),
                        all_accepted=jnp.ones((batch,), jnp.float32),
                        log_values=jnp.zeros((batch,), jnp.float32) if beam is None else beam.start(batch))
    end = jax.lax.while_loop(cond, body, start)
    if self.bonus_q:
      return Draft(tokens=end.tokens, q=end.q, q_raw=end.q_raw, n_drafted=end.n_drafted,
                   calls=end.n_drafted + 1, state=end.cache)
    # Rows still drafting when the loop ended drafted max_drafts tokens without a call on the last one.
    return Draft(tokens=end.tokens, q=end.q, q_raw=end.q_raw, n_drafted=end.n_drafted,
                 calls=end.n_drafted + 1 - end.drafting, state=end.cache, pending=end.drafting)

  def catch_up(self, draft: Draft, rows: Array, sampling: sampling_lib.Sampling) -> Draft:
    """Completes the `pending` rows of a draft among `rows` [B] (those that accepted every draft): one call
    scores their last draft, which puts it in the cache and gives q after it, at the bonus position. No
    call when no such row exists; a row is charged only when it needed the call."""
    rows = rows & draft.pending

    def score(draft: Draft) -> Draft:
      scored = self.model.score(draft.state, draft.tokens[:, -1:])
      q_raw, q = sampling.distributions(scored.logits[:, 0])
      put = rows[:, None]
      return draft.replace(q=draft.q.at[:, -1].set(jnp.where(put, q, draft.q[:, -1])),
                           q_raw=draft.q_raw.at[:, -1].set(jnp.where(put, q_raw, draft.q_raw[:, -1])),
                           calls=draft.calls + rows, state=scored.cache)

    return jax.lax.cond(jnp.any(rows), score, lambda draft: draft, draft).replace(pending=None)


def as_drafter(drafter: Model | Drafter) -> Drafter:
  """A `Drafter` as is; a model wrapped in a `ModelDrafter`."""
  return drafter if isinstance(drafter, Drafter) else ModelDrafter(drafter)


@struct.dataclass
class MaxGramState:
  """history [B, H]: each row's committed tokens (slots < length), then the pending token and the last
  block's drafts; length [B]."""
  history: Array
  length: Array


@struct.dataclass
class MaxGram(Drafter):
  """CS Drafting's Max-Gram drafter: continues the longest match of the current suffix found earlier in
  the row's own prompt and output (copying is frequent: a synopsis reuses words of its description, a
  translation keeps package names, paths and code). A deterministic drafter: q is one-hot on its proposal,
  so speculative sampling with it keeps the verifier's law exactly. No model calls.

  Suffixes of `min_match` … `max_match` tokens are matched (the longest wins, the latest occurrence among
  equals); the proposal copies what followed the match, continuing periodically when the match runs into
  the present. Without a match it follows `bigram` [V] (the most frequent next token of each token, from
  `bigram_table`), or repeats the pending token when there is no table.

  `gate` > 0 drafts only where the text is being copied: a row whose longest match is shorter than `gate`
  tokens drafts nothing this block (`n_drafted` 0: the verifier then makes one ordinary decode step), so
  drafts are spent where they are likely to be accepted (prompt-lookup decoding's rule).
  """
  vocab_size: int = struct.field(pytree_node=False)
  min_match: int = struct.field(pytree_node=False, default=1)
  max_match: int = struct.field(pytree_node=False, default=8)
  bigram: Array | None = None
  gate: int = struct.field(pytree_node=False, default=0)

  def __post_init__(self):
    if not 1 <= self.min_match <= self.max_match:
      raise ValueError(f"MaxGram needs 1 <= min_match <= max_match; got min_match={self.min_match}, "
                       f"max_match={self.max_match}")
    if not 0 <= self.gate <= self.max_match:
      raise ValueError(f"MaxGram gate must lie in [0, max_match={self.max_match}]; got {self.gate}")

  @property
  def variable_length(self) -> bool:
    return self.gate > 0

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[MaxGramState, Array]:
    batch, width = prompts.shape
    history = jnp.zeros((batch, cache_length + 1), jnp.int32).at[:, :width].set(prompts)
    last = prompts[jnp.arange(batch), prompt_lengths - 1].astype(jnp.int32)
    return MaxGramState(history=history, length=(prompt_lengths - 1).astype(jnp.int32)), last

  def rollback(self, state: MaxGramState, lengths: Array) -> MaxGramState:
    return state.replace(length=jnp.asarray(lengths, jnp.int32))

  def observe(self, state: MaxGramState, tokens: Array, counts: Array) -> MaxGramState:
    batch, width = tokens.shape
    slots = jnp.where(jnp.arange(width) < counts[:, None], state.length[:, None] + jnp.arange(width),
                      state.history.shape[1])
    return MaxGramState(history=state.history.at[jnp.arange(batch)[:, None], slots].set(tokens, mode="drop"),
                        length=state.length + counts)

  def propose(self, key: Array, state: MaxGramState, last: Array, *, max_drafts: int,
              sampling: sampling_lib.Sampling, keep_drafting: Callable[[Array], Array] | None = None) -> Draft:
    """γ = max_drafts proposals and one more (q at the bonus position), whatever the sampling settings."""
    batch, size = state.history.shape
    rows = jnp.arange(batch)
    history = state.history.at[rows, state.length].set(last, mode="drop")
    n = state.length + 1                                   # tokens known: history[:, :n]
    position = jnp.arange(size)[None, :]
    # match[b, j]: how many tokens ending at j equal the suffix ending at n − 1 (j < n − 1).
    match = jnp.zeros((batch, size), jnp.int32)
    alive = position < (n - 1)[:, None]
    for k in range(self.max_match):
      shifted = jnp.pad(history, ((0, 0), (k, 0)))[:, :size]           # history[j − k]
      suffix = history[rows, jnp.maximum(n - 1 - k, 0)][:, None]
      alive &= (position >= k) & (n - 1 - k >= 0)[:, None] & (shifted == suffix)
      match += alive
    end = jnp.argmax(jnp.where(match >= self.min_match, match * size + position, -1), axis=-1)
    found = match[rows, end] >= self.min_match
    period = jnp.maximum(n - 1 - end, 1)
    proposals = jnp.zeros((batch, max_drafts + 1), jnp.int32)
    previous = last
    for i in range(max_drafts + 1):
      source = end + 1 + i
      copied = jnp.where(source < n, history[rows, jnp.minimum(source, size - 1)],
                         proposals[rows, jnp.clip(i - period, 0, max_drafts)])
      fallback = previous if self.bigram is None else self.bigram[previous]
      token = jnp.where(found, copied, fallback).astype(jnp.int32)
      proposals = proposals.at[:, i].set(token)
      previous = token
    q = jax.nn.one_hot(proposals, self.vocab_size, dtype=jnp.float32)
    written = history.at[rows[:, None], n[:, None] + jnp.arange(max_drafts)].set(proposals[:, :max_drafts],
                                                                                 mode="drop")
    n_drafted = jnp.full((batch,), max_drafts, jnp.int32)
    if self.gate:
      n_drafted = jnp.where(found & (match[rows, end] >= self.gate), n_drafted, 0)
    return Draft(tokens=proposals[:, :max_drafts], q=q, q_raw=q, n_drafted=n_drafted,
                 calls=jnp.zeros((batch,), jnp.int32), state=state.replace(history=written))


def observe_chunk(history: Array, start: Array, width: int) -> Array:
  """history[b, start[b] : start[b] + width] for each row [B, width] (clipped at the end; for `observe`)."""
  index = jnp.minimum(start[:, None] + jnp.arange(width), history.shape[1] - 1)
  return jnp.take_along_axis(history, index, axis=1)


def bigram_table(rows: Any, lengths: Any, vocab_size: int) -> Array:
  """The most frequent next token of each token [V] int32 (ties: the lowest id; unseen tokens: themselves)
  over token rows [N, L] with lengths [N] — `MaxGram`'s fallback, from a training split."""
  rows, lengths = np.asarray(rows), np.asarray(lengths)
  valid = np.arange(rows.shape[1] - 1)[None, :] < (lengths - 1)[:, None]
  pairs = rows[:, :-1][valid].astype(np.int64) * vocab_size + rows[:, 1:][valid]
  codes, counts = np.unique(pairs, return_counts=True)
  first, second = codes // vocab_size, codes % vocab_size
  order = np.lexsort((second, -counts, first))          # per first token: most frequent, then lowest id
  first, second = first[order], second[order]
  keep = np.concatenate([[True], first[1:] != first[:-1]])
  table = np.arange(vocab_size, dtype=np.int32)
  table[first[keep]] = second[keep]
  return jnp.asarray(table)
