"""S(·): temperature, top-k, top-p, and categorical sampling."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling
from specdec.core import _top_p
from tests import sampling_reference as reference
from tests.sampling_reference import assert_exact, reference_transform, softmax32
from tests.stats import assert_law


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_transform_matches_definition(temperature, top_p, top_k):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, 7, 11)).astype(np.float32) * 2
  got = sampling.transform(jnp.asarray(logits), temperature, top_p, top_k)
  want = reference_transform(logits, temperature, top_p, top_k)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


SEARCHES = pytest.mark.parametrize("search", sorted(reference.SEARCHES))


@SEARCHES
@pytest.mark.parametrize("vocab, scale", [(11, 2.0), (1000, 3.0), (32_000, 3.0)])
def test_top_p_is_the_exact_definition(vocab, scale, search):
  probs = softmax32(np.random.default_rng(vocab).normal(size=(6, vocab)) * scale, 0.7)
  for top_p in (1.0, 0.999, 0.9, 0.5, 0.1):
    assert_exact(probs, top_p, search)


@SEARCHES
def test_top_p_exact_on_ties_one_hot_rows_and_whole_vocabulary_nuclei(search):
  rng = np.random.default_rng(7)
  ties = rng.integers(-3, 3, size=(8, 64)).astype(np.float32)                 # groups of equal p
  uniform = np.zeros((8, 64), np.float32)                                      # one group of 64
  one_hot = np.full((8, 64), -np.inf, np.float32)
  one_hot[np.arange(8), rng.integers(0, 64, 8)] = 0.0                          # p = (0, .., 1, .., 0)
  flat = (rng.normal(size=(8, 64)) * 1e-3).astype(np.float32)                  # nucleus = whole vocabulary
  bf16 = np.asarray(jnp.asarray(rng.normal(size=(8, 64)) * 3, jnp.bfloat16), np.float32)
  probs = softmax32(np.concatenate([ties, uniform, one_hot, flat, bf16]))
  for top_p in (1.0, 1 - 1e-7, 0.99, 0.7, 0.5, 0.3, 1 / 64, 1e-3):
    assert_exact(probs, top_p, search)
  assert_exact(probs, rng.choice([1.0, 0.9, 0.5, 0.25], size=40), search)  # per-row budgets


@SEARCHES
def test_top_p_exact_at_budgets_on_the_boundaries_of_float_sums(search):
  """top_p set to float32 sums of the most likely tokens, in two orders, and to their neighbours: the
  budgets at which a search's float sums and the exact masses fall on both sides of top_p."""
  rng = np.random.default_rng(8)
  probs = softmax32(rng.normal(size=(64, 2000)) * 2)
  ordered = -np.sort(-probs, axis=-1)
  k = rng.integers(1, 200, size=(64, 1))
  forward = np.where(np.arange(2000) < k, ordered, 0).astype(np.float32).sum(-1, dtype=np.float32)
  backward = np.where(np.arange(2000) < k, ordered, 0)[:, ::-1].cumsum(-1, dtype=np.float32)[:, -1]
  for top_p in (forward, backward, np.nextafter(forward, 2.0), np.nextafter(forward, 0.0)):
    assert_exact(probs, np.minimum(top_p, 1.0), search)


@SEARCHES
@pytest.mark.parametrize("vocab", [32_000, 256_000])
def test_top_p_exact_where_probabilities_reach_the_subnormal_range(vocab, search):
  """Peaked rows at T = 0.3: most probabilities are tiny, many subnormal or zero."""
  rng = np.random.default_rng(vocab)
  logits = rng.normal(size=(4, vocab)) * 4
  logits[:, :3] += 20.0                                                        # a few dominant tokens
  scaled = logits / 0.3
  probs = np.exp(scaled - scaled.max(-1, keepdims=True))
  probs = (probs / probs.sum(-1, keepdims=True)).astype(np.float32)          # NumPy keeps subnormals
  assert np.any((probs > 0) & (probs < np.finfo(np.float32).tiny)), "the fixture must hold subnormals"
  for top_p in (0.999999, 0.99, 0.9, 0.5):
    assert_exact(probs, top_p, search)


def test_top_p_does_not_depend_on_the_order_of_the_vocabulary():
  """A compiler may sum in any order; the cut may not follow it. Permuting the vocabulary permutes the
  mask (no ties, so index order plays no part), at budgets on float sums' boundaries."""
  rng = np.random.default_rng(11)
  probs = softmax32(rng.normal(size=(32, 5000)) * 2)
  top_p = np.sort(probs, axis=-1)[:, ::-1].cumsum(-1, dtype=np.float32)[np.arange(32), rng.integers(5, 500, 32)]
  top_p = jnp.asarray(np.minimum(top_p, 1.0))[:, None]
  for search in ("bisection", "top_k"):
    cut, last, _ = reference.SEARCHES[search](jnp.asarray(probs), jnp.ones_like(top_p), top_p)
    mask = np.asarray(_top_p.keeps(_top_p.order_keys(jnp.asarray(probs)), cut, last))
    for seed in range(3):
      perm = np.random.default_rng(seed).permutation(5000)
      cut, last, _ = reference.SEARCHES[search](jnp.asarray(probs[:, perm]), jnp.ones_like(top_p), top_p)
      permuted = np.asarray(_top_p.keeps(_top_p.order_keys(jnp.asarray(probs[:, perm])), cut, last))
      np.testing.assert_array_equal(permuted, mask[:, perm])


