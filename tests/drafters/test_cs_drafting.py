"""CS Drafting: the lenient review's law, vertical cascades drafting exact samples of their upper model,
and speculative decoding with vertical / horizontal cascades keeping the verifier's output (greedy: token
for token, batch 1 and 8, ragged; T = 1: the law of whole sequences, by chi-square)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling, targets, verify
from tests.stats import assert_law, random_distributions, sequence_codes, sequence_law
from tests.toy_models import PositionalTrigram, tiny, tiny_pair


def _csd_law(q_lower, p, lenience):
  """CSD §3.2 written out: x ~ q_lower kept w.p. min(1, l·p(x)/q(x)), else a draw from norm(max(0, p − q))."""
  keep = np.where(q_lower > 0, np.minimum(1.0, lenience * p / np.where(q_lower > 0, q_lower, 1.0)), 0.0)
  residual = np.maximum(p - q_lower, 0.0)
  return q_lower * keep + (1.0 - np.sum(q_lower * keep, -1, keepdims=True)) * residual / residual.sum(-1, keepdims=True)


@pytest.mark.parametrize("lenience", [1.0, 1.7, 4.0])
def test_lenient_target_is_the_law_of_csds_lenient_review(lenience):
  rng = np.random.default_rng(0)
  q, p = random_distributions(rng, (64, 9)), random_distributions(rng, (64, 9))
  q[:8] = np.eye(9)[rng.integers(0, 9, 8)]             # deterministic lower drafters (Max-Gram): one-hot q
  pi = np.asarray(targets.lenient_target(jnp.asarray(q), jnp.asarray(p), q_raw=jnp.asarray(q), p_raw=jnp.asarray(p),
                                         lenience=lenience, greedy=False))
  want = _csd_law(q, p, lenience)
  np.testing.assert_allclose(pi, want, atol=1e-6)
  np.testing.assert_allclose(pi.sum(-1), 1.0, atol=1e-6)
  # Verifying q-drafts against π performs exactly that review: its law is π itself.
  np.testing.assert_allclose(np.asarray(verify.verification_law(jnp.asarray(q), jnp.asarray(pi))), want, atol=1e-6)
  if lenience == 1.0:
    np.testing.assert_allclose(pi, p, atol=1e-6)


def test_lenient_target_greedy_keeps_plausible_drafts_only_when_lenient():
  eye = np.eye(4, dtype=np.float32)
  q = eye[[2, 2, 1]]                                    # drafts 2, 2, 1 (one-hot: temperature 0)
  p_raw = np.array([[0.5, 0.1, 0.3, 0.1], [0.5, 0.1, 0.3, 0.1], [0.9, 0.05, 0.03, 0.02]], np.float32)
  p = eye[[0, 0, 0]]
  for lenience, kept in [(1.0, [0, 0, 0]), (3.5, [2, 2, 0]), (25.0, [2, 2, 1])]:
    pi = targets.lenient_target(jnp.asarray(q), jnp.asarray(p), q_raw=jnp.asarray(q), p_raw=jnp.asarray(p_raw),
                                lenience=lenience, greedy=True)
    np.testing.assert_array_equal(np.asarray(pi), eye[kept])


def _upper_and_prompt(vocab=4):
  return PositionalTrigram.random(7, vocab), [1, 2, 1, 3, 1]


@pytest.mark.parametrize("lower_gamma", [1, 3])
def test_vertical_cascade_drafts_are_exact_samples_of_its_upper_model(lower_gamma):
  """l = 1: whatever Max-Gram proposes, the γ = 3 drafts follow the upper model's sequence law, and q
  reports the upper model's distribution at every position (the bonus one included)."""
  vocab, gamma, samples = 4, 3, 60_000
  upper, prompt = _upper_and_prompt(vocab)
  cascade = decoding.VerticalCascade(upper, decoding.MaxGram(vocab), lower_gamma=lower_gamma)
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, len(prompt)))
  state, last = cascade.start(prompts, jnp.full((samples,), len(prompt)), cache_length=24)
  draft = jax.jit(lambda key, state, last: cascade.propose(key, state, last, max_drafts=gamma,
                                                           sampling=sampling.Sampling()))(jax.random.PRNGKey(1),
                                                                                          state, last)
  tokens = np.asarray(draft.tokens)
  seqs = np.array(list(itertools.product(range(vocab), repeat=gamma)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1))
  p = np.asarray(jax.nn.softmax(upper.logits(full)))[:, len(prompt) - 1:]
  law = np.take_along_axis(p[:, :gamma], seqs[:, :, None], -1)[..., 0].prod(1)
  assert_law((tokens * vocab ** np.arange(gamma - 1, -1, -1)).sum(1), law, what="vertical cascade drafts")
  # Reported q = the upper model's distribution given the drafted prefix, bonus position included.
  code = (tokens[:50] * vocab ** np.arange(gamma - 1, -1, -1)).sum(1)
  np.testing.assert_allclose(np.asarray(draft.q)[:50], p[code], atol=1e-5)
  assert np.all(np.asarray(draft.calls) >= 1) and np.all(np.asarray(draft.calls) <= gamma + 1)


