"""EAGLE-2's dynamic draft tree (`dynamic_tree`): the drafts are the K beams of a beam search over the
drafter's confidence, checked against a beam search written here from the drafter's teacher-forced logits;
the output keeps the verifier's law (chi-square against enumeration, T = 1 and with temperature and top-P),
and greedy output is the verifier's greedy decoding token for token (toy pair, transformers, and a feature
drafter over a transformer and over T5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling, tree
from specdec.decoding import multi_draft
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.models import feature_head
from tests.stats import assert_law, chi2_pvalue, sequence_codes, sequence_law
from tests.toy_models import PositionalTrigram, agreeing_toys, tiny, tiny_pair


def _reference_beams(drafter, prompt, num_beams, gamma):
  """The K best paths of a beam search from `prompt`, best first, by Π_j q(x_j | prompt, x_<j) at T = 1:
  (paths [K, γ], each path's q at its γ + 1 positions [K, γ + 1, V])."""
  def q_after(path):
    tokens = jnp.asarray([list(prompt) + list(path)], jnp.int32)
    return np.asarray(jax.nn.softmax(drafter.logits(tokens)[0, -1]), np.float64)

  beams = [((), 0.0)] + [None] * (num_beams - 1)    # copies 1 … K−1 start at −∞: only copy 0 expands
  for _ in range(gamma):
    candidates = []
    for beam in beams:
      if beam is None:
        continue
      path, value = beam
      candidates += [(value + np.log(q), path + (x,)) for x, q in enumerate(q_after(path))]
    candidates.sort(key=lambda c: -c[0])
    beams = [(path, value) for value, path in candidates[:num_beams]]
  paths = [path for path, _ in beams]
  return np.array(paths), np.array([[q_after(path[:j]) for j in range(gamma + 1)] for path in paths])


def test_beams_are_the_k_best_paths_of_a_beam_search():
  """Tokens, q and each copy's cache after `BeamDrafts.propose` against `_reference_beams`, per row of a
  ragged batch (the toy drafter's cache holds its tokens, so a copy that kept another beam's entries shows)."""
  vocab, num_beams, gamma = 5, 3, 3
  drafter = PositionalTrigram.random(4, vocab)
  prompts = jnp.asarray([[1, 4, 2, 0], [3, 3, 0, 0], [2, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([4, 2, 1], jnp.int32)
  drafts_of = multi_draft.BeamDrafts(decoding.ModelDrafter(drafter), num_drafts=num_beams)
  state, last = drafts_of.start(prompts, lengths, 16)
  drafts = drafts_of.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma, sampling=sampling.Sampling())
  for row, length in enumerate(np.asarray(lengths)):
    prompt = np.asarray(prompts[row, :length])
    paths, q = _reference_beams(drafter, prompt, num_beams, gamma)
    np.testing.assert_array_equal(drafts.tokens[row], paths)
    np.testing.assert_allclose(drafts.q[row], q, atol=1e-5)
    for copy, path in enumerate(paths):
      held = np.asarray(drafts.state.kv[row * num_beams + copy, :length + gamma])
      np.testing.assert_array_equal(held, np.concatenate([prompt, path]))


def test_beams_verified_as_samples_of_q_would_not_keep_the_law():
  """The verification alone, one position, V = 4: the drafter's two most likely tokens as deterministic
  candidates. Tested as proposals δ_x (dynamic_tree) the emitted token follows p; tested against q, as
  SpecInfer tests sampled drafts, it does not (so the law tests above can fail)."""
  samples = 200_000
  q, p = np.array([0.5, 0.3, 0.15, 0.05]), np.array([0.1, 0.2, 0.3, 0.4])
  drafts = jnp.broadcast_to(jnp.asarray([[0], [1]], jnp.int32), (samples, 2, 1))
  target = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (samples, 2, 2, 4))

  def emitted(proposal):
    proposals = jnp.broadcast_to(jnp.asarray(proposal, jnp.float32), (samples, 2, 1, 4))
    n_accepted, index, next_token = tree.verify_tree(jax.random.PRNGKey(0), drafts, proposals, target)
    return np.where(np.asarray(n_accepted) > 0, np.asarray(drafts[:, :, 0])[np.arange(samples), index],
                    np.asarray(next_token))

  assert_law(emitted(np.eye(4)[[0, 1]][:, None]), p, what="δ_x proposals")
  assert chi2_pvalue(emitted(np.broadcast_to(q, (2, 1, 4))), p) < 1e-9


@pytest.mark.parametrize("num_drafts, gamma, temperature, top_p", [(2, 2, 1.0, 1.0), (3, 2, 0.7, 0.8)])
def test_sampling_keeps_the_verifiers_sequence_law(num_drafts, gamma, temperature, top_p):
  """3 tokens over V = 4 after a 3-token prompt, 100k rows. Deterministic drafts verified as if sampled
  from the drafter's q (SpecInfer's rounds with q instead of δ_x) change the law."""
  vocab, n_new, samples, prompt = 4, 3, 100_000, np.array([1, 2, 3])
  drafter, verifier = PositionalTrigram.random(1, vocab), PositionalTrigram.random(2, vocab)
  out = decoding.generate(jax.random.PRNGKey(num_drafts), drafter, verifier,
                          jnp.broadcast_to(jnp.asarray(prompt), (samples, 3)), method="dynamic_tree",
                          num_drafts=num_drafts, gamma=gamma, temperature=temperature, top_p=top_p,
                          max_new_tokens=n_new, eos_id=None)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new, temperature, top_p),
             what=f"dynamic_tree K={num_drafts}")
  assert 0 < np.mean(np.asarray(out.stats.rejected)) and np.sum(np.asarray(out.stats.accepted)) > 0


