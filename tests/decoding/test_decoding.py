"""Decode loops: greedy exactness, counters, batch invariance, compile-once, EOS, bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specdec import decoding
from specdec.models.acceptance_head import HeadConfig, init_head
from tests.toy_models import PositionalTrigram, tiny_pair

V = 8
N_NEW = 12
# The greedy tests below decode batches of BATCH prompts of width WIDTH (and single rows) with the same γ, so
# that they share their compiled decode loops (one per method, γ, batch and pair) instead of each compiling
# its own: compilation is most of this file's time.
BATCH, WIDTH = 8, 6


def _toy_pair():
  return PositionalTrigram.random(3, V, max_length=96), PositionalTrigram.random(4, V, max_length=96)


def _transformer_pair():
  return tiny_pair(V, 96, seeds=(3, 4))


PAIRS = {"toy": _toy_pair, "transformer": _transformer_pair}


def _prompts(rng, batch, width, vocab):
  lengths = rng.integers(1, width + 1, size=batch)
  prompts = rng.integers(0, vocab, size=(batch, width))
  prompts[np.arange(width)[None] >= lengths[:, None]] = 0
  return jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)


def _greedy(drafter, verifier, prompts, lengths, method="autoregressive", **kw):
  return decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method=method,
                           temperature=0.0, max_new_tokens=N_NEW, **kw, eos_id=None)


def assert_same_greedy(got, want, verifier, prompts, lengths, *, tie_tolerance=1e-4):
  """Token-for-token equality. A row may differ only after a near-tie of the verifier's top-2 logits
  (|gap| < tie_tolerance, where float rounding of two equivalent computations can flip argmax); such
  rows are reported by the caller, and must be rare."""
  got, want = np.asarray(got.tokens), np.asarray(want.tokens)
  ambiguous = 0
  for b in np.nonzero(np.any(got != want, axis=1))[0]:
    t = int(np.argmax(got[b] != want[b]))
    prefix = np.concatenate([np.asarray(prompts[b, :lengths[b]]), want[b, :t]])
    logits = np.asarray(verifier.logits(jnp.asarray(prefix)[None]))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < tie_tolerance, f"row {b} differs at token {t} without a tie"
    ambiguous += 1
  return ambiguous


# The default run covers each batch size and each γ for both pairs; the other cases are slow (make test-slow).
GREEDY_DEFAULT = {(8, 1), (1, 3), (8, 7)}


@pytest.mark.parametrize("batch, gamma, pair", [
    pytest.param(batch, gamma, pair, marks=() if (batch, gamma) in GREEDY_DEFAULT else pytest.mark.slow)
    for pair in ("toy", "transformer") for gamma in (1, 3, 7) for batch in (1, 8)])
def test_greedy_speculative_equals_verifier_greedy(pair, gamma, batch):
  """200 prompts of mixed lengths per case, float32. The toy model's logits are table lookups, so
  equality is exact. The transformer computes a position's logits through different batched matmuls
  when it scores γ+1 tokens than when it scores 1, so a near-tie of the top-2 logits (< 1e-4) may
  round differently: a row may then differ from that token on, which `assert_same_greedy` accepts
  only at a verified near-tie; we require fewer than 2% such rows."""
  drafter, verifier = PAIRS[pair]()
  rng = np.random.default_rng(gamma * 10 + batch)
  ambiguous = 0
  for _ in range(0, 200, batch):
    prompts, lengths = _prompts(rng, batch, WIDTH, V)
    want = _greedy(None, verifier, prompts, lengths)
    got = _greedy(drafter, verifier, prompts, lengths, method="speculative", gamma=gamma)
    ambiguous += assert_same_greedy(got, want, verifier, prompts, lengths)
    assert np.all(np.asarray(got.stats.drafted) > 0)
  assert ambiguous <= (0 if pair == "toy" else 4)


@pytest.mark.parametrize("pair", ["toy", "transformer"])
def test_identical_models_accept_every_draft(pair):
  _, verifier = PAIRS[pair]()
  rng = np.random.default_rng(0)
  prompts, lengths = _prompts(rng, BATCH, WIDTH, V)
  for gamma in (1, 3, 7):
    out = _greedy(verifier, verifier, prompts, lengths, method="speculative", gamma=gamma)
    stats = jax.tree.map(np.asarray, out.stats)
    np.testing.assert_array_equal(stats.verifier_calls, math.ceil(N_NEW / (gamma + 1)))
    np.testing.assert_array_equal(stats.accepted, stats.drafted)
    np.testing.assert_array_equal(stats.rejected, 0)
    np.testing.assert_array_equal(out.tokens, _greedy(None, verifier, prompts, lengths).tokens)


@pytest.mark.parametrize("rule, alpha", [("spec", 0.0), ("token_v3", 0.5), ("lossy", 0.3), ("chow", 0.3)])
def test_speculative_counters_are_consistent(rule, alpha):
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(1), 32, 6, V)
  gamma = 3
  out = decoding.generate(jax.random.PRNGKey(1), drafter, verifier, prompts, lengths, method="speculative",
                          rule=rule, alpha=alpha, gamma=gamma, max_new_tokens=N_NEW, eos_id=None)
  s = jax.tree.map(np.asarray, out.stats)
  np.testing.assert_array_equal(s.generated, out.lengths)
  np.testing.assert_array_equal(out.lengths, N_NEW)
  np.testing.assert_array_equal(s.drafted, gamma * s.verifier_calls)
  # γ calls per block; the call scoring d_γ (q at the bonus position) only in the blocks that accept every
  # draft, except for the targets that read q there before verifying (cascade and token rules).
  bonus_calls = s.verifier_calls - s.rejected if rule in ("spec", "lossy") else s.verifier_calls
  np.testing.assert_array_equal(s.drafter_calls, gamma * s.verifier_calls + bonus_calls)
  assert rule not in ("spec", "lossy") or np.any(s.rejected > 0)  # some call was saved
  # one corrected or bonus token per verifier call; only the last block can be cut by max_new_tokens
  overshoot = s.accepted + s.verifier_calls - s.generated
  assert np.all((overshoot >= 0) & (overshoot <= gamma))
  assert np.all(s.rejected <= s.verifier_calls) and np.all(s.accepted <= s.drafted)
  # accepted = Σ_k a_k with a_k = γ on the (calls − rejected) full blocks and a_k ≤ γ − 1 on the others
  full = s.verifier_calls - s.rejected
  assert np.all(s.accepted >= gamma * full) and np.all(s.accepted <= gamma * full + (gamma - 1) * s.rejected)
  assert s.accepted.sum() > 0 and s.rejected.sum() > 0


# Every method on the toy pair; the transformer pair (its batched matmuls) in the default run with the
# speculative and autoregressive loops, the other methods' cases slow.
@pytest.mark.parametrize("pair, method, rule", [
    pytest.param(pair, method, rule, marks=pytest.mark.slow if pair == "transformer" and method not in (
        "speculative", "autoregressive") else ())
    for pair in ("toy", "transformer")
    for method, rule in [("speculative", "spec"), ("token_cascade", "chow"), ("oracle_cascade", "diff"), ("bild", "spec"),
                         ("seq_cascade", "spec"), ("autoregressive", "spec")]])
def test_batch_invariance_greedy(method, rule, pair):
  drafter, verifier = PAIRS[pair]()
  prompts, lengths = _prompts(np.random.default_rng(2), BATCH, WIDTH, V)
  kw = dict(method=method, rule=rule, alpha=0.3, gamma=3)
  batched = _greedy(drafter, verifier, prompts, lengths, **kw)
  for b in range(BATCH):
    alone = _greedy(drafter, verifier, prompts[b:b + 1], lengths[b:b + 1], **kw)
    np.testing.assert_array_equal(batched.tokens[b], alone.tokens[0])
    for name in decoding.common.STAT_NAMES:
      if method == "token_cascade" and name == "verifier_positions":
        continue   # a batched row also catches up in other rows' calls, uncharged: it needs fewer positions
      assert getattr(batched.stats, name)[b] == getattr(alone.stats, name)[0], (method, name)


def _row_case(method):
  drafter, verifier = _transformer_pair() if method == "specdec_pp" else _toy_pair()
  if method == "specdec_pp":
    head = init_head(HeadConfig(drafter.config.embed_dim, depth=1), jax.random.PRNGKey(3))
    drafter = decoding.ModelDrafter(drafter, head=head)
  kw = dict(method=method, temperature=1.0, max_new_tokens=N_NEW, eos_id=None,
            **({"rule": "opt", "alpha": 0.3} if method in ("speculative", "oracle_cascade") else {}))
  return lambda prompts, ids: decoding.generate(jax.random.PRNGKey(7), drafter, verifier, prompts, row_ids=ids, **kw)


@pytest.mark.parametrize("method", sorted(decoding.METHODS))
def test_a_rows_sample_depends_on_its_id_not_its_batch_position(method):
  """T = 1: row b draws from fold_in(key, row_ids[b]) alone, for every method: rows swapped with their ids
  give the same texts (prompts of one width, so no padding differs). Before per-row keys, the rows shared
  one draw and a row's sample changed with its position."""
  decode = _row_case(method)
  prompts = jnp.asarray(np.random.default_rng(5).integers(0, V, size=(3, 5)), jnp.int32)
  batched = decode(prompts, [4, 9, 2])
  swapped = decode(prompts[jnp.array([1, 0, 2])], [9, 4, 2])
  np.testing.assert_array_equal(swapped.tokens[jnp.array([1, 0, 2])], batched.tokens)
  moved = decode(prompts, [9, 4, 2])   # the ids, not the rows, carry the draws
  assert not np.array_equal(moved.tokens[:2], batched.tokens[:2])