def test_vertical_cascade_first_draft_under_lenience_follows_the_lenient_law():
  vocab, samples, lenience = 4, 60_000, 2.5
  upper, prompt = _upper_and_prompt(vocab)
  grams = decoding.MaxGram(vocab)
  cascade = decoding.VerticalCascade(upper, grams, lower_gamma=2, lenience=lenience)
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, len(prompt)))
  state, last = cascade.start(prompts, jnp.full((samples,), len(prompt)), cache_length=24)
  draft = cascade.propose(jax.random.PRNGKey(2), state, last, max_drafts=2, sampling=sampling.Sampling())
  proposal = _first_proposal(grams, prompt)
  p = np.asarray(jax.nn.softmax(upper.logits(jnp.asarray([prompt]))))[0, -1]
  want = _csd_law(np.eye(vocab)[proposal], p, lenience)
  assert want[proposal] > p[proposal]                    # lenience made the proposal more likely
  assert_law(np.asarray(draft.tokens)[:, 0], want, what="lenient first draft")
  np.testing.assert_allclose(np.asarray(draft.q)[0, 0], want, atol=1e-5)


def _first_proposal(grams, prompt):
  state, last = grams.start(jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)]), cache_length=24)
  return int(grams.propose(jax.random.PRNGKey(0), state, last, max_drafts=1, sampling=sampling.Sampling()).tokens[0, 0])


CASCADES = [dict(model_drafts=None, lower_gamma=3, lenience=1.0),    # vertical
            dict(model_drafts=None, lower_gamma=2, lenience=3.0),    # vertical, lenient
            dict(model_drafts=2, lower_gamma=3, lenience=2.0),       # vertical + horizontal
            dict(model_drafts=1, lower_gamma=0, lenience=1.0),       # horizontal: model, then Max-Gram
            dict(model_drafts=0, lower_gamma=3, lenience=1.0)]       # Max-Gram alone


# Each cascade at batch 8 (ragged rows) in the default run; batch 1 is slow (make test-slow).
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("cascade", CASCADES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_greedy_cs_drafting_equals_the_verifiers_greedy(batch, cascade):
  drafter, verifier = tiny_pair(12, 128)
  rng = np.random.default_rng(batch)
  prompts = jnp.asarray(np.tile(rng.integers(0, 12, (batch, 4)), (1, 3)), jnp.int32)   # repetitive prompts
  lengths = jnp.asarray(rng.integers(5, 13, batch), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=20, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method="cs_drafting",
                          gamma=4, **cascade, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert int(np.sum(got.stats.accepted)) > 0


@pytest.mark.parametrize("cascade", CASCADES[1:4], ids=["vertical-lenient", "vertical+horizontal", "horizontal"])
def test_cs_drafting_sampling_keeps_the_verifiers_sequence_law(cascade):
  """V = 4, 3 new tokens at T = 1: the output law must be Π_t p_t of the verifier alone (chi-square),
  whatever lenience does to the drafts."""
  vocab, n_new, samples = 4, 3, 60_000
  verifier, drafter = PositionalTrigram.random(2, vocab), PositionalTrigram.random(3, vocab)
  prompt = [1, 2, 1]
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, 3))
  out = decoding.generate(jax.random.PRNGKey(3), drafter, verifier, prompts, method="cs_drafting", gamma=2,
                          temperature=1.0, max_new_tokens=n_new, eos_id=None, **cascade)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new),
             what=f"cs_drafting {cascade}")
  assert 0 < np.asarray(out.stats.rejected).sum() < np.asarray(out.stats.verifier_calls).sum()


