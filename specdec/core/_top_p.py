"""The top-p cut of `sampling.transform` (layer 1, private), exact on every backend.

The definition. Tokens are ranked by probability, highest first, ties by lower index: by `order_keys`, the
bits of their exponentials e (monotone for non-negative floats; p = e / Σe), the order `lax.top_k` lists them
in. A token's mass is its float32 probability truncated to a multiple of 2^-43 (`weights`: two int32 limbs).
The nucleus is the shortest prefix of that ranking whose mass reaches P, or the whole row if none does.
Integer sums are exact and associative, so the mass of a set, every comparison with P and therefore the cut
are the same under any reduction order, fusion, flush of subnormals or lowering of division: nothing rests
on two computations rounding alike. (Truncation moves a set's mass by less than its size × 2^-43 ≤ 3e-8 at
V = 256k, below float32's resolution of 1.) Every pass derives keys and p elementwise from the same two
arrays, the exponentials and their sum (`keys_and_probs`).

A cut is (cut, last) [..., 1]: keep v iff key_v > cut, or key_v = cut and v ≤ last (`keeps`). Two searches
find it:
- `nucleus` (XLA:CPU, whose sort is slow): a snapping bisection with float sums proposes the cut, the exact
  masses (`certificate`) prove it or move it, and the definition's exact bisection (`definition`) takes the
  batch where moving does not settle it; then the tie group at the cut, exactly.
- `nucleus_by_top_k` (accelerators: no loop): `lax.top_k` lists the K most likely tokens in the
  definition's order, and an exact running mass over them gives the last kept token directly, ties
  included. Nuclei larger than K take `definition` (32 unrolled passes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# The static candidate set of the top-k search: nuclei of 1–2k tokens are common at top-p 0.9 (the
# shipped verifier, V = 8192: median 393, max 2017 over 1664 positions).
TOP_K_CANDIDATES = 2048

# Fixed point: p·2^43 as hi·2^LOW_BITS + lo, hi = ⌊p·2^30⌋ ≤ 2^30 and lo < 2^LOW_BITS. A row's Σ hi ≤ 2^30·Σp
# and its Σ lo < V·2^LOW_BITS both stay below 2^31 for V ≤ 2^18.
HIGH_BITS = 30
LOW_BITS = 13
MAX_VOCAB = 1 << (31 - LOW_BITS)

_INT_MAX = jnp.iinfo(jnp.int32).max
# Below every key (keys are the bits of non-negative floats): "keep the whole row" is (KEEP_ALL, V).
KEEP_ALL = -1


def check_vocab(vocab: int) -> None:
  if vocab > MAX_VOCAB:
    raise ValueError(f"top-p supports vocabularies of at most {MAX_VOCAB} tokens; got {vocab}")


def order_keys(unnormalised: Array) -> Array:
  """int32 order keys [..., V] of non-negative floats: their bit patterns (−0 read as +0)."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(unnormalised, jnp.float32), jnp.int32)
  return jnp.maximum(bits, 0)


def keys_and_probs(unnormalised: Array, total: Array) -> tuple[Array, Array]:
  """The order keys and probs = unnormalised / total [..., V]. Every pass derives both from the same two
  arrays, elementwise, rather than reading them written out: no [..., V] array to write on XLA:CPU, and
  the same operations on the same operands give every pass the same bits."""
  return order_keys(unnormalised), unnormalised / total


def weights(probs: Array) -> tuple[Array, Array, Array]:
  """p [..., V] in fixed point: (⌊p·2^30⌋, ⌊frac(p·2^30)·2^13⌋) int32, and the float remainder below 2^-43.
  Every step is exact in float32 (scaling by powers of two, floor, and the subtraction of a float's integer
  part), so any compiler gives the same limbs; a subnormal p, flushed or not, gives (0, 0)."""
  scaled = jnp.asarray(probs, jnp.float32) * float(1 << HIGH_BITS)
  high = jnp.floor(scaled)
  fraction = (scaled - high) * float(1 << LOW_BITS)
  low = jnp.floor(fraction)
  remainder = (fraction - low) * 2.0 ** -(HIGH_BITS + LOW_BITS)
  return high.astype(jnp.int32), low.astype(jnp.int32), remainder


