"""Micro-benchmark: a verifier `score` of γ+1 tokens against 1 token, and the drafter/verifier cost ratio c.

Random-weight `6m` (drafter) and `97m` (verifier) presets by default, or exported models (e.g. the
shipped pair: `--drafter data/models/debian_drafter --verifier data/models/debian_verifier`), batch 1, a cache
holding `--context` prefilled positions. c = time(drafter scores 1 token) / time(verifier scores 1 token),
the c of SpecTr and of the speculative-decoding wall-time formula.

Usage: python scripts/bench_models.py [--drafter 6m] [--verifier 97m] [--vocab 32000] [--context 128] [--repeats 20]
Prints the machine, the command and the ratios measured in this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specdec import models
from specdec.models import base
from specdec.evaluation.timing import median_seconds
from specdec.training import load_model

GAMMAS = (1, 3, 5, 7)


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


# Only the logits are returned: in a decode loop the cache update is an in-place scatter of n entries,
# but here the cache is not donated, so returning it would time a copy of the whole cache as well.
_score_logits = jax.jit(lambda model, cache, tokens: model.score(cache, tokens).logits)


def _score_seconds(model, context: int, n_values: tuple[int, ...], repeats: int) -> dict[int, float]:
  """Median seconds of one `score` of n tokens after `context` cached positions, for each n."""
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, model.vocab_size, size=(1, context + 1)), jnp.int32)
  cache = model.init_cache(1, context + 1 + max(n_values))
  _, cache = jax.jit(base.prefill)(model, cache, prompt, jnp.array([context + 1], jnp.int32))
  return {n: median_seconds(_score_logits, model, cache, prompt[:, :n], repeats=repeats) for n in n_values}


def _model(name: str, vocab_size: int, seed: int):
  """An exported model directory, or a preset with random weights."""
  if os.path.isdir(name):
    return load_model(name)
  return models.build(name, vocab_size=vocab_size, seed=seed)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--drafter", default="6m", help="a preset (random weights) or an exported model directory")
  parser.add_argument("--verifier", default="97m", help="a preset (random weights) or an exported model directory")
  parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary of preset models")
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()

  drafter = _model(args.drafter, args.vocab, seed=0)
  verifier = _model(args.verifier, args.vocab, seed=1)
  t_drafter = _score_seconds(drafter, args.context, (1,), args.repeats)[1]
  t_verifier = _score_seconds(verifier, args.context, (1,) + tuple(g + 1 for g in GAMMAS), args.repeats)

  print(f"machine: {_cpu_name()} ({os.cpu_count()} cores visible) | {jax.devices()[0].device_kind} | "
        f"jax {jax.__version__} | python {platform.python_version()}")
  print(f"command: {' '.join([sys.executable.split('/')[-1]] + sys.argv)}")
  print(f"batch 1, {args.context} cached positions, vocab {verifier.vocab_size}; median of {args.repeats} jitted "
        f"calls after warm-up")
  print(f"drafter  {args.drafter} ({models.count_params(drafter):,} params), score 1 token: {t_drafter * 1e3:8.2f} ms")
  print(f"verifier {args.verifier} ({models.count_params(verifier):,} params), score 1 token: "
        f"{t_verifier[1] * 1e3:8.2f} ms")
  for g in GAMMAS:
    t = t_verifier[g + 1]
    print(f"verifier score gamma+1 = {g + 1} tokens: {t * 1e3:8.2f} ms   ({t / t_verifier[1]:.2f}x one token)")
  print(f"c = drafter / verifier, 1 token each: {t_drafter / t_verifier[1]:.3f}")


if __name__ == "__main__":
  main()
