"""SpecTr (Sun et al., 2023): draft selection as optimal transport with membership cost (OTM).

Notation: q is the DRAFTER, p the TARGET (DESIGN). The paper writes them the other way round; every
formula here is translated, e.g. its β_{p,q}(γ) = Σ_x min(p(x), q(x)/γ) is our Σ_v min(q(v), p(v)/γ).

- OTM-k (§5, eq. (4)): the exact optimal acceptance α_k(q, p) by linear program, for small V and k.
- K-SEQ (§6, Alg. 2, Thm 2): k i.i.d. drafts, each accepted w.p. min(1, p(x)/(γ*·q(x))); γ* by bisection.
- DraftSelection (§7, Alg. 3, Thm 3): K-SEQ at every depth over the drafts that still agree with the
  selected prefix.

The public functions check concrete arguments and raise ValueError; under jit the checks are skipped
(see `checks`). The private kernels behind them take no checks and also accept k = 0 (no drafts:
nothing can be accepted and the residual is p), which a batched loop needs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import optimize, sparse

from specdec import checks, rng, sampling

Array = jax.Array

# Bisection halves [1, k]; 40 steps leave an interval far below float32 resolution for any k < 1e4.
_BISECTION_STEPS = 40
_MAX_LP_VARIABLES = 2_000_000


def _check_pair(q, p) -> None:
  for name, x in (("q", q), ("p", p)):
    if np.ndim(x) < 1:
      raise ValueError(f"{name} must have a vocabulary axis [..., V]; got shape {np.shape(x)}")
    checks.check_probs(name, x)
  if np.shape(q)[-1] != np.shape(p)[-1]:
    raise ValueError(f"q and p must share the vocabulary size; got shapes {np.shape(q)}, {np.shape(p)}")
  try:
    np.broadcast_shapes(np.shape(q)[:-1], np.shape(p)[:-1])
  except ValueError:
    raise ValueError(f"q and p leading shapes do not broadcast: {np.shape(q)}, {np.shape(p)}") from None


def _beta(q: Array, p: Array, gamma: Array) -> Array:
  return jnp.sum(jnp.minimum(q, p / gamma[..., None]), axis=-1)


def _p_accept(beta: Array, k: Array) -> Array:
  """p_acc = 1 − (1 − β)^k, via log1p/expm1 so that a small β keeps its digits; k = 0 gives 0."""
  log_reject = jnp.log1p(-jnp.minimum(beta, 1.0))
  return jnp.where(k > 0, -jnp.expm1(jnp.where(k > 0, k, 1.0) * log_reject), 0.0)


@jax.jit
def _gamma_star(q: Array, p: Array, k: Array) -> Array:
  """γ* of Thm 2 by bisection of f(γ) = p_acc(γ) − γ·β(γ), which decreases on [1, k] (Lemma 3).

  Returns the upper end of the final bracket, where f ≤ 0: Thm 2 makes K-SEQ a valid transport plan
  for every γ ≥ γ*, so this side keeps the residual non-negative whatever the rounding. Jitted so that
  eager calls (analysis, tests) compile the bisection loop once per shape, not once per call.
  """
  dtype = jnp.result_type(q.dtype, p.dtype, jnp.float32)
  k = jnp.asarray(k, dtype)
  shape = jnp.broadcast_shapes(q.shape[:-1], p.shape[:-1], k.shape)
  k = jnp.broadcast_to(k, shape)

  def bisect(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    beta = _beta(q, p, mid)
    root_above = _p_accept(beta, k) - mid * beta > 0
    return jnp.where(root_above, mid, lo), jnp.where(root_above, hi, mid)

  bracket = (jnp.ones(shape, dtype), jnp.maximum(k, 1.0))
  return jax.lax.fori_loop(0, _BISECTION_STEPS, bisect, bracket)[1]


def _residual(q: Array, p: Array, gamma: Array, k: Array) -> Array:
  beta = _beta(q, p, gamma)
  p_acc = _p_accept(beta, jnp.asarray(k, beta.dtype))
  # p_acc/β equals γ* at the root; with β = 0 (disjoint supports) nothing is accepted or subtracted.
  scale = jnp.where(beta > 0, p_acc / jnp.where(beta > 0, beta, 1.0), 0.0)
  res = jnp.maximum(p - jnp.minimum(q, p / gamma[..., None]) * scale[..., None], 0.0)
  # Empty only when p_acc = 1: the residual is then never drawn, so p is a numerical guard.
  empty = jnp.sum(res, axis=-1, keepdims=True) <= 0.0
  return jnp.where(empty, p, res)


@jax.jit
def _select(key: Array, drafts: Array, q: Array, p: Array, active: Array) -> tuple[Array, Array]:
  """Alg. 2 over the active drafts [..., K] (any number, 0 included) with q, p [..., V]."""
  lead = jnp.broadcast_shapes(drafts.shape[:-1], q.shape[:-1], p.shape[:-1], active.shape[:-1])
  drafts = jnp.broadcast_to(drafts, lead + drafts.shape[-1:])
  active = jnp.broadcast_to(active, drafts.shape)
  q = jnp.broadcast_to(q, lead + q.shape[-1:])
  p = jnp.broadcast_to(p, lead + p.shape[-1:])
  k = jnp.sum(active, axis=-1)
  gamma = _gamma_star(q, p, k)
  key_accept, key_residual = rng.split(key)

  q_x = jnp.take_along_axis(q, drafts, axis=-1)
  p_x = jnp.take_along_axis(p, drafts, axis=-1)
  # u < p/(γ·q)  <=>  u·γ·q < p: no division, as in verify.verify_block.
  u = rng.uniform(key_accept, drafts.shape, dtype=gamma.dtype)
  accepted = active & (u * gamma[..., None] * q_x < p_x)
  any_accepted = jnp.any(accepted, axis=-1)
  # Drawing every u_i up front and keeping the first acceptance is Alg. 2's sequential loop.
  first = jnp.argmax(accepted, axis=-1)
  draft_token = jnp.take_along_axis(drafts, first[..., None], axis=-1)[..., 0]
  residual_token = sampling.sample(key_residual, _residual(q, p, gamma, k))
  return jnp.where(any_accepted, draft_token, residual_token).astype(jnp.int32), any_accepted


def kseq_beta(q: Array, p: Array, gamma: float | Array) -> Array:
  """β(γ) = Σ_v min(q(v), p(v)/γ) (Thm 2, translated). q, p [..., V], γ broadcast to [...] -> [...]."""
  _check_pair(q, p)
  checks.check_range("gamma", gamma, 0.0, math.inf, lo_closed=False)
  return _beta(jnp.asarray(q), jnp.asarray(p), jnp.asarray(gamma))


def kseq_gamma(q: Array, p: Array, k: int | Array) -> Array:
  """γ* ∈ [1, k] solving 1 − (1 − β(γ))^k = γ·β(γ) (Thm 2, eq. (6)) by bisection.

  q, p [..., V]; k (int, or int array broadcast to [...], may be traced) -> γ* [...].
  """
  _check_pair(q, p)
  checks.check_count("k", k, 1)
  return _gamma_star(jnp.asarray(q), jnp.asarray(p), k)


def kseq_acceptance(q: Array, p: Array, k: int | Array) -> Array:
  """K-SEQ's acceptance probability p_acc = 1 − (1 − β(γ*))^k (Thm 2). [..., V] -> [...]."""
  _check_pair(q, p)
  checks.check_count("k", k, 1)
  q, p = jnp.asarray(q), jnp.asarray(p)
  gamma = _gamma_star(q, p, k)
  beta = _beta(q, p, gamma)
  return _p_accept(beta, jnp.asarray(k, beta.dtype))