def as_float(mass: tuple[Array, Array], remainder: Array) -> Array:
  """A mass (carried limbs) plus the float sum of its members' remainders, as float32: the kept mass to
  float32's precision whatever the order of summation (a float32 sum of the p themselves, in one running
  total, drops every p below half an ulp of it: 4e-5 of a 32k row at XLA:CPU's opt level 0)."""
  return (mass[0].astype(jnp.float32) * 2.0 ** -HIGH_BITS
          + (mass[1].astype(jnp.float32) * 2.0 ** -(HIGH_BITS + LOW_BITS) + remainder))


def budget(top_p: Array) -> tuple[Array, Array]:
  """P in fixed point, rounded up: the least multiple of 2^-43 that is ≥ P (so mass ≥ P ⟺ limbs ≥ these)."""
  scaled = jnp.asarray(top_p, jnp.float32) * float(1 << HIGH_BITS)
  high = jnp.floor(scaled)
  low = jnp.ceil((scaled - high) * float(1 << LOW_BITS)).astype(jnp.int32)
  return _carried(high.astype(jnp.int32), low)


def _carried(high: Array, low: Array) -> tuple[Array, Array]:
  return high + (low >> LOW_BITS), low & ((1 << LOW_BITS) - 1)


def reaches(mass: tuple[Array, Array], target: tuple[Array, Array]) -> Array:
  """mass ≥ target, both carried limbs."""
  return (mass[0] > target[0]) | ((mass[0] == target[0]) & (mass[1] >= target[1]))


def keeps(keys: Array, cut: Array, last: Array) -> Array:
  """The mask of a cut [..., V]: key > cut, or key = cut at an index ≤ last (one comparison)."""
  index = jnp.arange(keys.shape[-1], dtype=jnp.int32)
  return keys > cut - (index <= last).astype(jnp.int32)


def merge(where: Array, chosen, other):
  """Per row [..., 1]: `chosen` where `where`, else `other` (tuples of [..., 1] arrays)."""
  return tuple(jnp.where(where, a, b) for a, b in zip(chosen, other))


def probe(keys: Array, probs: Array, threshold: Array) -> tuple[Array, Array, Array, Array]:
  """One pass over [..., V] at key t [..., 1], for the search only: the float sum Σ_{key ≥ t} p (in no
  particular order), the least key ≥ t, the greatest key < t and #{key ≥ t}, each [..., 1].

  One variadic reduction with a single float output: XLA:CPU fuses the masks into it and vectorises it
  (a plain sum's cost); exact limbs in every probe would double it (the `certificate` has them).
  """
  above = keys >= threshold
  outputs = jax.lax.reduce(
      (jnp.where(above, probs, 0.0), jnp.where(above, keys, _INT_MAX), jnp.where(above, -1, keys),
       above.astype(jnp.int32)),
      (jnp.float32(0.0), jnp.int32(_INT_MAX), jnp.int32(-1), jnp.int32(0)),
      lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1]), jnp.maximum(a[2], b[2]), a[3] + b[3]),
      (keys.ndim - 1,))
  return tuple(x[..., None] for x in outputs)


