"""The feature drafter (EAGLE): a one-layer head on the verifier's own hidden states.

Lossless by construction (only the verifier's test decides what is emitted): greedy output equals the
verifier's greedy decoding, and at T > 0 the output law is the verifier's for the lossless rule and
T(q, p)'s verification law for a cascade rule. The drafter's bookkeeping is checked against the head run
teacher-forced on the verifier's real features: after any sequence of blocks, the q of a block's first
draft is the teacher-forced one.
"""

import dataclasses
import functools
import gc
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, models, sampling, targets, verify
from specdec.decoding.drafters import Verified
from specdec.decoding.feature_drafter import FeatureDrafter, check_pair
from specdec.models import feature_head
from specdec.models.base import prefill
from tests.commands import load_script
from tests.stats import assert_law
from tests.toy_models import PositionalTrigram, tiny

V = 4


def _verifier(vocab=V, seed=1, scale=4.0):
  return tiny(seed, vocab, 32, scale=scale)


def _drafter(verifier, seed=0, scale=3.0, feature_layers=()):
  head = feature_head.init(verifier, jax.random.PRNGKey(seed), feature_layers=feature_layers)
  return FeatureDrafter(head.replace(params=jax.tree.map(lambda w: scale * w, head.params)), verifier)


def _fused_pair(vocab=16, seed=0, scale=3.0, verifier_seed=1):
  """A three-layer Llama verifier and a head reading its layers 0 and 1 beside its last hidden state (EAGLE-3)."""
  verifier = tiny(verifier_seed, vocab, 32, scale=1.5, preset="llama_tiny", num_layers=3)
  return verifier, _drafter(verifier, seed, scale, feature_layers=(0, 1))


TEACHER_WIDTH = 16


def _teacher_forced_q(drafter, tokens, draft=1):
  """q of draft `draft` r after tokens [1, n] (the first n − r + 1 committed, then the r − 1 drafts before it) as
  the head predicts it in training: pass r of `predict_unrolled` on the verifier's real features (pass 1:
  teacher-forced). The tokens are padded on the right to TEACHER_WIDTH: the verifier and the head are causal, so
  the padding changes no position up to n − 1, and every call has one shape (its eager ops compile once)."""
  verifier, n = drafter.decoding_verifier(drafter.verifier), tokens.shape[1]
  padded = jnp.pad(tokens, ((0, 0), (0, TEACHER_WIDTH - n)))
  _, hidden = verifier.logits(padded, return_hidden=True)
  passes = drafter.head.predict_unrolled(hidden, verifier.token_embeddings(jnp.roll(padded, -1, axis=1)), draft)
  # position t pairs (f_t, x_{t+1}); the last real pair is (f_{n-2}, x_{n-1}) -> predicts x_n
  return jax.nn.softmax(verifier.output_logits(passes[draft - 1][:, n - 2:n - 1])[:, 0])


@pytest.mark.parametrize("fused", [False, True])
def test_every_draft_of_every_block_is_what_training_unrolls(fused):
  """And with fused features (EAGLE-3): the first draft reads the verifier's layers through the head's reduction,
  the later ones the head's own predictions, in decoding as in training."""
  verifier, drafter = _fused_pair() if fused else (_verifier(vocab=16), None)
  drafter = drafter or _drafter(verifier)
  verifier = drafter.decoding_verifier(verifier)
  prompt = jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32)
  sampling_ = sampling.Sampling(1.0, 1.0).checked()
  propose = jax.jit(lambda key, state, last: drafter.propose(key, state, last, max_drafts=3, sampling=sampling_))
  verified = jax.jit(drafter.verified)
  state, last = drafter.start(prompt, jnp.asarray([5]), 24)
  _, cache, hidden = models.base.prefill(verifier, verifier.init_cache(1, 24), prompt, jnp.asarray([5]),
                                         return_hidden=True)
  state = verified(state, Verified(tokens=prompt, count=jnp.asarray([4]), next_token=last,
                                   lengths=jnp.asarray([4]), hidden=hidden))
  sequence = prompt
  for n_accepted in (2, 0, 3, 1):
    draft = propose(jax.random.PRNGKey(n_accepted), state, last)
    # The cached and the teacher-forced path round apart (1e-5 at these peaked logits); a stale or
    # predicted feature moves q by far more.
    np.testing.assert_allclose(draft.q_raw[:, 0], _teacher_forced_q(drafter, sequence), atol=1e-4)
    # Later drafts read the head's own predictions: training's unrolled passes (EAGLE-3's training-time test).
    for r in (2, 3):
      drafted = jnp.concatenate([sequence, draft.tokens[:, :r - 1]], axis=1)
      np.testing.assert_allclose(draft.q_raw[:, r - 1], _teacher_forced_q(drafter, drafted, r), atol=1e-4)
    block = jnp.concatenate([last[:, None], draft.tokens], axis=1)
    scored = verifier.score(cache, block)
    cache, hidden = scored.cache, scored.hidden
    next_token = jnp.asarray([(n_accepted * 5 + 2) % 16], jnp.int32)
    committed = cache.lengths - 4 + n_accepted + 1
    cache = models.base.rollback(cache, committed)
    state = verified(draft.state, Verified(tokens=block, count=jnp.asarray([n_accepted + 1]),
                                           next_token=next_token, lengths=committed, hidden=hidden))
    sequence = jnp.concatenate([sequence, draft.tokens[:, :n_accepted], next_token[:, None]], axis=1)
    last = next_token