@pytest.mark.parametrize("method", ["speculative", "spectr"])
def test_a_rows_sample_does_not_depend_on_the_batch_size(method):
  decode = _row_case(method)
  prompts = jnp.asarray(np.random.default_rng(6).integers(0, V, size=(3, 5)), jnp.int32)
  np.testing.assert_array_equal(decode(prompts, [4, 9, 2]).tokens[1], decode(prompts[1:2], [9]).tokens[0])


def test_sweep_compiles_once_per_method_rule_gamma():
  """α, temperature and top-P are traced: one program for the whole grid (`truncation=True`: the top-p
  search in it at top-P = 1 too, as a sweep asks). top-P = 1 alone compiles a program without the search,
  which draws the same tokens."""
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(3), 4, 5, V)
  before = decoding._generate._cache_size()
  run = lambda alpha, sampling: decoding.generate(
      jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method="speculative", rule="token_v3",
      alpha=float(alpha), gamma=2, sampling=sampling, max_new_tokens=4, eos_id=None)
  for temperature in (0.0, 0.5, 1.0):
    for top_p in (0.9, 1.0):
      for alpha in np.linspace(0.0, 0.95, 10):
        searched = run(alpha, decoding.Sampling(temperature, top_p, truncation=True))
  assert decoding._generate._cache_size() - before == 1
  np.testing.assert_array_equal(run(0.95, decoding.Sampling(1.0, 1.0)).tokens, searched.tokens)
  assert decoding._generate._cache_size() - before == 2


