"""Multi-draft decoding (SpecTr, SpecInfer): the verifier's law of whole sequences (T = 1 and with top-P,
chi-square against enumeration), greedy output equal to the verifier's greedy decoding token for token,
K = 1 equal to `speculative`, the i.i.d. draft set, counters, compile-once and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling
from specdec.decoding import multi_draft
from tests.stats import assert_law, sequence_codes, sequence_law
from tests.toy_models import PositionalTrigram, agreeing_toys, tiny_pair

METHODS = ["spectr", "specinfer"]


def _transformers(vocab, max_length=64, scale=1.0):
  return tiny_pair(vocab, max_length, scale=scale)


# K = 4 stays in the default run with top-P (and T = 1 with K = 2); K = 4 at T = 1 is slow (make test-slow).
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_drafts, gamma, temperature, top_p", [
    (2, 2, 1.0, 1.0), pytest.param(4, 2, 1.0, 1.0, marks=pytest.mark.slow), (4, 1, 0.7, 0.8)])
def test_sampling_keeps_the_verifiers_sequence_law(method, num_drafts, gamma, temperature, top_p):
  """3 tokens over V = 4 after a 3-token prompt, 100k rows: a wrong selection rule, a wrongly kept tree
  path (the toy model's logits read the previous token back from its cache) or drafts that are not i.i.d.
  change the law."""
  vocab, n_new, samples, prompt = 4, 3, 100_000, np.array([1, 2, 3])
  drafter, verifier = PositionalTrigram.random(1, vocab), PositionalTrigram.random(2, vocab)
  out = decoding.generate(jax.random.PRNGKey(num_drafts + 7 * gamma), drafter, verifier,
                          jnp.broadcast_to(jnp.asarray(prompt), (samples, 3)), method=method, num_drafts=num_drafts,
                          gamma=gamma, temperature=temperature, top_p=top_p, max_new_tokens=n_new, eos_id=None)
  np.testing.assert_array_equal(out.lengths, n_new)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new, temperature, top_p),
             what=f"{method} K={num_drafts}")
  assert 0 < np.mean(np.asarray(out.stats.rejected)) and np.sum(np.asarray(out.stats.accepted)) > 0


# specinfer in the default run; spectr is slow (make test-slow): both score their trees through the same tree
# attention and keep their path by the same KV-cache compaction, which the specinfer case checks, and spectr's
# selection law is the toy model's cases above (both methods, in the default run).
@pytest.mark.parametrize("method", [pytest.param("spectr", marks=pytest.mark.slow), "specinfer"])
def test_sampling_with_transformers_keeps_the_verifiers_sequence_law(method):
  """The same law through real tree attention and KV-cache compaction (20k rows)."""
  vocab, n_new, samples, prompt = 4, 3, 20_000, np.array([2, 0, 1])
  drafter, verifier = _transformers(vocab, max_length=32, scale=4.0)
  out = decoding.generate(jax.random.PRNGKey(3), drafter, verifier,
                          jnp.broadcast_to(jnp.asarray(prompt), (samples, 3)), method=method, num_drafts=3,
                          gamma=2, max_new_tokens=n_new, eos_id=None)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new), what=method)


def test_drafts_are_iid_samples_of_the_drafter():
  """Each of the K drafts follows the drafter's sequence law, and two drafts of one row are independent."""
  vocab, gamma, samples, prompt = 4, 2, 40_000, np.array([3, 1])
  drafter = PositionalTrigram.random(5, vocab)
  drafts_of = multi_draft.IIDDrafts(decoding.ModelDrafter(drafter), num_drafts=3)
  state, last = drafts_of.start(jnp.broadcast_to(jnp.asarray(prompt), (samples, 2)), jnp.full((samples,), 2), 16)
  drafts = drafts_of.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma, sampling=sampling.Sampling())
  tokens = np.asarray(drafts.tokens)
  assert tokens.shape == (samples, 3, gamma)
  law = sequence_law(drafter, prompt, gamma)
  for k in range(3):
    assert_law(sequence_codes(tokens[:, k], vocab), law, what=f"draft {k}")
  pair = sequence_codes(tokens[:, 0], vocab) * vocab ** gamma + sequence_codes(tokens[:, 2], vocab)
  assert_law(pair, np.outer(law, law).ravel(), what="drafts 0 and 2 jointly")


