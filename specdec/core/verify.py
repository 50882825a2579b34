"""Block verification: Algorithm 4 (GenSpecSample) of the speculative-cascades paper, for any target π.

One kernel serves every rule of `targets.py`: the rule only changes π. Draft token x_j ~ q_j is accepted
with probability min(1, π_j(x_j)/q_j(x_j)); at the first rejection j* a token is drawn from the residual
norm(max(0, π_j* − q_j*)); if all γ drafts are accepted the bonus token is drawn from π_γ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec import checks, rng, sampling

Array = jax.Array


def residual(pi: Array, q: Array) -> Array:
  """Unnormalised residual max(0, π − q) [..., V]; falls back to π where it is empty.

  An empty residual means π ≤ q everywhere, so Σπ ≥ 1 and no rejection can happen (DESIGN, pitfalls):
  the fallback is a numerical guard, never reached with exact arithmetic.
  """
  res = jnp.maximum(pi - q, 0.0)
  empty = jnp.sum(res, axis=-1, keepdims=True) <= 0.0
  return jnp.where(empty, pi, res)


def acceptance_probability(q: Array, pi: Array) -> Array:
  """min(1, π(v)/q(v)) for every token v [..., V] (1 where q(v) = 0: such a token is never drafted)."""
  return jnp.where(q > 0, jnp.minimum(1.0, pi / jnp.where(q > 0, q, 1.0)), 1.0)


def verification_law(q: Array, pi: Array) -> Array:
  """The exact law of the token emitted at one verified position, [..., V].

  P(v) = q(v)·min(1, π(v)/q(v)) + P(reject)·norm(max(0, π − q))(v), P(reject) = 1 − Σ_v min(q, π).
  Equals π when Σπ = 1; for lossy speculative sampling with β = 1 (Σπ > 1) it is Tran-Thien's law.
  """
  accepted = jnp.minimum(q, pi)
  p_reject = jnp.maximum(1.0 - jnp.sum(accepted, axis=-1, keepdims=True), 0.0)
  res = residual(pi, q)
  return accepted + p_reject * res / jnp.sum(res, axis=-1, keepdims=True)


def verify_block(key: Array, draft_tokens: Array, q: Array, pi: Array,
                 n_drafted: Array | None = None) -> tuple[Array, Array]:
  """Algorithm 4 on a batch of blocks: accept a prefix of the drafts, then one corrected/bonus token.

  Args:
    key: PRNG key.
    draft_tokens: [B, γ] tokens x_j drawn from q_j.
    q: [B, γ, V] drafter distributions q_j the drafts were drawn from (transformed, S(q)).
    pi: [B, γ+1, V] target distributions π_j = T(q_j, p_j); row γ is the bonus distribution.
    n_drafted: [B] drafts each row made (None: γ); drafts at j ≥ n_drafted[b] are padding, and when the
      first n_drafted[b] are all accepted the bonus token is drawn from π at n_drafted[b].
  Returns:
    n_accepted: [B] int32 in [0, n_drafted], the number of leading drafts accepted.
    next_token: [B] int32, the residual sample at j* = n_accepted (or the bonus sample when all
      drafts are accepted).
    Rows where NaN reaches the step (in q(x_j), π(x_j) or the rows q_j*, π_j* that are sampled from)
    get n_accepted = next_token = -1: the in-jit flag. Outside jit, NaN anywhere raises ValueError.
  """
  batch, gamma = draft_tokens.shape
  if q.shape[:2] != (batch, gamma) or pi.shape[:2] != (batch, gamma + 1) or q.shape[2] != pi.shape[2]:
    raise ValueError(f"verify_block expects draft_tokens [B, γ], q [B, γ, V], pi [B, γ+1, V]; got "
                     f"{draft_tokens.shape}, {q.shape}, {pi.shape}")
  checks.check_probs("q", q)
  checks.check_probs("pi", pi)
  if n_drafted is None:
    n_drafted = jnp.full((batch,), gamma, jnp.int32)
  checks.check_count("n_drafted", n_drafted, 0, gamma)
  return _verify_block(key, jnp.asarray(draft_tokens, jnp.int32), jnp.asarray(q), jnp.asarray(pi),
                       jnp.asarray(n_drafted, jnp.int32))


@jax.jit
def _verify_block(key: Array, draft_tokens: Array, q: Array, pi: Array, n_drafted: Array) -> tuple[Array, Array]:
  """The jitted kernel behind `verify_block` (no checks): eager calls compile once per shape."""
  batch, gamma = draft_tokens.shape
  key_accept, key_resample = rng.split(key)

  q_x = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  pi_x = jnp.take_along_axis(pi[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  # u < π/q  <=>  u·q < π: no division, and a draft with q(x) = π(x) = 0 is rejected.
  u = rng.uniform(key_accept, (batch, gamma))
  accepted = (u * q_x < pi_x) & (jnp.arange(gamma) < n_drafted[:, None])
  n_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)

  # At j* < n_drafted the residual is max(0, π − q); at j* = n_drafted no draft was made there (q taken
  # as 0), so the residual is π itself: the bonus token.
  # Row b's position n_accepted[b], one row at a time (`vmap`): a gather whose rows are a batch dimension
  # stays on each row's device under a mesh (indexing by row ids gathers every row onto every device).
  at_row = jax.vmap(lambda x, j: x[j])
  pi_star = at_row(pi, n_accepted)
  q_star = jnp.where((n_accepted < n_drafted)[:, None], at_row(q, jnp.minimum(n_accepted, gamma - 1)), 0.0)
  next_token = sampling.sample(key_resample, residual(pi_star, q_star))

  # NaN anywhere in the entries this step reads poisons its outcome; checking only those keeps the
  # flag off the [B, γ, V] arrays (a full pass each).
  drafted = jnp.arange(gamma) < n_drafted[:, None]
  used = jnp.concatenate([jnp.where(drafted, q_x, 0.0), jnp.where(drafted, pi_x, 0.0),
                          jnp.sum(pi_star, -1, keepdims=True),
                          jnp.sum(q_star, -1, keepdims=True)], axis=-1)
  bad = jnp.any(jnp.isnan(used), axis=-1)
  return jnp.where(bad, -1, n_accepted).astype(jnp.int32), jnp.where(bad, -1, next_token)
