"""Speculative decoding with any target rule (Alg. 4/5 of the speculative-cascades paper) and the
original BiLD (Kim et al.; cascades paper App. F.5), which shares its draft / verify / commit structure.

One block: the drafter scores the pending token and its own drafts one at a time (γ+1 calls, the last
giving q at the bonus position, which cascade targets T(q, p) need, and putting d_γ in its cache); the
verifier scores [last, d_1 … d_γ] in ONE call; `verify.verify_block` accepts a prefix; both caches roll
back to the committed length by a length reset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec import sampling, targets, verify
from specdec.decoding import common
from specdec.models.base import Cache, Model, rollback

Array = jax.Array


@struct.dataclass
class Draft:
  """A block of drafts [B, γ] with the drafter's distributions at the γ+1 positions [B, γ+1, V]."""
  tokens: Array
  q: Array
  q_raw: Array
  n_drafted: Array            # [B] drafts made (γ for speculative, ≤ γ for BiLD's fallback window)
  cache: Cache


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


def draft(key: Array, drafter: Model, cache: Cache, last: Array, *, max_drafts: int, temperature,
          top_p, top_k: int, keep_drafting=None) -> Draft:
  """Scores `last` then each new draft, drawing x_{j+1} ~ S(q_j), for up to `max_drafts` drafts.

  `keep_drafting(q_raw_j) -> [B] bool` stops a row early (BiLD's fallback); a stopped row drafts no more
  and the loop ends when every row has stopped, so at batch size 1 no call is wasted. A row makes
  n_drafted + 1 drafter calls: the last one scores its final draft (or finds it unconfident).
  """
  batch, vocab = last.shape[0], drafter.vocab_size
  keys = jax.random.split(key, max_drafts + 1)

  def cond(c: _DraftCarry) -> Array:
    return (c.step <= max_drafts) & jnp.any(c.drafting)

  def body(c: _DraftCarry) -> _DraftCarry:
    logits, cache = drafter.score(c.cache, c.token[:, None])
    q_raw_j, q_j = common.distributions(logits[:, 0], temperature, top_p, top_k)
    keep = c.drafting[:, None]
    q = c.q.at[:, c.step].set(jnp.where(keep, q_j, c.q[:, c.step]))
    q_raw = c.q_raw.at[:, c.step].set(jnp.where(keep, q_raw_j, c.q_raw[:, c.step]))
    go_on = c.drafting & (c.step < max_drafts)
    if keep_drafting is not None:
      go_on &= keep_drafting(q_raw_j)
    x = sampling.sample(keys[c.step], q_j)
    slot = jnp.minimum(c.step, max_drafts - 1)
    tokens = c.tokens.at[:, slot].set(jnp.where(go_on, x, c.tokens[:, slot]))
    # Rows that stopped keep being scored (static batch) but the rollback after verification resets them.
    return _DraftCarry(step=c.step + 1, cache=cache, token=jnp.where(go_on, x, c.token), tokens=tokens,
                       q=q, q_raw=q_raw, drafting=go_on, n_drafted=c.n_drafted + go_on)

  zeros = jnp.zeros((batch, max_drafts + 1, vocab), jnp.float32)
  start = _DraftCarry(step=jnp.int32(0), cache=cache, token=last,
                      tokens=jnp.zeros((batch, max_drafts), jnp.int32), q=zeros, q_raw=zeros,
                      drafting=jnp.ones((batch,), bool), n_drafted=jnp.zeros((batch,), jnp.int32))
  end = jax.lax.while_loop(cond, body, start)
  return Draft(tokens=end.tokens, q=end.q, q_raw=end.q_raw, n_drafted=end.n_drafted, cache=end.cache)


