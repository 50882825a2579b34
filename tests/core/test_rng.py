"""specdec.rng: one key or one key per row, raw (PRNGKey) or typed (jax.random.key), for the samplers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import rng, sampling


@pytest.mark.parametrize("make", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_row_keys_draw_what_each_row_key_draws_alone(make):
  keys = rng.per_row(make(3), jnp.array([5, 0, 9]))
  assert rng.batch_shape(keys) == (3,) and rng.batch_shape(make(3)) == ()
  u = rng.uniform(keys, (3, 4))
  for b in range(3):
    np.testing.assert_array_equal(u[b], jax.random.uniform(jax.random.fold_in(make(3), [5, 0, 9][b]), (4,)))
  first, second = rng.split(keys)
  np.testing.assert_array_equal(rng.uniform(first, (3,))[1], jax.random.uniform(jax.random.split(keys[1])[0], ()))
  assert not np.array_equal(rng.uniform(first, (3,)), rng.uniform(second, (3,)))
  with pytest.raises(ValueError, match=r"a draw of shape \(4, 3\) with keys for rows \(3,\)"):
    rng.uniform(keys, (4, 3))


@pytest.mark.parametrize("make", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_expand_keeps_the_row_key_for_copy_zero(make):
  keys = rng.per_row(make(1), jnp.arange(2))
  copies = rng.expand(keys, 3)
  assert rng.batch_shape(copies) == (6,)
  data = jax.random.key_data if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) else (lambda k: k)
  np.testing.assert_array_equal(data(copies[3]), data(keys[1]))
  np.testing.assert_array_equal(data(copies[4]), data(jax.random.fold_in(keys[1], 1)))
  assert len({tuple(np.asarray(data(k)).ravel()) for k in copies}) == 6
  single = make(0)
  assert rng.expand(single, 3) is single


def test_sample_with_row_keys_matches_each_row_alone():
  weights = jnp.asarray(np.random.default_rng(0).random((4, 7)), jnp.float32)
  keys = rng.per_row(jax.random.PRNGKey(2), jnp.arange(4))
  drawn = sampling.sample(keys, weights)
  for b in range(4):
    assert drawn[b] == sampling.sample(keys[b], weights[b])
