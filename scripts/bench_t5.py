"""Micro-benchmark of T5 as drafter and verifier: a decoder `score` of γ+1 positions against 1, and the
drafter/verifier cost ratio c of one decode step.

Random-weight T5 v1.1 presets (t5_tiny, t5_mini, t5_small by default) or exported T5 models (e.g. the
trained Debian T5 pair: `--presets outputs/train/debian_t5_drafter/export
outputs/train/debian_t5_verifier/export`), batch 1, an encoder input of
`--input-length` tokens (encoded once by `prefill`, not timed per step) and a decoder cache holding
`--context` positions. c = time(drafter scores 1 position) / time(verifier scores 1 position).

Usage: python scripts/bench_t5.py [--presets t5_tiny t5_mini t5_small | DIR …] [--vocab 32128] [--input-length 128]
                                  [--context 32] [--repeats 20]
Prints the machine, the command and the ratios measured in this run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specdec import models
from specdec.evaluation.timing import median_seconds
from specdec.models import base
from specdec.training import export_name, load_model

GAMMAS = (1, 3, 5, 7)

# Only the logits are returned: in a decode loop the cache update is an in-place scatter of n entries,
# but here the cache is not donated, so returning it would time a copy of the whole cache as well.
_score_logits = jax.jit(lambda model, cache, tokens: model.score(cache, tokens).logits)
_prefill = jax.jit(base.prefill)
_score = jax.jit(lambda model, cache, tokens: model.score(cache, tokens))


def _timings(model, input_length: int, context: int, repeats: int) -> dict[str, float]:
  """Median seconds of `prefill` (encoding) and of one decoder `score` of n positions after `context`."""
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(2, model.vocab_size, size=(1, input_length)), jnp.int32)
  lengths = jnp.array([input_length], jnp.int32)
  decoder = jnp.asarray(rng.integers(2, model.vocab_size, size=(1, context + max(GAMMAS) + 1)), jnp.int32)
  empty = model.init_cache(1, context + max(GAMMAS) + 1)
  _, cache = _prefill(model, empty, prompt, lengths)
  cache = _score(model, cache, decoder[:, :context]).cache
  times = {"prefill": median_seconds(_prefill, model, empty, prompt, lengths, repeats=repeats)}
  for n in (1,) + tuple(g + 1 for g in GAMMAS):
    times[n] = median_seconds(_score_logits, model, cache, decoder[:, context:context + n], repeats=repeats)
  return times


def _model(name: str, vocab_size: int, seed: int, max_length: int):
  """(label, model): an exported model directory, or a preset with random weights."""
  if os.path.isdir(name):
    return export_name(name), load_model(name)
  return name, models.build(name, vocab_size=vocab_size, seed=seed, max_length=max_length)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["t5_tiny", "t5_mini", "t5_small"],
                      help="T5 presets (random weights) or exported T5 model directories")
  parser.add_argument("--vocab", type=int, default=32128, help="the presets' vocabulary size")
  parser.add_argument("--input-length", type=int, default=128)
  parser.add_argument("--context", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=20)
  args = parser.parse_args()

  print(f"machine: {platform.machine()} ({os.cpu_count()} cores visible) | {jax.devices()[0].device_kind} | "
        f"jax {jax.__version__} | python {platform.python_version()}")
  print(f"command: {' '.join([sys.executable.split('/')[-1]] + sys.argv)}")
  print(f"batch 1, encoder input {args.input_length} tokens, {args.context} cached decoder positions, presets' vocab "
        f"{args.vocab}; median of {args.repeats} jitted calls after warm-up")
  step = {}
  for seed, name in enumerate(args.presets):
    label, model = _model(name, args.vocab, seed, args.context + max(GAMMAS) + 1)
    t = _timings(model, args.input_length, args.context, args.repeats)
    step[label] = t[1]
    ratios = ", ".join(f"{g + 1}: {t[g + 1] / t[1]:.2f}x" for g in GAMMAS)
    print(f"{label:9s} ({models.count_params(model):>11,} params): prefill {t['prefill'] * 1e3:8.2f} ms, "
          f"score 1 position {t[1] * 1e3:7.2f} ms; gamma+1 positions vs 1: {ratios}")
  for drafter, verifier in itertools.combinations(step, 2):
    print(f"c = {drafter} / {verifier}, 1 position each: {step[drafter] / step[verifier]:.3f}")


if __name__ == "__main__":
  main()