@pytest.mark.parametrize("fused", [False, True])
def test_chain_acceptance_replays_the_blocks_of_a_greedy_decode(fused):
  """`training.feature_head.losses`' chain_accepted_r counts the positions from which a greedy block accepts its
  first r drafts: on the verifier's greedy text, replaying the decode's blocks from those per-position outcomes
  gives the accepted drafts a greedy speculative decode counts (with fused features too: `generate` decodes with
  the verifier that returns them)."""
  from specdec.training import feature_head as training
  if fused:
    decoding_with, drafter = _fused_pair(vocab=V, seed=3, scale=1.0, verifier_seed=2)
  else:
    decoding_with = _verifier(vocab=V)
    drafter = _drafter(decoding_with, seed=3, scale=1.0)
  verifier = drafter.decoding_verifier(decoding_with)
  prompt, n_new, gamma = jnp.asarray([[1, 2, 3]], jnp.int32), 24, 3
  greedy = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompt, jnp.asarray([3]),
                             method="autoregressive", max_new_tokens=n_new + gamma + 1, temperature=0.0, eos_id=None)
  text = jnp.concatenate([prompt, greedy.tokens], axis=1)
  weights = jnp.ones(text.shape, jnp.float32)
  sums = training.losses(drafter.head.params, drafter.head, verifier, text, weights, None, 0.0, unroll=gamma)
  _, hidden = verifier.logits(text, return_hidden=True)
  passes = drafter.head.predict_unrolled(hidden[:, :-1], verifier.token_embeddings(text[:, 1:]), gamma)
  top1 = jnp.argmax(verifier.output_logits(hidden[:, 1:, -verifier.hidden_size:]), -1)[0]   # fused: f is last
  match = np.asarray([jnp.argmax(verifier.output_logits(p), -1)[0] == top1 for p in passes])   # [γ, L − 1]
  width = match.shape[1]
  accepted_from = np.zeros((gamma, width), bool)   # u: the block with pending token x_{u+1} accepts ≥ r + 1 drafts
  for u in range(width):
    for r in range(gamma):
      if u + r >= width or not match[r, u + r]:
        break
      accepted_from[r, u] = True
  np.testing.assert_array_equal([float(sums[f"chain_accepted_{r + 1}"]) for r in range(gamma)],
                                accepted_from.sum(axis=1))
  lengths, confidences = training.accepted_lengths(drafter.head, verifier, text, weights, gamma)
  np.testing.assert_array_equal(lengths[0], accepted_from.sum(axis=0))
  for r in range(gamma):   # draft r + 1 of the block from u is pass r + 1 at u + r
    top = np.asarray(jnp.max(jax.nn.softmax(verifier.output_logits(passes[r])), -1))[0]
    np.testing.assert_allclose(confidences[r, 0, :width - r], top[r:], rtol=1e-5)
  assert 0 < accepted_from[0].sum() < width and accepted_from[1].sum() > 0   # both outcomes occur
  u, generated, accepted = prompt.shape[1] - 2, 0, 0
  while generated < n_new:
    n_accepted = int(accepted_from[:, u].sum())
    u, generated, accepted = u + n_accepted + 1, generated + n_accepted + 1, accepted + n_accepted
  out = decoding.generate(jax.random.PRNGKey(1), drafter, decoding_with, prompt, jnp.asarray([3]),
                          method="speculative", gamma=gamma, max_new_tokens=n_new, temperature=0.0, eos_id=None)
  np.testing.assert_array_equal(out.tokens[0], greedy.tokens[0, :n_new])
  assert int(out.stats.accepted[0]) == accepted
  # scripts/head_acceptance.py's replay of a confidence stop: the calls of a decode that stops there.
  replay = load_script("head_acceptance").replayed_calls
  for stop_below in np.quantile(np.asarray(confidences[:, 0]), [0.3, 0.6]):
    calls, _ = replay(np.asarray(lengths), [3], [n_new], gamma, np.asarray(confidences), float(stop_below))
    stopped = decoding.generate(jax.random.PRNGKey(1), drafter, decoding_with, prompt, jnp.asarray([3]),
                                method="confidence_stop", max_gamma=gamma, stop_below=float(stop_below),
                                max_new_tokens=n_new, temperature=0.0, eos_id=None)
    np.testing.assert_array_equal(stopped.tokens[0], greedy.tokens[0, :n_new])
    assert int(stopped.stats.verifier_calls[0]) == calls and int(np.sum(stopped.stats.drafted)) < gamma * calls


