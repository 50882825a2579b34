"""Decode loops (layer 3) and their public entry point `generate`.

Every loop is one `jax.lax.while_loop`, batched with ragged per-row progress, and sees models only
through `specdec.models.base`. `generate` checks its arguments on the host, then runs a jitted loop
whose sweep parameters (alpha, temperature, top_p) are traced: a sweep compiles once per
(method, rule, γ, shapes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specdec import checks, targets
from specdec.decoding import cascades, common, speculative
from specdec.decoding.autoregressive import autoregressive
from specdec.decoding.common import Output, Stats
from specdec.models import base
from specdec.models.base import Model

Array = jax.Array

METHODS = ("autoregressive", "speculative", "token_cascade", "seq_cascade", "oracle_cascade", "bild")
__all__ = ["generate", "METHODS", "Output", "Stats"]


def cache_length_for(prompt_positions: int, max_new_tokens: int, gamma: int) -> int:
  """Cache positions a run needs: the padded prompt's (`base.prompt_cache_positions`: its width, 1 for an
  encoder-decoder), the new tokens, and one block of overshoot."""
  return prompt_positions + max_new_tokens + gamma + cascades.MAX_DRAFTER_RUN + 2


def generate(key: Array, drafter: Model | None, verifier: Model, prompts: Array, prompt_lengths: Array, *,
             method: str, rule: str = "spec", alpha: float = 0.0, gamma: int = 5,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int,
             eos_id: int | None = None, fallback_alpha: float = 0.5) -> Output:
  """Decodes a batch of prompts [B, L] (row b's prompt is prompts[b, :prompt_lengths[b]]).

  method:
    autoregressive  the verifier alone (the latency baseline; pass the drafter as `verifier` to run the
                    small model alone); drafter may be None.
    speculative     γ drafts, one verifier call scoring γ+1 positions, Alg. 4 with π = T(q, p) of `rule`
                    (spec: SpecDecode; lossy / lossy_tuned: SpecDecode [Lossy]; bild: BiLD*; cascade and
                    token rules: SpecCascade). Greedy lossy (Leviathan) is token_v3 at temperature 0.
    token_cascade   TokenCascade [chow / chow_log] (Alg. 2, ≤ 10 drafter tokens per verifier call).
    seq_cascade     SeqCascade [Chow] (eq. 1).
    oracle_cascade  OracleCascade (Alg. 3) with any rule (diff: Oracle [Diff]).
    bild            the original BiLD: fallback while max q ≥ 1 − fallback_alpha, at most γ drafts,
                    deterministic rollback where D(q, p) > alpha.
  Returns tokens [B, max_new_tokens] (0 after each row's end), lengths [B] and per-row stats. NaN in a
  model's logits stops the affected rows (inside the jitted loop, without a host round-trip) and then
  raises FloatingPointError naming them.
  """
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
  targets.check_rule(rule)
  if method == "bild":
    targets.check_alpha("bild", alpha)
    checks.check_range("fallback_alpha", fallback_alpha, 0.0, 1.0)
  elif method == "seq_cascade":
    checks.check_range("alpha (seq_cascade)", alpha, 0.0, 1.0, hi_closed=False)
  else:
    targets.check_alpha(rule, alpha)
  checks.check_gamma(gamma)
  checks.check_temperature(temperature)
  checks.check_top_p(top_p)
  checks.check_top_k(top_k)
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
  if method != "autoregressive" and drafter is None:
    raise ValueError(f"method {method!r} needs a drafter")
  common.check_models(None if method == "autoregressive" else drafter, verifier)
  models = [verifier] if method == "autoregressive" else [drafter, verifier]
  cache_length = cache_length_for(max(base.prompt_cache_positions(m, prompts.shape[1]) for m in models),
                                  max_new_tokens, gamma)
  common.check_prompts(prompts, prompt_lengths, cache_length, models)
  out = _generate(key, drafter, verifier, jnp.asarray(prompts, jnp.int32),
                  jnp.asarray(prompt_lengths, jnp.int32), jnp.float32(alpha), jnp.float32(temperature),
                  jnp.float32(top_p), jnp.float32(fallback_alpha), method=method, rule=rule, gamma=gamma,
                  top_k=top_k, max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=cache_length)
  failed = np.asarray(out.failed)
  if failed.any():
    raise FloatingPointError(f"NaN logits reached rows {np.flatnonzero(failed).tolist()} of the batch; "
                             "those rows stopped (Output.failed). Check the model's parameters and dtype.")
  return out


@functools.partial(jax.jit, static_argnames=("method", "rule", "gamma", "top_k", "max_new_tokens",
                                             "eos_id", "cache_length"))
def _generate(key, drafter, verifier, prompts, prompt_lengths, alpha, temperature, top_p, fallback_alpha, *,
              method, rule, gamma, top_k, max_new_tokens, eos_id, cache_length) -> Output:
  sampling_args = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                       eos_id=eos_id, cache_length=cache_length)
  if method == "autoregressive":
    return autoregressive(key, verifier, prompts, prompt_lengths, **sampling_args)
  if method == "speculative":
    return speculative.speculative(key, drafter, verifier, prompts, prompt_lengths, rule=rule,
                                   alpha=alpha, gamma=gamma, **sampling_args)
  if method == "bild":
    return speculative.bild(key, drafter, verifier, prompts, prompt_lengths, alpha=alpha,
                            fallback_alpha=fallback_alpha, gamma=gamma, **sampling_args)
  if method == "token_cascade":
    return cascades.token_cascade(key, drafter, verifier, prompts, prompt_lengths, rule=rule, alpha=alpha,
                                  **sampling_args)
  if method == "oracle_cascade":
    return cascades.oracle_cascade(key, drafter, verifier, prompts, prompt_lengths, rule=rule, alpha=alpha,
                                   **sampling_args)
  return cascades.seq_cascade(key, drafter, verifier, prompts, prompt_lengths, alpha=alpha,
                              **sampling_args)
