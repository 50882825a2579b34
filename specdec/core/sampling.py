"""The sampling transform S(·) and categorical sampling (layer 1).

S(·) is the transformation of a model's next-token distribution that is actually sampled from:
temperature scaling, then top-k, then top-p truncation (speculative-cascades paper, App. C.1). The
cascade rules defer on the untransformed distributions and interleave the transformed ones. The public
API comes first (`Sampling`, `transform`, `sample`, `argmax`, `masked_sum`, `entropy`); the search for
the top-p cut is in `specdec.core._top_p`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specdec.core import _top_p, checks, rng

Array = jax.Array


@struct.dataclass
class Sampling:
  """How tokens are drawn: S(·) with `temperature` and `top_p` (traced: a sweep over them does not
  recompile), `top_k` (static) and `top_p_method` (static: how the top-p cut is searched, `TOP_P_METHODS`;
  every method gives the same distribution). Passed to the decode loops as one value."""
  temperature: Array | float = 1.0
  top_p: Array | float = 1.0
  top_k: int = struct.field(pytree_node=False, default=0)
  top_p_method: str = struct.field(pytree_node=False, default="auto")

  def checked(self) -> "Sampling":
    """The same settings as float32 scalars, after the range checks (ValueError naming the parameter), with
    "auto" resolved for this backend."""
    checks.check_temperature(self.temperature)
    checks.check_top_p(self.top_p)
    checks.check_top_k(self.top_k)
    return Sampling(jnp.float32(self.temperature), jnp.float32(self.top_p), int(self.top_k),
                    top_p_method(self.top_p_method))

  def transform(self, logits: Array) -> Array:
    """S(logits) [..., V] with these settings (`transform`)."""
    return transform(logits, self.temperature, self.top_p, self.top_k, self.top_p_method)

  def distributions(self, logits: Array) -> tuple[Array, Array]:
    """(raw, transformed) of logits [..., V]: the softmax at temperature 1 (deferral rules decide on it)
    and S(·) (what is sampled and verified)."""
    return jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1), self.transform(logits)


def transform(logits: Array, temperature: float | Array, top_p: float | Array = 1.0,
              top_k: int = 0, method: str = "auto") -> Array:
  """S(logits): the distribution sampled at a given temperature, top-k and top-p. [..., V] -> [..., V].

  Temperature 0 gives the one-hot argmax (lowest index on ties), on which top-k and top-p act as the
  identity. top-k keeps the k most likely tokens (ties broken by index; 0 disables it). top-p keeps the
  smallest set of most likely tokens whose mass reaches top_p (at least one token). `temperature` and
  `top_p` may be traced (no recompilation when they change) and broadcast against logits.shape[:-1];
  `top_k` is static. Truncation is skipped at run time when top_p = 1.

  `method` chooses how the top-p cut is searched (`TOP_P_METHODS`; the result is the same bit for bit).

  The run-time branches return per-row values only and one pass writes the result: a `lax.cond` that
  returns the [..., V] array copies it on XLA:CPU.
  """
  checks.check_temperature(temperature)
  checks.check_top_p(top_p)
  checks.check_top_k(top_k)
  checks.check_logits("logits", logits)
  return _transform(logits, temperature, top_p, top_k, top_p_method(method))


# How the top-p cut is found (one definition, `_keep_most_likely`; the paths agree bit for bit): "bisection"
# (`_top_p.nucleus`, fastest on XLA:CPU, whose sort is slow), "top_k" (`_top_p.nucleus_by_top_k`, no loop:
# TPU/GPU), or "auto", the one for `jax.default_backend()`.
TOP_P_METHODS = ("auto", "bisection", "top_k")

# The top_k search's candidate set (`_top_p.nucleus_by_top_k`): a larger nucleus falls back to bisection.
TOP_K_CANDIDATES = _top_p.TOP_K_CANDIDATES


def top_p_method(method: str = "auto") -> str:
  """The top-p search `method` names ("auto": "bisection" on CPU, "top_k" on TPU/GPU)."""
  if method not in TOP_P_METHODS:
    raise ValueError(f"top_p_method must be one of {TOP_P_METHODS}; got {method!r}")
  if method == "auto":
    return "bisection" if jax.default_backend() == "cpu" else "top_k"
  return method


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
  u = jnp.minimum(rng.uniform(key, weights.shape[:-1]) * total, jnp.nextafter(total, 0.0))
  index = jnp.sum(cdf <= u[..., None], axis=-1)
  return jnp.minimum(index, weights.shape[-1] - 1).astype(jnp.int32)


def argmax(x: Array) -> Array:
  """Index of the largest value over the last axis, the lowest on ties: [..., V] -> [...] int32.

  A max and a min over the axis: XLA:CPU's (value, index) argmax reduction costs far more at V = 8192,
  a fixed cost of every greedy decode step.
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  index = jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)
  return jnp.minimum(index, x.shape[-1] - 1)