@pytest.mark.parametrize("batch, gamma, rule", [(1, 3, "spec"), (8, 1, "token_v3"), (8, 7, "spec")])
def test_greedy_output_is_the_verifiers_greedy_output(batch, gamma, rule):
  verifier = _verifier(vocab=64, scale=1.0)
  drafter = _drafter(verifier, scale=1.0)
  rng = np.random.default_rng(batch * 10 + gamma)
  prompts = jnp.asarray(rng.integers(0, 64, (batch, 6)), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, 7, batch), jnp.int32)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive",
                           max_new_tokens=16, temperature=0.0, eos_id=None)
  got = decoding.generate(jax.random.PRNGKey(1), drafter, verifier, prompts, lengths, method="speculative",
                          rule=rule, alpha=0.0, gamma=gamma, max_new_tokens=16, temperature=0.0, eos_id=None)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def _self_distilled(verifier):
  """A drafter whose head agrees with the verifier often: the head's block copies the verifier's, so that
  acceptance is far from 0 and both accept and reject paths run."""
  return _drafter(verifier, seed=3, scale=1.0)


PROMPT = jnp.asarray([[1, 2, 3]], jnp.int32)
N_NEW, SAMPLES = 3, 100_000


def _codes(drafter, verifier, rule, alpha, gamma, method="speculative", **params):
  prompts = jnp.broadcast_to(PROMPT, (SAMPLES, PROMPT.shape[1]))
  rule_params = dict(rule=rule, alpha=alpha) if method == "speculative" else {}
  length = {"max_gamma" if method == "confidence_stop" else "gamma": gamma}
  out = decoding.generate(jax.random.PRNGKey(gamma), drafter, verifier, prompts, jnp.full((SAMPLES,), 3),
                          method=method, temperature=1.0, max_new_tokens=N_NEW, eos_id=None,
                          **length, **rule_params, **params)
  tokens = np.asarray(out.tokens)
  return (tokens * V ** np.arange(N_NEW - 1, -1, -1)).sum(1), out


# The chain (`speculative`) in the default run; the two trees over the feature drafter are slow (make test-slow:
# 100k rows of a K-draft tree through the transformer, over two minutes between them). The default run keeps
# each part of their claim: the tree loops' sequence laws (tests/drafters/test_multi_draft.py
# `test_sampling_keeps_the_verifiers_sequence_law` and `…_with_transformers_…` for specinfer,
# tests/drafters/test_dynamic_tree.py for the dynamic tree), the feature drafter's law on the chain (here),
# every copy's features after a tree block (`test_every_copy_of_k_drafts_reads_the_kept_paths_real_features`),
# the tree block over the feature drafter at K = 1 (`test_one_draft_token_trees_are_speculative_decoding`) and
# the dynamic tree's greedy output over it (tests/drafters/test_dynamic_tree.py).
@pytest.mark.parametrize("method, gamma, params", [
    ("speculative", 2, {}), ("confidence_stop", 3, {"stop_below": 0.6}),
    pytest.param("specinfer", 2, {"num_drafts": 3}, marks=pytest.mark.slow),
    pytest.param("dynamic_tree", 2, {"num_drafts": 2}, marks=pytest.mark.slow)])
def test_lossless_rule_keeps_the_verifiers_sequence_law(method, gamma, params):
  """SpecDecode (with a confidence stop too), token trees of K i.i.d. feature drafts (each copy re-reads the kept
  path's real features) and EAGLE-2's dynamic tree (K beams of the head): the output law is the verifier's.
  (SpecTr's selection shares the tree block: K = 1 below.)"""
  verifier = _verifier()
  drafter = _self_distilled(verifier)
  codes, out = _codes(drafter, verifier, "spec", 0.0, gamma, method=method, **params)
  seqs = np.array(list(itertools.product(range(V), repeat=N_NEW)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(PROMPT[0], (len(seqs), 3)), seqs], 1))
  p = jax.nn.softmax(verifier.logits(full)[:, 2:2 + N_NEW])
  law = np.take_along_axis(np.asarray(p), seqs[:, :, None], -1)[..., 0].prod(1)
  assert_law(codes, law / law.sum(), what=f"feature drafter, {method}")
  stats = out.stats
  assert 0 < np.asarray(stats.accepted).sum() < np.asarray(stats.drafted).sum()


