"""Autoregressive decoding of one model: the latency baseline, and the verifier pass of SeqCascade."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec import sampling
from specdec.decoding import common
from specdec.models.base import Cache, Model, prefill

Array = jax.Array


@struct.dataclass
class _State:
  key: Array
  cache: Cache
  last: Array            # [B] the last token, not yet in the cache
  emitted: common.Emitted
  stats: common.Stats
  log_confidence: Array  # [B] Σ_t log max_v p_raw(v | x_<t) over the emitted tokens


def autoregressive(key: Array, model: Model, prompts: Array, prompt_lengths: Array, *, temperature,
                   top_p, top_k: int, max_new_tokens: int, eos_id: int | None, cache_length: int,
                   active: Array | None = None, calls: str = "verifier_calls",
                   with_log_confidence: bool = False):
  """x_t ~ S(p(·|x_<t)) one token per model call. Rows where `active` [B] is False emit nothing.

  `calls` names the counter that model calls go to (the drafter's when the drafter runs alone). With
  `with_log_confidence` also returns Σ_t log max_v p_raw(v|x_<t) over each row's tokens [B] (SeqCascade).
  """
  batch = prompts.shape[0]
  cache, last = _prefilled(model, prompts, prompt_lengths, cache_length)
  emitted = common.Emitted.empty(batch, max_new_tokens, slack=1)
  if active is not None:
    emitted = emitted.replace(done=~active)

  def cond(state: _State) -> Array:
    return jnp.any(~state.emitted.done)

  def body(state: _State) -> _State:
    key, step_key = jax.random.split(state.key)
    logits, cache = model.score(state.cache, state.last[:, None])
    probs = sampling.transform(logits[:, 0], temperature, top_p, top_k)
    token = sampling.sample(step_key, probs)
    live = ~state.emitted.done
    emitted, count = common.emit(state.emitted, token[:, None], jnp.ones((batch,), jnp.int32),
                                 max_new_tokens=max_new_tokens, eos_id=eos_id,
                                 failed=common.has_nan(logits))
    stats = state.stats.add(live, **{calls: 1}, generated=count)
    log_max = jnp.max(jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1), axis=-1)
    log_confidence = state.log_confidence + jnp.where(count > 0, log_max, 0.0)
    return _State(key=key, cache=cache, last=token, emitted=emitted, stats=stats,
                  log_confidence=log_confidence)

  start = _State(key=key, cache=cache, last=last, emitted=emitted, stats=common.Stats.zeros(batch),
                 log_confidence=jnp.zeros((batch,), jnp.float32))
  end = jax.lax.while_loop(cond, body, start)
  output = common.finish(end.emitted, end.stats, max_new_tokens)
  return (output, end.log_confidence) if with_log_confidence else output


def _prefilled(model: Model, prompts: Array, prompt_lengths: Array, cache_length: int) -> tuple[Cache, Array]:
  last, cache = prefill(model, model.init_cache(prompts.shape[0], cache_length), prompts, prompt_lengths)
  return cache, last
