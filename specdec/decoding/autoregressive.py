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


def autoregressive(key: Array, model: Model, prompts: Array, prompt_lengths: Array, *, temperature,
                   top_p, top_k: int, max_new_tokens: int, eos_id: int | None, cache_length: int,
                   active: Array | None = None, calls: str = "verifier_calls") -> common.Output:
  """x_t ~ S(p(·|x_<t)) one token per model call. Rows where `active` [B] is False emit nothing.

  `calls` names the counter that model calls go to (the drafter's when the drafter runs alone).
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
                                 max_new_tokens=max_new_tokens, eos_id=eos_id)
    stats = state.stats.add(live, **{calls: 1}, generated=count)
    return _State(key=key, cache=cache, last=token, emitted=emitted, stats=stats)

  start = _State(key=key, cache=cache, last=last, emitted=emitted, stats=common.Stats.zeros(batch))
  end = jax.lax.while_loop(cond, body, start)
  return common.finish(end.emitted, end.stats, max_new_tokens)


def _prefilled(model: Model, prompts: Array, prompt_lengths: Array, cache_length: int) -> tuple[Cache, Array]:
  last, cache = prefill(model, model.init_cache(prompts.shape[0], cache_length), prompts, prompt_lengths)
  return cache, last
