"""Target distributions π = T(q, p) of the speculative-cascades paper (Tables 1 and 3, eqs. 6, 11–16).

Deferral decisions use the untransformed distributions q_raw, p_raw; the interpolation uses the
transformed (temperature / top-k / top-p) q, p that are sampled and verified (App. C.1). OPT and OPTLog
measure the rejection cost with D_TV of the transformed pair (App. C.1). BiLD's discrepancy is
D(q, p) = −Σ_v q(v)·log p_raw(v) with the transformed q (App. F.1; F.5 drops the minus sign).

Every function is jit-able with α and β traced; the rule name is static.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specdec.core import checks
from specdec.core.sampling import entropy, masked_sum

Array = jax.Array

# Rules whose π is (1 − δ)·q + δ·p with a deferral decision δ ∈ {0, 1} (eq. 6).
CASCADE_RULES = ("chow", "chow_log", "diff", "diff_log", "opt", "opt_log", "bild")
# Token-specific rules: π(v) = q(v)·(1 − r(v)) + p(v)·Σ_v' r(v')·q(v') (eq. 11, Alg. 6).
TOKEN_RULES = ("token_v1", "token_v2", "token_v3")
RULES = ("spec", "lossy", "lossy_tuned") + CASCADE_RULES + TOKEN_RULES

# Allowed α per rule: probability-scale thresholds live in [0, 1); entropy / log-probability
# thresholds (ChowLog, DiffLog, OPTLog, BiLD's cross-entropy) are in nats, [0, ∞).
_NATS_RULES = ("chow_log", "diff_log", "opt_log", "bild")


def check_rule(rule: str) -> None:
  if rule not in RULES:
    raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")


def alpha_range(rule: str) -> tuple[float, float, str]:
  """α's allowed interval [lo, hi) for `rule` and the name errors give it: [0, 1) for probability-scale
  rules, [0, ∞) for the nats-scale ones."""
  check_rule(rule)
  if rule in _NATS_RULES:
    return 0.0, math.inf, f"alpha (rule {rule!r}, a threshold in nats)"
  return 0.0, 1.0, f"alpha (rule {rule!r})"


def check_alpha(rule: str, alpha) -> None:
  """α in `alpha_range(rule)` (raises ValueError)."""
  lo, hi, name = alpha_range(rule)
  checks.check_range(name, alpha, lo, hi, hi_closed=False)


def check_beta(alpha, beta) -> None:
  """β ≥ 1 − α (Tran-Thien's condition), checked when both are concrete."""
  if checks.is_concrete(alpha) and checks.is_concrete(beta):
    a, b = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
    if np.any(np.isnan(b)) or np.any(b < 1.0 - a):
      raise ValueError(f"beta must satisfy beta >= 1 - alpha; got beta={b.tolist()}, alpha={a.tolist()}")


def _per_token(x) -> Array:
  """A scalar or [...] parameter, broadcast against [..., V]. A scalar stays a scalar: broadcast to
  [..., 1], XLA:CPU writes it out at [..., V] when two fusions share it."""
  x = jnp.asarray(x, jnp.float32)
  return x if x.ndim == 0 else x[..., None]


def tv_distance(p: Array, q: Array) -> Array:
  """D_TV(p, q) = Σ_v max(0, p(v) − q(v)) over the last axis (Lemma 3)."""
  return masked_sum(p - q, p > q)[0]


def bild_discrepancy(q: Array, p_raw: Array) -> Array:
  """D(q, p) = −Σ_v q(v)·log p_raw(v): cross-entropy, and −log p_raw(argmax q) when q is one-hot."""
  log_p = jnp.log(jnp.maximum(p_raw, jnp.finfo(jnp.float32).tiny))
  return -masked_sum(q * log_p, q > 0)[0]


def deferral(rule: str, *, q_raw: Array, p_raw: Array | None = None, q: Array | None = None,
             p: Array | None = None, alpha) -> Array:
  """δ(q, p) ∈ {0, 1} of a cascade rule (Table 3, eqs. 2, 5, 10, 26–28), [..., V] -> [...] bool.

  chow      max q_raw < 1 − α                            (needs q_raw only: sequential cascades)
  chow_log  entropy(q_raw) > α                           (needs q_raw only)
  diff      max q_raw < max p_raw − α
  diff_log  entropy(p_raw) < entropy(q_raw) − α
  opt       max q_raw < max p_raw − α·D_TV(p, q)         (q, p transformed)
  opt_log   entropy(p_raw) < entropy(q_raw) − α·D_TV(p, q)
  bild      −Σ q·log p_raw > α                           (q transformed)
  """
  if rule not in CASCADE_RULES:
    raise ValueError(f"deferral() is defined for the cascade rules {CASCADE_RULES}; got {rule!r}")
  needs = {"diff": ("p_raw",), "diff_log": ("p_raw",), "opt": ("p_raw", "q", "p"),
           "opt_log": ("p_raw", "q", "p"), "bild": ("p_raw", "q")}.get(rule, ())
  given = {"p_raw": p_raw, "q": q, "p": p}
  missing = [name for name in needs if given[name] is None]
  if missing:
    raise ValueError(f"rule {rule!r} needs {', '.join(missing)}")
  alpha = jnp.asarray(alpha, jnp.float32)
  if rule == "chow":
    return jnp.max(q_raw, axis=-1) < 1.0 - alpha
  if rule == "chow_log":
    return entropy(q_raw) > alpha
  if rule == "diff":
    return jnp.max(q_raw, axis=-1) < jnp.max(p_raw, axis=-1) - alpha
  if rule == "diff_log":
    return entropy(p_raw) < entropy(q_raw) - alpha
  if rule == "opt":
    return jnp.max(q_raw, axis=-1) < jnp.max(p_raw, axis=-1) - alpha * tv_distance(p, q)
  if rule == "opt_log":
    return entropy(p_raw) < entropy(q_raw) - alpha * tv_distance(p, q)
  return bild_discrepancy(q, p_raw) > alpha


def token_deferral(rule: str, *, q_raw: Array, p_raw: Array, alpha) -> Array:
  """r(v) ∈ {0, 1} of a token-specific rule, eqs. (13)–(15), [..., V] -> [..., V] bool.

  token_v1  q_raw(v) < max p_raw − α
  token_v2  p_raw(v) < max p_raw − α
  token_v3  p_raw(v) < max p_raw·(1 − α)
  """
  alpha = _per_token(alpha)
  p_max = jnp.max(p_raw, axis=-1, keepdims=True)
  if rule == "token_v1":
    return q_raw < p_max - alpha
  if rule == "token_v2":
    return p_raw < p_max - alpha
  if rule == "token_v3":
    return p_raw < p_max * (1.0 - alpha)
  raise ValueError(f"token_deferral() is defined for {TOKEN_RULES}; got {rule!r}")


def lossy_target(q: Array, p: Array, alpha, beta) -> Array:
  """π_Lossy(v) = max(min(q(v), p(v)/(1 − α)), p(v)/β) (Table 1, Lemma 2; Table 3 swaps q and p)."""
  return jnp.maximum(jnp.minimum(q, p / (1.0 - _per_token(alpha))), p / _per_token(beta))


@functools.partial(jax.jit, static_argnames=("iterations",))
def lossy_beta(q: Array, p: Array, alpha, *, iterations: int = 64) -> Array:
  """β* ≥ 1 solving Σ max(0, q − p/(1−α)) = Σ max(0, p/β − q) (App. F.6) by Newton's method. [..., V] -> [...]

  In x = 1/β the right side f(x) = Σ max(0, p·x − q) is convex, piecewise linear and increasing, and
  f(1) = D_TV(p, q) ≥ lhs, the left side; so Newton's iteration from β = 1,
  β ← Σ_{p > βq} p / (lhs + Σ_{p > βq} q), increases β monotonically to β*, exactly once the set
  {p > βq} stops changing. Each step is one pass over q and p. It converges quadratically (relative steps
  9e-3, 7e-6, 0 at V = 32k), so it stops after a step below 2^-16 of β, whose successor would be below
  float32 resolution, or once the set is unchanged: 2 steps at V = 32k (at most `iterations`), where a
  bisection took 64 passes. With this β*, Σ π_Lossy = 1. When lhs = 0 every β ≥ max p/q solves it and
  all give π = q: the smallest, max(1, max p/q) (at most 1e12, where q = 0 < p), is returned.
  """
  excess = q - p / (1.0 - _per_token(alpha))
  lhs, n_excess = masked_sum(excess, excess > 0.0)
  tuned = n_excess > 0

  def moving(state):
    beta, previous, n_active, n_previous, k = state
    moved = (beta - previous > beta * 2.0 ** -16) & (n_active != n_previous)
    return jnp.any(tuned & moved) & (k < iterations)

  def newton(state):
    beta, _, previous_count, _, k = state
    active = p > beta[..., None] * q
    (above_p, n_active), (above_q, _) = masked_sum(p, active), masked_sum(q, active)
    step = jnp.where(tuned, jnp.maximum(beta, above_p / (lhs + above_q)), beta)
    return step, beta, n_active, previous_count, k + 1

  ones = jnp.ones_like(lhs)
  unset = jnp.full(lhs.shape, -1, jnp.int32)
  beta = jax.lax.while_loop(moving, newton, newton((ones, ones, unset, unset, 0)))[0]

  def smallest_solution(_):
    return jnp.clip(jnp.max(p / jnp.maximum(q, jnp.finfo(jnp.float32).tiny), axis=-1), 1.0, 1e12)

  return jnp.where(tuned, beta, jax.lax.cond(jnp.all(tuned), lambda _: ones, smallest_solution, None))


def target_distribution(rule: str, *, q: Array, p: Array, q_raw: Array, p_raw: Array, alpha=0.0,
                        beta=1.0) -> Array:
  """π = T(q, p) for `rule`, [..., V] each -> [..., V].

  spec          p                                                (Alg. 1)
  lossy         max(min(q, p/(1−α)), p/β), β given (1 = the paper's default; Σπ ≥ 1 in general)
  lossy_tuned   the same with β = β*(q, p, α) of App. F.6 (Σπ = 1)
  cascade rules (1 − δ)·q + δ·p with δ from `deferral`          (eq. 6, App. C.1 eq. 23)
  token_v1..v3  q·(1 − r) + p·Σ r·q with r from `token_deferral` (eqs. 11, 16, App. C.1)

  q, p are the transformed S(·) distributions; q_raw, p_raw the untransformed ones. α and β are
  scalars or arrays of shape [...] (e.g. per row); α is checked against the rule's range when concrete.
  """
  check_alpha(rule, alpha)
  if rule == "spec":
    return p
  if rule == "lossy":
    check_beta(alpha, beta)
    return lossy_target(q, p, alpha, beta)
  if rule == "lossy_tuned":
    return lossy_target(q, p, alpha, lossy_beta(q, p, alpha))
  if rule in CASCADE_RULES:
    delta = deferral(rule, q_raw=q_raw, p_raw=p_raw, q=q, p=p, alpha=alpha)[..., None]
    return jnp.where(delta, p, q)
  r = token_deferral(rule, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
  eta = masked_sum(q, r)[0][..., None]
  return jnp.where(r, 0.0, q) + p * eta


def lenient_target(q: Array, p: Array, *, q_raw: Array, p_raw: Array, lenience, greedy) -> Array:
  """CS Drafting's lenient review (§3.2) as the law π of what a reviewer p emits for drafts x ~ q, [..., V].

  Sampling: x is accepted with probability min(1, l·p(x)/q(x)), else a token is drawn from
  norm(max(0, p − q)); so π = m + (1 − Σm)·norm(max(0, p − q)) with m = min(q, l·p). Verifying the
  q-drafts against this π (`verify.verify_block`) performs exactly that test and residual; l = 1 gives
  π = p. Greedy (`greedy` true, q and p one-hot): x = argmax q is kept where x = argmax p or, for l > 1,
  where q_raw(x) ≤ l·p_raw(x) (CSD's greedy rule); otherwise argmax p. At l = 1 only argmax p is kept, so
  lenience 1 is exact (CSD's text would also keep x when q_raw(x) ≤ p_raw(x)). `lenience` ≥ 1 and
  `greedy` may be traced.
  """
  lenience = _per_token(lenience)
  kept = jnp.minimum(q, lenience * p)
  res = jnp.maximum(p - q, 0.0)
  res = res / jnp.maximum(jnp.sum(res, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
  pi = kept + (1.0 - jnp.sum(kept, axis=-1, keepdims=True)) * res
  q_at_x, p_at_x = jnp.sum(q * q_raw, axis=-1, keepdims=True), jnp.sum(q * p_raw, axis=-1, keepdims=True)
  keep_draft = greedy & (lenience > 1.0) & (q_at_x <= lenience * p_at_x)
  return jnp.where(keep_draft, q, pi)