def test_eos_and_max_new_tokens_per_row():
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(4), 64, 4, V)
  eos = 2
  for method in ("speculative", "autoregressive", "token_cascade", "bild"):
    out = decoding.generate(jax.random.PRNGKey(5), drafter, verifier, prompts, lengths, method=method,
                            rule="chow" if method == "token_cascade" else "spec", alpha=0.3, gamma=3,
                            max_new_tokens=N_NEW, eos_id=eos)
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    assert np.any(n < N_NEW) and np.any(n == N_NEW)
    for b in range(64):
      row = tokens[b, :n[b]]
      assert np.all(row[:-1] != eos) and (n[b] == N_NEW or row[-1] == eos)
      assert np.all(tokens[b, n[b]:] == 0)
    np.testing.assert_array_equal(out.stats.generated, n)


def test_token_cascade_calls_verifier_only_on_deferral():
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(6), 16, 4, V)
  for alpha, expect in ((0.999, "never"), (0.0, "always")):
    out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths,
                            method="token_cascade", rule="chow", alpha=alpha, max_new_tokens=N_NEW, eos_id=None)
    s = jax.tree.map(np.asarray, out.stats)
    np.testing.assert_array_equal(s.drafter_calls, N_NEW)
    if expect == "never":  # only the forced call after MAX_DRAFTER_RUN drafter tokens
      np.testing.assert_array_equal(s.verifier_calls, N_NEW // (decoding.cascades.MAX_DRAFTER_RUN + 1))
    else:
      np.testing.assert_array_equal(s.verifier_calls, N_NEW)
    np.testing.assert_array_equal(s.deferred, s.verifier_calls)


def test_bad_input_raises():
  drafter, verifier = _toy_pair()
  other = PositionalTrigram.random(5, V + 1)
  prompts, lengths = _prompts(np.random.default_rng(7), 2, 4, V)
  call = lambda **kw: decoding.generate(jax.random.PRNGKey(0), kw.pop("drafter", drafter),
                                        kw.pop("verifier", verifier), kw.pop("prompts", prompts),
                                        kw.pop("lengths", lengths), **{"method": "speculative",
                                                                       "max_new_tokens": 4, **kw}, eos_id=None)
  with pytest.raises(ValueError, match="vocabularies differ"):
    call(drafter=other)
  with pytest.raises(ValueError, match="max_length"):
    call(max_new_tokens=200)
  with pytest.raises(ValueError, match="gamma"):
    call(gamma=0)
  with pytest.raises(ValueError, match="unknown method"):
    call(method="medusa")
  with pytest.raises(ValueError, match="unknown rule"):
    call(rule="opt2")
  with pytest.raises(ValueError, match="alpha"):
    call(rule="lossy", alpha=1.0)
  with pytest.raises(ValueError, match="top_p"):
    call(top_p=0.0)
  with pytest.raises(ValueError, match="prompt_lengths"):
    call(lengths=jnp.array([0, 2]))
  with pytest.raises(ValueError, match="chow"):
    call(method="token_cascade", rule="diff")
  with pytest.raises(ValueError, match=r"prompts must be \[B, L\].*prompts\[None\]"):
    call(prompts=prompts[0], lengths=None)
  with pytest.raises(ValueError, match="prompts must be an integer array"):
    call(prompts=np.asarray(prompts).tolist())
  with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1; got 2.5"):
    call(max_new_tokens=2.5)
  with pytest.raises(ValueError, match="unknown parameter.*gama"):
    call(gama=3)
  # NumPy integer scalars are ints; prompt_lengths default to the whole width.
  out = call(gamma=np.int64(2), max_new_tokens=np.int32(3), lengths=None)
  assert out.tokens.shape == (2, 3)


@pytest.mark.parametrize("pair", ["toy", "transformer"])
def test_seq_cascade_defers_whole_responses_at_the_alpha_limits(pair):
  """Greedy: α = 0 defers every response (Π max q < 1) to the verifier; α → 1 keeps the drafter's."""
  drafter, verifier = PAIRS[pair]()
  prompts, lengths = _prompts(np.random.default_rng(8), BATCH, WIDTH, V)
  verifier_alone = _greedy(None, verifier, prompts, lengths)
  drafter_alone = _greedy(None, drafter, prompts, lengths)
  always = _greedy(drafter, verifier, prompts, lengths, method="seq_cascade", alpha=0.0)
  # over 3 tokens Π max q ≥ (1/V)^3 = 0.002 > 1 − 0.999: no response can defer
  never = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths,
                            method="seq_cascade", alpha=0.999, temperature=0.0, max_new_tokens=3, eos_id=None)
  np.testing.assert_array_equal(always.tokens, verifier_alone.tokens)
  np.testing.assert_array_equal(always.stats.deferred, N_NEW)
  np.testing.assert_array_equal(never.tokens, drafter_alone.tokens[:, :3])
  np.testing.assert_array_equal(never.stats.verifier_calls, 0)
  assert not np.array_equal(verifier_alone.tokens, drafter_alone.tokens)


