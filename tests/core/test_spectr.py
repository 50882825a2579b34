"""SpecTr: OTM-k by linear program, K-SEQ (Alg. 2, Thm 2) and DraftSelection (Alg. 3, Thm 3).

Notation as in the code: q is the drafter, p the target (the paper swaps them).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize

from specdec import spectr
from tests.stats import assert_binomial, assert_law, draw, random_distributions

N_SAMPLES = 100_000


def _uniform_pair(d, r):
  """Drafter U(d), target U(d/r) (App. B.2, Figure 1)."""
  return np.full(d, 1.0 / d), np.r_[np.full(d // r, r / d), np.zeros(d - d // r)]


def _bernoulli(a):
  return np.array([1.0 - a, a])


def _random_pair(rng, vocab_size):
  q = random_distributions(rng, (vocab_size,)).astype(np.float64)
  p = random_distributions(rng, (vocab_size,)).astype(np.float64)
  return q / q.sum(), p / p.sum()


# --- OTM-k (§5, App. B.2) and K-SEQ (§6, App. D) acceptance -------------------------------------------

@pytest.mark.parametrize("d, r", [(4, 2), (6, 3), (6, 2)])
def test_appB2_uniform_otm_optimum_is_1_minus_1_minus_1_over_r_to_the_k(d, r):
  q, p = _uniform_pair(d, r)
  for k in (1, 2, 3):
    assert spectr.otm_acceptance(q, p, k) == pytest.approx(1 - (1 - 1 / r) ** k, abs=1e-7)


def test_appD1_kseq_is_optimal_for_uniform_pairs():
  for d, r in [(4, 2), (6, 3), (120, 2), (120, 5), (120, 24)]:
    q, p = _uniform_pair(d, r)
    k = np.arange(1, 11)
    np.testing.assert_allclose(spectr.kseq_acceptance(q, p, k), 1 - (1 - 1 / r) ** k, atol=2e-6)
    # D.1: γ* = r·(1 − (1 − 1/r)^k).
    np.testing.assert_allclose(spectr.kseq_gamma(q, p, k), r * (1 - (1 - 1 / r) ** k), rtol=2e-6)


def test_appB2_bernoulli_otm_optimum_closed_form():
  for a, b, k in itertools.product([0.1, 0.25, 0.5, 0.8], [0.05, 0.25, 0.5, 0.9], [1, 2, 3]):
    want = min(b, 1 - (1 - a) ** k) + min(1 - b, 1 - a**k)
    got = spectr.otm_acceptance(_bernoulli(a), _bernoulli(b), k)
    assert got == pytest.approx(want, abs=1e-7), (a, b, k)


def test_sec6_kseq_is_not_optimal_for_bernoulli_counterexample():
  q, p = _bernoulli(0.25), _bernoulli(0.5)
  assert spectr.otm_acceptance(q, p, 2) == pytest.approx(0.9375, abs=1e-7)
  assert float(spectr.kseq_acceptance(q, p, 2)) == pytest.approx(0.8476, abs=1e-4)


def test_thm2_kseq_within_1_minus_1_over_e_of_otm_and_below_it():
  rng = np.random.default_rng(0)
  for vocab_size in (2, 3, 4):
    pairs = [_random_pair(rng, vocab_size) for _ in range(9)]
    ks = np.tile([1, 2, 3], 3)
    q, p = np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])
    kseq = np.asarray(spectr.kseq_acceptance(q, p, ks), np.float64)
    otm = np.array([spectr.otm_acceptance(q[i], p[i], int(ks[i])) for i in range(len(ks))])
    assert np.all(kseq <= otm + 1e-5), (kseq, otm)
    # Thm 2's proof gives the factor 1 − (1 − 1/k)^k ≥ 1 − 1/e.
    assert np.all(kseq >= (1 - (1 - 1 / ks) ** ks) * otm - 1e-5), (kseq, otm)
    assert np.all(kseq >= (1 - np.exp(-1)) * otm)


def test_k1_kseq_and_otm_both_equal_sum_of_min():
  rng = np.random.default_rng(1)
  pairs = [_random_pair(rng, 5) for _ in range(6)]
  q, p = np.stack([a for a, _ in pairs]), np.stack([b for _, b in pairs])
  want = np.minimum(q, p).sum(-1)
  np.testing.assert_allclose(spectr.kseq_acceptance(q, p, 1), want, atol=1e-6)
  np.testing.assert_allclose([spectr.otm_acceptance(a, b, 1) for a, b in pairs], want, atol=1e-7)


def test_thm2_gamma_star_solves_eq6_in_1_k_with_traced_k():
  rng = np.random.default_rng(2)
  q = random_distributions(rng, (4, 8, 6))
  p = random_distributions(rng, (4, 8, 6))
  k = jnp.asarray(rng.integers(1, 9, size=(4, 8)), jnp.int32)
  traces = []

  @jax.jit
  def gamma_and_beta(q, p, k):
    traces.append(1)
    gamma = spectr.kseq_gamma(q, p, k)
    return gamma, spectr.kseq_beta(q, p, gamma)

  gamma, beta = gamma_and_beta(q, p, k)
  gamma_and_beta(q, p, k + 1)
  assert len(traces) == 1
  assert np.all((gamma >= 1) & (gamma <= k + 1e-5))
  np.testing.assert_allclose(1 - (1 - beta) ** k, gamma * beta, atol=2e-6)


def test_eq5_residual_at_gamma_star_is_max_p_minus_gamma_q():
  rng = np.random.default_rng(3)
  q, p = random_distributions(rng, (16, 7)), random_distributions(rng, (16, 7))
  k = jnp.asarray(rng.integers(2, 6, size=16))
  gamma = spectr.kseq_gamma(q, p, k)
  res = np.asarray(spectr.kseq_residual(q, p, gamma, k), np.float64)
  want = np.maximum(p - np.asarray(gamma)[:, None] * q, 0.0)
  # Rows where K-SEQ always accepts have no residual (the fallback p is never drawn).
  has_residual = want.sum(-1) > 1e-4
  np.testing.assert_allclose(res.sum(-1), 1 - spectr.kseq_acceptance(q, p, k), atol=2e-6)
  np.testing.assert_allclose((res / res.sum(-1, keepdims=True))[has_residual],
                             (want / want.sum(-1, keepdims=True))[has_residual], atol=2e-4)


# --- K-SEQ sampling (Alg. 2) --------------------------------------------------------------------------

def test_alg2_kseq_select_keeps_target_law_and_acceptance_rate():
  rng = np.random.default_rng(0)
  q, p = _random_pair(rng, 8)
  drafts = draw(rng, np.broadcast_to(q, (N_SAMPLES, 3, 8)))
  token, accepted = jax.jit(spectr.kseq_select)(jax.random.key(0), drafts, q.astype(np.float32),
                                                p.astype(np.float32))
  assert_law(token, p, what="K-SEQ token")
  assert_binomial(int(accepted.sum()), N_SAMPLES, float(spectr.kseq_acceptance(q, p, 3)),
                  what="K-SEQ acceptance")


def test_alg2_kseq_select_with_traced_number_of_drafts():
  rng = np.random.default_rng(4)
  q, p = _random_pair(rng, 5)
  num_slots = 4
  k = rng.integers(1, num_slots + 1, size=N_SAMPLES)
  drafts = draw(rng, np.broadcast_to(q, (N_SAMPLES, num_slots, 5)))
  # Slots beyond k hold the token K-SEQ would accept most readily: using them would bias the law.
  drafts = np.where(np.arange(num_slots) < k[:, None], drafts, np.argmax(p / np.maximum(q, 1e-9)))
  token, accepted = jax.jit(spectr.kseq_select)(jax.random.key(4), drafts, q, p, k)
  for n in range(1, num_slots + 1):
    rows = k == n
    assert_law(token[rows], p, what=f"token, k = {n}")
    assert_binomial(int(accepted[rows].sum()), int(rows.sum()), float(spectr.kseq_acceptance(q, p, n)),
                    what=f"acceptance, k = {n}")


def test_alg2_kseq_select_with_active_mask_anywhere():
  rng = np.random.default_rng(5)
  q, p = _random_pair(rng, 6)
  drafts = draw(rng, np.broadcast_to(q, (N_SAMPLES, 5, 6)))
  masks = np.array([[False, True, False, False, True], [False] * 5])
  which = rng.integers(0, 2, size=N_SAMPLES)
  active = masks[which]
  drafts = np.where(active, drafts, np.argmax(p / np.maximum(q, 1e-9)))
  token, accepted = jax.jit(spectr.kseq_select)(jax.random.key(5), drafts, q, p, active=active)
  two = which == 0
  assert_law(token[two], p, what="token, 2 active drafts")
  assert_binomial(int(accepted[two].sum()), int(two.sum()), float(spectr.kseq_acceptance(q, p, 2)),
                  what="acceptance, 2 active drafts")
  # No active draft: K-SEQ with k = 0 is a plain draw from p.
  assert_law(token[~two], p, what="token, no active draft")
  assert not np.any(accepted[~two])


# --- DraftSelection (Alg. 3, Thm 3) -------------------------------------------------------------------
# Prefix-dependent tables on a complete V-ary tree: the empty prefix is node 0 and the child of node n by
# token v is n·V + 1 + v. Row n of a table is the next-token distribution after that prefix.

def _tables(rng, vocab_size, depth):
  num_nodes = (vocab_size ** (depth + 1) - 1) // (vocab_size - 1)
  q = random_distributions(rng, (num_nodes, vocab_size)).astype(np.float64)
  p = random_distributions(rng, (num_nodes, vocab_size)).astype(np.float64)
  return q / q.sum(-1, keepdims=True), p / p.sum(-1, keepdims=True)


def _child(node, token, vocab_size):
  return node * vocab_size + 1 + token


def _sample_drafts(rng, q_table, p_table, num_drafts, length):
  """K i.i.d. drafts of length L from q autoregressively, with their q [N,K,L,V] and p [N,K,L+1,V]."""
  vocab_size = q_table.shape[1]
  node = np.zeros((N_SAMPLES, num_drafts), np.int64)
  drafts, q_rows, p_rows = [], [], []
  for _ in range(length):
    q_rows.append(q_table[node])
    p_rows.append(p_table[node])
    drafts.append(draw(rng, q_table[node]))
    node = _child(node, drafts[-1], vocab_size)
  p_rows.append(p_table[node])
  return (np.stack(drafts, -1).astype(np.int32), np.stack(q_rows, 2).astype(np.float32),
          np.stack(p_rows, 2).astype(np.float32))


def _reference_gamma(q, p, k):
  f = lambda g: 1 - (1 - np.minimum(q, p / g).sum()) ** k - g * np.minimum(q, p / g).sum()  # noqa: E731
  return 1.0 if k == 1 or f(1.0) <= 0 else optimize.brentq(f, 1.0, k, xtol=1e-14)


def _reference_n_accepted_law(q_table, p_table, num_drafts, length):
  """Exact law of n_accepted by enumerating every draft tuple at every depth (Alg. 2 + Alg. 3)."""
  vocab_size = q_table.shape[1]

  @functools.lru_cache(maxsize=None)
  def law_from(node, depth, k):
    """Law of n_accepted given `depth` tokens kept so far, k drafts agreeing with them."""
    law = np.zeros(length + 1)
    if depth == length:
      law[length] = 1.0
      return law
    q, p = q_table[node], p_table[node]
    gamma = _reference_gamma(q, p, k)
    accept = np.minimum(1.0, p / np.maximum(gamma * q, 1e-300))
    res = np.maximum(p - gamma * q, 0.0)
    res = res / res.sum() if res.sum() > 1e-12 else p
    for x in itertools.product(range(vocab_size), repeat=k):
      prob_x = np.prod(q[list(x)])
      if prob_x == 0:
        continue
      selected, reject = np.zeros(vocab_size), 1.0
      for token in x:
        selected[token] += reject * accept[token]
        reject *= 1.0 - accept[token]
      selected += reject * res
      for y in range(vocab_size):
        agree = x.count(y)
        if agree == 0:
          law[depth] += prob_x * selected[y]
        else:
          law = law + prob_x * selected[y] * law_from(_child(node, y, vocab_size), depth + 1, agree)
    return law

  return law_from(0, 0, num_drafts)


@pytest.mark.parametrize("length, num_drafts, seed", [(2, 1, 0), (2, 3, 1), (3, 4, 3)])
def test_thm3_draft_selection_output_law_is_target_law(length, num_drafts, seed):
  vocab_size = 3
  rng = np.random.default_rng(seed)
  q_table, p_table = _tables(rng, vocab_size, length)
  drafts, q, p = _sample_drafts(rng, q_table, p_table, num_drafts, length)
  n_accepted, draft_index, next_token = map(
      np.asarray, jax.jit(spectr.draft_selection)(jax.random.key(seed), drafts, q, p))

  rows = np.arange(N_SAMPLES)
  chosen = drafts[rows, draft_index]  # [N, L]
  # Alg. 3 stops only when no active draft agrees with the selected token, the chosen one included.
  stopped = n_accepted < length
  assert np.all(chosen[rows[stopped], n_accepted[stopped]] != next_token[stopped])

  # Thm 3: output tokens, completed to length L+1 by autoregressive draws from p, follow Π p.
  sequence = np.where(np.arange(length + 1) < n_accepted[:, None], np.pad(chosen, ((0, 0), (0, 1))), 0)
  sequence[rows, n_accepted] = next_token
  node, code = np.zeros(N_SAMPLES, np.int64), np.zeros(N_SAMPLES, np.int64)
  for t in range(length + 1):
    sequence[:, t] = np.where(t > n_accepted, draw(rng, p_table[node]), sequence[:, t])
    node, code = _child(node, sequence[:, t], vocab_size), code * vocab_size + sequence[:, t]
  all_sequences = np.stack(np.unravel_index(np.arange(vocab_size ** (length + 1)),
                                            (vocab_size,) * (length + 1)), -1)
  target = np.ones(len(all_sequences))
  node = np.zeros(len(all_sequences), np.int64)
  for t in range(length + 1):
    target *= p_table[node, all_sequences[:, t]]
    node = _child(node, all_sequences[:, t], vocab_size)
  assert_law(code, target, what="completed DraftSelection output")

  # The number of kept draft tokens follows the exact K-SEQ/Alg. 3 law (so it spans 0..L).
  law = _reference_n_accepted_law(q_table, p_table, num_drafts, length)
  assert law.sum() == pytest.approx(1.0, abs=1e-9)
  assert law[length] > 0.02 and np.all(np.bincount(n_accepted, minlength=length + 1) > 0)
  assert_law(n_accepted, law, what="n_accepted")


def test_draft_selection_flags_nan_rows_inside_jit():
  rng = np.random.default_rng(6)
  q_table, p_table = _tables(rng, 3, 2)
  drafts, q, p = _sample_drafts(rng, q_table, p_table, 2, 2)
  drafts, q, p = drafts[:4], q[:4].copy(), p[:4].copy()
  p[1, 0, 1, 2] = np.nan
  n_accepted, draft_index, next_token = jax.jit(spectr.draft_selection)(jax.random.key(0), drafts, q, p)
  assert n_accepted[1] == draft_index[1] == next_token[1] == -1
  assert np.all(np.asarray(n_accepted)[[0, 2, 3]] >= 0)


# --- bad input ----------------------------------------------------------------------------------------

_Q = np.array([0.5, 0.3, 0.2])
_P = np.array([0.2, 0.2, 0.6])
_DRAFTS, _QS, _PS = np.zeros((2, 3, 2), np.int32), np.full((2, 3, 2, 3), 1 / 3), np.full((2, 3, 3, 3), 1 / 3)


@pytest.mark.parametrize("call, match", [
    (lambda: spectr.kseq_gamma(np.array([np.nan, 1.0, 0.0]), _P, 2), "q contains NaN"),
    (lambda: spectr.kseq_acceptance(_Q, -_P, 2), "p must be finite and non-negative"),
    (lambda: spectr.kseq_acceptance(_Q, _P[:2], 2), "vocabulary size"),
    (lambda: spectr.kseq_acceptance(np.ones((2, 3)) / 3, np.ones((3, 3)) / 3, 2), "do not broadcast"),
    (lambda: spectr.kseq_gamma(_Q, _P, 0), "k must lie in"),
    (lambda: spectr.kseq_gamma(_Q, _P, 1.5), "k must be an integer"),
    (lambda: spectr.kseq_beta(_Q, _P, 0.0), "gamma must lie in"),
    (lambda: spectr.kseq_residual(_Q, _P, 0.5, 2), "gamma must lie in"),
    (lambda: spectr.kseq_select(jax.random.key(0), np.array([0, 1]), _Q, _P, 3), "k must lie in"),
    (lambda: spectr.kseq_select(jax.random.key(0), np.array([0, 3]), _Q, _P), "drafts must lie in"),
    (lambda: spectr.kseq_select(jax.random.key(0), np.array([0, 1]), _Q, _P, 1, active=np.ones(2, bool)),
     "either k or active"),
    (lambda: spectr.kseq_select(jax.random.key(0), np.array([0, 1]), _Q, _P, active=np.ones(3, bool)),
     "active must be"),
    (lambda: spectr.otm_acceptance(_Q, _P, 0), "k \\(the number of drafts\\)"),
    (lambda: spectr.otm_acceptance(_Q, _P * 2, 2), "p must sum to 1"),
    (lambda: spectr.otm_acceptance(np.ones((2, 3)) / 3, np.ones((2, 3)) / 3, 2), "single distributions"),
    (lambda: spectr.otm_acceptance(np.ones(100) / 100, np.ones(100) / 100, 3), "LP variables"),
    (lambda: spectr.draft_selection(jax.random.key(0), _DRAFTS[0], _QS, _PS), "drafts must be"),
    (lambda: spectr.draft_selection(jax.random.key(0), _DRAFTS, _QS[:, :2], _PS), "q must be"),
    (lambda: spectr.draft_selection(jax.random.key(0), _DRAFTS, _QS, _PS[:, :, :2]), "p must be"),
    (lambda: spectr.draft_selection(jax.random.key(0), _DRAFTS + 3, _QS, _PS), "drafts must lie in"),
    (lambda: spectr.draft_selection(jax.random.key(0), _DRAFTS, _QS * np.nan, _PS), "q contains NaN"),
])
def test_bad_input_raises_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()