def test_cascade_rule_first_token_follows_the_verification_law_of_t_q_p():
  """γ = 1 with a deferral rule: the first emitted token's law is verification_law(q, π), π = T(q, p),
  with q the head's prediction from the prompt's real features."""
  verifier = _verifier()
  drafter = _self_distilled(verifier)
  codes, _ = _codes(drafter, verifier, "chow", 0.4, 1)
  q_raw = _teacher_forced_q(drafter, PROMPT)
  p_raw = jax.nn.softmax(verifier.logits(PROMPT)[:, -1])
  pi = targets.target_distribution("chow", q=q_raw, p=p_raw, q_raw=q_raw, p_raw=p_raw, alpha=0.4)
  law = np.asarray(verify.verification_law(q_raw[:, None], pi[:, None]))[0, 0]
  assert_law(codes // V ** (N_NEW - 1), law, what="feature drafter, chow, first token")


def test_a_head_for_another_verifier_is_refused_naming_both():
  verifier, other = _verifier(seed=1), _verifier(seed=2)
  head = feature_head.init(verifier, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="trained for the verifier with output layer .*; this verifier's is"):
    check_pair(head, other)
  wider = models.build("2m", vocab_size=V, seed=1, max_length=32)
  with pytest.raises(ValueError, match="hidden size 32 .* the verifier has"):
    check_pair(head, wider)
  with pytest.raises(ValueError, match="trained for the verifier with output layer"):
    decoding.generate(jax.random.PRNGKey(0), FeatureDrafter(head, verifier), other, PROMPT, None,
                      method="speculative", max_new_tokens=2, eos_id=None)
  unmarked = head.replace(config=dataclasses.replace(head.config, fingerprint=""))
  with pytest.raises(ValueError, match="another verifier's output layer"):
    decoding.generate(jax.random.PRNGKey(0), FeatureDrafter(unmarked, verifier), other, PROMPT, None,
                      method="speculative", max_new_tokens=2, eos_id=None)


def test_a_verifiers_fingerprint_is_digested_once_per_table_and_follows_its_values():
  verifier = _verifier(seed=1)
  table = verifier.output_table()
  first = feature_head.verifier_fingerprint(verifier)
  assert feature_head._FINGERPRINTS[id(table)][1] == first
  assert feature_head.verifier_fingerprint(verifier) == first
  # A verifier whose output table holds other values (a new array) gets its own digest.
  changed = verifier.replace(params=jax.tree.map(lambda w: w * 1.5, verifier.params))
  assert changed.output_table() is not table
  assert feature_head.verifier_fingerprint(changed) != first
  assert feature_head.verifier_fingerprint(_verifier(seed=1)) == first     # equal values, a new array
  gc.collect()
  entries = len(feature_head._FINGERPRINTS)
  negated = lambda: verifier.replace(params=jax.tree.map(lambda w: -w, verifier.params))  # noqa: E731
  assert feature_head.verifier_fingerprint(negated()) != first
  gc.collect()
  assert len(feature_head._FINGERPRINTS) == entries     # a dropped table's entry goes with it


def test_a_verifier_without_hidden_state_access_is_named():
  head = feature_head.init(_verifier(), jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="through token_embeddings, output_logits, output_table, which "
                                       "PositionalTrigram"):
    check_pair(head, PositionalTrigram.random(0, V))


def test_one_draft_token_trees_are_speculative_decoding():
  """K = 1: the tree is the chain, and specinfer's and spectr's tokens are `speculative`'s for the same key
  (the hidden states handed to the drafter along the kept path are the chain's)."""
  verifier = _verifier(vocab=16, scale=1.0)
  drafter = _drafter(verifier, scale=1.0)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 16, (64, 5)), jnp.int32)
  run = functools.partial(decoding.generate, jax.random.PRNGKey(5), drafter, verifier, prompts, None, gamma=3,
                          temperature=1.0, max_new_tokens=12, eos_id=None)
  want = run(method="speculative")
  for method in ("specinfer", "spectr"):
    got = run(method=method, num_drafts=1)
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=method)
    np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted, err_msg=method)


