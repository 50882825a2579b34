"""Why scoring γ+1 tokens costs the shipped verifier far more than one on XLA:CPU, and three levers tried.

The verifier's `score` of n ∈ {1, 2, 4, 6, 8} tokens after 128 cached positions (batch 1), as shipped
(parameters passed to the jitted call), with the parameters baked into the program as constants (XLA
can pack the weights for its matmul library once instead of at every call), and with bfloat16
activations and matmuls (`TransformerConfig.dtype`; a different model numerically, so not a lossless
option — measured to see whether the kernels for n ≥ 2 are the cost). Each variant's n-token cost is
reported against the shipped one-token step of the same run, the block-cost figure speculative
decoding pays. XLA flags were tried with `specdec-bench score` (experiments/verification_cost/README.md).

Usage (repository root): python experiments/verification_cost/levers.py [--repeats 100]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from specdec.evaluation.bench import device, median_seconds
from specdec.training import load_model

WIDTHS = (1, 2, 4, 6, 8)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--verifier", default="data/models/debian_verifier")
  parser.add_argument("--repeats", type=int, default=100)
  args = parser.parse_args()
  verifier = load_model(args.verifier)
  bf16 = verifier.replace(config=dataclasses.replace(verifier.config, dtype=jnp.bfloat16))

  def cache_of(model):
    return model.init_cache(1, 256).replace(lengths=jnp.array([128], jnp.int32))

  def score(model, cache, tokens):
    return model.score(cache, tokens).logits

  variants = {  # name: (function, its model argument, cache)
      "shipped (parameters as arguments)": (score, verifier, cache_of(verifier)),
      "parameters as constants": (lambda _, cache, tokens: score(verifier, cache, tokens), None, cache_of(verifier)),
      "bfloat16 activations": (score, bf16, cache_of(bf16)),
  }
  print(f"machine: {device()} | {args.verifier}, "
        f"batch 1, 128 cached positions, median of {args.repeats} calls")
  timings = {name: {n: median_seconds(jax.jit(fn), model, cache, jnp.ones((1, n), jnp.int32),
                                      repeats=args.repeats) for n in WIDTHS}
             for name, (fn, model, cache) in variants.items()}
  step = timings["shipped (parameters as arguments)"][1]
  print(f"{'':36s}" + "".join(f"{f'n={n}':>16s}" for n in WIDTHS))
  for name, by_width in timings.items():
    print(f"{name:36s}" + "".join(f"{t * 1e3:8.2f} ms {t / step:4.2f}x" for t in by_width.values()))


if __name__ == "__main__":
  main()
