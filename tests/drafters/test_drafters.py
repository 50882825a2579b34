"""Drafters that are not models: CS Drafting's Max-Gram. Its proposals on hand-made sequences, greedy
speculative output equal to the verifier's, and the verifier's exact sequence law under sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling
from tests.stats import assert_law, sequence_codes, sequence_law
from tests.toy_models import PositionalTrigram, tiny


def _propose(drafter, prompt, gamma):
  prompts = jnp.asarray([prompt], jnp.int32)
  state, last = drafter.start(prompts, jnp.asarray([len(prompt)]), cache_length=32)
  draft = drafter.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma, sampling=sampling.Sampling())
  return np.asarray(draft.tokens)[0].tolist(), np.asarray(draft.q)[0], draft


@pytest.mark.parametrize("prompt, gamma, expected", [
    ([5, 6, 7, 8, 5, 6], 3, [7, 8, 5]),          # the suffix "5 6" occurred at the start: copy what followed
    ([1, 2, 1, 2], 4, [1, 2, 1, 2]),              # the match runs into the present: continue periodically
    ([3, 4, 9, 4, 9, 3, 4], 2, [9, 4]),           # "3 4" (length 2) beats the later "4" (length 1)
    ([3, 4, 9, 8, 4, 7, 4], 1, [7]),              # among equal lengths the latest occurrence wins
])
def test_max_gram_copies_the_continuation_of_the_longest_latest_match(prompt, gamma, expected):
  tokens, q, draft = _propose(decoding.MaxGram(vocab_size=10), prompt, gamma)
  assert tokens == expected
  np.testing.assert_array_equal(q.argmax(-1)[:gamma], expected)
  np.testing.assert_array_equal(q.sum(-1), 1.0)
  assert int(draft.calls[0]) == 0 and int(draft.n_drafted[0]) == gamma


def test_max_gram_without_a_match_follows_the_bigram_table_or_repeats():
  table = decoding.bigram_table(np.array([[1, 2, 3, 1, 2, 0], [2, 3, 2, 3, 2, 3]]), np.array([5, 6]), 5)
  assert np.asarray(table).tolist() == [0, 2, 3, 2, 4]   # 3 → 2 (twice) beats 3 → 1; unseen 0, 4: themselves
  tokens, _, _ = _propose(decoding.MaxGram(vocab_size=5, bigram=table), [4, 1], 3)
  assert tokens == [2, 3, 2]
  tokens, _, _ = _propose(decoding.MaxGram(vocab_size=5), [4, 1], 2)
  assert tokens == [1, 1]
  tokens, _, _ = _propose(decoding.MaxGram(vocab_size=5, min_match=2, bigram=table), [1, 3, 4, 1], 1)
  assert tokens == [2]     # "1" recurs, but a match of 2 tokens is required: bigram 1 → 2
  with pytest.raises(ValueError, match="min_match <= max_match"):
    decoding.MaxGram(vocab_size=5, min_match=3, max_match=2)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculative_with_max_gram_equals_the_verifiers_greedy(gamma):
  verifier = tiny(4, 12, 96)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(np.tile(rng.integers(0, 12, (6, 4)), (1, 3)), jnp.int32)   # repetitive prompts
  lengths = jnp.asarray(rng.integers(5, 13, 6), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=16, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), decoding.MaxGram(vocab_size=12), verifier, prompts, lengths,
                          method="speculative", gamma=gamma, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert int(np.sum(got.stats.accepted)) > 0 and int(np.sum(got.stats.drafter_calls)) == 0


def test_speculative_sampling_with_max_gram_keeps_the_verifiers_sequence_law():
  """V = 4, 3 new tokens: the output law must be Π_t p_t (the verifier sampling alone), by chi-square."""
  vocab, n_new, samples = 4, 3, 100_000
  verifier = PositionalTrigram.random(2, vocab)
  prompt = [1, 2, 1]
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, 3))
  out = decoding.generate(jax.random.PRNGKey(3), decoding.MaxGram(vocab_size=vocab), verifier, prompts,
                          method="speculative", gamma=2, temperature=1.0, max_new_tokens=n_new, eos_id=None)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new), what="speculative/MaxGram")
  # Some blocks were accepted whole, others rejected: both branches of the acceptance test ran.
  assert 0 < np.asarray(out.stats.rejected).sum() < np.asarray(out.stats.verifier_calls).sum()


def test_gated_max_gram_drafts_only_where_the_text_repeats():
  grams = decoding.MaxGram(vocab_size=10, gate=2)
  assert grams.variable_length and not decoding.MaxGram(vocab_size=10).variable_length
  tokens, _, draft = _propose(grams, [5, 6, 7, 8, 5, 6], 3)            # "5 6" matched: 2 tokens
  assert tokens == [7, 8, 5] and int(draft.n_drafted[0]) == 3
  _, _, draft = _propose(grams, [3, 4, 9, 8, 4, 7, 4], 2)              # only "4" matched
  assert int(draft.n_drafted[0]) == 0
  with pytest.raises(ValueError, match="gate"):
    decoding.MaxGram(vocab_size=10, gate=9)


def test_greedy_speculative_with_gated_max_gram_equals_the_verifiers_greedy():
  """Rows draft 0 or γ tokens (the verifier scores the longest row's block), B = 8, half the rows repeating."""
  verifier = tiny(4, 12, 96)
  rng = np.random.default_rng(0)
  prompts = np.tile(rng.integers(0, 12, (8, 4)), (1, 3))
  prompts[::2] = rng.integers(0, 12, (4, 12))                           # half the rows do not repeat
  lengths = jnp.asarray(rng.integers(5, 13, 8), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=16, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, jnp.asarray(prompts), lengths,
                           method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), decoding.MaxGram(vocab_size=12, gate=2), verifier,
                          jnp.asarray(prompts), lengths, method="speculative", gamma=4, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  drafted = np.asarray(got.stats.drafted)
  assert np.all(drafted % 4 == 0) and np.any(drafted < 4 * np.asarray(got.stats.verifier_calls))


def test_speculative_sampling_with_gated_max_gram_keeps_the_verifiers_sequence_law():
  """V = 4, 3 tokens, T = 1: the verifier's sequence law (chi-square) with blocks of 0 or γ drafts."""
  vocab, n_new, samples = 4, 3, 100_000
  verifier = PositionalTrigram.random(2, vocab)
  prompt = [1, 2, 1, 3, 0]
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, 5))
  out = decoding.generate(jax.random.PRNGKey(4), decoding.MaxGram(vocab_size=vocab, gate=2), verifier, prompts,
                          method="speculative", gamma=2, temperature=1.0, max_new_tokens=n_new, eos_id=None)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new),
             what="speculative/gated MaxGram")
  drafted, calls = np.asarray(out.stats.drafted), np.asarray(out.stats.verifier_calls)
  assert 0 < drafted.sum() < 2 * calls.sum()                           # some blocks drafted, some did not


def test_a_drafter_reading_the_prompt_unlike_the_verifier_is_refused():
  """Both caches are committed to the verifier's lengths: a drafter that holds the prompt (Max-Gram, a
  decoder-only model) cannot serve an encoder-decoder verifier, nor mix with one in a cascade."""
  t5_model = tiny(0, 16, 32, preset="t5_tiny")
  prompts = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="both be decoder-only or both encoder-decoder"):
    decoding.generate(jax.random.PRNGKey(0), decoding.MaxGram(16), t5_model, prompts, method="speculative",
                      max_new_tokens=4)
  with pytest.raises(ValueError, match="read the prompt alike"):
    decoding.VerticalCascade(t5_model, decoding.MaxGram(16))
  assert decoding.ModelDrafter(t5_model).encoder_decoder and not decoding.MaxGram(16).encoder_decoder
