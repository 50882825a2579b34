"""The top-p cut of `sampling.transform` (layer 1, private): where the nucleus of probs = e / Σe [..., V]
ends, found on the float32 bit pattern (monotone for non-negative floats) with no sort.

The definition is `sampling._keep_most_likely(probs, probs, P)`: 32 masked bisection passes. `nucleus`
(XLA:CPU) and `nucleus_by_top_k` (accelerators: no loop) find the same cut c, tie end and normaliser bit
for bit in fewer passes: a search proposes c with sums in its own order (`probe`, or `lax.top_k`), then the
definition's own sums (`mass_from`) certify it, Σ_{bits > c} p < P ≤ Σ_{bits ≥ c} p, and the rows they
do not certify fall back to the definition's bisection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# The static candidate set of the top-k search: nuclei of 1–2k tokens are common at top-p 0.9 (the
# shipped verifier, V = 8192: median 393, max 2017 over 1664 positions).
TOP_K_CANDIDATES = 2048

_NONE_ABOVE = jnp.iinfo(jnp.int32).max


def nucleus(unnormalised: Array, total: Array, top_p: Array) -> tuple[Array, Array, Array]:
  """Top-p truncation of probs = unnormalised / total [..., V] as (cut, tie_end, norm), each [..., 1]:
  keep v iff bits(p_v) > cut, or bits(p_v) = cut and v < tie_end; S(p) = kept p / norm. The mask and
  normaliser of the definition `sampling._keep_most_likely(probs, probs, top_p)` bit for bit, for a
  fraction of its 32 masked passes:

  1. Search: bisection on the bit pattern in which each probe also returns the nearest values present
     on either side of it (`probe`), so that the bracket snaps to values that occur and closes once no
     value lies inside it: 12–20 probes at [72, 32k] and top-p 0.5–0.99, each one vectorised pass. Its
     sums are not in the definition's order, so the cut c it finds is a candidate.
  2. Certificate: the definition's own sums at c and c + 1, Σ_{bits ≥ c} p ≥ P > Σ_{bits > c} p (or
     c = 0), prove that its bisection ends at c. Where rounding puts P between the two orders' sums
     (4 rows in 3456 on random logits, V = 32k, top-p 0.5–0.95) c is one value off: it moves one value
     at a time until certified, and after 4 moves the batch falls back to the definition's bisection.
  3. Ties at the cut are kept lowest index first while rank·τ* < room (the definition's test); only rows
     whose tie group straddles the budget need the index at which to stop (`_tie_end`).

  A top-k search (`lax.top_k`, then a cumulative sum over it) is slower here: on XLA:CPU top_k grows dear
  with k (at [72, 32k]: experiments/sampling_speed/primitives.txt), and nuclei of 1–2k tokens are common at
  top-p 0.9 (the shipped 15m verifier, V = 8192: median 393, max 2017 over 1664 positions;
  experiments/sampling_speed). On TPU `lax.approx_max_k` is the fast top-k, but approximate: it could
  only propose the candidate, for step 2 to certify.
  """
  vocab = unnormalised.shape[-1]

  def searching(state):
    lo, hi, _, _ = state
    return jnp.any(hi > lo + 1)

  def narrow(state):  # mass(lo) ≥ P > mass(hi); lo is 0 or a value, hi − 1 a value; n_x = #{bits ≥ x}
    probs, (lo, hi, n_lo, n_hi) = _in_loop(unnormalised, total, state)
    mass, least_above, greatest_below, count = probe(probs, lo + (hi - lo) // 2)
    up = (hi > lo + 1) & (mass >= top_p)
    down = (hi > lo + 1) & (mass < top_p)
    return (jnp.where(up, least_above, lo), jnp.where(down, greatest_below + 1, hi),
            jnp.where(up, count, n_lo), jnp.where(down, count, n_hi))

  # (1 − P)/V < τ* (the tokens at or below τ* hold more than 1 − P): a first probe that usually cuts
  # the long tail of tiny probabilities out of the bracket.
  probs = unnormalised / total
  mass, least_above, greatest_below, count = probe(
      probs, jax.lax.bitcast_convert_type((1.0 - top_p) / vocab, jnp.int32))
  enough = mass >= top_p
  # max(e)/Σe = max(e/Σe) (division is monotone), with no [..., V] array of probabilities to write.
  top = jax.lax.bitcast_convert_type(jnp.max(unnormalised, axis=-1, keepdims=True) / total, jnp.int32) + 1
  cut, _, n_from, n_above = jax.lax.while_loop(searching, narrow, (
      jnp.where(enough, least_above, 0), jnp.where(enough, top, greatest_below + 1),
      jnp.where(enough, count, vocab), jnp.where(enough, 0, count)))

  def uncertified(state):
    return _uncertified(*state[:3], top_p)

  def retrying(state):
    return jnp.any(uncertified(state)) & (state[-1] < 4)

  def move(state):  # one value down where Σ_{bits ≥ c} p < P, one value up where Σ_{bits > c} p ≥ P
    probs, (cut, mass_from_cut, mass_above_cut, moves) = _in_loop(unnormalised, total, state)
    down = (mass_from_cut < top_p) & (cut > 0)
    up = mass_above_cut >= top_p
    _, least_above, greatest_below, _ = probe(probs, jnp.where(down, cut, cut + 1))
    cut = jnp.where(down, greatest_below, jnp.where(up, least_above, cut))
    return (cut,) + _certificate(unnormalised / total, cut) + (moves + 1,)

  state = (cut,) + _certificate(unnormalised / total, cut) + (0,)
  moved = jax.lax.while_loop(retrying, move, state)

  # The branches recompute the probabilities from the exponentials: a branch's operands are written
  # out, and a [..., V] array of probabilities would be one more.
  def definition(unnormalised, total):
    cut = _cut_by_bisection(unnormalised, total, top_p)
    return (cut,) + _certificate(unnormalised / total, cut) + (0,)

  cut, mass_from_cut, mass_above_cut, _ = jax.lax.cond(
      jnp.any(uncertified(moved)), definition, lambda *_: moved, unnormalised, total)
  # The search's counts give the size of the tie group at its own cut; after a move, count it again.
  n_tied = jax.lax.cond(jnp.all(cut == state[0]), lambda *_: n_from - n_above,
                        lambda e, z: _count_at(e / z, cut), unnormalised, total)

  # Ties at τ* are kept while rank·τ* < room, ranks 0, 1, ... by index; rank·τ* increases, so the group
  # is kept whole iff its last member is, and the kept mass is then the certificate's Σ_{bits ≥ cut} p.
  room = top_p - mass_above_cut
  straddles = (n_tied - 1) * jax.lax.bitcast_convert_type(cut, jnp.float32) >= room

  def kept_mass(unnormalised, total):
    end = _tie_end(unnormalised, total, cut, room, straddles)
    probs = unnormalised / total
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    keep = (bits > cut) | ((bits == cut) & (jnp.arange(vocab, dtype=jnp.int32) < end))
    return end, jnp.sum(jnp.where(keep, probs, 0.0), axis=-1, keepdims=True)

  end, norm = jax.lax.cond(jnp.any(straddles), kept_mass,
                           lambda *_: (jnp.full_like(cut, vocab), mass_from_cut), unnormalised, total)
  return cut, end, norm


def nucleus_by_top_k(unnormalised: Array, total: Array, top_p: Array) -> tuple[Array, Array, Array]:
  """`nucleus` for accelerators, where `lax.top_k` is fast and a data-dependent loop is dear (on
  XLA:GPU each `while` condition is a host round-trip): no loop in the program.

  1. Candidate: the k most likely values (k = min(V, TOP_K_CANDIDATES)) and their running sum; the first
     value at which it reaches P is the cut c. The running sum is not the definition's order of summation.
  2. Certificate: the definition's own sums at c (`_certificate`), as in `nucleus`. Rows it does not
     certify (rounding at the boundary, or a nucleus larger than k) fall back, for the whole batch and
     only then, to the definition's bisection unrolled into 32 passes.
  3. Ties at the cut, lowest index first while rank·τ* < room (the definition's test), by a running count
     over [..., V]: one pass, cheap where a data-dependent loop is not.
  Returns (cut, tie_end, norm) [..., 1], the mask and normaliser of `nucleus` bit for bit.
  """
  vocab = unnormalised.shape[-1]
  probs = unnormalised / total
  values, _ = jax.lax.top_k(probs, min(vocab, TOP_K_CANDIDATES))
  reached = jnp.cumsum(values, axis=-1) >= top_p
  first = jnp.minimum(jnp.argmax(reached, axis=-1), values.shape[-1] - 1)[..., None]
  cut = jax.lax.bitcast_convert_type(jnp.take_along_axis(values, first, axis=-1), jnp.int32)
  mass_from_cut, mass_above_cut = _certificate(probs, cut)

  def definition(unnormalised, total):
    cut = _cut_by_bisection(unnormalised, total, top_p, unroll=True)
    return (cut,) + _certificate(unnormalised / total, cut)

  cut, mass_from_cut, mass_above_cut = jax.lax.cond(
      jnp.any(_uncertified(cut, mass_from_cut, mass_above_cut, top_p)), definition,
      lambda *_: (cut, mass_from_cut, mass_above_cut), unnormalised, total)
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
  tied = bits == cut
  room = top_p - mass_above_cut
  dropped = tied & ((jnp.cumsum(tied, axis=-1) - 1) * jax.lax.bitcast_convert_type(cut, jnp.float32) >= room)
  index = jnp.arange(vocab, dtype=jnp.int32)
  end = jnp.min(jnp.where(dropped, index, vocab), axis=-1, keepdims=True)
  # A tie group cut short keeps a mass of its own; otherwise the kept mass is the certificate's sum.
  kept = bits > cut - (index < end).astype(jnp.int32)
  norm = jnp.where(end < vocab, jnp.sum(jnp.where(kept, probs, 0.0), axis=-1, keepdims=True), mass_from_cut)
  return cut, end, norm


def _tie_end(unnormalised: Array, total: Array, cut: Array, room: Array, straddles: Array) -> Array:
  """Index of the first dropped tie [..., 1] in the rows whose tie group at `cut` straddles the budget, V
  elsewhere: the definition keeps the tied tokens of rank r (by index) while r·τ* < room. One row at a
  time, over the straddling rows only: a cumulative sum over all of [..., V] is dear on XLA:CPU."""
  vocab = unnormalised.shape[-1]
  rows = unnormalised.reshape(-1, vocab)
  total, cut, room = (x.reshape(-1) for x in (total, cut, room))

  def next_row(state):
    remaining, _ = state
    return jnp.any(remaining)

  def one_row(state):
    remaining, end = state
    r = jnp.argmax(remaining)
    probs = jax.lax.dynamic_index_in_dim(rows, r, keepdims=False) / total[r]
    tied = jax.lax.bitcast_convert_type(probs, jnp.int32) == cut[r]
    dropped = tied & ((jnp.cumsum(tied) - 1) * probs >= room[r])
    first = jnp.min(jnp.where(dropped, jnp.arange(vocab, dtype=jnp.int32), vocab))
    return remaining.at[r].set(False), end.at[r].set(first)

  remaining = straddles.reshape(-1)
  _, end = jax.lax.while_loop(next_row, one_row, (remaining, jnp.full(remaining.shape, vocab, jnp.int32)))
  return end.reshape(straddles.shape)


def _at_least(probs: Array, threshold: Array) -> Array:
  """1.0 where bits(p) ≥ t, else 0.0 [..., V], for bit patterns t [..., 1], with arithmetic only:
  min(max(p·s − b·s, 0)·u, 1), b the float just below t, s = 2^64 (p·s is exact and normal for every
  p > 0, so t − b ≥ 2^-85 after scaling) and u = 1/((t − b)·s), a power of two.

  XLA:CPU fuses this into a sum over it (YNNPACK) with no [..., V] array written: a `jnp.where` mask is
  written out first (and with it the program's scratch memory grows past glibc's 32 MB mmap threshold
  at [8, 9, 32k], above which every call page-faults all of it afresh). The constants are per row,
  derived from t: a constant that two fusions share is written out at [..., V] too.
  """
  tau = jax.lax.bitcast_convert_type(threshold, jnp.float32)
  below = jnp.where(threshold > 0, jax.lax.bitcast_convert_type(threshold - 1, jnp.float32), -1.0)
  zero = tau * 0.0
  scale = zero + 2.0 ** 64
  return jnp.minimum(jnp.maximum(probs * scale - below * scale, zero) / ((tau - below) * scale), zero + 1.0)


def mass_from(probs: Array, threshold: Array) -> Array:
  """Σ_{bits(p) ≥ t} p [..., 1] for bit patterns t [..., 1], bit for bit the definition's
  `jnp.sum(jnp.where(bits >= t, probs, 0))`: the same summands (p·1 = p, p·0 = 0), the same reduction."""
  return jnp.sum(probs * _at_least(probs, threshold), axis=-1, keepdims=True)


def _certificate(probs: Array, cut: Array) -> tuple[Array, Array]:
  """(Σ_{bits ≥ c} p, Σ_{bits > c} p) [..., 1], summed as the definition sums them."""
  return mass_from(probs, cut), mass_from(probs, cut + 1)


def _count_at(probs: Array, value: Array) -> Array:
  """#{v: bits(p_v) = c} [..., 1] int32 for bit patterns c [..., 1] (a float sum, exact below 2^24: XLA:CPU
  runs an int32 sum over [..., V] as reduce-windows with [..., V] temporaries)."""
  return jnp.sum(_at_least(probs, value) - _at_least(probs, value + 1), axis=-1, keepdims=True
                 ).astype(jnp.int32)


def probe(probs: Array, threshold: Array) -> tuple[Array, Array, Array, Array]:
  """One pass over [..., V] at bit pattern t [..., 1]: Σ_{bits ≥ t} p, the least bits ≥ t, the greatest
  bits < t and #{bits ≥ t}, each [..., 1].

  One variadic reduction with a single float output: XLA:CPU fuses the masks into it and vectorises it
  (a plain sum's cost); with two float outputs it is slower, and `jnp.sum`s of `jnp.where`s write
  each mask out first. It does not sum in `mass_from`'s order.
  """
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
  above = bits >= threshold
  outputs = jax.lax.reduce(
      (jnp.where(above, probs, 0.0), jnp.where(above, bits, _NONE_ABOVE), jnp.where(above, -1, bits),
       above.astype(jnp.int32)),
      (jnp.float32(0.0), jnp.int32(_NONE_ABOVE), jnp.int32(-1), jnp.int32(0)),
      lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1]), jnp.maximum(a[2], b[2]), a[3] + b[3]),
      (bits.ndim - 1,))
  return tuple(x[..., None] for x in outputs)


def _in_loop(unnormalised: Array, total: Array, state):
  """The probabilities inside a loop body, tied to the loop state by an optimization barrier: without it
  XLA hoists their bit pattern and broadcast constants out of the loop and writes each at [..., V]."""
  (unnormalised, total), state = jax.lax.optimization_barrier(((unnormalised, total), state))
  return unnormalised / total, state


def _cut_by_bisection(unnormalised: Array, total: Array, top_p: Array, unroll: bool = False) -> Array:
  """τ* of `sampling._keep_most_likely(probs, probs, top_p)` as bits [..., 1]: 32 bisection steps on
  `mass_from` (`unroll`: as 32 passes in line, no loop in the program)."""
  def bisect(_, bracket):  # invariant: mass(lo) >= top_p > mass(hi)
    probs, (lo, hi) = _in_loop(unnormalised, total, bracket)
    mid = lo + (hi - lo) // 2
    enough = mass_from(probs, mid) >= top_p
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  hi = jax.lax.bitcast_convert_type(jnp.max(unnormalised, axis=-1, keepdims=True) / total, jnp.int32) + 1
  return jax.lax.fori_loop(0, 32, bisect, (jnp.zeros_like(hi), hi), unroll=unroll)[0]


def _uncertified(cut: Array, mass_from_cut: Array, mass_above_cut: Array, top_p: Array) -> Array:
  """Rows [..., 1] where the definition's sums do not prove that its bisection ends at `cut`:
  certified iff Σ_{bits > c} p < P ≤ Σ_{bits ≥ c} p, or c = 0 (even the whole row falls short of P)."""
  return (mass_above_cut >= top_p) | ((mass_from_cut < top_p) & (cut > 0))
