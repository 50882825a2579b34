"""Autoregressive decoding of one model: the latency baseline, and the verifier pass of SeqCascade."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec import rng
from specdec import sampling as sampling_lib
from specdec.decoding import common
from specdec.decoding.methods import Method, register
from specdec.models.base import Cache, Model, prefill

Array = jax.Array


@struct.dataclass
class _State:
  key: Array
  cache: Cache
  last: Array            # [B] the last token, not yet in the cache
  log_confidence: Array  # [B] Σ_t log max_v p_raw(v | x_<t) over the emitted tokens


def autoregressive(key: Array, model: Model, prompts: Array, prompt_lengths: Array, *,
                   sampling: sampling_lib.Sampling, max_new_tokens: int, eos_id: int | None, cache_length: int,
                   program: common.Program, active: Array | None = None, calls: str = "verifier_calls",
                   with_log_confidence: bool = False):
  """x_t ~ S(p(·|x_<t)) one token per model call. Rows where `active` [B] is False emit nothing.

  `calls` names the counter that model calls go to (the drafter's when the drafter runs alone). With
  `with_log_confidence` also returns Σ_t log max_v p_raw(v|x_<t) over each row's tokens [B] (SeqCascade).
  """
  batch = prompts.shape[0]
  last, cache = prefill(model, model.init_cache(batch, cache_length, program.cache_layout), prompts, prompt_lengths)

  def step(state: _State, done: Array) -> tuple[_State, common.Emission]:
    key, step_key = rng.split(state.key)
    scored = model.score(state.cache, state.last[:, None])
    logits, cache = scored.logits, scored.cache
    token = sampling_lib.sample(step_key, sampling.transform(logits[:, 0]))
    failed = common.has_nan(logits)
    log_confidence = state.log_confidence
    if with_log_confidence:
      log_max = jnp.max(jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1), axis=-1)
      log_confidence += jnp.where(~done & ~failed, log_max, 0.0)
    return (_State(key=key, cache=cache, last=token, log_confidence=log_confidence),
            common.Emission(block=token[:, None], count=jnp.ones((batch,), jnp.int32), failed=failed,
                            counters={calls: 1, "verifier_positions": int(calls == "verifier_calls")}))

  start = _State(key=key, cache=cache, last=last, log_confidence=jnp.zeros((batch,), jnp.float32))
  output, end = common.decode_loop(start, step, batch_size=batch, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                   active=active)
  return (output, end.log_confidence) if with_log_confidence else output


register(Method(
    "autoregressive", drafter="none",
    decode=lambda key, drafter, verifier, prompts, prompt_lengths, **kw: autoregressive(
        key, verifier, prompts, prompt_lengths, **kw),
    summary="the verifier alone (the latency baseline; pass the drafter as `verifier` to run the small model "
            "alone); drafter may be None"))
