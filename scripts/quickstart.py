"""Interim main job: every target rule on one synthetic drafter/verifier pair, checked against its math.

Until the decode loops, trained pairs and sweeps land (see README, "Status"), `make quickstart` runs the
layer-1 math end to end on the CPU: for T ∈ {1, 0.5} and top-p ∈ {1, 0.5} it draws drafts from q, runs
`verify_block` with π = T(q, p) of each rule on 20k positions (V = 512), and writes a Markdown table of
measured acceptance rates next to the exact Σ_v min(q, π) and the deferral rate.
Output: outputs/quickstart/rules.md
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from specdec import sampling, targets, verify

POSITIONS, VOCAB = 20_000, 512
ALPHA = {"chow_log": 2.0, "diff_log": 0.2, "opt_log": 0.5, "bild": 3.0}


def main() -> None:
  key = jax.random.PRNGKey(0)
  k_q, k_p, k_run = jax.random.split(key, 3)
  # A drafter that is a noisy, flatter copy of the verifier, as a small model is of a large one.
  logits_p = jax.random.normal(k_p, (POSITIONS, VOCAB)) * 2.5
  logits_q = 0.7 * logits_p + jax.random.normal(k_q, (POSITIONS, VOCAB)) * 1.2

  # Arrays are arguments, not closed-over constants: XLA would constant-fold the whole computation.
  @functools.partial(jax.jit, static_argnames="rule")
  def measure(key, logits_q, logits_p, temperature, top_p, alpha, rule):
    q_raw, p_raw = jax.nn.softmax(logits_q), jax.nn.softmax(logits_p)
    q = sampling.transform(logits_q, temperature, top_p)
    p = sampling.transform(logits_p, temperature, top_p)
    pi = targets.target_distribution(rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
    k_draft, k_verify = jax.random.split(key)
    drafts = sampling.sample(k_draft, q)[:, None]
    n_acc, _ = verify.verify_block(k_verify, drafts, q[:, None], jnp.stack([pi, p], axis=1))
    exact = jnp.sum(jnp.minimum(q, pi), axis=-1)
    changed = jnp.any(jnp.abs(pi - p) > 1e-6, axis=-1)  # π ≠ p: the rule kept something of q
    return jnp.mean(n_acc), jnp.mean(exact), jnp.mean(changed)

  lines = ["| rule | α | T | top-p | accepted (measured) | accepted (exact) | π ≠ p |", "|---|---|---|---|---|---|---|"]
  for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5)]:
    for rule in targets.RULES:
      alpha = ALPHA.get(rule, 0.3)
      got, exact, changed = measure(k_run, logits_q, logits_p, temperature, top_p, alpha,
                                     rule=rule)
      lines.append(f"| {rule} | {alpha} | {temperature} | {top_p} | {float(got):.4f} | {float(exact):.4f} | "
                   f"{float(changed):.3f} |")
  out = pathlib.Path("outputs/quickstart")
  out.mkdir(parents=True, exist_ok=True)
  (out / "rules.md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))
  print(f"\nwrote {out / 'rules.md'}")


if __name__ == "__main__":
  main()
