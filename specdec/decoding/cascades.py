"""Sequential cascades of the speculative-cascades paper: TokenCascade (Alg. 2), OracleCascade (Alg. 3)
and the sequence-level SeqCascade (eq. 1). Speculative cascades are `speculative.speculative` with a
cascade rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec import sampling, targets
from specdec.decoding import common
from specdec.decoding.autoregressive import autoregressive
from specdec.models.base import Cache, Model, prefill, rollback

Array = jax.Array

# App. F.1: the small model predicts at most 10 tokens before the large model is invoked.
MAX_DRAFTER_RUN = 10


@struct.dataclass
class _State:
  key: Array
  drafter_cache: Cache
  verifier_cache: Cache
  last: Array              # [B] last emitted token, in neither cache yet
  pending: Array           # [B, MAX_DRAFTER_RUN] tokens in the drafter's cache, not yet the verifier's
  n_pending: Array         # [B]
  run: Array               # [B] drafter tokens since the row last deferred (TokenCascade's cap)
  emitted: common.Emitted
  stats: common.Stats


def oracle_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                   rule: str, alpha, temperature, top_p, top_k: int, max_new_tokens: int,
                   eos_id: int | None, cache_length: int) -> common.Output:
  """OracleCascade (Alg. 3): both models every step, x_t ~ π_t = T(q_t, p_t) of any rule.

  With a cascade rule π_t = (1 − δ)·S(q_t) + δ·S(p_t); it is the reference law of the speculative
  cascade with the same rule, at twice the calls.
  """
  batch = prompts.shape[0]
  last, drafter_cache = prefill(drafter, drafter.init_cache(batch, cache_length), prompts, prompt_lengths)
  _, verifier_cache = prefill(verifier, verifier.init_cache(batch, cache_length), prompts, prompt_lengths)

  def body(state: _State) -> _State:
    key, step_key = jax.random.split(state.key)
    q_logits, drafter_cache = drafter.score(state.drafter_cache, state.last[:, None])
    p_logits, verifier_cache = verifier.score(state.verifier_cache, state.last[:, None])
    q_raw, q = common.distributions(q_logits[:, 0], temperature, top_p, top_k)
    p_raw, p = common.distributions(p_logits[:, 0], temperature, top_p, top_k)
    pi = targets.target_distribution(rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
    token = sampling.sample(step_key, pi)
    live = ~state.emitted.done
    emitted, count = common.emit(state.emitted, token[:, None], jnp.ones((batch,), jnp.int32),
                                 max_new_tokens=max_new_tokens, eos_id=eos_id)
    deferred = jnp.any(jnp.abs(pi - q) > 0.0, axis=-1)
    stats = state.stats.add(live, drafter_calls=1, verifier_calls=1, deferred=deferred & (count > 0),
                            generated=count)
    return state.replace(key=key, drafter_cache=drafter_cache, verifier_cache=verifier_cache, last=token,
                         emitted=emitted, stats=stats)

  start = _State(key=key, drafter_cache=drafter_cache, verifier_cache=verifier_cache, last=last,
                 pending=jnp.zeros((batch, MAX_DRAFTER_RUN), jnp.int32),
                 n_pending=jnp.zeros((batch,), jnp.int32), run=jnp.zeros((batch,), jnp.int32),
                 emitted=common.Emitted.empty(batch, max_new_tokens, slack=1),
                 stats=common.Stats.zeros(batch))
  end = jax.lax.while_loop(lambda s: jnp.any(~s.emitted.done), body, start)
  return common.finish(end.emitted, end.stats, max_new_tokens)


def token_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                  rule: str, alpha, temperature, top_p, top_k: int, max_new_tokens: int,
                  eos_id: int | None, cache_length: int) -> common.Output:
  """TokenCascade (Alg. 2), sequential: the drafter runs until δ(q_raw) = 1 or for MAX_DRAFTER_RUN
  tokens; then the verifier catches up on the accumulated prefix in one call and emits one token from
  S(p) (App. F.1). `rule` must decide from q alone (chow, chow_log).

  Law: x_t ~ S(q_t) where the drafter keeps the token, S(p_t) where it defers or its run is full.
  With a batch, rows that did not defer ride along in a verifier call (catching up their prefix, which
  changes nothing in their output or their cap); their counters do not count it. Latency is measured
  at batch size 1.
  """
  if rule not in ("chow", "chow_log"):
    raise ValueError(f"token_cascade defers before the verifier runs, so its rule must use q only "
                     f"(chow or chow_log); got {rule!r}")
  batch = prompts.shape[0]
  last, drafter_cache = prefill(drafter, drafter.init_cache(batch, cache_length), prompts, prompt_lengths)
  _, verifier_cache = prefill(verifier, verifier.init_cache(batch, cache_length), prompts, prompt_lengths)
  rows = jnp.arange(batch)

  def body(state: _State) -> _State:
    key, key_q, key_p = jax.random.split(state.key, 3)
    live = ~state.emitted.done
    q_logits, drafter_cache = drafter.score(state.drafter_cache, state.last[:, None])
    q_raw, q = common.distributions(q_logits[:, 0], temperature, top_p, top_k)
    defers = targets.deferral(rule, q_raw=q_raw, alpha=alpha) | (state.run == MAX_DRAFTER_RUN)
    defers &= live

    def catch_up(state: _State):
      # Score [pending…, last] padded to a static width; the row's own last position gives p_t.
      tokens = jnp.concatenate([state.pending, jnp.zeros((batch, 1), jnp.int32)], axis=1)
      tokens = tokens.at[rows, state.n_pending].set(state.last)
      p_logits, cache = verifier.score(state.verifier_cache, tokens)
      p_raw, p = common.distributions(p_logits[rows, state.n_pending], temperature, top_p, top_k)
      return p, rollback(cache, state.verifier_cache.lengths + state.n_pending + 1)

    def wait(state: _State):
      return jnp.zeros_like(q), state.verifier_cache

    p, caught_up = jax.lax.cond(jnp.any(defers), catch_up, wait, state)
    token = sampling.sample(key_q, q)
    token = jnp.where(defers, sampling.sample(key_p, p), token)
    emitted, count = common.emit(state.emitted, token[:, None], jnp.ones((batch,), jnp.int32),
                                 max_new_tokens=max_new_tokens, eos_id=eos_id)
    synced = jnp.any(defers)  # every row caught up in this call
    pending = state.pending.at[rows, jnp.minimum(state.n_pending, MAX_DRAFTER_RUN - 1)].set(
        jnp.where(synced, 0, state.last))
    n_pending = jnp.where(synced, 0, state.n_pending + live)
    run = jnp.where(defers, 0, state.run + live)
    stats = state.stats.add(live, drafter_calls=1, verifier_calls=defers, deferred=defers & (count > 0),
                            generated=count)
    # A finished row's drafter cache must not run ahead of its pending list: freeze it.
    drafter_cache = rollback(drafter_cache, jnp.where(live, drafter_cache.lengths,
                                                      state.drafter_cache.lengths))
    return state.replace(key=key, drafter_cache=drafter_cache, verifier_cache=caught_up,
                         last=jnp.where(live, token, state.last), pending=pending, n_pending=n_pending,
                         run=run, emitted=emitted, stats=stats)

  start = _State(key=key, drafter_cache=drafter_cache, verifier_cache=verifier_cache, last=last,
                 pending=jnp.zeros((batch, MAX_DRAFTER_RUN), jnp.int32),
                 n_pending=jnp.zeros((batch,), jnp.int32), run=jnp.zeros((batch,), jnp.int32),
                 emitted=common.Emitted.empty(batch, max_new_tokens, slack=1),
                 stats=common.Stats.zeros(batch))
  end = jax.lax.while_loop(lambda s: jnp.any(~s.emitted.done), body, start)
  return common.finish(end.emitted, end.stats, max_new_tokens)


def seq_cascade(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                alpha, temperature, top_p, top_k: int, max_new_tokens: int, eos_id: int | None,
                cache_length: int) -> common.Output:
  """SeqCascade [Chow] (eq. 1): the drafter writes the whole response; the row defers to the verifier,
  which writes a new response from the prompt, when the drafter's confidence is below 1 − α.

  max over responses of q(response) is approximated along the drafted response by Π_t max_v q_raw(v|x_<t)
  (exact for greedy drafting), computed by scoring the response teacher-forced in one drafter call.
  """
  key_draft, key_verify = jax.random.split(key)
  drafted = autoregressive(key_draft, drafter, prompts, prompt_lengths, temperature=temperature,
                           top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, eos_id=eos_id,
                           cache_length=cache_length, calls="drafter_calls")
  log_confidence = _response_log_confidence(drafter, prompts, prompt_lengths, drafted, cache_length)
  defers = log_confidence < jnp.log(jnp.maximum(1.0 - jnp.asarray(alpha, jnp.float32), 1e-30))
  verified = autoregressive(key_verify, verifier, prompts, prompt_lengths, temperature=temperature,
                            top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, eos_id=eos_id,
                            cache_length=cache_length, active=defers)
  tokens = jnp.where(defers[:, None], verified.tokens, drafted.tokens)
  lengths = jnp.where(defers, verified.lengths, drafted.lengths)
  stats = drafted.stats.replace(verifier_calls=verified.stats.verifier_calls,
                                deferred=jnp.where(defers, verified.lengths, 0), generated=lengths)
  return common.Output(tokens=tokens, lengths=lengths, stats=stats)


def _response_log_confidence(drafter: Model, prompts: Array, prompt_lengths: Array, drafted: common.Output,
                             cache_length: int) -> Array:
  """Σ_t log max_v q_raw(v | prompt, x_<t) over each row's drafted tokens, [B]."""
  batch = prompts.shape[0]
  last, cache = prefill(drafter, drafter.init_cache(batch, cache_length), prompts, prompt_lengths)
  tokens = jnp.concatenate([last[:, None], drafted.tokens], axis=1)
  logits, _ = drafter.score(cache, tokens[:, :-1])
  log_max = jnp.max(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.sum(jnp.where(jnp.arange(drafted.tokens.shape[1]) < drafted.lengths[:, None], log_max, 0.0),
                 axis=-1)