def kseq_residual(q: Array, p: Array, gamma: float | Array, k: int | Array) -> Array:
  """Unnormalised K-SEQ residual of Alg. 2, eq. (5) translated, [..., V].

  p_res(v) ∝ p(v) − min(q(v), p(v)/γ)·p_acc/β(γ), which sums to 1 − p_acc; at γ = γ* it is
  max(p − γ*·q, 0). A valid law for γ ≥ γ* (Thm 2); clipped at 0 against rounding, and p where it is
  empty (p_acc = 1, never drawn). k = 0 (no drafts) gives p.
  """
  _check_pair(q, p)
  checks.check_range("gamma", gamma, 1.0, math.inf)
  checks.check_count("k", k, 0)
  return _residual(jnp.asarray(q), jnp.asarray(p), jnp.asarray(gamma), k)


def kseq_select(key: Array, drafts: Array, q: Array, p: Array, k: int | Array | None = None, *,
                active: Array | None = None) -> tuple[Array, Array]:
  """K-SEQ (Alg. 2): one token with law p from k i.i.d. drafts of q.

  Draft x_i is accepted w.p. min(1, p(x_i)/(γ*·q(x_i))); the first accepted draft is returned, else a
  draw from the residual (eq. (5)).

  Args:
    key: PRNG key.
    drafts: [..., K] int tokens; the active ones are i.i.d. draws from q.
    q: [..., V] drafter distribution (leading axes broadcast against drafts.shape[:-1]).
    p: [..., V] target distribution.
    k: the number of active drafts, the first k of the K slots (int or int array [...], may be traced);
      defaults to K. Give `k` or `active`, not both.
    active: [..., K] bool mask of the drafts to use, in any positions. A row with no active draft
      returns a draw from p (K-SEQ with k = 0).
  Returns:
    token: [...] int32, distributed as p.
    accepted: [...] bool, whether token is an accepted draft (probability `kseq_acceptance(q, p, k)`).
  """
  if np.ndim(drafts) < 1:
    raise ValueError(f"drafts must be [..., K]; got shape {np.shape(drafts)}")
  _check_pair(q, p)
  vocab_size, num_slots = np.shape(q)[-1], np.shape(drafts)[-1]
  checks.check_count("drafts", drafts, 0, vocab_size - 1)
  if active is None:
    k = num_slots if k is None else k
    checks.check_count("k", k, 1, num_slots)
    active = jnp.arange(num_slots) < jnp.asarray(k)[..., None]
  elif k is not None:
    raise ValueError("give kseq_select either k or active, not both")
  elif np.ndim(active) < 1 or np.shape(active)[-1] != num_slots:
    raise ValueError(f"active must be [..., K] with K = {num_slots}; got shape {np.shape(active)}")
  return _select(key, jnp.asarray(drafts), jnp.asarray(q), jnp.asarray(p), jnp.asarray(active, bool))


