"""S(·): temperature, top-k, top-p, and categorical sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling
from specdec.core import _top_p
from tests.stats import assert_law


def _reference_transform(logits, temperature, top_p, top_k):
  """Independent NumPy S(·): one row at a time, by the definitions."""
  logits = np.asarray(logits, np.float64)
  out = np.zeros_like(logits)
  for i, row in enumerate(logits.reshape(-1, logits.shape[-1])):
    if temperature == 0:
      out.reshape(-1, row.size)[i, np.argmax(row)] = 1.0
      continue
    order = sorted(range(row.size), key=lambda v: (-row[v], v))
    keep = set(order[:top_k]) if top_k else set(order)
    probs = np.array([np.exp(row[v] / temperature) if v in keep else 0.0 for v in range(row.size)])
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


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_transform_matches_definition(temperature, top_p, top_k):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 7, 11)).astype(np.float32) * 2
  got = sampling.transform(jnp.asarray(logits), temperature, top_p, top_k)
  want = _reference_transform(logits, temperature, top_p, top_k)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def _top_p_by_bisection(logits, temperature, top_p):
  """S(·) without top-k as the definition computes it (the implementation before the certified search):
  32 masked sums bisect τ* on the float32 bit pattern, ties at τ* are kept lowest index first while
  rank·τ* < room. The fast top-P must agree with it bit for bit."""
  logits = jnp.asarray(logits, jnp.float32)
  temperature = jnp.asarray(temperature, jnp.float32)[..., None]
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32)[..., None], logits.shape[:-1] + (1,))
  greedy = temperature <= 0.0
  probs = jax.nn.softmax(logits / jnp.where(greedy, 1.0, temperature), axis=-1)
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)

  def measure_from(threshold):
    return jnp.sum(jnp.where(bits >= threshold, probs, 0.0), axis=-1, keepdims=True)

  def bisect(_, bracket):
    lo, hi = bracket
    mid = lo + (hi - lo) // 2
    enough = measure_from(mid) >= top_p
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, _ = jax.lax.fori_loop(0, 32, bisect, (jnp.zeros_like(top_p, jnp.int32),
                                            jnp.max(bits, axis=-1, keepdims=True) + 1))
  above, tied = bits > lo, bits == lo
  room = top_p - jnp.sum(jnp.where(above, probs, 0.0), axis=-1, keepdims=True)
  keep = above | (tied & ((jnp.cumsum(tied, axis=-1) - 1) * probs < room))
  kept = jnp.where(keep, probs, 0.0)
  truncated = jnp.where(jnp.all(top_p >= 1.0), probs, kept / jnp.sum(kept, axis=-1, keepdims=True))
  one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  return jnp.where(greedy, one_hot, truncated)


_transform = jax.jit(sampling.transform, static_argnames=("top_k", "method"))
_definition = jax.jit(_top_p_by_bisection)
# Both top-p searches (the CPU's bisection, the accelerators' top-k) against the definition, on this CPU.
METHODS = pytest.mark.parametrize("method", ["bisection", "top_k"])


def _assert_same_bits(logits, temperature, top_p, method="auto"):
  got = np.asarray(_transform(logits, temperature, top_p, method=method))
  want = np.asarray(_definition(logits, temperature, top_p))
  np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@METHODS
@pytest.mark.parametrize("vocab, scale", [(11, 2.0), (1000, 3.0), (32_000, 3.0)])
def test_top_p_equals_bisection_bit_for_bit(vocab, scale, method):
  logits = jnp.asarray(np.random.default_rng(vocab).normal(size=(6, vocab)) * scale, jnp.float32)
  for temperature in (0.0, 0.7, 1.0):
    for top_p in (1.0, 0.999, 0.9, 0.5, 0.1):
      _assert_same_bits(logits, temperature, top_p, method)


@METHODS
def test_top_p_bit_for_bit_on_ties_one_hot_rows_and_whole_vocabulary_nuclei(method):
  rng = np.random.default_rng(7)
  ties = rng.integers(-3, 3, size=(8, 64)).astype(np.float32)                 # groups of equal p
  uniform = np.zeros((8, 64), np.float32)                                      # one group of 64
  one_hot = np.full((8, 64), -np.inf, np.float32)
  one_hot[np.arange(8), rng.integers(0, 64, 8)] = 0.0                          # p = (0, .., 1, .., 0)
  flat = (rng.normal(size=(8, 64)) * 1e-3).astype(np.float32)                  # nucleus = whole vocabulary
  bf16 = np.asarray(jnp.asarray(rng.normal(size=(8, 64)) * 3, jnp.bfloat16), np.float32)
  logits = jnp.asarray(np.concatenate([ties, uniform, one_hot, flat, bf16]))
  for top_p in (1.0, 1 - 1e-7, 0.99, 0.7, 0.5, 0.3, 1 / 64, 1e-3):
    _assert_same_bits(logits, 1.0, top_p, method)
  per_row = jnp.asarray(rng.choice([1.0, 0.9, 0.5, 0.25], size=40), jnp.float32)  # mixed top_p = 1 rows
  _assert_same_bits(logits, jnp.asarray(rng.choice([0.0, 0.5, 1.0], size=40), jnp.float32), per_row, method)


@METHODS
def test_top_p_bit_for_bit_where_the_search_and_the_definition_sum_differently(method):
  """top_p set to the definition's own Σ_{p ≥ p_v} p: at such budgets the search's vectorised sums and
  the definition's fall on both sides of top_p in some rows, which the certificate must catch."""
  logits = jnp.asarray(np.random.default_rng(8).normal(size=(64, 2000)) * 2, jnp.float32)
  probs = jax.nn.softmax(logits)
  values = jnp.take_along_axis(probs, jnp.asarray(np.random.default_rng(9).integers(0, 2000, (64, 1))), -1)
  threshold = jax.lax.bitcast_convert_type(values, jnp.int32)
  definition_sum = jnp.minimum(_top_p.mass_from(probs, threshold)[:, 0], 1.0)
  search_sum = jnp.minimum(_top_p.probe(probs, threshold)[0][:, 0], 1.0)
  assert np.any(np.asarray(definition_sum != search_sum)), "the fixture must make the two orders disagree"
  for top_p in (definition_sum, search_sum, jnp.nextafter(definition_sum, 2.0)):
    _assert_same_bits(logits, 1.0, jnp.minimum(top_p, 1.0), method)