@pytest.mark.parametrize("method", ["bisection", "top_k"])
@pytest.mark.parametrize("vocab", [32_000, 256_000])
def test_transform_against_float64_on_peaked_rows(vocab, method):
  """S(·) at T = 0.3 against probabilities computed in float64: the kept set is a top set, the smallest
  whose mass reaches top_p up to float32 rounding, and the kept values are p/Σ_kept p."""
  rng = np.random.default_rng(vocab + 1)
  logits = (rng.normal(size=(3, vocab)) * 4).astype(np.float32)
  logits[:, :5] += 18.0
  for top_p in (0.9999, 0.95, 0.6):
    got = np.asarray(sampling.transform(jnp.asarray(logits), 0.3, top_p, method=method), np.float64)
    scaled = logits.astype(np.float64) / 0.3
    p64 = np.exp(scaled - scaled.max(-1, keepdims=True))
    p64 /= p64.sum(-1, keepdims=True)
    for row, probs in zip(got, p64):
      kept = row > 0
      assert probs[kept].min() >= probs[~kept & (probs > 0)].max(initial=0.0) * (1 - 1e-5), "not a top set"
      mass = probs[kept].sum()
      assert mass >= top_p - 1e-6, f"kept mass {mass} < top_p {top_p}"
      assert mass - probs[kept].min() < top_p + 1e-6, "a smaller set reaches top_p"
      np.testing.assert_allclose(row[kept], probs[kept] / mass, rtol=1e-5)


def test_top_k_search_has_no_loop_and_falls_back_only_for_large_nuclei():
  """The accelerators' path compiles to straight-line code (plus one conditional fallback); a nucleus
  larger than its candidate set (a flat row of 32k) is still cut exactly, by the fallback."""
  lowered = _transform.lower(jnp.zeros((8, 9, 32_000)), 1.0, 0.9, method="top_k")
  assert " while(" not in lowered.compile().as_text()
  assert " while(" in _transform.lower(jnp.zeros((8, 9, 32_000)), 1.0, 0.9, method="bisection").compile().as_text()
  flat = softmax32(np.random.default_rng(3).normal(size=(2, 32_000)) * 1e-2)
  assert int(reference.exact_nucleus(flat, 0.9).sum(-1).min()) > sampling.TOP_K_CANDIDATES
  assert_exact(flat, 0.9, "top_k")


_transform = jax.jit(sampling.transform, static_argnames=("top_k", "method"))


def test_auto_top_p_method_follows_the_backend_and_a_bad_one_raises():
  assert sampling.top_p_method("auto") == ("bisection" if jax.default_backend() == "cpu" else "top_k")
  assert sampling.Sampling(top_p=0.9, top_p_method="top_k").checked().top_p_method == "top_k"
  with pytest.raises(ValueError, match="top_p_method must be one of"):
    sampling.Sampling(top_p_method="sort").checked()


def test_a_program_holds_the_top_p_search_only_where_it_may_truncate():
  """top_p = 1 compiles no search ("none"), top_p < 1 the platform's; truncation=True keeps the search at
  top_p = 1 (a sweep's points share one program), and a search-free program refuses top_p < 1."""
  method = lambda **kw: sampling.Sampling(**kw).checked("cpu").top_p_method
  assert method() == method(top_p=np.ones(3)) == method(truncation=False) == "none"
  assert method(top_p=0.9) == method(truncation=True) == method(top_p=np.array([1.0, 0.5])) == "bisection"
  assert sampling.Sampling(truncation=True).checked("tpu").top_p_method == "top_k"
  for bad in (dict(top_p=0.9, truncation=False), dict(top_p=0.9, top_p_method="none")):
    with pytest.raises(ValueError, match="top_p must be 1 where the program holds no top-p search"):
      sampling.Sampling(**bad).checked()
  with pytest.raises(ValueError, match="contradicts truncation=True"):
    sampling.Sampling(top_p_method="none", truncation=True).checked()
  with pytest.raises(ValueError, match="top_p must be 1 where"):
    sampling.transform(jnp.zeros(4), 1.0, 0.9, method="none")
  logits = jax.random.normal(jax.random.PRNGKey(0), (3, 64))
  np.testing.assert_array_equal(sampling.transform(logits, 0.7, method="none"), sampling.transform(logits, 0.7))