def _greedy_case(drafter, verifier, method, batch, num_drafts, gamma, vocab):
  rng = np.random.default_rng(batch)
  prompts = jnp.asarray(rng.integers(0, vocab, (batch, 6)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, 7, batch), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=20, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method=method,
                          num_drafts=num_drafts, gamma=gamma, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  return got.stats


# K = 1 runs the same code for both methods (verify.verify_block): once is enough. The default run covers
# both batch sizes and γ = 1 and 7 for each; the other cases are slow (make test-slow).
GREEDY_DEFAULT = {(1, 7), (8, 1)}


@pytest.mark.parametrize("gamma, batch, method, num_drafts", [
    pytest.param(gamma, batch, method, num_drafts, marks=() if (batch, gamma) in GREEDY_DEFAULT else pytest.mark.slow)
    for method, num_drafts in [("spectr", 1), ("spectr", 4), ("specinfer", 4)] for batch in (1, 8)
    for gamma in (1, 3, 7)])
def test_greedy_equals_the_verifiers_greedy(method, batch, num_drafts, gamma):
  stats = _greedy_case(*agreeing_toys(12), method, batch, num_drafts, gamma, 12)
  assert int(np.sum(stats.accepted)) > 0 and int(np.sum(stats.rejected)) > 0


@pytest.mark.parametrize("method, batch, num_drafts, gamma", [("spectr", 8, 3, 5), ("specinfer", 1, 4, 3)])
def test_greedy_with_transformers_equals_the_verifiers_greedy(method, batch, num_drafts, gamma):
  stats = _greedy_case(*_transformers(12, max_length=128), method, batch, num_drafts, gamma, 12)
  assert int(np.sum(stats.accepted)) > 0


@pytest.mark.parametrize("method", METHODS)
def test_one_draft_is_speculative_decoding(method):
  """K = 1: the same tokens as `speculative` for the same key (T = 1, top-P 0.9, ragged batch)."""
  drafter, verifier = _transformers(12, scale=3.0)
  rng = np.random.default_rng(3)
  prompts = jnp.asarray(rng.integers(0, 12, (8, 5)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, 6, 8), jnp.int32)
  kw = dict(gamma=3, top_p=0.9, max_new_tokens=24, eos_id=3)
  want = decoding.generate(jax.random.PRNGKey(1), drafter, verifier, prompts, lengths, method="speculative", **kw)
  got = decoding.generate(jax.random.PRNGKey(1), drafter, verifier, prompts, lengths, method=method,
                          num_drafts=1, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  for name in ("verifier_calls", "verifier_positions", "accepted", "rejected", "generated"):
    np.testing.assert_array_equal(getattr(got.stats, name), getattr(want.stats, name), err_msg=name)
  # The drafts make γ + 1 calls per block here; `speculative` skips the call on d_γ in rejected blocks.
  np.testing.assert_array_equal(got.stats.drafter_calls, want.stats.drafter_calls + want.stats.rejected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_counters_charge_the_scored_tree(temperature):
  """Per block: one verifier call scoring the row's tree at one of the widths 1 + k·γ (k = 1, 2, 4, K: at
  T = 0 the drafts coincide and the tree is one chain of γ + 1 nodes), γ + 1 drafter calls, K·γ drafts."""
  drafter, verifier = _transformers(12, scale=3.0)
  num_drafts, gamma = 8, 2
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 12, (4, 5)), jnp.int32)
  out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, method="spectr", num_drafts=num_drafts,
                          gamma=gamma, temperature=temperature, max_new_tokens=16, eos_id=None)
  s = jax.tree.map(np.asarray, out.stats)
  if temperature == 0.0:
    np.testing.assert_array_equal(s.verifier_positions, s.verifier_calls * (gamma + 1))
  else:
    per_call = s.verifier_positions / s.verifier_calls
    assert np.all(per_call > gamma + 1) and np.all(per_call <= 1 + num_drafts * gamma)
  np.testing.assert_array_equal(s.drafter_calls, s.verifier_calls * (gamma + 1))
  np.testing.assert_array_equal(s.drafted, s.verifier_calls * num_drafts * gamma)
  assert np.all(s.accepted <= s.verifier_calls * gamma) and np.all(s.rejected <= s.verifier_calls)
  np.testing.assert_array_equal(s.generated, 16)


def test_temperature_and_top_p_sweep_compiles_once():
  """A sweep over temperature and top-P (the top-p search in its program at every point, as the sweep asks
  with `truncation=True`), greedy included, compiles one program."""
  drafter, verifier = _transformers(12)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 12, (4, 5)), jnp.int32)
  kw = dict(method="spectr", num_drafts=8, gamma=2, max_new_tokens=16, eos_id=None)
  run = lambda temperature, top_p: decoding.generate(
      jax.random.PRNGKey(0), drafter, verifier, prompts, sampling=decoding.Sampling(temperature, top_p, truncation=True),
      **kw)
  run(1.0, 1.0)
  before = decoding._generate._cache_size()
  for temperature, top_p in [(0.5, 1.0), (1.0, 0.9), (0.0, 1.0), (0.8, 0.5)]:
    run(temperature, top_p)
  assert decoding._generate._cache_size() == before


def test_bad_input_raises_naming_the_parameter():
  drafter, verifier = _transformers(12)
  prompts = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="num_drafts"):
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, method="spectr", num_drafts=0,
                      max_new_tokens=4)
  with pytest.raises(ValueError, match="gamma"):
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, method="specinfer", gamma=0,
                      max_new_tokens=4)
  with pytest.raises(ValueError, match="max_length"):   # the tree needs 1 + K·γ cache slots
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, method="specinfer", num_drafts=8,
                      gamma=8, max_new_tokens=4)