def test_top_k_search_has_no_loop_and_falls_back_only_when_uncertified():
  """The accelerators' path compiles to straight-line code (plus one conditional fallback); a nucleus
  larger than its candidate set (a flat row of 32k) is still cut exactly, by the fallback."""
  lowered = _transform.lower(jnp.zeros((8, 9, 32_000)), 1.0, 0.9, method="top_k")
  assert " while(" not in lowered.compile().as_text()
  assert " while(" in _transform.lower(jnp.zeros((8, 9, 32_000)), 1.0, 0.9, method="bisection").compile().as_text()
  flat = jnp.asarray(np.random.default_rng(3).normal(size=(2, 32_000)) * 1e-2, jnp.float32)
  assert int(np.sum(np.asarray(_transform(flat, 1.0, 0.9)) > 0, axis=-1).min()) > sampling.TOP_K_CANDIDATES
  _assert_same_bits(flat, 1.0, 0.9, "top_k")


def test_auto_top_p_method_follows_the_backend_and_a_bad_one_raises():
  assert sampling.top_p_method("auto") == ("bisection" if jax.default_backend() == "cpu" else "top_k")
  assert sampling.Sampling(top_p_method="top_k").checked().top_p_method == "top_k"
  with pytest.raises(ValueError, match="top_p_method must be one of"):
    sampling.Sampling(top_p_method="sort").checked()


