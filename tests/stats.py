"""Statistical checks for Monte Carlo tests: a law either matches or the test fails.

The significance level is fixed (1e-6 by default): with fixed seeds each test is deterministic, and a
wrong algorithm at n = 1e5 samples gives p-values many orders of magnitude below it.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

SIGNIFICANCE = 1e-6


def chi2_pvalue(samples, probs, *, min_expected: float = 5.0) -> float:
  """Pearson chi-square p-value of integer `samples` against the law `probs` [V].

  Cells whose expected count is below `min_expected` are pooled. A sample in a cell of probability 0
  gives p = 0 (an impossible outcome is never within any bound).
  """
  samples = np.asarray(samples).ravel()
  probs = np.asarray(probs, dtype=np.float64).ravel()
  if abs(probs.sum() - 1.0) > 1e-5:
    raise ValueError(f"reference law sums to {probs.sum()}, not 1")
  counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
  if counts.size > probs.size:
    return 0.0
  n = counts.sum()
  if np.any(counts[probs <= 1e-12] > 0):
    return 0.0
  expected = n * probs
  big = expected >= min_expected
  obs = list(counts[big])
  exp = list(expected[big])
  if np.any(~big) and expected[~big].sum() > 0:
    obs.append(counts[~big].sum())
    exp.append(expected[~big].sum())
  if len(exp) < 2:
    return 1.0
  obs, exp = np.asarray(obs), np.asarray(exp)
  stat = np.sum((obs - exp) ** 2 / exp)
  return float(stats.chi2.sf(stat, df=len(exp) - 1))


def assert_law(samples, probs, *, significance: float = SIGNIFICANCE, what: str = "") -> None:
  p = chi2_pvalue(samples, probs)
  assert p > significance, f"{what}: samples do not follow the law (chi-square p = {p:.3g})"


def assert_binomial(successes: int, trials: int, prob: float, *, significance: float = SIGNIFICANCE,
                    what: str = "") -> None:
  """Two-sided exact binomial test of an observed frequency against `prob`."""
  p = stats.binomtest(int(successes), int(trials), float(prob)).pvalue
  assert p > significance, f"{what}: {successes}/{trials} vs {prob:.6f} (binomial p = {p:.3g})"


def random_distributions(rng: np.random.Generator, shape, *, sparsity: float = 0.2,
                         concentration: float = 1.0) -> np.ndarray:
  """Random distributions [..., V] with some exact zeros (top-p/greedy-like supports)."""
  x = rng.gamma(concentration, size=shape)
  x = np.where(rng.random(shape) < sparsity, 0.0, x)
  # keep at least one positive entry per row
  idx = np.argmax(rng.random(shape), axis=-1)
  np.put_along_axis(x, idx[..., None], np.maximum(np.take_along_axis(x, idx[..., None], -1), 0.1), -1)
  return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def draw(rng: np.random.Generator, probs) -> np.ndarray:
  """One index per row of `probs` [..., V] by inverse CDF (float64: no mass beyond the support)."""
  cdf = np.cumsum(np.asarray(probs, np.float64), axis=-1)
  u = rng.random(cdf.shape[:-1]) * cdf[..., -1]
  return np.minimum(np.sum(u[..., None] >= cdf, axis=-1), cdf.shape[-1] - 1)


def sequence_law(model, prompt, n_new: int, temperature: float = 1.0, top_p: float = 1.0) -> np.ndarray:
  """The law of the n_new tokens a model samples after `prompt` (S(·) at `temperature`, `top_p`), by
  enumeration over all V^n_new continuations (teacher-forced `model.logits`): [V^n_new], indexed by
  `sequence_codes`."""
  import itertools

  import jax.numpy as jnp

  from specdec import sampling
  vocab, n = model.vocab_size, len(prompt)
  seqs = np.array(list(itertools.product(range(vocab), repeat=n_new)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(prompt, (len(seqs), n)), seqs], 1))
  p = np.asarray(sampling.transform(model.logits(full)[:, n - 1:n - 1 + n_new], temperature, top_p), np.float64)
  law = np.take_along_axis(p, seqs[:, :, None], -1)[..., 0].prod(1)
  return law / law.sum()


def sequence_codes(tokens, vocab_size: int) -> np.ndarray:
  """Rows of tokens [N, n] as integers in [0, V^n) (the order of `sequence_law`)."""
  tokens = np.asarray(tokens)
  return (tokens * vocab_size ** np.arange(tokens.shape[1] - 1, -1, -1)).sum(1)