@pytest.mark.parametrize("pair", ["toy", "transformer"])
def test_bild_rollback_and_fallback_limits(pair):
  """Greedy BiLD: α = 0 rolls back every draft (D > 0), so the output is the verifier's greedy; with a
  fallback that never fires and α above every D, each window of γ drafts is kept and the verifier adds
  one token per window."""
  drafter, verifier = PAIRS[pair]()
  prompts, lengths = _prompts(np.random.default_rng(9), BATCH, WIDTH, V)
  strict = _greedy(drafter, verifier, prompts, lengths, method="bild", alpha=0.0, gamma=3)
  np.testing.assert_array_equal(strict.tokens, _greedy(None, verifier, prompts, lengths).tokens)
  np.testing.assert_array_equal(strict.stats.accepted, 0)
  lenient = _greedy(drafter, verifier, prompts, lengths, method="bild", alpha=1e9, gamma=3,
                    fallback_alpha=1.0)
  s = jax.tree.map(np.asarray, lenient.stats)
  np.testing.assert_array_equal(s.verifier_calls, N_NEW // 4)
  np.testing.assert_array_equal(s.accepted, 3 * (N_NEW // 4))
  np.testing.assert_array_equal(s.rejected, 0)
  # ... and a confident-only fallback (α_f = 0) drafts while max q = 1, i.e. never for these models
  cautious = _greedy(drafter, verifier, prompts, lengths, method="bild", alpha=1e9, gamma=3,
                     fallback_alpha=0.0)
  np.testing.assert_array_equal(cautious.stats.drafted, 0)
  np.testing.assert_array_equal(cautious.tokens, _greedy(None, verifier, prompts, lengths).tokens)


REFERENCE_WIDTH = 48


def _next_token_probs(model, tokens):
  """The teacher-forced distribution of the token after `tokens` (a list). The sequence is padded on the
  right to REFERENCE_WIDTH, which leaves the logits of its positions unchanged (a position's logits read only
  positions up to it), so that every call has one shape and the eager ops compile once, not once per length."""
  padded = jnp.asarray(tokens + [0] * (REFERENCE_WIDTH - len(tokens)))[None]
  return np.asarray(jax.nn.softmax(model.logits(padded)[0, len(tokens) - 1]))


def _greedy_reference(drafter, verifier, prompt, n_new, step):
  """Runs `step(q_raw, p_raw, state) -> (token, state)` on teacher-forced logits, one token at a time."""
  tokens, state = list(prompt), None
  for _ in range(n_new):
    q_raw = _next_token_probs(drafter, tokens)
    p_raw = _next_token_probs(verifier, tokens)
    token, state = step(q_raw, p_raw, state)
    tokens.append(token)
  return tokens[len(prompt):]


@pytest.mark.parametrize("alpha", [0.3, 0.5, 0.7])
def test_token_cascade_greedy_matches_reference(alpha):
  """Alg. 2 at T = 0, long enough (30 tokens) to hit the 10-token cap and multi-token catch-ups."""
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(10), 4, 5, V)
  n_new = 30

  def step(q_raw, p_raw, run):
    run = run or 0
    if q_raw.max() < 1 - alpha or run == decoding.cascades.MAX_DRAFTER_RUN:
      return int(np.argmax(p_raw)), 0
    return int(np.argmax(q_raw)), run + 1

  out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method="token_cascade",
                          rule="chow", alpha=alpha, temperature=0.0, max_new_tokens=n_new, eos_id=None)
  for b in range(4):
    want = _greedy_reference(drafter, verifier, list(np.asarray(prompts[b, :lengths[b]])), n_new, step)
    np.testing.assert_array_equal(out.tokens[b], want)
  assert 0 < np.asarray(out.stats.verifier_calls).sum() < 4 * n_new


@pytest.mark.parametrize("alpha, fallback_alpha", [(1.0, 0.5), (2.0, 0.3), (0.5, 0.8), (1e9, 1.0)])
def test_bild_greedy_matches_reference(alpha, fallback_alpha):
  """Original BiLD at T = 0: draft argmax q while max q ≥ 1 − α_f (≤ γ), keep drafts while
  −log p(draft) ≤ α, the verifier's argmax at the first failure or the window's end."""
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(11), 4, 5, V)
  gamma, n_new = 3, 20
  for b in range(4):
    tokens = list(np.asarray(prompts[b, :lengths[b]]))
    want = []
    while len(want) < n_new:
      window = []
      for _ in range(gamma):  # fallback phase
        q_raw = _next_token_probs(drafter, tokens + window)
        if q_raw.max() < 1 - fallback_alpha:
          break
        window.append(int(np.argmax(q_raw)))
      kept = []
      for x in window:  # rollback phase
        p_raw = _next_token_probs(verifier, tokens + kept)
        if -np.log(p_raw[x]) > alpha:
          break
        kept.append(x)
      p_raw = _next_token_probs(verifier, tokens + kept)
      block = kept + [int(np.argmax(p_raw))]
      tokens += block
      want += block
    out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts[b:b + 1], lengths[b:b + 1],
                            method="bild", alpha=alpha, fallback_alpha=fallback_alpha, gamma=gamma,
                            temperature=0.0, max_new_tokens=n_new, eos_id=None)
    np.testing.assert_array_equal(out.tokens[0], want[:n_new])


