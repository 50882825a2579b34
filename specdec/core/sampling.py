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

from specdec import checks, rng
from specdec.core import _top_p

Array = jax.Array


@struct.dataclass
class Sampling:
  """How tokens are drawn: S(·) with `temperature` and `top_p` (traced: a sweep over them does not
  recompile), `top_k` (static) and `top_p_method` (static: how the top-p cut is searched, `TOP_P_METHODS`;
  every method gives the same distribution). Passed to the decode loops as one value.

  `truncation` (static): whether the program holds the top-p search. None: where top_p < 1 somewhere (a
  traced top_p: always) — top_p = 1 compiles a program without it, about half the compile time of a decode
  loop, the same tokens; True: always, so that the points of a sweep at top-P = 1 and below share one
  program; False: never (top_p must be 1)."""
  temperature: Array | float = 1.0
  top_p: Array | float = 1.0
  top_k: int = struct.field(pytree_node=False, default=0)
  top_p_method: str = struct.field(pytree_node=False, default="auto")
  truncation: bool | None = struct.field(pytree_node=False, default=None)

  def checked(self, platform: str | None = None) -> "Sampling":
    """The same settings as float32 scalars, after the range checks (ValueError naming the parameter), with
    "auto" resolved for `platform` (the backend the program is built for: "cpu", "gpu", "tpu"; None: this
    process's default backend) and `truncation` into the method: "none" where the program holds no search."""
    checks.check_temperature(self.temperature)
    checks.check_top_p(self.top_p)
    checks.check_top_k(self.top_k)
    if self.truncation not in (None, True, False):
      raise ValueError(f"truncation must be None, True or False; got {self.truncation!r}")
    method = top_p_method(self.top_p_method, platform)
    if self.truncation is False or (method != "none" and self.truncation is None and _keeps_all(self.top_p)):
      method = "none"
    elif self.truncation and method == "none":
      raise ValueError("top_p_method 'none' (no top-p search in the program) contradicts truncation=True")
    _check_no_search(method, self.top_p)
    return Sampling(jnp.float32(self.temperature), jnp.float32(self.top_p), int(self.top_k), method, method != "none")

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

  `method` chooses how the top-p cut is searched (`TOP_P_METHODS`); each gives the exact definition's cut
  on the probabilities its program computes (`_top_p`: integer masses, exact in any summation order).
  """
  checks.check_temperature(temperature)
  checks.check_top_p(top_p)
  checks.check_top_k(top_k)
  checks.check_logits("logits", logits)
  method = top_p_method(method)
  _check_no_search(method, top_p)
  return _transform(logits, temperature, top_p, top_k, method)


# How the top-p cut is found (one definition, `_top_p`'s exact integer masses): "bisection" (`_top_p.nucleus`,
# fastest on XLA:CPU, whose sort is slow), "top_k" (`_top_p.nucleus_by_top_k`, no loop: TPU/GPU), "auto",
# the one for the platform the program is built for (`top_p_method`), or "none": no search in the program,
# for top_p = 1 only (`Sampling.truncation`).
TOP_P_METHODS = ("auto", "bisection", "top_k", "none")

# The top_k search's candidate set (`_top_p.nucleus_by_top_k`): a larger nucleus takes the exact bisection.
TOP_K_CANDIDATES = _top_p.TOP_K_CANDIDATES


def top_p_method(method: str = "auto", platform: str | None = None) -> str:
  """The top-p search `method` names; "auto": "bisection" for a CPU program, "top_k" for TPU/GPU.

  `platform` is the backend the program is compiled for (a TPU program lowered on a CPU host is a TPU
  program: `decoding.lower` passes the models' platform); None: this process's default backend."""
  if method not in TOP_P_METHODS:
    raise ValueError(f"top_p_method must be one of {TOP_P_METHODS}; got {method!r}")
  if method == "auto":
    return "bisection" if (platform or jax.default_backend()) == "cpu" else "top_k"
  return method


def _keeps_all(top_p: float | Array) -> bool:
  """Whether top_p is known, outside any trace, to be 1 everywhere (no truncation)."""
  return checks.is_concrete(top_p) and bool(np.all(np.asarray(top_p) >= 1.0))


def _check_no_search(method: str, top_p: float | Array) -> None:
  if method == "none" and not (_keeps_all(top_p) or not checks.is_concrete(top_p)):
    raise ValueError(f"top_p must be 1 where the program holds no top-p search (top_p_method 'none' or "
                     f"truncation=False); got {top_p!r}")


def sample(key: Array, weights: Array) -> Array:
  """Draws an index from unnormalised non-negative `weights` [..., V] -> [...] (int32).

  Inverse CDF with one uniform per row: on CPU a [..., V] Gumbel or exponential draw costs more than
  the rest of a verification step at V = 32k. The drawn index is the first whose running sum exceeds u
  among the positive weights only: a zero weight is never drawn, even where a backend's blocked or tree
  scan rounds the running sum so that it moves at a zero. An all-zero row returns its last index (callers
  guarantee a positive row, e.g. `verify.residual` falls back to π).
  """
  weights = jnp.asarray(weights, jnp.float32)
  cdf = jnp.cumsum(weights, axis=-1)
  total = cdf[..., -1]
  # u·total can round up to total: keep u strictly below it, so that a positive weight whose running sum
  # exceeds u exists (the last positive one's running sum is the scan's total, up to its rounding).
  u = jnp.minimum(rng.uniform(key, weights.shape[:-1]) * total, jnp.nextafter(total, 0.0))
  vocab = weights.shape[-1]
  index = jnp.arange(vocab, dtype=jnp.int32)
  positive = weights > 0.0
  # One pass: the first positive weight whose running sum exceeds u, and the last positive weight (drawn
  # where rounding leaves none above u).
  chosen, last_positive = jax.lax.reduce(
      (jnp.where((cdf > u[..., None]) & positive, index, vocab), jnp.where(positive, index, -1)),
      (jnp.int32(vocab), jnp.int32(-1)), lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
      (weights.ndim - 1,))
  return jnp.where(chosen < vocab, chosen, jnp.where(last_positive >= 0, last_positive, vocab - 1))


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
  per shape, not at every call.

  Tokens are ranked by the bits of their exponentials (`_top_p.order_keys`, ties by lower index) for top-k
  and top-p alike. Every pass, the last included, derives keys and p from the same two arrays (the
  exponentials, written once as the branch's operand, and their sum), elementwise; the top-p cut is exact
  (`_top_p`). The run-time branches return per-row values only and one pass writes the result: a
  `lax.cond` that returns the [..., V] array copies it on XLA:CPU."""
  logits = jnp.asarray(logits, jnp.float32)
  vocab = logits.shape[-1]
  _top_p.check_vocab(vocab)
  temperature = jnp.asarray(temperature, jnp.float32)
  temperature = temperature if temperature.ndim == 0 else temperature[..., None]
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32)[..., None], logits.shape[:-1] + (1,))
  greedy = temperature <= 0.0
  # Tied to these logits, the divisor is not shared with another transform in the same program (S(q) and
  # S(p) of a block): XLA:CPU writes a broadcast that two fusions share out at [..., V].
  divisor, logits = jax.lax.optimization_barrier((jnp.where(greedy, 1.0, temperature), logits))
  # max(l/T) = max(l)/T (division by T > 0 is monotone): no [..., V] array of l/T is shared with a reduction.
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)) / divisor
  unnormalised = jnp.exp(logits / divisor - top)
  if top_k and top_k < vocab:
    unnormalised = jnp.where(keep_top_k(_top_p.order_keys(unnormalised), top_k), unnormalised, 0.0)
  total = jnp.sum(unnormalised, axis=-1, keepdims=True)

  row = logits.shape[:-1] + (1,)
  keep_all = (jnp.full(row, _top_p.KEEP_ALL, jnp.int32), jnp.full(row, vocab, jnp.int32), jnp.ones(row))

  if method == "none":   # top_p = 1: nothing to search, and no search compiled
    cut, last, norm = keep_all
  else:
    search = _top_p.nucleus if method == "bisection" else _top_p.nucleus_by_top_k
    cut, last, norm = _top_p.merge(top_p >= 1.0, keep_all, jax.lax.cond(
        jnp.all(top_p >= 1.0), lambda *_: keep_all, lambda *s: search(*s, top_p), unnormalised, total))
  greedy_token = jax.lax.cond(jnp.any(greedy), lambda x: argmax(x)[..., None],
                              lambda x: jnp.full(row, -1, jnp.int32), logits)
  index = jnp.arange(vocab, dtype=jnp.int32)
  keys, probs = _top_p.keys_and_probs(unnormalised, total)
  truncated = jnp.where(_top_p.keeps(keys, cut, last), probs, 0.0) / norm
  return jnp.where(greedy, (index == greedy_token).astype(jnp.float32), truncated)


def keep_top_k(keys: Array, k: int) -> Array:
  """Mask [..., V] of the k most likely tokens by order key, ties by lower index: `lax.top_k`'s own
  order (exact on every backend: integer keys, no sums)."""
  values, indices = jax.lax.top_k(keys, k)
  return _top_p.keeps(keys, values[..., k - 1:], indices[..., k - 1:])