def test_batched_rows_progress_independently():
  """B = 8 rows with different prompts (so different match lengths) in one loop give each row what it
  gives alone."""
  drafter, verifier = tiny_pair(12, 128)
  rng = np.random.default_rng(3)
  prompts = np.concatenate([np.tile(rng.integers(0, 12, (8, 3)), (1, 4)), rng.integers(0, 12, (8, 2))], 1)
  prompts[::2] = rng.integers(0, 12, (4, 14))                          # half the rows do not repeat
  lengths = rng.integers(6, 15, 8)
  kw = dict(method="cs_drafting", gamma=3, model_drafts=2, lower_gamma=3, temperature=0.0, max_new_tokens=16,
            eos_id=None)
  together = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, jnp.asarray(prompts), lengths, **kw)
  calls = []
  for b in range(8):
    alone = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, jnp.asarray(prompts[b:b + 1]),
                              lengths[b:b + 1], **kw)
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[b])
    assert int(alone.stats.verifier_calls[0]) == int(together.stats.verifier_calls[b])
    calls.append(int(alone.stats.verifier_calls[0]))
  assert len(set(calls)) > 1                                           # rows really progressed differently


def test_bad_cascade_arguments_are_refused():
  verifier = tiny(4, 12, 64)
  prompts = jnp.zeros((1, 4), jnp.int32)
  for bad, match in [(dict(model_drafts=6), "model_drafts"), (dict(lenience=0.5), "lenience"),
                     (dict(lower_gamma=-1), "lower_gamma")]:
    with pytest.raises(ValueError, match=match):
      decoding.generate(jax.random.PRNGKey(0), verifier, verifier, prompts, method="cs_drafting", gamma=5,
                        max_new_tokens=4, **bad)
  with pytest.raises(ValueError, match="vocabularies"):
    decoding.VerticalCascade(verifier, decoding.MaxGram(vocab_size=13))
  with pytest.raises(ValueError, match="BiLD"):
    decoding.generate(jax.random.PRNGKey(0), decoding.VerticalCascade(verifier, decoding.MaxGram(12)), verifier,
                      prompts, method="bild", max_new_tokens=4)


def test_a_three_level_vertical_cascade_keeps_the_verifiers_greedy_output():
  """verifier ← model A ← (model B ← Max-Gram): the recursion of CSD's Alg. 1, through the Drafter interface."""
  verifier, middle, bottom = (tiny(seed, 12, 128) for seed in (4, 5, 6))
  rng = np.random.default_rng(7)
  prompts = jnp.asarray(np.tile(rng.integers(0, 12, (4, 4)), (1, 3)), jnp.int32)
  lengths = jnp.asarray(rng.integers(5, 13, 4), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=16, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  lower = decoding.VerticalCascade(bottom, decoding.MaxGram(12), lower_gamma=2)
  cascade = decoding.VerticalCascade(middle, lower, lower_gamma=3)
  assert cascade.cache_overhang == 3 + 1 + lower.cache_overhang
  got = decoding.generate(jax.random.PRNGKey(0), cascade, verifier, prompts, lengths, method="speculative",
                          gamma=4, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_a_cascade_of_t5_stages_sizes_decoder_caches_without_the_prompt():
  """A T5 decoder cache holds only the start token of the prompt (the prompt is the encoder's input), in
  the verifier and in every stage of a vertical cascade over T5 models: the run needs 1 + max_new_tokens +
  the overhangs, whatever the encoder input's width (48 here, beyond the decoders' 32 positions), and
  greedy speculative decoding with it equals the verifier's greedy decoding."""
  verifier, upper, lower = (tiny(seed, 16, 32, preset="t5_tiny") for seed in (0, 1, 2))
  cascade = decoding.VerticalCascade(upper, decoding.ModelDrafter(lower), lower_gamma=2)
  method, params, n_new = decoding.METHODS["speculative"], dict(rule="spec", alpha=0.0, gamma=3), 6
  needed = decoding.required_cache_length(method, params, verifier, cascade, prompt_width=48, max_new_tokens=n_new)
  assert needed == 1 + n_new + method.cache_overhang(params) + cascade.cache_overhang
  prompts = jax.random.randint(jax.random.PRNGKey(3), (2, 48), 2, 16)
  out = decoding.generate(jax.random.PRNGKey(0), cascade, verifier, prompts, method="speculative", gamma=3,
                          temperature=0.0, max_new_tokens=n_new, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                           temperature=0.0, max_new_tokens=n_new, eos_id=None)
  np.testing.assert_array_equal(out.tokens, want.tokens)
