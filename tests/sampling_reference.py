"""Independent references for the sampling tests: S(·) by its definition in float64, and the exact top-p
nucleus in integer arithmetic, with the check that a top-p search's cut is that nucleus (tests/core and the
fast-math check, which runs them in a process of its own)."""

import jax
import jax.numpy as jnp
import numpy as np

from specdec.core import _top_p


def reference_transform(logits, temperature, top_p, top_k):
  """Independent NumPy S(·) in float64: one row at a time, by the definitions."""
  logits = np.asarray(logits, np.float64)
  out = np.zeros_like(logits)
  for i, row in enumerate(logits.reshape(-1, logits.shape[-1])):
    if temperature == 0:
      out.reshape(-1, row.size)[i, np.argmax(row)] = 1.0
      continue
    order = sorted(range(row.size), key=lambda v: (-row[v], v))
    keep = set(order[:top_k]) if top_k else set(order)
    probs = np.array([np.exp((row[v] - row.max()) / temperature) if v in keep else 0.0 for v in range(row.size)])
    probs /= probs.sum()
    kept, mass = [], 0.0
    for v in order:  # smallest most-likely set whose mass reaches top_p
      if v in keep and mass < top_p:
        kept.append(v)
        mass += probs[v]
    nucleus = np.zeros_like(probs)
    nucleus[kept] = probs[kept]
    out.reshape(-1, row.size)[i] = nucleus / nucleus.sum()
  return out


def exact_nucleus(probs, top_p):
  """The definition in exact integer arithmetic (NumPy, independent of `_top_p`): tokens ranked by the bits
  of p, highest first, ties by lower index; masses ⌊p·2^43⌋ summed as integers; keep the shortest prefix
  whose mass reaches ⌈P·2^43⌉, or the whole row when none does. probs [N, V] float32 -> mask [N, V]."""
  probs = np.asarray(probs, np.float32)
  top_p = np.broadcast_to(np.asarray(top_p, np.float32), probs.shape[:1])
  keys = np.maximum(probs.view(np.int32), 0)
  mask = np.zeros(probs.shape, bool)
  for i, (row, key) in enumerate(zip(probs, keys)):
    order = np.lexsort((np.arange(row.size), -key.astype(np.int64)))
    mass = np.cumsum(np.floor(row[order].astype(np.float64) * 2.0**43).astype(np.int64))
    target = int(np.ceil(np.float64(top_p[i]) * 2.0**43))
    reached = np.flatnonzero(mass >= target)
    mask[i, order[:reached[0] + 1] if reached.size else order] = True
  return mask


SEARCHES = {"bisection": jax.jit(_top_p.nucleus), "top_k": jax.jit(_top_p.nucleus_by_top_k),
            "definition": jax.jit(_top_p.definition)}


def assert_exact(probs, top_p, search):
  """The search's mask on probs [N, V] (passed as exponentials over a total of 1, so that p is read as
  given) is the exact definition's, element for element; its normaliser is the kept mass."""
  probs = jnp.asarray(probs, jnp.float32)
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), probs.shape[:1])[:, None]
  cut, last, norm = SEARCHES[search](probs, jnp.ones_like(top_p), top_p)
  got = np.asarray(_top_p.keeps(_top_p.order_keys(probs), cut, last))
  want = exact_nucleus(probs, top_p[:, 0])
  bad = np.flatnonzero((got != want).any(-1))
  assert bad.size == 0, f"rows {bad[:5]} differ from the definition (top_p {np.asarray(top_p)[bad[:5], 0]})"
  np.testing.assert_allclose(np.asarray(norm)[:, 0], np.where(want, probs, 0).sum(-1, dtype=np.float64),
                             rtol=1e-6)


def softmax32(logits, temperature=1.0):
  return np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1))