def test_fixed_point_weights_are_exact_and_flush_proof():
  """⌊p·2^43⌋ as two limbs, for p from subnormal to 1; subnormals weigh nothing either way."""
  rng = np.random.default_rng(10)
  values = np.concatenate([rng.random(1000), 10.0 ** rng.uniform(-45, 0, 1000), [0.0, 1.0, 1e-45, 2.0**-43]])
  values = values.astype(np.float32)
  high, low, remainder = jax.jit(_top_p.weights)(jnp.asarray(values))
  got = np.asarray(high, np.int64) * 2**13 + np.asarray(low, np.int64)
  want = np.floor(values.astype(np.float64) * 2.0**43)
  np.testing.assert_array_equal(got, want.astype(np.int64))
  normal = values >= np.finfo(np.float32).tiny
  np.testing.assert_allclose(np.asarray(remainder, np.float64)[normal],
                             (values.astype(np.float64) - want * 2.0**-43)[normal], rtol=1e-6, atol=1e-50)


def test_top_k_keeps_the_k_most_likely_lowest_index_on_ties():
  logits = jnp.array([[0.0, 2.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
  np.testing.assert_array_equal(np.asarray(sampling.transform(logits, 1.0, top_k=2)) > 0,
                                [[0, 1, 1, 0, 0], [1, 1, 0, 0, 0]])


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


def test_sample_never_draws_a_zero_weight():
  """Rows of tiny and zero weights (down to 1e-30) and trailing zeros: the uniforms nearest
  the total must still land on a positive weight."""
  rng = np.random.default_rng(12)
  weights = np.where(rng.random((4096, 300)) < 0.9, 0.0, rng.random((4096, 300)) * 10.0 ** rng.uniform(-30, 0, (4096, 1)))
  weights[:, -50:] = 0.0
  weights[:, 0] = np.where(weights.sum(-1) == 0, 1.0, weights[:, 0])
  draws = np.asarray(sampling.sample(jax.random.PRNGKey(1), jnp.asarray(weights, jnp.float32)))
  assert np.all(weights.astype(np.float32)[np.arange(4096), draws] > 0)


def test_masked_sum_sums_and_counts_the_masked_entries():
  values = np.random.default_rng(3).normal(size=(4, 5, 300)).astype(np.float32)
  mask = values > 0.3
  total, count = sampling.masked_sum(jnp.asarray(values), jnp.asarray(mask))
  np.testing.assert_allclose(total, np.where(mask, values, 0).sum(-1), rtol=1e-5)
  np.testing.assert_array_equal(count, mask.sum(-1))


def test_entropy():
  np.testing.assert_allclose(sampling.entropy(jnp.array([0.5, 0.5, 0.0])), np.log(2), rtol=1e-6)
  np.testing.assert_allclose(sampling.entropy(jnp.array([1.0, 0.0])), 0.0, atol=1e-7)


_FAST_MATH_CHECKS = r"""
import numpy as np, jax.numpy as jnp
from specdec import sampling
from tests import sampling_reference as t
rng = np.random.default_rng(0)
logits = rng.normal(size=(4, 7, 11)).astype(np.float32) * 2
for temperature in (0.3, 1.0):
  for top_p in (0.9, 0.5, 0.05):
    for method in ("bisection", "top_k"):
      got = sampling.transform(jnp.asarray(logits), temperature, top_p, method=method)
      np.testing.assert_allclose(np.asarray(got), t.reference_transform(logits, temperature, top_p, 0), atol=2e-6)
probs = t.softmax32(rng.normal(size=(64, 2000)) * 2)
ties = t.softmax32(rng.integers(-3, 3, size=(64, 2000)).astype(np.float32))
budgets = np.minimum(np.sort(probs, -1)[:, ::-1].cumsum(-1, dtype=np.float32)[np.arange(64), rng.integers(1, 300, 64)], 1.0)
for search in ("bisection", "top_k", "definition"):
  for rows, top_p in ((probs, budgets), (probs, np.nextafter(budgets, 2.0)), (ties, 0.5), (ties, 0.93)):
    t.assert_exact(rows, np.minimum(top_p, 1.0), search)
print("exact under fast math")
"""


def test_top_p_exact_under_xla_cpu_fast_math():
  """XLA:CPU with fast math reassociates sums, divides approximately and flushes subnormals, as an
  accelerator's compiler may: S(·) still matches the float64 definition and each search's cut is the exact
  one, at budgets on float sums' boundaries and on ties (at bc6d910: NaN rows at top_p 0.05, T = 0.3, and
  cuts off by one). A process of its own: XLA reads its flags once, at start; the default optimisation level,
  where LLVM applies them."""
  flags = "--xla_cpu_enable_fast_math=true --xla_backend_optimization_level=2"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), flags]))
  root = pathlib.Path(__file__).resolve().parents[2]
  run = subprocess.run([sys.executable, "-c", _FAST_MATH_CHECKS], cwd=root, env=env, capture_output=True,
                       text=True, timeout=900)
  assert run.returncode == 0 and "exact under fast math" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