def otm_acceptance(q: np.ndarray, p: np.ndarray, k: int) -> float:
  """α_k(q, p): OTM-k's optimal acceptance probability, by the linear program (4) (HiGHS).

  Variables π(x^k, y) ≥ 0 for x^k ∈ [V]^k, y ∈ [V]; maximise P(y ∈ S(x^k)) subject to the marginals
  q^{⊗k} (drafts) and p (target). q, p: [V] NumPy; V^(k+1) variables, for small V and k only.
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k (the number of drafts) must be an int >= 1; got {k!r}")
  _check_pair(q, p)
  q, p = np.asarray(q, np.float64), np.asarray(p, np.float64)
  if q.ndim != 1 or p.ndim != 1:
    raise ValueError(f"otm_acceptance takes single distributions q [V], p [V]; got {q.shape}, {p.shape}")
  for name, x in (("q", q), ("p", p)):
    if abs(x.sum() - 1.0) > 1e-4:
      raise ValueError(f"{name} must sum to 1; got {x.sum()}")
  vocab_size = q.size
  num_tuples = vocab_size**k
  if num_tuples * vocab_size > _MAX_LP_VARIABLES:
    raise ValueError(f"V^(k+1) = {vocab_size}^{k + 1} LP variables exceeds {_MAX_LP_VARIABLES:.0e}; "
                     "use kseq_acceptance")
  q, p = q / q.sum(), p / p.sum()

  digits = np.stack(np.unravel_index(np.arange(num_tuples), (vocab_size,) * k), axis=-1)  # [V^k, k]
  draft_law = np.prod(q[digits], axis=-1)
  member = np.any(digits[:, :, None] == np.arange(vocab_size), axis=1)  # [V^k, V]: y ∈ S(x^k)
  var = np.arange(num_tuples * vocab_size).reshape(num_tuples, vocab_size)  # π(x^k, y) -> column
  # Both marginals sum to one, so one constraint row is redundant; drop the last target row, or HiGHS
  # may report the (numerically inconsistent) full system infeasible.
  rows = np.concatenate([np.repeat(np.arange(num_tuples), vocab_size),
                         num_tuples + np.tile(np.arange(vocab_size - 1), num_tuples)])
  cols = np.concatenate([var.ravel(), var[:, :-1].ravel()])
  a_eq = sparse.csr_matrix((np.ones(rows.size), (rows, cols)),
                           shape=(num_tuples + vocab_size - 1, var.size))
  b_eq = np.concatenate([draft_law, p[:-1]])
  result = optimize.linprog(-member.ravel().astype(np.float64), A_eq=a_eq, b_eq=b_eq, bounds=(0, None),
                            method="highs")
  if not result.success:
    raise RuntimeError(f"OTM linear program failed: {result.message}")
  return float(-result.fun)


def draft_selection(key: Array, drafts: Array, q: Array, p: Array) -> tuple[Array, Array, Array]:
  """DraftSelection (Alg. 3) with K-SEQ at every depth, over a batch of K draft sequences of length L.

  At depth j K-SEQ runs over the drafts that agree with the selected prefix (k = how many); the drafts
  whose token j differs from the selected token are dropped; when none agrees the selected token is the
  last one. If some draft survives all L depths, a bonus token is drawn from p at depth L (lines 3–6).
  Tokens out: drafts[b, draft_index, :n_accepted] then next_token; their law is the target's (Thm 3).

  Args:
    key: PRNG key.
    drafts: [B, K, L] int tokens; drafts[b, k, j] ~ q[b, k, j], sampled autoregressively.
    q: [B, K, L, V] drafter distribution each draft token was drawn from.
    p: [B, K, L+1, V] target distribution given the context and drafts[b, k, :j] (identical rows for
      drafts that share a prefix).
  Returns:
    n_accepted: [B] int32 in [0, L], the number of draft tokens kept.
    draft_index: [B] int32, a draft whose first n_accepted tokens are the ones kept.
    next_token: [B] int32, the token after them (a residual draw or the bonus token).
    Rows whose q or p contain NaN get -1 in all three (the in-jit flag; outside jit NaN raises).
  """
  if np.ndim(drafts) != 3:
    raise ValueError(f"drafts must be [B, K, L]; got shape {np.shape(drafts)}")
  batch, num_drafts, length = np.shape(drafts)
  if np.ndim(q) != 4 or np.shape(q)[:3] != (batch, num_drafts, length):
    raise ValueError(f"q must be [B, K, L, V] = [{batch}, {num_drafts}, {length}, V]; got {np.shape(q)}")
  vocab_size = np.shape(q)[3]
  if np.shape(p) != (batch, num_drafts, length + 1, vocab_size):
    raise ValueError(f"p must be [B, K, L+1, V] = {(batch, num_drafts, length + 1, vocab_size)}; "
                     f"got {np.shape(p)}")
  checks.check_probs("q", q)
  checks.check_probs("p", p)
  checks.check_count("drafts", drafts, 0, vocab_size - 1)
  return _draft_selection(key, jnp.asarray(drafts, jnp.int32), jnp.asarray(q), jnp.asarray(p))


@jax.jit
def _draft_selection(key: Array, drafts: Array, q: Array, p: Array) -> tuple[Array, Array, Array]:
  """The jitted Alg. 3 kernel behind `draft_selection` (no checks)."""
  batch, num_drafts, length = drafts.shape
  rows = jnp.arange(batch)
  depth_keys = rng.split(key, length + 1)

  def depth_step(j, state):
    # A row is live at depth j while its first j selected tokens all came from drafts.
    active, n_accepted, next_token = state
    live = n_accepted == j
    # Active drafts share the selected prefix, so any one of them holds q and p at depth j.
    lead = jnp.argmax(active, axis=-1)
    tokens = drafts[:, :, j]
    token, _ = _select(depth_keys[j], tokens, q[rows, lead, j], p[rows, lead, j], active)
    agree = active & (tokens == token[:, None])
    proceed = live & jnp.any(agree, axis=-1)
    return (jnp.where(proceed[:, None], agree, active),
            jnp.where(proceed, j + 1, n_accepted),
            jnp.where(live & ~proceed, token, next_token))

  init = (jnp.ones((batch, num_drafts), bool), jnp.zeros(batch, jnp.int32), jnp.zeros(batch, jnp.int32))
  active, n_accepted, next_token = jax.lax.fori_loop(0, length, depth_step, init)
  draft_index = jnp.argmax(active, axis=-1).astype(jnp.int32)
  bonus = sampling.sample(depth_keys[length], p[rows, draft_index, length])
  next_token = jnp.where(n_accepted == length, bonus, next_token)

  bad = jnp.any(jnp.isnan(q), axis=(1, 2, 3)) | jnp.any(jnp.isnan(p), axis=(1, 2, 3))
  return tuple(jnp.where(bad, -1, x).astype(jnp.int32) for x in (n_accepted, draft_index, next_token))