def test_every_copy_of_k_drafts_reads_the_kept_paths_real_features():
  """After a multi-draft block (K copies drafting apart, one path kept), every copy's head state over the
  committed positions is the one a single feature drafter reaches from the same verified block."""
  from specdec.decoding.multi_draft import IIDDrafts
  verifier = _verifier(vocab=16, scale=1.0)
  drafter = _drafter(verifier, scale=1.0)
  k, gamma, length = 3, 3, 5
  prompt, lengths = jnp.asarray([[3, 7, 1, 12, 5], [2, 2, 9, 4, 0]], jnp.int32), jnp.asarray([5, 4])
  sampling_ = sampling.Sampling(1.0, 1.0).checked()
  _, cache, hidden = models.base.prefill(verifier, verifier.init_cache(2, 24), prompt, lengths, return_hidden=True)
  last = prompt[jnp.arange(2), lengths - 1]
  prefix = Verified(tokens=prompt, count=lengths - 1, next_token=last, lengths=lengths - 1, hidden=hidden)
  copies, single = IIDDrafts(drafter, k), drafter
  copies_state = copies.verified(copies.start(prompt, lengths, 24)[0], prefix)
  single_state = single.verified(single.start(prompt, lengths, 24)[0], prefix)
  drafts = copies.propose(jax.random.PRNGKey(1), copies_state, last, max_drafts=gamma, sampling=sampling_)
  single_draft = single.propose(jax.random.PRNGKey(2), single_state, last, max_drafts=gamma, sampling=sampling_)
  assert not np.all(np.asarray(drafts.tokens[:, 0]) == np.asarray(drafts.tokens[:, 1]))   # copies drafted apart
  kept, n_accepted = jnp.asarray([2, 1]), jnp.asarray([2, 0])
  path = jnp.concatenate([last[:, None], drafts.tokens[jnp.arange(2), kept]], axis=1)   # [B, γ + 1]
  path_hidden = verifier.score(cache, path).hidden
  next_token = jnp.asarray([6, 11], jnp.int32)
  count = n_accepted + 1
  block = Verified(tokens=path, count=count, next_token=next_token, lengths=lengths - 1 + count, hidden=path_hidden)
  copies_state = copies.verified(copies.keep(drafts.state, kept, lengths - 1, gamma + 1), block)
  single_state = single.verified(single_draft.state, block)
  for row in range(2):
    entries = int(block.lengths[row]) - 1
    for copy in range(k):
      np.testing.assert_allclose(copies_state.feature[row * k + copy], single_state.feature[row], atol=1e-6)
      for name in ("keys", "values"):
        # one row's [heads, slots, head_dim]: the committed slots
        got = copies_state.cache.kv[name][0][row * k + copy][:, :entries]
        np.testing.assert_allclose(got, single_state.cache.kv[name][0][row][:, :entries], atol=1e-5)
      assert int(copies_state.cache.lengths[row * k + copy]) == entries == int(single_state.cache.lengths[row])


@pytest.mark.parametrize("preset", ["tiny", "gemma2_tiny", "t5_tiny"])
def test_the_verifiers_accessors_give_its_own_logits_and_inputs(preset):
  """output_logits of the hidden states `score` returns are its logits (the transformer, Gemma 2 and T5's
  decoder, after a prefill), and the embeddings and output table have the hidden size."""
  verifier = models.build(preset, vocab_size=32, seed=4, max_length=32)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 32, (2, 7)), jnp.int32)
  last, cache = prefill(verifier, verifier.init_cache(2, 16), jnp.asarray(rng.integers(0, 32, (2, 4)), jnp.int32),
                        jnp.asarray([4, 2], jnp.int32))
  scored = verifier.score(cache, jnp.concatenate([last[:, None], tokens], 1))
  logits, hidden = scored.logits, scored.hidden
  np.testing.assert_allclose(verifier.output_logits(hidden), logits, atol=1e-4, rtol=1e-4)
  assert verifier.token_embeddings(tokens).shape == (2, 7, verifier.hidden_size)
  assert verifier.output_table().shape == (32, verifier.hidden_size)


def test_greedy_output_with_a_gemma2_verifier_is_its_greedy_output():
  verifier = models.build("gemma2_tiny", vocab_size=64, seed=2, max_length=32)
  drafter = _drafter(verifier, scale=1.0)
  prompts = jnp.asarray(np.random.default_rng(3).integers(0, 64, (4, 6)), jnp.int32)
  run = functools.partial(decoding.generate, jax.random.PRNGKey(0), verifier=verifier, prompts=prompts,
                          max_new_tokens=12, temperature=0.0, eos_id=None)
  want = run(drafter=None, method="autoregressive")
  got = run(drafter=drafter, method="speculative", gamma=3)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert 0 < int(np.sum(got.stats.drafted))


# --- a confidence stop: blocks end before the first draft whose top probability is below stop_below ----------

