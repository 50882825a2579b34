"""Micro-benchmark: one `verify_block` call against one softmax over the same [B, γ+1, V] logits.

Usage: python scripts/bench_verify.py [--batch 8] [--gamma 8] [--vocab 32000] [--repeats 50]
Prints the machine, the command and the ratios measured in this run.
"""

from __future__ import annotations

import argparse
import platform
import sys

import jax
import jax.numpy as jnp

from specdec import sampling, targets, verify
from specdec.evaluation.timing import median_seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--gamma", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32_000)
  parser.add_argument("--repeats", type=int, default=50)
  args = parser.parse_args()
  b, g, v = args.batch, args.gamma, args.vocab

  key = jax.random.PRNGKey(0)
  kq, kp, kd, kv = jax.random.split(key, 4)
  logits_q = jax.random.normal(kq, (b, g + 1, v)) * 3
  logits_p = jax.random.normal(kp, (b, g + 1, v)) * 3
  q = jax.nn.softmax(logits_q)[:, :g]
  pi = jax.nn.softmax(logits_p)
  drafts = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)

  softmax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
  kernel = jax.jit(verify.verify_block)

  def transforms(logits_q, logits_p, temperature):
    return sampling.transform(logits_q, temperature), sampling.transform(logits_p, temperature)

  def rule_and_verify(key, drafts, q_all, p_all, alpha):
    pi = targets.target_distribution("token_v3", q=q_all, p=p_all, q_raw=q_all, p_raw=p_all, alpha=alpha)
    return verify.verify_block(key, drafts, q_all[:, :g], pi)

  @jax.jit
  def fused(key, drafts, logits_q, logits_p, temperature, alpha):
    return rule_and_verify(key, drafts, *transforms(logits_q, logits_p, temperature), alpha)

  transforms_jit, rule_and_verify_jit = jax.jit(transforms), jax.jit(rule_and_verify)

  def separate(key, drafts, logits_q, logits_p, temperature, alpha):
    return rule_and_verify_jit(key, drafts, *transforms_jit(logits_q, logits_p, temperature), alpha)

  t_softmax = median_seconds(softmax, logits_p, repeats=args.repeats)
  t_verify = median_seconds(kernel, kv, drafts, q, pi, repeats=args.repeats)
  t_fused = median_seconds(fused, kv, drafts, logits_q, logits_p, 1.0, 0.3, repeats=args.repeats)
  t_separate = median_seconds(separate, kv, drafts, logits_q, logits_p, 1.0, 0.3, repeats=args.repeats)

  print(f"machine: {platform.machine()} {platform.processor() or ''} | {jax.devices()[0].device_kind} | "
        f"jax {jax.__version__} | python {platform.python_version()}")
  print(f"command: {' '.join([sys.executable.split('/')[-1]] + sys.argv)}")
  print(f"shape: B={b}, gamma={g}, V={v}; median of {args.repeats} calls after warm-up")
  print(f"softmax over [B, gamma+1, V]:              {t_softmax * 1e3:8.3f} ms   (1.00x)")
  print(f"verify_block (q, pi given):                {t_verify * 1e3:8.3f} ms   ({t_verify / t_softmax:.2f}x)")
  for name, t in [("one jit", t_fused), ("two jits", t_separate)]:
    print(f"S(.) of q and p + token_v3 + verify, {name}: {t * 1e3:7.3f} ms   ({t / t_softmax:.2f}x)")


if __name__ == "__main__":
  main()