@struct.dataclass
class _NaNAfter:
  """A model whose logits turn NaN from a given position on: generation must stop and raise, not hang."""
  inner: PositionalTrigram
  position: int = struct.field(pytree_node=False)
  encoder_decoder = False
  scores_trees = False
  feature_access = False

  @property
  def vocab_size(self):
    return self.inner.vocab_size

  def prompt_cache_positions(self, prompt_width):
    return prompt_width

  @property
  def max_length(self):
    return self.inner.max_length

  def logits(self, tokens):
    return self.inner.logits(tokens)

  def init_cache(self, batch_size, cache_length, layout=None):
    return self.inner.init_cache(batch_size, cache_length, layout)

  def score(self, cache, tokens):
    scored = self.inner.score(cache, tokens)
    positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])
    return scored.replace(logits=jnp.where((positions >= self.position)[..., None], jnp.nan, scored.logits))


@pytest.mark.parametrize("method, rule", [("speculative", "spec"), ("speculative", "token_v3"),
                                          ("autoregressive", "spec"), ("bild", "spec"),
                                          ("token_cascade", "chow"), ("oracle_cascade", "diff"),
                                          ("seq_cascade", "spec")])
def test_nan_logits_stop_and_raise(method, rule):
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(12), 3, 4, V)
  bad = _NaNAfter(verifier, position=6)
  with pytest.raises(FloatingPointError, match="NaN logits reached rows"):
    decoding.generate(jax.random.PRNGKey(0), drafter, bad, prompts, lengths, method=method, rule=rule,
                      alpha=0.0 if method != "bild" else 1.0, gamma=3, max_new_tokens=N_NEW, eos_id=None)


def test_rows_stop_at_the_vocabularys_eos_unless_told_otherwise():
  drafter, verifier = _toy_pair()
  prompts, lengths = _prompts(np.random.default_rng(4), 32, 4, V)
  stopped = decoding.generate(jax.random.PRNGKey(5), drafter, verifier, prompts, lengths, method="speculative",
                              gamma=3, max_new_tokens=N_NEW)
  free = decoding.generate(jax.random.PRNGKey(5), drafter, verifier, prompts, lengths, method="speculative",
                           gamma=3, max_new_tokens=N_NEW, eos_id=None)
  tokens, n = np.asarray(stopped.tokens), np.asarray(stopped.lengths)
  assert decoding.DEFAULT_EOS_ID == 1 and np.any(n < N_NEW)
  for b in range(32):
    assert n[b] == N_NEW or tokens[b, n[b] - 1] == decoding.DEFAULT_EOS_ID
    np.testing.assert_array_equal(tokens[b, :n[b]], np.asarray(free.tokens)[b, :n[b]])
  np.testing.assert_array_equal(free.lengths, N_NEW)