@jax.custom_jvp
def masked_sum(values: Array, mask: Array) -> tuple[Array, Array]:
  """(Σ_{mask} values, #mask) over the last axis, [..., V] -> [...] (float32, int32).

  One pass over [..., V] on every backend. On XLA:CPU a float sum with one int output is fused with its
  mask and vectorised (a plain sum's cost), while `jnp.sum(jnp.where(...))` goes to YNNPACK, which
  first writes the masked array, and every operand it shares with another fusion (a constant, p/(1−α)),
  out at [..., V]. The count is passed through an optimization barrier so that it is kept even when
  the caller drops it (without it the reduction reverts to a `jnp.sum`). It does not sum in
  `jnp.sum`'s order: the sums differ from it in the last bits.
  """
  total, count = jax.lax.reduce((jnp.where(mask, values, 0.0), mask.astype(jnp.int32)),
                                (jnp.float32(0.0), jnp.int32(0)), lambda a, b: (a[0] + b[0], a[1] + b[1]),
                                (values.ndim - 1,))
  return jax.lax.optimization_barrier((total, count))


@masked_sum.defjvp
def _masked_sum_jvp(primals, tangents):  # linear in `values`; the mask and the count have no tangent
  values, mask = primals
  total, count = masked_sum(values, mask)
  d_total = jnp.sum(jnp.where(mask, tangents[0], 0.0), axis=-1)
  return (total, count), (d_total, np.zeros(count.shape, jax.dtypes.float0))


def entropy(probs: Array) -> Array:
  """Shannon entropy −Σ_v q(v)·log q(v) in nats over the last axis (0·log 0 = 0), in one pass."""
  support = probs > 0
  return -masked_sum(probs * jnp.log(jnp.where(support, probs, 1.0)), support)[0]


@functools.partial(jax.jit, static_argnames=("top_k", "method"))
def _transform(logits: Array, temperature: Array, top_p: Array, top_k: int, method: str) -> Array:
  """The jitted kernel behind `transform` (no checks): called eagerly, its loops and branches compile once
  per shape, not at every call."""
  logits = jnp.asarray(logits, jnp.float32)
  vocab = logits.shape[-1]
  temperature = jnp.asarray(temperature, jnp.float32)
  temperature = temperature if temperature.ndim == 0 else temperature[..., None]
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32)[..., None], logits.shape[:-1] + (1,))
  greedy = temperature <= 0.0
  # Tied to these logits, the divisor is not shared with another transform in the same program (S(q) and
  # S(p) of a block): XLA:CPU writes a broadcast that two fusions share out at [..., V].
  divisor, logits = jax.lax.optimization_barrier((jnp.where(greedy, 1.0, temperature), logits))
  # jax.nn.softmax spelled out: the branches below take the exponentials and their sum, so that the
  # probabilities are only written once, by the last pass (XLA:CPU writes a branch's array operands).
  scaled = logits / divisor
  unnormalised = jnp.exp(scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True)))
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)
  if top_k:
    unnormalised = _renormalise(unnormalised / total, _keep_most_likely(
        unnormalised / total, jnp.ones_like(unnormalised), float(top_k)))
    total = jnp.ones_like(total)

  row = logits.shape[:-1] + (1,)
  keep_all = (jnp.zeros(row, jnp.int32), jnp.full(row, vocab, jnp.int32), jnp.ones(row, jnp.float32))
  search = _top_p.nucleus if method == "bisection" else _top_p.nucleus_by_top_k
  cut, tie_end, norm = jax.lax.cond(jnp.all(top_p >= 1.0), lambda *_: keep_all,
                                    lambda e, z: search(e, z, top_p), unnormalised, total)
  greedy_token = jax.lax.cond(jnp.any(greedy), lambda x: argmax(x)[..., None],
                              lambda x: jnp.full(row, -1, jnp.int32), logits)
  probs = unnormalised / total
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
  index = jnp.arange(vocab, dtype=jnp.int32)
  # bits > cut, or bits = cut before the tie end, as one comparison: XLA:CPU runs the two-comparison form
  # slower at [1, 8192], where this pass is most of the cost.
  keep = bits > cut - (index < tie_end).astype(jnp.int32)
  return jnp.where(greedy, (index == greedy_token).astype(jnp.float32), jnp.where(keep, probs, 0.0) / norm)


def _keep_most_likely(probs: Array, measure: Array, budget: Array) -> Array:
  """Mask of the most likely tokens taken in order (ties by lower index) while the measure taken
  *before* a token is < budget; [..., V] probs and measure, budget broadcast against [..., 1].

  measure = 1 gives top-k (budget k); measure = probs gives top-p (budget P), which `_top_p.nucleus`
  computes faster and bit for bit. No sort: the cut-off probability τ* (the least likely kept value) is
  found by bisection on the float32 bit pattern, which is monotone for non-negative floats, so 32
  masked reductions find it exactly; ties at τ* are then kept lowest index first. A full argsort costs
  far more on CPU (experiments/sampling_speed/primitives.txt).
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
