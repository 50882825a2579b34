"""What limits top-P on XLA:CPU: the cost of the selection primitives, the nucleus sizes, and the scratch
memory of the block programs (glibc serves allocations above 32 MB from fresh, page-faulting mmap pages).

A search pass over K thresholds at once (mass and count per threshold in one variadic reduction, the
cheapest multi-threshold form here) and the number of candidates above the search's first bound (1 − P)/V
give the floor of any pass-based exact search: ≥ log2(candidates) / log2(K + 1) such passes.

Usage (repository root): python experiments/sampling_speed/primitives.py
(The block's scratch memory at another revision: `specdec-bench --before a649a8b verify`, column temp_mib.)
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from specdec import sampling, targets, verify
from specdec.cli.bench.verify import programs
from specdec.core import _top_p
from specdec.data import debian
from specdec.data.vocab import load_vocabulary
from specdec.evaluation.bench import median_seconds
from specdec.training.checkpoint import load_model


def thresholds_pass(probs: jax.Array, thresholds: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(Σ_{bits ≥ t} p, #{bits ≥ t}) [rows, K] for K bit patterns t [rows, K] in one variadic reduction."""
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)[:, None, :]
  above = bits >= thresholds[..., None]
  return jax.lax.reduce((jnp.where(above, probs[:, None, :], 0.0), above.astype(jnp.int32)),
                        (jnp.float32(0.0), jnp.int32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]), (2,))


def main() -> None:
  batch, gamma, vocab = 8, 8, 32_000
  logits = jax.random.normal(jax.random.PRNGKey(1), (batch * (gamma + 1), vocab)) * 3
  probs = jax.nn.softmax(logits)
  softmax_fn = jax.jit(lambda x: jax.nn.softmax(x, -1))
  threshold = jnp.full((72, 1), 950_000_000, jnp.int32)  # bit pattern of p ≈ 1.3e-4
  t = jax.lax.bitcast_convert_type(threshold, jnp.float32)
  candidates = {  # name: (function, its input)
      "one pass: jnp.sum": (lambda p: jnp.sum(p, -1), probs),
      "one pass: jnp.sum(jnp.where(p >= t, p, 0))": (lambda p: jnp.sum(jnp.where(p >= t, p, 0), -1), probs),
      "one pass: sampling.masked_sum(p, p >= t)": (lambda p: sampling.masked_sum(p, p >= t), probs),
      "top-P search probe (_top_p.probe)": (lambda p: _top_p.probe(_top_p.order_keys(p), p, threshold), probs),
      "top-P exact certificate (_top_p.certificate)": (
          lambda p: _top_p.certificate(_top_p.order_keys(p), p, threshold), probs),
      "S(.) at top-P 1 (sampling.transform)": (lambda x: sampling.transform(x, 1.0, 1.0), logits),
      "S(.) at top-P 0.9 (sampling.transform)": (lambda x: sampling.transform(x, 1.0, 0.9), logits),
      **{f"search pass over K={k} thresholds": (lambda p, k=k: thresholds_pass(p, threshold + jnp.arange(k)), probs)
         for k in (1, 4, 8, 16)},
      "jnp.cumsum": (lambda p: jnp.cumsum(p, -1), probs),
      "jnp.sort": (lambda p: jnp.sort(p, -1), probs),
      **{f"lax.top_k k={k}": (lambda p, k=k: jax.lax.top_k(p, k), probs) for k in (16, 64, 256, 1024, 2048)}}
  softmax_times = [median_seconds(softmax_fn, logits, repeats=30)]
  timed = {}
  for name, (fn, x) in candidates.items():
    timed[name] = median_seconds(jax.jit(fn), x, repeats=10 if "sort" in name else 30)
    if name == "jnp.sort":
      softmax_times.append(median_seconds(softmax_fn, logits, repeats=30))
  softmax_times.append(median_seconds(softmax_fn, logits, repeats=30))
  softmax = sorted(softmax_times)[1]
  print(f"[72, 32000]: softmax {softmax * 1e3:.3f} ms "
        f"(median of {', '.join(f'{t * 1e3:.3f}' for t in softmax_times)})")
  for name, t in timed.items():
    print(f"  {name:46s} {t * 1e3:8.3f} ms  {t / softmax:6.2f}x")

  ranked = np.cumsum(-np.sort(-np.asarray(probs), -1), -1)
  for top_p in (0.5, 0.9):
    sizes = (ranked < top_p).sum(-1) + 1
    candidates = (np.asarray(probs) >= (1.0 - top_p) / vocab).sum(-1)
    print(f"nucleus at top-P {top_p} over the 72 rows: min {sizes.min()}, median {np.median(sizes):.0f}, "
          f"max {sizes.max()} tokens; candidates above (1 - P)/V: median {np.median(candidates):.0f}, "
          f"max {candidates.max()}")

  # A trained model's nuclei: the shipped 15m verifier (V = 8192), teacher-forced on debian_lm validation
  # texts of the shipped sample (first 128 tokens of each text that has them).
  model = load_model("data/models/debian_verifier")
  vocabulary = load_vocabulary()
  records = debian.load("debian_lm", "validation", source="sample")
  texts = [vocabulary.encode(r["text"])[:128] for r in records]
  tokens = jnp.asarray([t for t in texts if len(t) == 128][:32], jnp.int32)
  ranked = np.cumsum(-np.sort(-np.asarray(jax.nn.softmax(model.logits(tokens), -1)), -1), -1)
  ranked = ranked.reshape(-1, ranked.shape[-1])
  for top_p in (0.5, 0.9, 0.95):
    sizes = (ranked < top_p).sum(-1) + 1
    print(f"debian_verifier, {len(sizes)} positions, T = 1, top-P {top_p}: nucleus median "
          f"{np.median(sizes):.0f}, 90% {np.percentile(sizes, 90):.0f}, 99% {np.percentile(sizes, 99):.0f}, "
          f"max {sizes.max()} of 8192")

  key, drafts = jax.random.PRNGKey(0), jnp.zeros((batch, gamma), jnp.int32)
  lq = lp = logits.reshape(batch, gamma + 1, vocab)

  def scratch(fn, *a):
    return jax.jit(fn).lower(*a).compile().memory_analysis().temp_size_in_bytes / 1e6

  block = programs(gamma)["block top-P 1, one jit"][0]

  def two(lq, lp, t, p):
    return sampling.transform(lq, t, p), sampling.transform(lp, t, p)

  def rule_and_verify(key, drafts, q, p, alpha):
    pi = targets.target_distribution("token_v3", q=q, p=p, q_raw=q, p_raw=p, alpha=alpha)
    return verify.verify_block(key, drafts, q[:, :gamma], pi)

  q, p = jax.jit(two)(lq, lp, 1.0, 1.0)
  print(f"scratch memory of the block (B=8, gamma=8, V=32000): one jit "
        f"{scratch(block, key, drafts, lq, lp, 1.0, 1.0, 0.3):.1f} MB; two jits "
        f"{scratch(two, lq, lp, 1.0, 1.0):.1f} MB + "
        f"{scratch(rule_and_verify, key, drafts, q, p, 0.3):.1f} MB")

if __name__ == "__main__":
  main()
