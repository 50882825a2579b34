"""Sequential cascades of the speculative-cascades paper: TokenCascade (Alg. 2), OracleCascade (Alg. 3)
and the sequence-level SeqCascade (eq. 1). Speculative cascades are `speculative.speculative` with a
cascade rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specdec import sampling as sampling_lib
from specdec import rng, targets, verify
from specdec.decoding import common
from specdec.decoding.autoregressive import autoregressive
from specdec.decoding.drafters import ModelDrafter
from specdec.decoding.methods import ALPHA, RULE, Bounds, Method, Param, register
from specdec.decoding.speculative import PairState
from specdec.models.base import Model, rollback

Array = jax.Array

# App. F.1: the small model predicts at most 10 tokens before the large model is invoked.
MAX_DRAFTER_RUN = 10
# Static widths of a TokenCascade catch-up call (pending tokens + the current one).
_CATCH_UP_WIDTHS = (1, 4, MAX_DRAFTER_RUN + 1)


@struct.dataclass
class _CascadeState(PairState):
  pending: Array           # [B, MAX_DRAFTER_RUN] tokens in the drafter's cache, not yet the verifier's
  n_pending: Array         # [B]
  run: Array               # [B] drafter tokens since the row last deferred (TokenCascade's cap)


def oracle_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                   sampling: sampling_lib.Sampling, rule: str, alpha, max_new_tokens: int, eos_id: int | None,
                   cache_length: int, program: common.Program) -> common.Output:
  """OracleCascade (Alg. 3): both models every step; x_t is drawn from the law that one step of Alg. 4
  with π_t = T(q_t, p_t) emits (`verify.verification_law`: π_t itself when Σπ_t = 1, Tran-Thien's law for
  lossy with β = 1). With a cascade rule this is (1 − δ)·S(q_t) + δ·S(p_t), and in every case it is the
  reference law of `speculative` with the same rule, at two calls per token.
  """
  batch, target = prompts.shape[0], targets.get_rule(rule)

  def step(state: PairState, done: Array) -> tuple[PairState, common.Emission]:
    key, step_key = rng.split(state.key)
    drafted, verified = (drafter.score(state.drafter_state, state.last[:, None]),
                         verifier.score(state.verifier_cache, state.last[:, None]))
    q_logits, drafter_cache, p_logits, verifier_cache = drafted.logits, drafted.cache, verified.logits, verified.cache
    q_raw, q = sampling.distributions(q_logits[:, 0])
    p_raw, p = sampling.distributions(p_logits[:, 0])
    pi = target.distribution(q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
    token = sampling_lib.sample(step_key, verify.verification_law(q, pi))
    deferred = target.deferred(q=q, p=p, q_raw=q_raw, p_raw=p_raw, pi=pi, alpha=alpha)
    new_state = state.replace(key=key, drafter_state=drafter_cache, verifier_cache=verifier_cache, last=token)
    return new_state, common.Emission(
        block=token[:, None], count=jnp.ones((batch,), jnp.int32),
        failed=common.has_nan(q_logits) | common.has_nan(p_logits),
        counters=dict(drafter_calls=1, verifier_calls=1, verifier_positions=1), deferred=deferred[:, None])

  start = PairState.start(key, ModelDrafter(drafter), verifier, prompts, prompt_lengths, cache_length,
                          program.cache_layout)
  output, _ = common.decode_loop(start, step, batch_size=batch, max_new_tokens=max_new_tokens, eos_id=eos_id)
  return output


def token_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                  sampling: sampling_lib.Sampling, rule: str, alpha, max_new_tokens: int, eos_id: int | None,
                  cache_length: int, program: common.Program) -> common.Output:
  """TokenCascade (Alg. 2), sequential: the drafter runs until δ(q_raw) = 1 or for MAX_DRAFTER_RUN
  tokens; then the verifier catches up on the accumulated prefix in one call and emits one token from
  S(p) (App. F.1). `rule` must decide from q alone (chow, chow_log).

  Law: x_t ~ S(q_t) where the drafter keeps the token, S(p_t) where it defers or its run is full.
  The catch-up call scores pending tokens + the current one at the smallest of a few static widths that
  covers the deferring rows. Other rows ride along, catching up as far as that width allows (which
  changes nothing in their output or their cap); their counters do not count the call. Latency is
  measured at batch size 1.
  """
  batch = prompts.shape[0]
  rows = jnp.arange(batch)

  def step(state: _CascadeState, done: Array) -> tuple[_CascadeState, common.Emission]:
    key, key_q, key_p = rng.split(state.key, 3)
    live = ~done
    drafted = drafter.score(state.drafter_state, state.last[:, None])
    q_logits, drafter_cache = drafted.logits, drafted.cache
    q_raw, q = sampling.distributions(q_logits[:, 0])
    defers = targets.deferral(rule, q_raw=q_raw, alpha=alpha) | (state.run == MAX_DRAFTER_RUN)
    defers &= live

    def catch_up(state: _CascadeState):
      # [pending…, last] per row, scored at one static width; row b's p_t is at index n_pending[b].
      tokens = jnp.concatenate([state.pending, jnp.zeros((batch, 1), jnp.int32)], axis=1)
      tokens = tokens.at[rows, state.n_pending].set(state.last)
      needed = jnp.where(defers, state.n_pending + 1, 1)
      scored, width = common.score_prefix(verifier, state.verifier_cache, tokens, needed, _CATCH_UP_WIDTHS,
                                          narrow=program.narrow_calls)
      synced = state.n_pending + 1 <= width
      lengths = state.verifier_cache.lengths + jnp.where(synced, state.n_pending + 1, 0)
      return scored.logits[rows, state.n_pending], rollback(scored.cache, lengths), synced

    def wait(state: _CascadeState):
      return jnp.zeros_like(q_logits[:, 0]), state.verifier_cache, jnp.zeros((batch,), bool)

    p_logits, verifier_cache, synced = jax.lax.cond(jnp.any(defers), catch_up, wait, state)
    _, p = sampling.distributions(p_logits)
    token = jnp.where(defers, sampling_lib.sample(key_p, p), sampling_lib.sample(key_q, q))
    failed = common.has_nan(q_logits) | (defers & common.has_nan(p_logits))
    live &= ~failed
    pending = state.pending.at[rows, jnp.minimum(state.n_pending, MAX_DRAFTER_RUN - 1)].set(
        jnp.where(synced, 0, state.last))
    # A finished row's drafter cache must not run ahead of its pending list: freeze it.
    drafter_cache = rollback(drafter_cache, jnp.where(live, drafter_cache.lengths, state.drafter_state.lengths))
    new_state = state.replace(
        key=key, drafter_state=drafter_cache, verifier_cache=verifier_cache,
        last=jnp.where(live, token, state.last), pending=pending,
        n_pending=jnp.where(synced, 0, state.n_pending + live), run=jnp.where(defers, 0, state.run + live))
    return new_state, common.Emission(block=token[:, None], count=jnp.ones((batch,), jnp.int32), failed=failed,
                                      counters=dict(drafter_calls=1, verifier_calls=defers, verifier_positions=defers
                                                    * common.covering_width(state.n_pending + 1, _CATCH_UP_WIDTHS,
                                                                            MAX_DRAFTER_RUN + 1)),
                                      deferred=defers[:, None])

  pair = PairState.start(key, ModelDrafter(drafter), verifier, prompts, prompt_lengths, cache_length,
                         program.cache_layout)
  start = _CascadeState(**vars(pair),
                        pending=jnp.zeros((batch, MAX_DRAFTER_RUN), jnp.int32),
                        n_pending=jnp.zeros((batch,), jnp.int32), run=jnp.zeros((batch,), jnp.int32))
  output, _ = common.decode_loop(start, step, batch_size=batch, max_new_tokens=max_new_tokens, eos_id=eos_id)
  return output


def seq_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                sampling: sampling_lib.Sampling, alpha, max_new_tokens: int, eos_id: int | None,
                cache_length: int, program: common.Program) -> common.Output:
  """SeqCascade [Chow] (eq. 1): the drafter writes the whole response; the row defers to the verifier,
  which writes a new response from the prompt, when the drafter's confidence is below 1 − α.

  The max over responses of q(response) is estimated along the drafted response by Π_t max_v q_raw(v|x_<t)
  (a plug-in in the spirit of eq. (1): it is the probability of the greedy continuation only when the
  drafted tokens are the argmaxes, and a lower bound on the max then). The verifier pass runs only when
  some row defers.
  """
  key_draft, key_verify = rng.split(key)
  drafted, log_confidence = autoregressive(
      key_draft, drafter, prompts, prompt_lengths, sampling=sampling, max_new_tokens=max_new_tokens,
      eos_id=eos_id, cache_length=cache_length, program=program, calls="drafter_calls", with_log_confidence=True)
  defers = ~drafted.failed & (
      log_confidence < jnp.log(jnp.maximum(1.0 - jnp.asarray(alpha, jnp.float32), 1e-30)))

  def verify_deferred(_):
    return autoregressive(key_verify, verifier, prompts, prompt_lengths, sampling=sampling,
                          max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=cache_length, program=program,
                          active=defers)

  def nothing_deferred(_):
    return jax.tree.map(jnp.zeros_like, drafted)

  verified = jax.lax.cond(jnp.any(defers), verify_deferred, nothing_deferred, None)
  tokens = jnp.where(defers[:, None], verified.tokens, drafted.tokens)
  lengths = jnp.where(defers, verified.lengths, drafted.lengths)
  stats = drafted.stats.replace(verifier_calls=verified.stats.verifier_calls,
                                verifier_positions=verified.stats.verifier_positions,
                                deferred=jnp.where(defers, verified.lengths, 0), generated=lengths)
  return common.Output(tokens=tokens, lengths=lengths, stats=stats,
                       failed=drafted.failed | (defers & verified.failed))


def _check_sequential_rule(rule, params) -> None:
  if not targets.get_rule(rule).decides_from_q:
    raise ValueError(f"rule must be {' or '.join(targets.sequential_rules())} for token_cascade (it defers on q "
                     f"alone, before the verifier runs); got {rule!r}")


register(Method(
    "seq_cascade", decode=seq_cascade, drafter="model", summary="SeqCascade [Chow] (eq. 1)",
    params=(Param("alpha", 0.0, traced=True, help=ALPHA.help,
                  bounds=Bounds(0.0, 1.0, hi_closed=False, label="alpha (seq_cascade)")),)))
register(Method(
    "token_cascade", decode=token_cascade, drafter="model", cache_overhang=lambda p: MAX_DRAFTER_RUN + 2,
    summary=f"TokenCascade (Alg. 2, ≤ {MAX_DRAFTER_RUN} drafter tokens per verifier call)",
    params=(dataclasses.replace(RULE, default="chow", check=_check_sequential_rule, choices=targets.sequential_rules(),
                                help=f"{' or '.join(targets.sequential_rules())} (defers on q alone)"), ALPHA)))
register(Method(
    "oracle_cascade", decode=oracle_cascade, drafter="model",
    summary="OracleCascade (Alg. 3) with any rule (diff: Oracle [Diff])", params=(RULE, ALPHA)))