def certificate(keys: Array, probs: Array, cut: Array):
  """One pass at a candidate cut c [..., 1]: the exact masses Σ_{key ≥ c} p and Σ_{key > c} p (carried
  limbs), Σ_{key ≥ c} p as float32 (the normaliser when the tie group is kept whole; `as_float`) and
  #{key = c}."""
  high, low, remainder = weights(probs)
  from_cut, above = keys >= cut, keys > cut
  outputs = jax.lax.reduce(
      (jnp.where(from_cut, high, 0), jnp.where(from_cut, low, 0), jnp.where(above, high, 0),
       jnp.where(above, low, 0), jnp.where(from_cut, remainder, 0.0), (from_cut & ~above).astype(jnp.int32)),
      (jnp.int32(0),) * 4 + (jnp.float32(0.0), jnp.int32(0)),
      lambda a, b: tuple(x + y for x, y in zip(a, b)), (keys.ndim - 1,))
  high_from, low_from, high_above, low_above, remainder_from, n_tied = (x[..., None] for x in outputs)
  mass_from_cut = _carried(high_from, low_from)
  return mass_from_cut, _carried(high_above, low_above), as_float(mass_from_cut, remainder_from), n_tied


def _certified(cut: Array, mass_from_cut, mass_above_cut, target) -> Array:
  """Rows [..., 1] where the exact masses prove c the definition's cut: Σ_{key > c} < P ≤ Σ_{key ≥ c}, or
  c = KEEP_ALL and the whole row falls short of P."""
  return ~reaches(mass_above_cut, target) & (reaches(mass_from_cut, target) | (cut == KEEP_ALL))


def _pinned(scores, state):
  """The scores inside a loop body, tied to the loop state by an optimization barrier: without it XLA
  hoists what is derived from them out of the loop and writes it at [..., V]."""
  scores, state = jax.lax.optimization_barrier((scores, state))
  return keys_and_probs(*scores), state


def _midpoint(lo: Array, hi: Array) -> Array:
  return (lo >> 1) + (hi >> 1) + (lo & hi & 1)                  # ⌊(lo + hi)/2⌋ without overflow


def nucleus(unnormalised: Array, total: Array, top_p: Array) -> tuple[Array, Array, Array]:
  """The definition's nucleus of probs = unnormalised / total [..., V] as (cut, last, norm) [..., 1] (norm:
  the float sum of the kept p), for XLA:CPU:

  1. Search: bisection on the key in which each probe also returns the nearest keys present on either
     side of it (`probe`), so that the bracket snaps to keys that occur and closes once none lies inside
     it: 12–20 vectorised passes at [72, 32k] and top-p 0.5–0.99. Its float sums are in no particular
     order, so the cut it finds is a candidate.
  2. Certificate: the exact masses at the candidate (`certificate`) prove it the definition's cut, or show
     on which side it is off (P within float rounding of a boundary); it then moves one key at a time, up
     to 4 times, and after that the batch takes `definition`. Correctness rests on the certificate only.
  3. Ties at the cut (`_tie_end`), in the rows whose tie group has more than one member.
  """
  scores = (unnormalised, total)
  target = budget(top_p)
  vocab = unnormalised.shape[-1]

  def searching(state):
    lo, hi, _, _ = state
    return jnp.any(hi > lo + 1)

  def narrow(state):  # mass(lo) ≥ P > mass(hi) in the probes' sums; lo is 0 or a key, hi − 1 a key
    (keys, probs), (lo, hi, n_lo, n_hi) = _pinned(scores, state)
    mass, least_above, greatest_below, count = probe(keys, probs, _midpoint(lo, hi))
    up = (hi > lo + 1) & (mass >= top_p)
    down = (hi > lo + 1) & (mass < top_p)
    return (jnp.where(up, least_above, lo), jnp.where(down, greatest_below + 1, hi),
            jnp.where(up, count, n_lo), jnp.where(down, count, n_hi))

  keys, probs = keys_and_probs(*scores)
  # (1 − P)/V < τ* (the tokens at or below τ* hold more than 1 − P): a first probe that usually cuts the
  # long tail of tiny probabilities out of the bracket. Keys are the exponentials' bits.
  mass, least_above, greatest_below, count = probe(keys, probs, order_keys((1.0 - top_p) / vocab * total))
  enough = mass >= top_p
  top = jnp.max(keys, axis=-1, keepdims=True) + 1
  cut, _, _, _ = jax.lax.while_loop(searching, narrow, (
      jnp.where(enough, least_above, 0), jnp.where(enough, top, greatest_below + 1),
      jnp.where(enough, count, vocab), jnp.where(enough, 0, count)))

  def uncertified(cut, mass_from_cut, mass_above_cut):
    return ~_certified(cut, mass_from_cut, mass_above_cut, target)

  def moving(state):
    cut, mass_from_cut, mass_above_cut, _, _, moves = state
    return jnp.any(uncertified(cut, mass_from_cut, mass_above_cut)) & (moves < 4)

  def move(state):  # one key down where Σ_{key ≥ c} < P, one key up where Σ_{key > c} ≥ P
    (keys, probs), (cut, mass_from_cut, mass_above_cut, _, _, moves) = _pinned(scores, state)
    down = ~reaches(mass_from_cut, target) & (cut > KEEP_ALL)
    up = reaches(mass_above_cut, target)
    _, least_above, greatest_below, _ = probe(keys, probs, jnp.where(down, cut, cut + 1))
    # Nothing below c: greatest_below is −1 = KEEP_ALL, the whole row (which falls short of P).
    cut = jnp.where(down, greatest_below, jnp.where(up, least_above, cut))
    return (cut, *certificate(keys, probs, cut), moves + 1)

  state = (cut, *certificate(keys, probs, cut), 0)
  cut, mass_from_cut, mass_above_cut, cut_total, n_tied, _ = jax.lax.while_loop(moving, move, state)
  cut, last, norm = jax.lax.cond(
      jnp.any(uncertified(cut, mass_from_cut, mass_above_cut)),
      lambda *s: definition(*s, top_p),
      lambda *s: (cut,) + _tie_end(s, n_tied > 1, cut, mass_above_cut, target, cut_total, by_rows=True),
      *scores)
  return cut, last, norm