def test_certificate_sums_are_the_definitions_bit_for_bit():
  """The certificate's arithmetic mask sums to exactly what `jnp.sum(jnp.where(bits >= t, p, 0))` gives,
  at thresholds on, next to and below the values (0, the smallest subnormal, probabilities near 1e-38)."""
  rng = np.random.default_rng(10)
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(16, 3000)) * rng.choice([1.0, 3.0, 40.0], (16, 1)),
                                     jnp.float32))
  bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
  values_bits = jnp.take_along_axis(bits, jnp.asarray(rng.integers(0, 3000, (16, 8))), -1)
  thresholds = jnp.maximum(values_bits + rng.integers(-1, 2, (16, 8)), 0)  # bit patterns: never negative
  thresholds = jnp.concatenate([jnp.zeros((16, 1), jnp.int32), jnp.ones((16, 1), jnp.int32), thresholds], -1)
  values = np.asarray(probs)
  assert np.any((values > 0) & (values < 1e-30)), "the fixture must hold probabilities near 1e-38"
  definition = jax.jit(lambda p, t: jnp.sum(
      jnp.where(jax.lax.bitcast_convert_type(p, jnp.int32) >= t, p, 0.0), axis=-1, keepdims=True))
  for j in range(thresholds.shape[1]):
    threshold = thresholds[:, j:j + 1]
    got, want = jax.jit(_top_p.mass_from)(probs, threshold), definition(probs, threshold)
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))


def test_temperature_zero_is_argmax_lowest_index_on_ties():
  logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
  np.testing.assert_array_equal(sampling.transform(logits, 0.0), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_p_keeps_smallest_set_reaching_mass():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits = jnp.log(jnp.asarray(probs))
  np.testing.assert_allclose(sampling.transform(logits, 1.0, top_p=0.5), [1, 0, 0, 0], atol=1e-6)
  np.testing.assert_allclose(sampling.transform(logits, 1.0, top_p=0.51), [0.625, 0.375, 0, 0], atol=1e-6)
  np.testing.assert_allclose(sampling.transform(logits, 1.0, top_p=0.96), probs, atol=1e-6)


def test_traced_temperature_and_top_p_compile_once():
  traces = []

  @jax.jit
  def f(logits, temperature, top_p):
    traces.append(1)
    return sampling.transform(logits, temperature, top_p)

  logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 9)), jnp.float32)
  outs = [f(logits, t, p) for t in (0.0, 0.5, 1.0) for p in (0.3, 0.9, 1.0)]
  assert len(traces) == 1
  np.testing.assert_allclose(outs[0], sampling.transform(logits, 0.0, 0.3), atol=1e-6)
  np.testing.assert_allclose(outs[4], sampling.transform(logits, 0.5, 0.9), atol=1e-6)


def test_per_row_temperature_broadcasts():
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, 6)), jnp.float32)
  temps = jnp.array([0.0, 0.5, 1.5])
  got = sampling.transform(logits, temps)
  for i, t in enumerate([0.0, 0.5, 1.5]):
    np.testing.assert_allclose(got[i], sampling.transform(logits[i], t), atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=-1), "top_k"),
])
def test_bad_arguments_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.transform(jnp.zeros((2, 4)), **kwargs)


def test_nan_logits_raise():
  with pytest.raises(ValueError, match="NaN"):
    sampling.transform(jnp.array([0.0, jnp.nan]), 1.0)


def test_sample_follows_weights():
  weights = jnp.array([0.0, 2.0, 1.0, 0.5, 0.0, 4.5])
  draws = sampling.sample(jax.random.PRNGKey(0), jnp.broadcast_to(weights, (100_000, 6)))
  assert_law(np.asarray(draws), np.asarray(weights) / weights.sum(), what="sample")


def test_masked_sum_sums_and_counts_the_masked_entries():
  values = np.random.default_rng(3).normal(size=(4, 5, 300)).astype(np.float32)
  mask = values > 0.3
  total, count = sampling.masked_sum(jnp.asarray(values), jnp.asarray(mask))
  np.testing.assert_allclose(total, np.where(mask, values, 0).sum(-1), rtol=1e-5)
  np.testing.assert_array_equal(count, mask.sum(-1))


def test_entropy():
  np.testing.assert_allclose(sampling.entropy(jnp.array([0.5, 0.5, 0.0])), np.log(2), rtol=1e-6)
  np.testing.assert_allclose(sampling.entropy(jnp.array([1.0, 0.0])), 0.0, atol=1e-7)