def test_a_confidence_stop_drafts_less_and_keeps_the_verifiers_greedy_output():
  """Greedy: the verifier's output at every threshold; stop_below = 0 is SpecDecode at γ = max_gamma, token for
  token and call for call at T = 1 too; a higher threshold drafts fewer tokens and makes fewer head calls (the
  draft loop ends once every row has stopped)."""
  verifier = _verifier()
  drafter = _drafter(verifier)   # peaked q: max q_raw spreads over (1/4, 1)
  prompts = jnp.asarray(np.random.default_rng(4).integers(0, V, (3, 6)), jnp.int32)
  run = functools.partial(decoding.generate, jax.random.PRNGKey(2), drafter, verifier, prompts=prompts,
                          max_new_tokens=16, eos_id=None)
  want = run(method="autoregressive", temperature=0.0)
  drafted, calls = [], []
  for stop_below in (0.0, 0.95, 0.999):
    got = run(method="confidence_stop", stop_below=stop_below, max_gamma=4, temperature=0.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    drafted.append(int(np.sum(got.stats.drafted)) / int(np.sum(got.stats.verifier_calls)))
  assert drafted[0] == 4 > drafted[1] > drafted[2]
  for stop_below in (0.0, 0.999):   # one row: the loop ends where it stops (4 drafts and `verified`'s call: 5)
    alone = run(prompts=prompts[:1], method="confidence_stop", stop_below=stop_below, max_gamma=4, temperature=0.0)
    calls.append(int(np.sum(alone.stats.drafter_calls)) / int(np.sum(alone.stats.verifier_calls)))
  assert calls[0] == 5 > calls[1]
  sampled = run(method="confidence_stop", stop_below=0.0, max_gamma=3, temperature=1.0)
  plain = run(method="speculative", gamma=3, temperature=1.0)
  np.testing.assert_array_equal(sampled.tokens, plain.tokens)
  for name in ("drafted", "accepted", "verifier_calls", "drafter_calls"):
    np.testing.assert_array_equal(getattr(sampled.stats, name), getattr(plain.stats, name))


def _draft_loop_condition_primitives(drafter, keep_drafting):
  """The primitives of the condition of `propose`'s draft loop, traced (no compile)."""
  prompts = jnp.zeros((2, 3), jnp.int32)
  state, last = drafter.start(prompts, jnp.asarray([3, 3]), cache_length=16)
  propose = functools.partial(drafter.propose, max_drafts=3, sampling=sampling.Sampling(),
                              keep_drafting=keep_drafting)
  jaxpr = jax.make_jaxpr(propose)(jax.random.PRNGKey(0), state, last)
  loops = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "while"]
  assert len(loops) == 1
  return {eqn.primitive.name for eqn in loops[0].params["cond_jaxpr"].jaxpr.eqns}


def test_the_draft_loop_reads_the_rows_only_where_a_stop_is_given():
  """Without a stop the loop's trip count is static (its condition reads the step alone: on a GPU/TPU no
  device-to-host read per call); with one it also ends once every row has stopped."""
  drafter = _drafter(_verifier())
  assert "reduce_or" not in _draft_loop_condition_primitives(drafter, None)
  assert "reduce_or" in _draft_loop_condition_primitives(drafter, lambda q_raw: jnp.max(q_raw, axis=-1) > 0.5)


# --- fused features (EAGLE-3): the head reads low and middle layers beside the last hidden state --------------

def test_fused_features_are_the_chosen_layers_normalised_then_the_last_hidden_state():
  """`Decoder.with_feature_layers`: the same logits and cache, hidden states [B, n, (k + 1)·E] whose last E are the
  plain ones and whose first E are layer 0's output RMS-normalised (a one-layer model of the same weights with a
  unit final gain computes it)."""
  verifier = tiny(1, 16, 32, scale=1.5, preset="llama_tiny", num_layers=3)
  fused = verifier.with_feature_layers((0, 1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (2, 9)), jnp.int32)
  logits, hidden = verifier.logits(tokens, return_hidden=True)
  fused_logits, fused_hidden = fused.logits(tokens, return_hidden=True)
  e = verifier.hidden_size
  assert fused_hidden.shape == (2, 9, 3 * e)
  np.testing.assert_array_equal(fused_logits, logits)
  np.testing.assert_array_equal(fused_hidden[..., 2 * e:], hidden)
  one_layer = models.decoder.Decoder(
      params={"embedder": verifier.params["embedder"], "layer_0": verifier.params["layer_0"],
              "final_norm": {"scale": jnp.ones((e,))}},
      config=dataclasses.replace(verifier.config, num_layers=1))
  np.testing.assert_allclose(fused_hidden[..., :e], one_layer.logits(tokens, return_hidden=True)[1], atol=1e-5)
  assert not np.allclose(fused_hidden[..., :e], fused_hidden[..., e:2 * e], atol=0.1)
  for layers in [(2,), (1, 0), (-1,)]:
    with pytest.raises(ValueError, match=r"feature_layers must be increasing layer indices in \[0, 2\)"):
      verifier.with_feature_layers(layers)


@pytest.mark.parametrize("gamma, batch", [(3, 1), (2, 4)])
def test_greedy_output_with_fused_features_is_the_verifiers(gamma, batch):
  verifier, drafter = _fused_pair(vocab=8, scale=1.0)   # a small vocabulary: the random head is accepted at times
  prompts = jnp.asarray(np.random.default_rng(gamma).integers(0, 8, (batch, 6)), jnp.int32)
  run = functools.partial(decoding.generate, jax.random.PRNGKey(0), verifier=verifier, prompts=prompts,
                          max_new_tokens=20, temperature=0.0, eos_id=None)
  want = run(drafter=None, method="autoregressive")
  got = run(drafter=drafter, method="speculative", gamma=gamma)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert 0 < int(np.sum(got.stats.accepted)) < int(np.sum(got.stats.drafted))


def test_a_fused_head_names_the_features_it_misses():
  verifier, drafter = _fused_pair()
  with pytest.raises(ValueError, match=r"features of width 96 \(layers \(0, 1\) and the last\); got width 32"):
    drafter.head.reduce(jnp.zeros((1, 2, 32)))
  transformer = _verifier(vocab=16)
  with pytest.raises(ValueError, match=rf"{type(transformer).__name__} does not return its layers' outputs"):
    FeatureDrafter(drafter.head, transformer).decoding_verifier(transformer)


