"""Closed-form cost models of speculative decoding under i.i.d. acceptances.

α here is the per-token acceptance rate E[min(1, p/q)] = 1 − D_TV(p, q) (Leviathan et al.), γ the
number of draft tokens per block, c the cost of a drafter step relative to a verifier step.
"""

from __future__ import annotations

import numpy as np

ArrayLike = float | np.ndarray


def _check_rate(name: str, x: ArrayLike) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if np.any(np.isnan(x)) or np.any((x < 0) | (x > 1)):
    raise ValueError(f"{name} must lie in [0, 1]; got {x}")
  return x


def _check_block(gamma: int) -> None:
  if int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma must be an int >= 1; got {gamma}")


def _geometric_sum(alpha: np.ndarray, n: int) -> np.ndarray:
  """Σ_{t=0}^{n-1} α^t = (1 − α^n)/(1 − α), with the limit n at α = 1."""
  one = np.isclose(alpha, 1.0, rtol=0.0, atol=1e-12)
  safe = np.where(one, 0.0, alpha)
  return np.where(one, float(n), (1 - safe**n) / (1 - safe))


def expected_tokens_per_call(alpha: ArrayLike, gamma: int) -> np.ndarray:
  """E[L] = (1 − α^{γ+1})/(1 − α): tokens emitted per verifier call (notes §1.1.1, corrected sum).

  β = 0.8, T = γ = 10 gives 4.5705 (the notes' "> 4").
  """
  _check_block(gamma)
  return _geometric_sum(_check_rate("alpha", alpha), gamma + 1)


def walltime_improvement(alpha: ArrayLike, gamma: int, c: ArrayLike) -> np.ndarray:
  """Expected walltime improvement factor (1 − α^{γ+1}) / ((1 − α)(γc + 1)) (CS Drafting Cor. 4.2)."""
  c = np.asarray(c, np.float64)
  if np.any(c < 0):
    raise ValueError(f"c (drafter/verifier cost ratio) must be >= 0; got {c}")
  return expected_tokens_per_call(alpha, gamma) / (gamma * c + 1)


def optimal_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
  """The γ in [1, max_gamma] that maximises `walltime_improvement(α, γ, c)`."""
  gammas = np.arange(1, max_gamma + 1)
  gains = [walltime_improvement(alpha, int(g), c) for g in gammas]
  return int(gammas[int(np.argmax(gains))])


def phi(alpha: ArrayLike, k: int, x: ArrayLike) -> np.ndarray:
  """PGF of the tokens emitted by one speculative step with k drafts (CS Drafting Thm 4.1, App. C.1).

  φ_(α,k)(x) = 1 + (x − 1)(1 − α^{k+1}x^{k+1})/(1 − αx) = x + (x − 1)·Σ_{i=1}^{k} (αx)^i
  (App. eq. (6) misprints the leading term and the exponent; DESIGN, pitfalls).
  """
  _check_block(k)
  alpha = _check_rate("alpha", alpha)
  x = np.asarray(x, np.float64)
  return 1 + (x - 1) * _geometric_sum(alpha * x, k + 1)


def vertical_cascade_ewif(alpha_target: float, alpha_drafters: float, k: int, n: int, c_d1: float,
                          c_d2: float) -> np.ndarray:
  """EWIF of a two-drafter vertical cascade (CS Drafting Thm 4.3).

  (1 − α·φ(α)^n) / ((1 − α)(1 + n·c_d1 + n·k·c_d2)) with α = α(M_t, M_d1), φ = φ_(α', k), α' =
  α(M_d1, M_d2); φ^n is the n-th power (not n-fold composition). M_d2 drafts k tokens per M_d1 review,
  M_d1 reviews n times per target call.
  """
  _check_block(n)
  alpha = _check_rate("alpha_target", alpha_target)
  tokens = (1 - alpha * phi(alpha_drafters, k, alpha) ** n) / (1 - alpha)
  return tokens / (1 + n * c_d1 + n * k * c_d2)


def horizontal_cascade_ewif(alphas, costs) -> float:
  """EWIF of a horizontal cascade (CS Drafting Thm 4.5): Σ_{i=0}^{k} Π_{j≤i} α_j / (1 + Σ_i c_i).

  alphas[i], costs[i] are the acceptance rate and relative cost of the drafter of draft position i+1.
  """
  alphas = _check_rate("alphas", alphas)
  costs = np.asarray(costs, np.float64)
  if alphas.shape != costs.shape or alphas.ndim != 1:
    raise ValueError(f"alphas and costs must be 1-D of equal length; got {alphas.shape}, {costs.shape}")
  accepted_prefix = np.concatenate([[1.0], np.cumprod(alphas)])
  return float(accepted_prefix.sum() / (1 + costs.sum()))


def rejection_rate(deferral: ArrayLike, p: np.ndarray, q: np.ndarray) -> np.ndarray:
  """P(reject a draft x ~ q) under π = (1 − r)·q + r·p: r·D_TV(p, q) (cascades Lemma 3)."""
  r = np.asarray(deferral, np.float64)
  return r * np.sum(np.maximum(np.asarray(p) - np.asarray(q), 0.0), axis=-1)