def _commit(state: common.PairState, drafted: Draft, verifier_cache: Cache, n_accepted: Array, next_token: Array,
            deferred: Array, failed: Array, *, max_new_tokens: int, eos_id: int | None) -> common.PairState:
  """Emits d_1 … d_a, next_token; rolls both caches back to the committed length; counts.

  `failed` [B] marks rows NaN reached (verify_block's −1 flag): they stop, flagged, emitting nothing.
  """
  batch, gamma = drafted.tokens.shape
  index = jnp.arange(gamma + 1)
  n_accepted = jnp.maximum(n_accepted, 0)
  padded = jnp.concatenate([drafted.tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  block = jnp.where(index < n_accepted[:, None], padded, next_token[:, None])
  live = ~state.emitted.done & ~failed
  emitted, count = common.emit(state.emitted, block, n_accepted + 1, max_new_tokens=max_new_tokens,
                               eos_id=eos_id, failed=failed)
  committed = state.verifier_cache.lengths + jnp.where(live, n_accepted + 1, 0)
  stats = state.stats.add(
      live, drafter_calls=drafted.n_drafted + 1, verifier_calls=1, drafted=drafted.n_drafted,
      accepted=n_accepted, rejected=(n_accepted < drafted.n_drafted).astype(jnp.int32),
      deferred=jnp.sum(deferred & (index < count[:, None]), axis=-1), generated=count)
  return state.replace(drafter_cache=rollback(drafted.cache, committed),
                       verifier_cache=rollback(verifier_cache, committed),
                       last=jnp.where(live, next_token, state.last), emitted=emitted, stats=stats)


def _loop(key, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, block_fn, *,
          gamma: int, max_new_tokens: int, eos_id: int | None, cache_length: int) -> common.Output:
  start = common.PairState.start(key, drafter, verifier, prompts, prompt_lengths, cache_length=cache_length,
                                 max_new_tokens=max_new_tokens, slack=gamma + 1)
  end = jax.lax.while_loop(lambda s: jnp.any(~s.emitted.done), block_fn, start)
  return common.finish(end.emitted, end.stats, max_new_tokens)


def speculative(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                rule: str, alpha, gamma: int, temperature, top_p, top_k: int, max_new_tokens: int,
                eos_id: int | None, cache_length: int) -> common.Output:
  """SpecDecode / SpecCascade: GenSpecSample (Alg. 4) with π_j = T(q_j, p_j) of `rule` at each position.

  The bonus position γ uses π_γ = T(q_γ, p_γ) too, except for the lossy rules, whose bonus is drawn
  from p as in Tran-Thien (DESIGN, pitfalls). `deferred` counts emitted positions where π_j ≠ q_j.
  """
  def block(state: common.PairState) -> common.PairState:
    key, key_draft, key_verify = jax.random.split(state.key, 3)
    drafted = draft(key_draft, drafter, state.drafter_cache, state.last, max_drafts=gamma,
                    temperature=temperature, top_p=top_p, top_k=top_k)
    verify_in = jnp.concatenate([state.last[:, None], drafted.tokens], axis=1)
    logits, verifier_cache = verifier.score(state.verifier_cache, verify_in)
    p_raw, p = common.distributions(logits, temperature, top_p, top_k)
    pi = targets.target_distribution(rule, q=drafted.q, p=p, q_raw=drafted.q_raw, p_raw=p_raw, alpha=alpha)
    if rule.startswith("lossy"):
      pi = pi.at[:, gamma].set(p[:, gamma])
    n_accepted, next_token = verify.verify_block(key_verify, drafted.tokens, drafted.q[:, :gamma], pi)
    if rule in targets.CASCADE_RULES:  # δ itself: at T = 0 a deferral to an agreeing p leaves π = q
      deferred = targets.deferral(rule, q_raw=drafted.q_raw, p_raw=p_raw, q=drafted.q, p=p, alpha=alpha)
    else:  # the verifier moved mass: π ≠ q beyond float noise (lossy_tuned's β* is a bisection)
      deferred = jnp.any(jnp.abs(pi - drafted.q) > 1e-6, axis=-1)
    # NaN logits can vanish from π (a comparison with NaN is False: token rules then give π = q), so
    # the loop checks the logits, not only verify_block's flag.
    failed = (n_accepted < 0) | common.has_nan(logits) | common.has_nan(drafted.q)
    return _commit(state.replace(key=key), drafted, verifier_cache, n_accepted, next_token, deferred,
                   failed, max_new_tokens=max_new_tokens, eos_id=eos_id)

  return _loop(key, drafter, verifier, prompts, prompt_lengths, block, gamma=gamma,
               max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=cache_length)


def bild(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *, alpha,
         fallback_alpha, gamma: int, temperature, top_p, top_k: int, max_new_tokens: int,
         eos_id: int | None, cache_length: int) -> common.Output:
  """The original Big Little Decoder (cascades App. F.5; Kim et al. 2023).

  Fallback: the drafter drafts while max q_raw ≥ 1 − α_f, up to `gamma` tokens (the maximum window).
  Rollback: the verifier scores the window in one call (at the smallest of three static widths that
  covers the longest row's window); the first draft with D(q_j, p_j) > α
  (D = −Σ q·log p_raw, `targets.bild_discrepancy`) and everything after it is discarded, and its
  position gets a token from S(p_j) — deterministic rollback instead of rejection sampling. If the whole
  window passes, the next token is the verifier's (the fallback token) from S(p) at the window's end.
  """
  def confident(q_raw_j):
    return jnp.max(q_raw_j, axis=-1) >= 1.0 - fallback_alpha

  def block(state: common.PairState) -> common.PairState:
    key, key_draft, key_next = jax.random.split(state.key, 3)
    drafted = draft(key_draft, drafter, state.drafter_cache, state.last, max_drafts=gamma,
                    temperature=temperature, top_p=top_p, top_k=top_k, keep_drafting=confident)
    verify_in = jnp.concatenate([state.last[:, None], drafted.tokens], axis=1)
    # The window is as long as the drafter stayed confident: score only what the longest row needs.
    needed = jnp.where(state.emitted.done, 1, drafted.n_drafted + 1)
    logits, verifier_cache, _ = common.score_prefix(verifier, state.verifier_cache, verify_in, needed,
                                                    (1, (gamma + 2) // 2))
    p_raw, p = common.distributions(logits, temperature, top_p, top_k)
    index = jnp.arange(gamma)
    passes = (targets.bild_discrepancy(drafted.q[:, :gamma], p_raw[:, :gamma]) <= alpha) & (
        index < drafted.n_drafted[:, None])
    n_accepted = jnp.sum(jnp.cumprod(passes, axis=-1), axis=-1).astype(jnp.int32)
    next_token = sampling.sample(key_next, p[jnp.arange(p.shape[0]), n_accepted])
    deferred = jnp.arange(gamma + 1) == n_accepted[:, None]
    failed = common.has_nan(jnp.where((jnp.arange(gamma + 1) <= drafted.n_drafted[:, None])[..., None],
                                      logits, 0.0)) | common.has_nan(drafted.q)
    return _commit(state.replace(key=key), drafted, verifier_cache, n_accepted, next_token, deferred,
                   failed, max_new_tokens=max_new_tokens, eos_id=eos_id)

  return _loop(key, drafter, verifier, prompts, prompt_lengths, block, gamma=gamma,
               max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=cache_length)
