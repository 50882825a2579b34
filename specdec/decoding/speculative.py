"""Speculative decoding with any target rule (Alg. 4/5 of the speculative-cascades paper) and the
original BiLD (Kim et al.; cascades paper App. F.5), which shares its draft / verify / commit structure.

One block: the drafter proposes γ drafts (`drafters.Drafter.propose`); the verifier scores
[last, d_1 … d_γ] in ONE call; `verify.verify_block` accepts a prefix; the drafter and the verifier's
cache roll back to the committed length (a length reset). A model drafter makes γ calls, and a γ+1-th,
scoring d_γ, only where it is needed: before verification for the targets that read q at the bonus
position (cascade and token rules, T(q_γ, p_γ)); after it, and only for the rows that accepted every
draft, for the rest (SpecDecode, Lossy, BiLD draw the bonus token from p): a rejected draft costs no call.
A drafter marked `variable_length` drafts 0 … γ tokens per row (`Draft.n_drafted`), as does any drafter under a
confidence stop (`confidence_stop`); the verifier then scores only the longest row's block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specdec import sampling as sampling_lib
from specdec import rng, targets, verify
from specdec.decoding import common
from specdec.decoding.drafters import Draft, Drafter, ModelDrafter, Verified
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.decoding.methods import ALPHA, GAMMA, RULE, Bounds, Method, Param, alpha_bounds, count_bounds, register
from specdec.models.base import Cache, Model, prefill, rollback

Array = jax.Array


@struct.dataclass
class PairState:
  """Loop state of a drafter/verifier method: both hold the committed tokens but the last one."""
  key: Array
  drafter_state: object
  verifier_cache: Cache
  last: Array              # [B] last emitted token, consumed by neither model yet

  @classmethod
  def start(cls, key: Array, drafter: Drafter, verifier: Model, prompts: Array, prompt_lengths: Array,
            cache_length: int, layout: str) -> "PairState":
    """Both models after reading the prompts, their caches of `cache_length` slots in `layout`."""
    drafter_state, last = drafter.start(prompts, prompt_lengths, cache_length, layout)
    empty = verifier.init_cache(prompts.shape[0], cache_length, layout)
    if drafter.reads_verifier and verifier.encoder_decoder:
      # The prompt is the encoder's: the decoder has read nothing, so there are no hidden states yet, and
      # the pending token is the verifier's decoder start token.
      last, verifier_cache = prefill(verifier, empty, prompts, prompt_lengths)
      none = jnp.zeros((prompts.shape[0],), jnp.int32)
      drafter_state = drafter.verified(drafter_state, Verified(
          tokens=last[:, None], count=none, next_token=last, lengths=none,
          hidden=jnp.zeros((prompts.shape[0], 1, verifier.hidden_size), jnp.float32)))
    elif drafter.reads_verifier:   # the drafter reads the prompt from the verifier's prefill
      _, verifier_cache, hidden = prefill(verifier, empty, prompts, prompt_lengths, return_hidden=True)
      drafter_state = drafter.verified(drafter_state, Verified(
          tokens=prompts, count=prompt_lengths - 1, next_token=last, lengths=prompt_lengths - 1, hidden=hidden))
    else:
      _, verifier_cache = prefill(verifier, empty, prompts, prompt_lengths)
    return cls(key=key, drafter_state=drafter_state, verifier_cache=verifier_cache, last=last)


def commit(state: PairState, key: Array, drafter: Drafter, drafted: Draft, verifier_cache: Cache, n_accepted: Array,
           next_token: Array, deferred: Array | None, failed: Array, done: Array, scored: Array | int,
           verified_tokens: Array | None = None, hidden: Array | None = None) -> tuple[PairState, common.Emission]:
  """Emits d_1 … d_a, next_token; rolls the verifier's cache back to the committed length and hands the
  drafter the verified block (`Drafter.verified`: the tokens the verifier scored, `verified_tokens` [B, W],
  with its hidden states there, `hidden` [B, W, E], for a drafter that reads them).
  `scored` [B]: the positions the verifier's call scored for each row (`common.covering_width`).

  `failed` [B] marks rows NaN reached (verify_block's −1 flag): they stop, flagged, emitting nothing.
  """
  batch, gamma = drafted.tokens.shape
  index = jnp.arange(gamma + 1)
  n_accepted = jnp.maximum(n_accepted, 0)
  padded = jnp.concatenate([drafted.tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  block = jnp.where(index < n_accepted[:, None], padded, next_token[:, None])
  live = ~done & ~failed
  count = jnp.where(live, n_accepted + 1, 0)
  committed = state.verifier_cache.lengths + count
  if verified_tokens is None:
    verified_tokens = jnp.concatenate([state.last[:, None], drafted.tokens], axis=1)
  verified = Verified(tokens=verified_tokens, count=count, next_token=next_token, lengths=committed, hidden=hidden)
  new_state = PairState(key=key, drafter_state=drafter.verified(drafted.state, verified),
                        verifier_cache=rollback(verifier_cache, committed),
                        last=jnp.where(live, next_token, state.last))
  counters = dict(drafter_calls=drafted.calls, verifier_calls=1, verifier_positions=scored,
                  drafted=drafted.n_drafted, accepted=n_accepted,
                  rejected=(n_accepted < drafted.n_drafted).astype(jnp.int32))
  return new_state, common.Emission(block=block, count=n_accepted + 1, failed=failed, counters=counters,
                                    deferred=deferred)


def _deferring_last_call(drafter: Drafter, needs_bonus_q: bool) -> Drafter:
  """A model or feature drafter that saves the call on its last draft (`bonus_q`) where q is not needed at
  the bonus position; any other drafter as it is (a cascade or Max-Gram emits q there at no call)."""
  if isinstance(drafter, (ModelDrafter, FeatureDrafter)) and not needs_bonus_q:
    return drafter.replace(bonus_q=False)
  return drafter


def _complete(drafter: Drafter, drafted: Draft, n_accepted: Array, done: Array,
              sampling: sampling_lib.Sampling) -> Draft:
  """`drafted` with its pending last drafts scored for the live rows that accepted every draft."""
  if drafted.pending is None:
    return drafted
  return drafter.catch_up(drafted, (n_accepted == drafted.n_drafted) & ~done, sampling)


def speculative(key: Array, drafter: Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                sampling: sampling_lib.Sampling, rule: str, alpha, gamma: int, max_new_tokens: int,
                eos_id: int | None, cache_length: int, program: common.Program,
                stop_below: Array | float | None = None) -> common.Output:
  """SpecDecode / SpecCascade: GenSpecSample (Alg. 4) with π_j = T(q_j, p_j) of `rule` at each position.

  The bonus position γ uses π_γ = T(q_γ, p_γ) too, except for rules whose bonus is drawn from p (the lossy
  rules, as in Tran-Thien; docs/design.md). `deferred` counts emitted positions where a deferral rule's
  δ_j = 1, or, for any other rule, π_j ≠ q_j (`targets.Rule.deferred`). `stop_below` (traced; None: none): a
  row's block stops before draft j where max q_raw_j < stop_below (`confidence_stop`).
  """
  target = targets.get_rule(rule)
  drafter = _deferring_last_call(drafter, needs_bonus_q=target.needs_bonus_q)
  keep_drafting = None if stop_below is None else (lambda q_raw_j: jnp.max(q_raw_j, axis=-1) >= stop_below)

  def step(state: PairState, done: Array) -> tuple[PairState, common.Emission]:
    key, key_draft, key_verify = rng.split(state.key, 3)
    drafted = drafter.propose(key_draft, state.drafter_state, state.last, max_drafts=gamma, sampling=sampling,
                              keep_drafting=keep_drafting)
    verify_in = jnp.concatenate([state.last[:, None], drafted.tokens], axis=1)
    if drafter.variable_length or stop_below is not None:
      # Rows draft 0 … γ tokens: score only what the longest row needs (at batch 1, exactly its block).
      widths = tuple(range(1, gamma + 1))
      needed = jnp.where(done, 1, drafted.n_drafted + 1)
      scored, _ = common.score_prefix(verifier, state.verifier_cache, verify_in, needed, widths,
                                      narrow=program.narrow_calls, return_hidden=drafter.reads_verifier)
      width = common.covering_width(needed, widths, gamma + 1)
    else:
      scored, width = verifier.score(state.verifier_cache, verify_in), gamma + 1
    logits, verifier_cache = scored.logits, scored.cache
    hidden = scored.hidden if drafter.reads_verifier else None
    p_raw, p = sampling.distributions(logits)
    pi = target.distribution(q=drafted.q, p=p, q_raw=drafted.q_raw, p_raw=p_raw, alpha=alpha)
    pi = target.with_bonus(pi, p, (jnp.arange(gamma + 1) >= drafted.n_drafted[:, None])[..., None])
    n_accepted, next_token = verify.verify_block(key_verify, drafted.tokens, drafted.q[:, :gamma], pi,
                                                 drafted.n_drafted)
    drafted = _complete(drafter, drafted, n_accepted, done, sampling)
    deferred = target.deferred(q=drafted.q, p=p, q_raw=drafted.q_raw, p_raw=p_raw, pi=pi, alpha=alpha)
    # NaN logits can vanish from π (a comparison with NaN is False: token rules then give π = q), so
    # the loop checks the logits, not only verify_block's flag.
    failed = (n_accepted < 0) | common.has_nan(logits) | common.has_nan(drafted.q)
    return commit(state, key, drafter, drafted, verifier_cache, n_accepted, next_token, deferred, failed, done,
                  width, verify_in, hidden)

  start = PairState.start(key, drafter, verifier, prompts, prompt_lengths, cache_length, program.cache_layout)
  output, _ = common.decode_loop(start, step, batch_size=prompts.shape[0], max_new_tokens=max_new_tokens,
                                 eos_id=eos_id)
  return output


def bild(key: Array, drafter: Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, *,
         sampling: sampling_lib.Sampling, alpha, fallback_alpha, gamma: int, max_new_tokens: int,
         eos_id: int | None, cache_length: int, program: common.Program) -> common.Output:
  """The original Big Little Decoder (cascades App. F.5; Kim et al. 2023).

  Fallback: the drafter drafts while max q_raw ≥ 1 − α_f, up to `gamma` tokens (the maximum window).
  Rollback: the verifier scores the window in one call (at the smallest of three static widths that
  covers the longest row's window); the first draft with D(q_j, p_j) > α
  (D = −Σ q·log p_raw, `targets.bild_discrepancy`) and everything after it is discarded, and its
  position gets a token from S(p_j) — deterministic rollback instead of rejection sampling. If the whole
  window passes, the next token is the verifier's (the fallback token) from S(p) at the window's end.
  """
  drafter = _deferring_last_call(drafter, needs_bonus_q=False)   # the next token is always drawn from p

  def confident(q_raw_j):
    return jnp.max(q_raw_j, axis=-1) >= 1.0 - fallback_alpha

  def step(state: PairState, done: Array) -> tuple[PairState, common.Emission]:
    key, key_draft, key_next = rng.split(state.key, 3)
    drafted = drafter.propose(key_draft, state.drafter_state, state.last, max_drafts=gamma, sampling=sampling,
                              keep_drafting=confident)
    verify_in = jnp.concatenate([state.last[:, None], drafted.tokens], axis=1)
    # The window is as long as the drafter stayed confident: score only what the longest row needs.
    needed, widths = jnp.where(done, 1, drafted.n_drafted + 1), (1, (gamma + 2) // 2)
    scored, _ = common.score_prefix(verifier, state.verifier_cache, verify_in, needed, widths,
                                    narrow=program.narrow_calls, return_hidden=drafter.reads_verifier)
    logits, width = scored.logits, common.covering_width(needed, widths, gamma + 1)
    p_raw, p = sampling.distributions(logits)
    index = jnp.arange(gamma)
    passes = (targets.bild_discrepancy(drafted.q[:, :gamma], p_raw[:, :gamma]) <= alpha) & (
        index < drafted.n_drafted[:, None])
    n_accepted = jnp.sum(jnp.cumprod(passes, axis=-1), axis=-1).astype(jnp.int32)
    next_token = sampling_lib.sample(key_next, p[jnp.arange(p.shape[0]), n_accepted])
    drafted = _complete(drafter, drafted, n_accepted, done, sampling)
    deferred = jnp.arange(gamma + 1) == n_accepted[:, None]
    failed = common.has_nan(jnp.where((jnp.arange(gamma + 1) <= drafted.n_drafted[:, None])[..., None],
                                      logits, 0.0)) | common.has_nan(drafted.q)
    return commit(state, key, drafter, drafted, scored.cache, n_accepted, next_token, deferred, failed, done,
                  width, verify_in, scored.hidden)

  start = PairState.start(key, drafter, verifier, prompts, prompt_lengths, cache_length, program.cache_layout)
  output, _ = common.decode_loop(start, step, batch_size=prompts.shape[0], max_new_tokens=max_new_tokens,
                                 eos_id=eos_id)
  return output


def specdec_pp(key: Array, drafter: Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, *,
               sampling: sampling_lib.Sampling, stop_threshold, max_gamma: int, max_new_tokens: int,
               eos_id: int | None, cache_length: int, program: common.Program) -> common.Output:
  """SpecDec++ (Huang et al., Alg. 1): lossless SpecDecode whose drafter stops a block once its acceptance
  head predicts P(some draft rejected) > h = `stop_threshold` (at most `max_gamma` drafts; the verifier
  scores only the longest row's block). `drafter`: a `ModelDrafter` with a `head`."""
  if not isinstance(drafter, ModelDrafter) or drafter.head is None:
    raise ValueError("method 'specdec_pp' needs a drafter with an acceptance head: decoding.ModelDrafter(model, "
                     "head=…), e.g. training.exports.drafter_for(method, model, "
                     "exports.load_parts(export_directory))")
  return speculative(key, drafter.replace(stop_threshold=stop_threshold), verifier, prompts, prompt_lengths,
                     sampling=sampling, rule="spec", alpha=0.0, gamma=max_gamma, max_new_tokens=max_new_tokens,
                     eos_id=eos_id, cache_length=cache_length, program=program)


def confidence_stop(key: Array, drafter: Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                    sampling: sampling_lib.Sampling, stop_below, max_gamma: int, max_new_tokens: int,
                    eos_id: int | None, cache_length: int, program: common.Program) -> common.Output:
  """Lossless SpecDecode with a confidence stop (Kangaroo's early exit, Liu et al. 2024; EAGLE-2 §4: a draft's
  probability tracks its acceptance): a row's block stops before draft j where the drafter's top probability
  max q_raw_j < `stop_below` (at most `max_gamma` drafts; the verifier scores only the longest row's block). The
  stop reads only what the drafter drew, so each position's test is SpecDecode's and the output law the
  verifier's; a drafter that ignores `keep_drafting` drafts max_gamma."""
  return speculative(key, drafter, verifier, prompts, prompt_lengths, sampling=sampling, rule="spec", alpha=0.0,
                     gamma=max_gamma, max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=cache_length,
                     program=program, stop_below=stop_below)


def block_overhang(params) -> int:
  """A block of γ drafts and the token after them: the verifier's call writes γ + 1 positions."""
  return params["gamma"] + 1


register(Method(
    "speculative", decode=speculative, cache_overhang=block_overhang,
    summary="γ drafts, one verifier call scoring γ+1 positions, Alg. 4 with π = T(q, p) of `rule` (spec: "
            "SpecDecode; lossy, lossy_tuned: SpecDecode [Lossy]; bild: BiLD*; cascade and token rules: "
            "SpecCascade). Greedy lossy (Leviathan) is token_v3 at temperature 0",
    params=(RULE, dataclasses.replace(ALPHA, used=lambda p: targets.get_rule(p["rule"]).uses_alpha), GAMMA)))
register(Method(
    "bild", decode=bild, cache_overhang=block_overhang,
    summary="the original BiLD: the drafter drafts while max q ≥ 1 − fallback_alpha, at most γ tokens; "
            "deterministic rollback where D(q, p) > alpha",
    params=(Param("alpha", 0.0, traced=True, bounds=alpha_bounds("bild"), help=ALPHA.help),
            Param("fallback_alpha", 0.5, traced=True, bounds=Bounds(0.0, 1.0),
                  help="BiLD's fallback: the drafter hands over while max q < 1 − fallback_alpha, in [0, 1]"),
            GAMMA)))
register(Method(
    "confidence_stop", decode=confidence_stop, cache_overhang=lambda p: p["max_gamma"] + 1,
    summary="SpecDecode (lossless) whose drafter stops a block before the first draft with max q_raw < "
            "stop_below (at most max_gamma drafts)",
    params=(Param("stop_below", 0.3, traced=True, bounds=Bounds(0.0, 1.0),
                  help="a block stops before a draft whose top probability max q_raw is below it, in [0, 1]"),
            Param("max_gamma", 5, traced=False, bounds=count_bounds(1),
                  help="the most drafts per block, an int >= 1"))))
register(Method(
    "specdec_pp", decode=specdec_pp, cache_overhang=lambda p: p["max_gamma"] + 1,
    summary="SpecDec++ (lossless): the drafter, a `ModelDrafter(model, head=…)`, stops a block once its "
            "acceptance head predicts P(some draft rejected) > stop_threshold",
    export_parts=("acceptance_head",),
    make_drafter=lambda model, acceptance_head: ModelDrafter(model, head=acceptance_head),
    params=(Param("stop_threshold", 0.5, traced=True, bounds=Bounds(0.0, 1.0),
                  help="the head stops a block once P(some draft rejected) > stop_threshold, in [0, 1]"),
            Param("max_gamma", 8, traced=False, bounds=count_bounds(1),
                  help="the most drafts per block, an int >= 1"))))