def nucleus_by_top_k(unnormalised: Array, total: Array, top_p: Array) -> tuple[Array, Array, Array]:
  """`nucleus` for accelerators, where `lax.top_k` is fast and a data-dependent loop is dear (on XLA:GPU
  each `while` condition is a host round-trip): no loop in the program.

  `lax.top_k` lists the K = min(V, TOP_K_CANDIDATES) most likely tokens by key, ties by lower index: the
  definition's order. The exact running mass over them is the definition's, so the first candidate at
  which it reaches P is the last kept token, ties included: nothing to certify. Rows whose K candidates
  fall short of P (a nucleus larger than K, or a row whose whole mass is short) take `definition`
  unrolled, for the whole batch and only then.
  """
  keys, probs = keys_and_probs(unnormalised, total)
  candidate_keys, candidates = jax.lax.top_k(keys, min(keys.shape[-1], TOP_K_CANDIDATES))
  high, low, remainder = weights(jnp.take_along_axis(probs, candidates, axis=-1))
  running = _carried(jnp.cumsum(high, axis=-1), jnp.cumsum(low, axis=-1))
  reached = reaches(running, budget(top_p))
  first = jnp.argmax(reached, axis=-1)[..., None]
  found = jnp.any(reached, axis=-1, keepdims=True)
  cut = jnp.take_along_axis(candidate_keys, first, axis=-1)
  last = jnp.take_along_axis(candidates, first, axis=-1)
  at_first = [jnp.take_along_axis(x, first, axis=-1) for x in (*running, jnp.cumsum(remainder, axis=-1))]
  norm = as_float(at_first[:2], at_first[2])
  return jax.lax.cond(jnp.all(found), lambda *_: (cut, last, norm),
                      lambda *s: merge(found, (cut, last, norm), definition(*s, top_p, unroll=True)),
                      unnormalised, total)


