"""Checks every model family's tests run on their own models (shared test code: test modules import it, not each
other)."""

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding


def assert_greedy_decoding_is_the_verifiers(drafter, verifier, method: str, params: dict, vocab_size: int) -> None:
  """Ragged prompts of 3 rows, 24 new tokens, greedy: `method`'s tokens are the verifier's autoregressive ones, and
  some drafts were accepted (the drafter's path ran)."""
  rng = np.random.default_rng(0)
  prompts, lengths = jnp.asarray(rng.integers(0, vocab_size, (3, 7)), jnp.int32), jnp.asarray([7, 2, 5], jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=24, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method=method, **params, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert int(np.sum(got.stats.accepted)) > 0
