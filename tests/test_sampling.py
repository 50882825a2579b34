"""S(·): temperature, top-k, top-p, and categorical sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling
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


def test_entropy():
  np.testing.assert_allclose(sampling.entropy(jnp.array([0.5, 0.5, 0.0])), np.log(2), rtol=1e-6)
  np.testing.assert_allclose(sampling.entropy(jnp.array([1.0, 0.0])), 0.0, atol=1e-7)
