"""Cost models against the papers' numbers and against Monte Carlo of i.i.d. acceptances."""

import numpy as np
import pytest

from specdec import theory

RNG = np.random.default_rng(0)


def _tokens_per_step(rng, alpha, gamma, n):
  """Tokens emitted by n speculative steps with i.i.d. Bernoulli(α) acceptances: accepted prefix + 1."""
  accepted = rng.random((n, gamma)) < alpha
  return np.cumprod(accepted, axis=1).sum(1) + 1


def test_notes_example_beta_08_t10():
  np.testing.assert_allclose(theory.expected_tokens_per_call(0.8, 10), 4.5705, atol=1e-4)
  assert theory.expected_tokens_per_call(0.8, 10) > 4


@pytest.mark.parametrize("alpha, gamma", [(0.8, 10), (0.5, 3), (0.95, 7), (0.0, 4), (1.0, 5)])
def test_expected_tokens_matches_monte_carlo(alpha, gamma):
  tokens = _tokens_per_step(RNG, alpha, gamma, 200_000)
  se = tokens.std() / np.sqrt(tokens.size) + 1e-12
  assert abs(tokens.mean() - theory.expected_tokens_per_call(alpha, gamma)) < 5 * se + 1e-12


def test_walltime_improvement_and_optimal_gamma():
  np.testing.assert_allclose(theory.walltime_improvement(0.8, 4, 0.05), (1 - 0.8**5) / 0.2 / 1.2)
  for alpha, c in [(0.6, 0.1), (0.8, 0.05), (0.9, 0.01), (0.3, 0.5)]:
    best = theory.optimal_gamma(alpha, c)
    gains = [theory.walltime_improvement(alpha, g, c) for g in range(1, 65)]
    assert best == 1 + int(np.argmax(gains))
  assert theory.optimal_gamma(0.9, 0.01) > theory.optimal_gamma(0.6, 0.1)


@pytest.mark.parametrize("alpha, k", [(0.7, 3), (0.4, 1), (0.9, 6)])
def test_phi_is_the_pgf_of_tokens_per_step(alpha, k):
  tokens = _tokens_per_step(RNG, alpha, k, 400_000)
  pmf = np.bincount(tokens, minlength=k + 2) / tokens.size
  for x in (0.3, 0.7, 1.0, 1.4):
    np.testing.assert_allclose(theory.phi(alpha, k, x), np.sum(pmf * x ** np.arange(k + 2)), atol=5e-3)
  # the corrected closed form equals the App. C.1 series α^k x^{k+1} + Σ (α^i − α^{i+1}) x^{i+1}
  x = 0.8
  series = alpha**k * x ** (k + 1) + sum((alpha**i - alpha ** (i + 1)) * x ** (i + 1) for i in range(k))
  np.testing.assert_allclose(theory.phi(alpha, k, x), series, rtol=1e-12)


def test_vertical_cascade_matches_monte_carlo():
  """Thm 4.3: M_d2 drafts for M_d1 (α', k) n times, then M_t reviews the accumulated draft (α)."""
  alpha, alpha_d, k, n, c1, c2 = 0.75, 0.6, 3, 2, 0.1, 0.01
  m = 400_000
  draft_len = sum(_tokens_per_step(RNG, alpha_d, k, m) for _ in range(n))
  accepted = RNG.random((m, draft_len.max())) < alpha
  accepted &= np.arange(draft_len.max())[None] < draft_len[:, None]
  tokens = np.cumprod(accepted, axis=1).sum(1) + 1
  want = tokens.mean() / (1 + n * c1 + n * k * c2)
  got = theory.vertical_cascade_ewif(alpha, alpha_d, k, n, c1, c2)
  np.testing.assert_allclose(got, want, rtol=5e-3)


def test_horizontal_cascade_matches_monte_carlo():
  alphas, costs = np.array([0.9, 0.7, 0.5, 0.4]), np.array([0.1, 0.02, 0.01, 0.0])
  m = 400_000
  accepted = RNG.random((m, 4)) < alphas
  tokens = np.cumprod(accepted, axis=1).sum(1) + 1
  np.testing.assert_allclose(theory.horizontal_cascade_ewif(alphas, costs),
                             tokens.mean() / (1 + costs.sum()), rtol=5e-3)
  # equal drafters reduce to speculative decoding's EWIF (Cor. 4.2)
  np.testing.assert_allclose(theory.horizontal_cascade_ewif([0.8] * 5, [0.05] * 5),
                             theory.walltime_improvement(0.8, 5, 0.05))


def test_rejection_rate_lemma3():
  p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
  np.testing.assert_allclose(theory.rejection_rate(1, p, q), 0.3)
  np.testing.assert_allclose(theory.rejection_rate(0, p, q), 0.0)


@pytest.mark.parametrize("call", [
    lambda: theory.expected_tokens_per_call(1.2, 3),
    lambda: theory.expected_tokens_per_call(0.5, 0),
    lambda: theory.walltime_improvement(0.5, 3, -1.0),
    lambda: theory.horizontal_cascade_ewif([0.5, 0.4], [0.1]),
])
def test_bad_arguments_raise(call):
  with pytest.raises(ValueError):
    call()