def definition(unnormalised: Array, total: Array, top_p: Array,
               unroll: bool = False) -> tuple[Array, Array, Array]:
  """The nucleus by the definition's plain bisection: the greatest key c with exact mass(c) ≥ P, in 32
  passes (`unroll`: in line, no loop in the program), then the tie group at c. (cut, last, norm) [..., 1]."""
  scores = (unnormalised, total)
  target = budget(top_p)

  def bisect(_, bracket):  # invariant: mass(lo) ≥ P > mass(hi), or lo = KEEP_ALL
    (keys, probs), (lo, hi) = _pinned(scores, bracket)
    mid = _midpoint(lo, hi)
    enough = reaches(certificate(keys, probs, mid)[0], target)
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  keys, probs = keys_and_probs(*scores)
  top = jnp.max(keys, axis=-1, keepdims=True) + 1
  cut, _ = jax.lax.fori_loop(0, 32, bisect, (jnp.full_like(top, KEEP_ALL), top), unroll=unroll)
  # lo only moves to a mid whose mass reaches P; if it never moved, the whole row falls short: keep it.
  _, mass_above_cut, cut_total, n_tied = certificate(keys, probs, cut)
  return (cut,) + _tie_end(scores, n_tied > 1, cut, mass_above_cut, target, cut_total, by_rows=False)


def _tie_end(scores, several: Array, cut: Array, mass_above, target, cut_total: Array,
             by_rows: bool) -> tuple[Array, Array]:
  """(last, norm) [..., 1] at a cut: the definition keeps the tokens tied at `cut` in index order while the
  exact mass before each is < P. Only rows whose tie group has more than one member (`several`) need the
  running mass over it (`by_rows`: one row at a time, over those rows only, since a cumulative sum over
  all of [..., V] is dear on XLA:CPU); elsewhere last = V and the kept mass is `cut_total`."""
  vocab = scores[0].shape[-1]
  row = cut.shape
  columns = (cut, *mass_above, *(jnp.broadcast_to(t, row) for t in target))
  keep_whole = (jnp.full_like(cut, vocab), cut_total)
  if not by_rows:
    ends = jax.lax.cond(jnp.any(several), _tie_ends, lambda *_: keep_whole, *scores, *columns)
    return merge(several, ends, keep_whole)

  rows = [x.reshape(-1, x.shape[-1]) for x in (*scores, *columns)]

  def next_row(state):
    return jnp.any(state[0])

  def one_row(state):
    remaining, last, norm = state
    r = jnp.argmax(remaining)
    row_last, row_norm = _tie_ends(*(jax.lax.dynamic_index_in_dim(x, r) for x in rows))
    return remaining.at[r].set(False), last.at[r].set(row_last[0, 0]), norm.at[r].set(row_norm[0, 0])

  state = (several.reshape(-1), jnp.full(several.size, vocab, jnp.int32), cut_total.reshape(-1))
  _, last, norm = jax.lax.while_loop(next_row, one_row, state)
  return last.reshape(row), norm.reshape(row)


def _tie_ends(unnormalised, total, cut, above_high, above_low, target_high, target_low) -> tuple[Array, Array]:
  """(last, norm) [..., 1]: the exact running mass over the tie group at `cut`, in index order, from the
  mass above it; the first tied token before which it reaches P is the first dropped."""
  keys, probs = keys_and_probs(unnormalised, total)
  index = jnp.arange(keys.shape[-1], dtype=jnp.int32)
  tied = keys == cut
  high, low, remainder = weights(probs)
  tied_high, tied_low = jnp.where(tied, high, 0), jnp.where(tied, low, 0)
  before = _carried(above_high + jnp.cumsum(tied_high, -1) - tied_high,
                    above_low + jnp.cumsum(tied_low, -1) - tied_low)
  dropped = tied & reaches(before, (target_high, target_low))
  last = jnp.min(jnp.where(dropped, index, keys.shape[-1]), axis=-1, keepdims=True) - 1
  kept = (keys > cut) | (tied & (index <= last))
  kept_mass = _carried(*(jnp.sum(jnp.where(kept, x, 0), axis=-1, keepdims=True) for x in (high, low)))
  return last, as_float(kept_mass, jnp.sum(jnp.where(kept, remainder, 0.0), axis=-1, keepdims=True))
