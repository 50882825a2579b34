"""Whole-sequence laws of the decode loops, by enumeration on a tiny vocabulary vs Monte Carlo.

For 3 new tokens over V = 4 the law of the output sequence is Π_t π_t(x_t | x_<t), π_t computed from the
two models' teacher-forced logits at every prefix; 1e5 sequences per case are compared with it by a
chi-square test (tests/stats.py).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling, targets, verify
from tests.stats import assert_law
from tests.toy_models import PositionalTrigram, tiny_pair

V, N_NEW, SAMPLES = 4, 3, 100_000
PROMPTS = jnp.array([[1, 2, 3, 0], [2, 0, 0, 0]], jnp.int32)   # two rows, lengths 3 and 1
LENGTHS = jnp.array([3, 1], jnp.int32)
PAIRS = {
    "toy": (PositionalTrigram.random(1, V), PositionalTrigram.random(2, V)),
    # scaled-up random weights so the tiny transformer's distributions are far from uniform
    "transformer": tiny_pair(V, 32, seeds=(1, 2), scale=4.0),
    # the Llama family's decoder (models/decoder.py: RoPE, grouped-query attention, SwiGLU, RMSNorm)
    "llama": tiny_pair(V, 32, seeds=(1, 2), scale=0.2, preset="llama_tiny"),
}


def _exact_law(pair, prompt, method, rule, alpha, temperature, top_p, gamma):
  """P(x_1 x_2 x_3) over all V^3 continuations of `prompt`."""
  seqs = np.array(list(itertools.product(range(V), repeat=N_NEW)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1))
  start = len(prompt) - 1
  drafter, verifier = PAIRS[pair]
  lq = drafter.logits(full)[:, start:start + N_NEW]
  lp = verifier.logits(full)[:, start:start + N_NEW]
  q, p = sampling.transform(lq, temperature, top_p), sampling.transform(lp, temperature, top_p)
  q_raw, p_raw = jax.nn.softmax(lq), jax.nn.softmax(lp)
  if method == "autoregressive":
    law = p
  elif method == "token_cascade":
    delta = targets.deferral(rule, q_raw=q_raw, alpha=alpha)[..., None]
    law = jnp.where(delta, p, q)
  else:
    pi = targets.target_distribution(rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
    law = verify.verification_law(q, pi) if method == "speculative" else pi
    if method == "speculative" and targets.get_rule(rule).bonus == "p":
      assert gamma >= N_NEW, "lossy's bonus token is drawn from p: keep it out of the compared window"
  step = np.take_along_axis(np.asarray(law), seqs[:, :, None], -1)[..., 0]
  probs = step.prod(1)
  np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-5)
  return probs / probs.sum()


def _sample_codes(pair, method, rule, alpha, temperature, top_p, gamma, row):
  prompts = jnp.broadcast_to(PROMPTS[row], (SAMPLES, PROMPTS.shape[1]))
  lengths = jnp.broadcast_to(LENGTHS[row], (SAMPLES,))
  out = decoding.generate(jax.random.PRNGKey(row + 17 * gamma), *PAIRS[pair], prompts, lengths,
                          method=method, rule=rule, alpha=alpha, gamma=gamma, temperature=temperature,
                          top_p=top_p, max_new_tokens=N_NEW, eos_id=None)
  tokens = np.asarray(out.tokens)
  assert np.all(np.asarray(out.lengths) == N_NEW)
  return (tokens * V ** np.arange(N_NEW - 1, -1, -1)).sum(1), out


CASES = [
    ("autoregressive", "spec", 0.0, 1),
    ("speculative", "spec", 0.0, 1),
    ("speculative", "spec", 0.0, 2),
    ("speculative", "chow", 0.3, 2),
    ("speculative", "opt", 0.0, 1),
    ("speculative", "token_v3", 0.4, 2),
    ("speculative", "lossy", 0.3, 3),
    ("token_cascade", "chow", 0.4, 1),
    ("oracle_cascade", "diff", 0.1, 1),
]


@pytest.mark.parametrize("method, rule, alpha, gamma", CASES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.7)])
def test_sequence_law_matches_enumeration(method, rule, alpha, gamma, temperature, top_p):
  _check_law("toy", method, rule, alpha, gamma, temperature, top_p)


# token_v3's law is checked on the toy pair above; through the transformers' attention and caches, speculative
# decoding's is the spec case, so the token_v3 case is slow (make test-slow).
@pytest.mark.parametrize("method, rule, alpha, gamma", [
    ("speculative", "spec", 0.0, 2), pytest.param("speculative", "token_v3", 0.4, 3, marks=pytest.mark.slow),
    ("autoregressive", "spec", 0.0, 1)])
@pytest.mark.parametrize("pair", ["transformer", "llama"])
def test_sequence_law_with_transformers(pair, method, rule, alpha, gamma):
  _check_law(pair, method, rule, alpha, gamma, 1.0, 0.9)


def _check_law(pair, method, rule, alpha, gamma, temperature, top_p):
  row = 0 if gamma % 2 else 1
  codes, out = _sample_codes(pair, method, rule, alpha, temperature, top_p, gamma, row)
  law = _exact_law(pair, np.asarray(PROMPTS[row, :LENGTHS[row]]), method, rule, alpha, temperature,
                   top_p, gamma)
  assert_law(codes, law, what=f"{method}/{rule}")
  stats = out.stats
  if method == "speculative":
    assert np.asarray(stats.drafted).sum() > 0 and 0 < np.asarray(stats.rejected).mean()


@pytest.mark.parametrize("rule", ["lossy", "lossy_tuned"])
def test_lossy_bonus_token_is_drawn_from_p(rule):
  """γ = 1, two tokens: x_1 is the bonus after an accepted x_0 (drawn from p_1, Tran-Thien) or the next
  block's verified token after a rejection. P(x_0, x_1) = min(q_0, π_0)(x_0)·p_1(x_1)
  + P(reject)·norm(π_0 − q_0)₊(x_0)·law_1(x_1), law_1 = verification_law(q_1, π_1)."""
  drafter, verifier = PAIRS["toy"]
  prompt = np.asarray(PROMPTS[0, :LENGTHS[0]])
  seqs = np.array(list(itertools.product(range(V), repeat=2)))
  full = jnp.asarray(np.concatenate([np.broadcast_to(prompt, (len(seqs), len(prompt))), seqs], 1))
  start = len(prompt) - 1
  lq, lp = drafter.logits(full)[:, start:start + 2], verifier.logits(full)[:, start:start + 2]
  q, p = jax.nn.softmax(lq), jax.nn.softmax(lp)
  pi = np.asarray(targets.target_distribution(rule, q=q, p=p, q_raw=q, p_raw=p, alpha=0.4))
  q, p = np.asarray(q), np.asarray(p)
  x0, x1 = seqs[:, 0], seqs[:, 1]
  n = np.arange(len(seqs))
  accepted0 = np.minimum(q[:, 0], pi[:, 0])[n, x0]
  res0 = np.maximum(pi[:, 0] - q[:, 0], 0)
  p_reject = 1 - np.minimum(q[:, 0], pi[:, 0]).sum(-1)
  law1 = np.asarray(verify.verification_law(jnp.asarray(q[:, 1]), jnp.asarray(pi[:, 1])))[n, x1]
  probs = accepted0 * p[n, 1, x1] + p_reject * (res0 / res0.sum(-1, keepdims=True))[n, x0] * law1
  np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-5)
  out = decoding.generate(jax.random.PRNGKey(5), drafter, verifier,
                          jnp.broadcast_to(PROMPTS[0], (SAMPLES, PROMPTS.shape[1])),
                          jnp.broadcast_to(LENGTHS[0], (SAMPLES,)), method="speculative", rule=rule,
                          alpha=0.4, gamma=1, max_new_tokens=2, eos_id=None)
  codes = np.asarray(out.tokens) @ np.array([V, 1])
  assert_law(codes, probs / probs.sum(), what=rule)


@pytest.fixture
def mixture_rule():
  """A target rule registered from a test, touching nothing in decoding/: π = (1 − α)·p + α·q, its bonus π."""
  rule = targets.register_rule(targets.Rule(
      "test_mixture", lambda *, q, p, q_raw, p_raw, alpha, beta: (1.0 - alpha) * p + alpha * q,
      reads=frozenset({"q", "p"}), summary="(1 − α)·p + α·q"))
  yield rule.name
  del targets.RULES[rule.name]


def test_a_registered_rule_runs_exactly_in_every_loop_that_takes_rules(mixture_rule):
  """docs/extending.md, "A target rule": a `Rule` registered in core is run by speculative (γ = 2: its bonus
  position, inside the window, reads q) and oracle_cascade, law exact, α checked against its range."""
  _check_law("toy", "speculative", mixture_rule, 0.4, 2, 1.0, 0.7)
  _check_law("toy", "oracle_cascade", mixture_rule, 0.4, 1, 0.5, 1.0)
  with pytest.raises(ValueError, match=r"alpha \(rule 'test_mixture'\)"):
    decoding.generate(jax.random.PRNGKey(0), *PAIRS["toy"], PROMPTS, LENGTHS, method="speculative",
                      rule=mixture_rule, alpha=1.0, gamma=2, max_new_tokens=2)
