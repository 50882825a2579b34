"""The sampling transform S(·) and categorical sampling.

S(·) is the transformation of a model's next-token distribution that is actually sampled from:
temperature scaling, then top-k, then top-p truncation (speculative-cascades paper, App. C.1). The
cascade rules defer on the untransformed distributions and interleave the transformed ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specdec import checks

Array = jax.Array


def _keep_most_likely(probs: Array, measure: Array, budget: Array) -> Array:
  """Mask of the most likely tokens taken in order (ties by lower index) while the measure taken
  *before* a token is < budget; [..., V] probs and measure, budget broadcast against [..., 1].

  measure = 1 gives top-k (budget k); measure = probs gives top-p (budget P). No sort: the cut-off
  probability τ* (the least likely kept value) is found by bisection on the float32 bit pattern, which
  is monotone for non-negative floats, so 32 masked reductions find it exactly; ties at τ* are then
  kept lowest index first. A full argsort costs far more on CPU (about 600 ms at [72, 32k]).
  """
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def measure_from(threshold_bits):
    return jnp.sum(jnp.where(bits >= threshold_bits, measure, 0.0), axis=-1, keepdims=True)

  def bisect(_, bracket):  # invariant: measure_from(lo) >= budget > measure_from(hi)
    lo, hi = bracket
    mid = lo + (hi - lo) // 2
    enough = measure_from(mid) >= budget
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo = jnp.zeros(probs.shape[:-1] + (1,), jnp.int32)
  hi = jnp.max(bits, axis=-1, keepdims=True) + 1
  lo, _ = jax.lax.fori_loop(0, 32, bisect, (lo, hi))
  above = bits > lo
  tied = bits == lo
  room = budget - jnp.sum(jnp.where(above, measure, 0.0), axis=-1, keepdims=True)
  tie_index = jnp.cumsum(tied, axis=-1) - 1
  return above | (tied & (tie_index * measure < room))


def _renormalise(probs: Array, keep: Array) -> Array:
  kept = jnp.where(keep, probs, 0.0)
  return kept / jnp.sum(kept, axis=-1, keepdims=True)


def transform(logits: Array, temperature: float | Array, top_p: float | Array = 1.0,
              top_k: int = 0) -> Array:
  """S(logits): the distribution sampled at a given temperature, top-k and top-p. [..., V] -> [..., V].

  Temperature 0 gives the one-hot argmax (lowest index on ties), on which top-k and top-p act as the
  identity. top-k keeps the k most likely tokens (ties broken by index; 0 disables it). top-p keeps the
  smallest set of most likely tokens whose mass reaches top_p (at least one token). `temperature` and
  `top_p` may be traced (no recompilation when they change) and broadcast against logits.shape[:-1];
  `top_k` is static. Truncation is skipped at run time when top_p = 1.
  """
  checks.check_temperature(temperature)
  checks.check_top_p(top_p)
  checks.check_top_k(top_k)
  checks.check_logits("logits", logits)
  logits = jnp.asarray(logits, jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)[..., None]
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32)[..., None], logits.shape[:-1] + (1,))
  greedy = temperature <= 0.0
  probs = jax.nn.softmax(logits / jnp.where(greedy, 1.0, temperature), axis=-1)
  if top_k:
    probs = _renormalise(probs, _keep_most_likely(probs, jnp.ones_like(probs), float(top_k)))

  def top_p_truncate(probs):
    return _renormalise(probs, _keep_most_likely(probs, probs, top_p))

  probs = jax.lax.cond(jnp.all(top_p >= 1.0), lambda x: x, top_p_truncate, probs)

  def with_greedy_rows(probs):
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)

  return jax.lax.cond(jnp.any(greedy), with_greedy_rows, lambda x: x, probs)


def sample(key: Array, weights: Array) -> Array:
  """Draws an index from unnormalised non-negative `weights` [..., V] -> [...] (int32).

  Inverse CDF with one uniform per row: on CPU a [..., V] Gumbel or exponential draw costs more than
  the rest of a verification step at V = 32k. Zero weights are never drawn; an all-zero row returns its
  last index (callers guarantee a positive row, e.g. `verify.residual` falls back to π).
  """
  weights = jnp.asarray(weights, jnp.float32)
  cdf = jnp.cumsum(weights, axis=-1)
  total = cdf[..., -1]
  # u·total can round up to total: keep u strictly below it, so the first token whose cdf exceeds u (the
  # one drawn) exists and has positive weight (its cdf jumped past u).
  u = jnp.minimum(jax.random.uniform(key, weights.shape[:-1]) * total, jnp.nextafter(total, 0.0))
  index = jnp.sum(cdf <= u[..., None], axis=-1)
  return jnp.minimum(index, weights.shape[-1] - 1).astype(jnp.int32)


def argmax(x: Array) -> Array:
  """Index of the largest value over the last axis, the lowest on ties: [..., V] -> [...] int32.

  A max and a min over the axis: XLA:CPU's (value, index) argmax reduction costs ~10× that at V = 8192,
  a fixed cost of every greedy decode step.
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
  return jnp.minimum(index, x.shape[-1] - 1)


def entropy(probs: Array) -> Array:
  """Shannon entropy −Σ_v q(v)·log q(v) in nats over the last axis (0·log 0 = 0)."""
  safe = jnp.where(probs > 0, probs, 1.0)
  return -jnp.sum(jnp.where(probs > 0, probs * jnp.log(safe), 0.0), axis=-1)


@struct.dataclass
class Sampling:
  """How tokens are drawn: S(·) with `temperature` and `top_p` (traced: a sweep over them does not
  recompile) and `top_k` (static). Passed to the decode loops as one value."""
  temperature: Array | float = 1.0
  top_p: Array | float = 1.0
  top_k: int = struct.field(pytree_node=False, default=0)

  def checked(self) -> "Sampling":
    """The same settings as float32 scalars, after the range checks (ValueError naming the parameter)."""
    checks.check_temperature(self.temperature)
    checks.check_top_p(self.top_p)
    checks.check_top_k(self.top_k)
    return Sampling(jnp.float32(self.temperature), jnp.float32(self.top_p), int(self.top_k))

  def distributions(self, logits: Array) -> tuple[Array, Array]:
    """(raw, transformed) of logits [..., V]: the softmax at temperature 1 (deferral rules decide on it)
    and S(·) (what is sampled and verified)."""
    return (jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1),
            transform(logits, self.temperature, self.top_p, self.top_k))