# --- a draft vocabulary (FR-Spec): the head drafts among k of the V tokens --------------------------------------

def _restricted(drafter, ids):
  return FeatureDrafter(drafter.head.with_draft_vocabulary(ids), drafter.verifier)


def test_a_draft_vocabularys_q_is_the_heads_softmax_over_its_tokens_and_zero_elsewhere():
  """The first draft's q from the same state with and without the draft vocabulary: the head's softmax over
  the k tokens, renormalised, and 0 outside (the same features and head call: only the output layer's rows
  and S(·) differ)."""
  verifier = _verifier(vocab=16)
  drafter = _drafter(verifier)
  ids = np.array([0, 3, 4, 9, 15])
  restricted = _restricted(drafter, ids)
  prompt = jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32)
  _, _, hidden = models.base.prefill(verifier, verifier.init_cache(1, 24), prompt, jnp.asarray([5]),
                                     return_hidden=True)

  def first_draft(feature_drafter):
    state, last = feature_drafter.start(prompt, jnp.asarray([5]), 24)
    state = feature_drafter.verified(state, Verified(tokens=prompt, count=jnp.asarray([4]), next_token=last,
                                                     lengths=jnp.asarray([4]), hidden=hidden))
    return state, feature_drafter.propose(jax.random.PRNGKey(0), state, last, max_drafts=3,
                                          sampling=sampling.Sampling(1.0, 1.0).checked())

  state, draft = first_draft(restricted)
  assert state.table.shape == (5, verifier.hidden_size)
  full = np.asarray(first_draft(drafter)[1].q_raw, np.float64)[0, 0]
  want = np.zeros(16)
  want[ids] = full[ids] / full[ids].sum()
  np.testing.assert_allclose(draft.q_raw[0, 0], want, rtol=1e-5, atol=1e-7)
  outside = np.setdiff1d(np.arange(16), ids)
  assert np.all(np.asarray(draft.q)[0, :, outside] == 0) and np.all(np.isin(np.asarray(draft.tokens), ids))


def test_with_a_draft_vocabulary_the_beams_are_the_k_best_paths_among_its_tokens():
  """EAGLE-2's beams (`BeamDrafts`, top-k over the draft vocabulary's K·k candidates) against a beam search written
  here over the whole vocabulary from the head's unrolled q (`_teacher_forced_q`), restricted to the draft
  vocabulary: the same paths, best first."""
  verifier = _verifier(vocab=16)
  drafter = _drafter(verifier)
  ids = np.array([0, 3, 4, 9, 11, 15])
  restricted = _restricted(drafter, ids)
  prompt = jnp.asarray([[3, 7, 1, 12, 5]], jnp.int32)
  num_beams, gamma = 3, 3
  drafts_of = decoding.multi_draft.BeamDrafts(restricted, num_drafts=num_beams)
  state, last = drafts_of.start(prompt, jnp.asarray([5]), 24)
  _, _, hidden = models.base.prefill(verifier, verifier.init_cache(1, 24), prompt, jnp.asarray([5]),
                                     return_hidden=True)
  state = drafts_of.verified(state, Verified(tokens=prompt, count=jnp.asarray([4]), next_token=last,
                                             lengths=jnp.asarray([4]), hidden=hidden))
  drafts = drafts_of.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma, sampling=sampling.Sampling())

  def q_after(path):   # the head's q over all V tokens, 0 outside the draft vocabulary
    full = np.asarray(_teacher_forced_q(drafter, jnp.concatenate([prompt, jnp.asarray([path], jnp.int32)], 1)
                                        if path else prompt, draft=len(path) + 1), np.float64)[0]
    restricted_q = np.zeros_like(full)
    restricted_q[ids] = full[ids] / full[ids].sum()
    return restricted_q

  beams = [((), 0.0)]
  for _ in range(gamma):
    candidates = [(value + np.log(q), path + (x,)) for path, value in beams
                  for x, q in enumerate(q_after(list(path))) if q > 0]
    candidates.sort(key=lambda c: -c[0])
    beams = [(path, value) for value, path in candidates[:num_beams]]
  np.testing.assert_array_equal(drafts.tokens[0], np.array([path for path, _ in beams]))


