"""Wall-clock of speculative decoding against autoregressive decoding, and the theory's prediction.

Random-weight decoder-only models (the paper's LM1B sizes), batch size 1, greedy, one run:
  1. identical drafter and verifier: every draft is accepted (α = 1), so the measured speedup isolates
     the cost model — predicted (γ+1) / ((γ+1)·c + c_γ) with c = 1 and c_γ = t(score γ+1)/t(score 1)
     measured here (our blocks make γ+1 drafter calls; `theory.walltime_improvement` assumes γ drafter
     calls and a verification as cheap as one step);
  2. small drafter, large verifier: α measured from the run's acceptance, c measured; prediction
     `theory.walltime_improvement(α, γ, c)` and the refined one with the measured costs.

Usage: python scripts/bench_decoding.py [--drafter 6M] [--verifier 97M] [--gamma 3 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding, models, theory
from specdec.evaluation.timing import median_seconds


def _score_seconds(model, n: int, prefix: int, repeats: int) -> float:
  cache = model.init_cache(1, prefix + n + 1)
  _, cache = model.score(cache, jnp.ones((1, prefix), jnp.int32))
  score = jax.jit(lambda m, c, t: m.score(c, t)[0])
  tokens = jnp.ones((1, n), jnp.int32)
  return median_seconds(lambda: score(model, cache, tokens), repeats=repeats)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--drafter", default="6m")
  parser.add_argument("--verifier", default="97m")
  parser.add_argument("--vocab", type=int, default=32_000)
  parser.add_argument("--gamma", type=int, nargs="+", default=[3, 5])
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  small = models.build(args.drafter, vocab_size=args.vocab, seed=1, max_length=256)
  large = models.build(args.verifier, vocab_size=args.vocab, seed=2, max_length=256)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (1, args.prompt)), jnp.int32)
  lengths = jnp.array([args.prompt], jnp.int32)
  key = jax.random.PRNGKey(0)

  def run(drafter, verifier, method, gamma=1):
    return decoding.generate(key, drafter, verifier, prompts, lengths, method=method, gamma=gamma,
                             temperature=0.0, max_new_tokens=args.tokens)

  t1 = {name: _score_seconds(m, 1, args.prompt, 20) for name, m in (("small", small), ("large", large))}
  c = t1["small"] / t1["large"]
  print(f"machine: {platform.machine()} | {jax.devices()[0].device_kind} | jax {jax.__version__} | "
        f"python {platform.python_version()}")
  print(f"command: {' '.join(['python'] + sys.argv)}")
  print(f"models: drafter {args.drafter} ({models.count_params(small) / 1e6:.1f}M params), verifier "
        f"{args.verifier} ({models.count_params(large) / 1e6:.1f}M), V={args.vocab}, batch 1, greedy, "
        f"{args.tokens} new tokens, prompt {args.prompt}")
  print(f"one decode step: drafter {t1['small'] * 1e3:.2f} ms, verifier {t1['large'] * 1e3:.2f} ms, "
        f"c = {c:.3f}")
  t_ar = median_seconds(lambda: run(None, large, "autoregressive").tokens, repeats=args.repeats)
  print(f"autoregressive verifier: {t_ar * 1e3:.1f} ms ({t_ar / args.tokens * 1e3:.2f} ms/token)")
  for gamma in args.gamma:
    c_gamma = _score_seconds(large, gamma + 1, args.prompt, 20) / t1["large"]
    same = run(large, large, "speculative", gamma)
    t_same = median_seconds(lambda: run(large, large, "speculative", gamma).tokens, repeats=args.repeats)
    assert int(same.stats.rejected[0]) == 0
    predicted_same = (gamma + 1) / ((gamma + 1) * 1.0 + c_gamma)
    print(f"gamma={gamma}: verifier scoring gamma+1 tokens costs {c_gamma:.2f}x one token")
    print(f"  identical pair (alpha=1): speedup {t_ar / t_same:.2f}x measured, {predicted_same:.2f}x "
          f"predicted from measured costs, {theory.walltime_improvement(1.0, gamma, 1.0):.2f}x by "
          f"walltime_improvement(1, gamma, c=1)")
    mixed = run(small, large, "speculative", gamma)
    t_mixed = median_seconds(lambda: run(small, large, "speculative", gamma).tokens, repeats=args.repeats)
    s = jax.tree.map(lambda x: float(x[0]), mixed.stats)
    alpha = s.accepted / s.drafted  # per-token acceptance rate of this run
    refined = theory.expected_tokens_per_call(min(alpha, 0.999999), gamma) / ((gamma + 1) * c + c_gamma)
    print(f"  {args.drafter} -> {args.verifier}: acceptance {alpha:.3f}, "
          f"{s.generated / s.verifier_calls:.2f} tokens/verifier call, speedup {t_ar / t_mixed:.2f}x measured, "
          f"{refined:.2f}x predicted from measured costs, "
          f"{theory.walltime_improvement(min(alpha, 0.999999), gamma, c):.2f}x by walltime_improvement")


if __name__ == "__main__":
  main()