def _greedy(drafter, verifier, prompts, lengths, **kw):
  run = functools.partial(decoding.generate, jax.random.PRNGKey(0), verifier=verifier, prompts=prompts,
                          prompt_lengths=lengths, temperature=0.0, eos_id=None, **kw)
  want = run(drafter=None, method="autoregressive")
  got = run(drafter=drafter, method="dynamic_tree")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  return jax.tree.map(np.asarray, got.stats)


def test_greedy_equals_the_verifiers_greedy_and_beams_accept_more_than_one_chain():
  """Toy pair, ragged batch of 8: token for token; K = 3 beams accept more tokens per verifier call than
  K = 1 (one greedy chain) on this pair."""
  vocab = 12
  drafter, verifier = agreeing_toys(vocab)
  rng = np.random.default_rng(8)
  prompts = jnp.asarray(rng.integers(0, vocab, (8, 6)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, 7, 8), jnp.int32)
  per_call = []
  for num_drafts in (1, 3):
    stats = _greedy(drafter, verifier, prompts, lengths, gamma=3, num_drafts=num_drafts, max_new_tokens=20)
    assert stats.rejected.sum() > 0
    per_call.append(stats.accepted.sum() / stats.verifier_calls.sum())
  assert per_call[1] > per_call[0], per_call


def test_greedy_with_transformers_equals_the_verifiers_greedy():
  drafter, verifier = tiny_pair(12, 128)
  prompts = jnp.asarray(np.random.default_rng(1).integers(0, 12, (2, 5)), jnp.int32)
  stats = _greedy(drafter, verifier, prompts, jnp.asarray([5, 2], jnp.int32), gamma=3, num_drafts=4,
                  max_new_tokens=16)
  assert stats.accepted.sum() > 0


@pytest.mark.parametrize("preset", ["tiny", "t5_tiny"])
def test_greedy_with_a_feature_drafter_equals_the_verifiers_greedy(preset):
  """EAGLE-2's pairing: the head's beams over a transformer and over T5's decoder (T5 gives the head its
  decoder's hidden states; its prompt is the encoder's)."""
  verifier = tiny(2, 32, 32, scale=3.0, preset=preset)
  head = feature_head.init(verifier, jax.random.PRNGKey(0))
  drafter = FeatureDrafter(head.replace(params=jax.tree.map(lambda w: 3.0 * w, head.params)), verifier)
  prompts = jnp.asarray(np.random.default_rng(3).integers(2, 32, (4, 6)), jnp.int32)
  stats = _greedy(drafter, verifier, prompts, jnp.asarray([6, 3, 1, 5], jnp.int32), gamma=3, num_drafts=3,
                  max_new_tokens=12)
  assert stats.accepted.sum() > 0


def test_bad_input_raises_naming_the_parameter():
  drafter, verifier = PositionalTrigram.random(1, 4), PositionalTrigram.random(2, 4)
  with pytest.raises(ValueError, match="num_drafts"):
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, jnp.zeros((1, 3), jnp.int32),
                      method="dynamic_tree", num_drafts=0, max_new_tokens=4)