@pytest.mark.parametrize("rule", [r for r in targets.RULES if r != "lossy"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_with_a_draft_vocabulary_every_rules_one_step_law_is_its_target(rule, temperature):
  """Exact enumeration over V = 6 with a draft vocabulary of k = 3: q and q_raw are the head's softmax over those
  tokens placed at their ids, 0 elsewhere (`FeatureDrafter.to_vocabulary`); for every target rule the law of one
  draft-and-verify step, q·min(1, π/q) + P(reject)·residual, is π — the tokens outside the draft vocabulary
  included, which only the residual emits."""
  rng = np.random.default_rng(len(rule) * 31 + int(10 * temperature))
  ids = np.array([0, 2, 5])
  head_logits = jnp.asarray(rng.normal(size=(16, 3)) * 2, jnp.float32)
  verifier_logits = jnp.asarray(rng.normal(size=(16, 6)) * 2, jnp.float32)
  placed = lambda x: jnp.zeros((16, 6), jnp.float32).at[:, ids].set(x)  # noqa: E731
  q, q_raw = placed(sampling.transform(head_logits, temperature)), placed(jax.nn.softmax(head_logits))
  p, p_raw = sampling.transform(verifier_logits, temperature), jax.nn.softmax(verifier_logits)
  alpha = {"chow_log": 0.7, "diff_log": 0.2, "opt_log": 0.5, "bild": 1.3}.get(rule, 0.3)
  pi = targets.target_distribution(rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
  accept = verify.acceptance_probability(q, pi)
  residual = verify.residual(pi, q)
  law = q * accept + (1.0 - jnp.sum(q * accept, -1, keepdims=True)) * residual / jnp.sum(residual, -1, keepdims=True)
  np.testing.assert_allclose(law, pi, atol=1e-6)
  outside = np.setdiff1d(np.arange(6), ids)
  assert np.all(np.asarray(q)[:, outside] == 0)
  if rule == "spec" and temperature > 0:   # the verifier's own law reaches the tokens the head never drafts
    assert np.all(np.asarray(law)[:, outside] > 0)


def test_with_a_draft_vocabulary_the_output_law_is_the_verifiers():
  """k = 2 of V = 4 tokens: the verifier emits the other two only through its residual and bonus draws, and the
  law of the 3 tokens is still its own (chi-square against enumeration, 100k rows)."""
  verifier = _verifier()
  drafter = _restricted(_self_distilled(verifier), [0, 2])
  codes, out = _codes(drafter, verifier, "spec", 0.0, 2)
  seqs = np.array(list(itertools.product(range(V), repeat=N_NEW)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(PROMPT[0], (len(seqs), 3)), seqs], 1))
  p = jax.nn.softmax(verifier.logits(full)[:, 2:2 + N_NEW])
  law = np.take_along_axis(np.asarray(p), seqs[:, :, None], -1)[..., 0].prod(1)
  assert_law(codes, law / law.sum(), what="feature drafter with a draft vocabulary")
  tokens = np.asarray(out.tokens)
  assert np.isin(tokens, [1, 3]).mean() > 0.05   # tokens outside the draft vocabulary are emitted
  assert 0 < np.asarray(out.stats.accepted).sum() < np.asarray(out.stats.drafted).sum()


@pytest.mark.parametrize("method, params", [("speculative", {}), ("dynamic_tree", {"num_drafts": 2})])
def test_greedy_output_with_a_draft_vocabulary_is_the_verifiers(method, params):
  verifier = _verifier(vocab=64, scale=1.0)
  drafter = _restricted(_drafter(verifier, scale=1.0), np.arange(0, 64, 3))
  prompts = jnp.asarray(np.random.default_rng(4).integers(0, 64, (4, 6)), jnp.int32)
  kw = dict(max_new_tokens=16, temperature=0.0, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, None, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(1), drafter, verifier, prompts, None, method=method, gamma=3,
                          **params, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_a_draft_vocabulary_must_be_increasing_token_ids():
  head = feature_head.init(_verifier(vocab=16), jax.random.PRNGKey(0))
  for bad in ([], [3, 3], [5, 2], [0, 16], [-1, 2]):
    with pytest.raises(ValueError, match=r"increasing list of token ids in \[0, 16\)"):
      head.with_draft_vocabulary(bad)


def test_the_draft_vocabulary_is_the_most_frequent_tokens_and_the_kept_ones(tmp_path):
  from specdec.training import feature_head as training
  counts = np.array([5, 0, 9, 9, 1, 7, 0, 2])
  np.testing.assert_array_equal(training.draft_vocabulary(counts, 3), [2, 3, 5])      # ties: the lower id first
  np.testing.assert_array_equal(training.draft_vocabulary(counts, 3, always=[6, 2]), [2, 3, 5, 6])
  with pytest.raises(ValueError, match=r"size must lie in \[1, 8\]"):
    training.draft_vocabulary(counts, 0)
  head = feature_head.init(_verifier(vocab=16), jax.random.PRNGKey(0)).with_draft_vocabulary([1, 4, 9])
  training.save_head(str(tmp_path), head)
  loaded = training.load_head(str(tmp_path))
  np.testing.assert_array_equal(loaded.draft_ids, [1, 4, 9])
  jax.tree.map(np.testing.assert_array_equal, loaded.params, head.params)
  with pytest.raises(FileNotFoundError, match=r"no feature head in .*nothing .*expected .*head.json; train one with"):
    training.load_head(str(tmp_path / "nothing"))
