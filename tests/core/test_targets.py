"""Target rules T(q, p) against the speculative-cascades paper's tables and lemmas."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling, targets, theory, verify

NORMALISED_RULES = [r for r in targets.RULES if r != "lossy"]  # lossy with β = 1 has Σπ ≥ 1
ALPHAS = {"chow_log": 0.7, "diff_log": 0.2, "opt_log": 0.5, "bild": 1.3}


def _alpha(rule, default=0.3):
  return ALPHAS.get(rule, default)


def _distributions(seed, shape=(64, 6), temperature=1.0, top_p=1.0, scale=2.0):
  """Random drafter/verifier logits -> (q, p, q_raw, p_raw)."""
  rng = np.random.default_rng(seed)
  lq = jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
  lp = jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
  return (sampling.transform(lq, temperature, top_p), sampling.transform(lp, temperature, top_p),
          jax.nn.softmax(lq), jax.nn.softmax(lp))


def _target(rule, pair, alpha, **kw):
  q, p, q_raw, p_raw = pair
  return targets.target_distribution(rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha, **kw)


@pytest.mark.parametrize("rule", NORMALISED_RULES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 1.0), (1.0, 0.5), (0.0, 1.0)])
def test_one_step_law_equals_pi(rule, temperature, top_p):
  """q·acceptance + P(reject)·residual = π to 1e-6 for every rule whose π is a distribution."""
  pair = _distributions(zlib.crc32(f"{rule}/{temperature}/{top_p}".encode()), temperature=temperature, top_p=top_p)
  q = pair[0]
  pi = _target(rule, pair, _alpha(rule))
  assert np.all(np.asarray(pi) >= 0)
  np.testing.assert_allclose(np.sum(pi, -1), 1.0, atol=1e-6)
  accept = verify.acceptance_probability(q, pi)
  p_reject = 1.0 - jnp.sum(q * accept, -1, keepdims=True)
  res = verify.residual(pi, q)
  law = q * accept + p_reject * res / jnp.sum(res, -1, keepdims=True)
  np.testing.assert_allclose(law, pi, atol=1e-6)
  np.testing.assert_allclose(verify.verification_law(q, pi), pi, atol=1e-6)


def test_lossy_with_beta_one_is_not_a_distribution_but_alg4_law_is():
  pair = _distributions(3)
  pi = _target("lossy", pair, 0.4)
  assert np.all(np.sum(pi, -1) >= 1 - 1e-6) and np.any(np.sum(pi, -1) > 1.01)
  np.testing.assert_allclose(np.sum(verify.verification_law(pair[0], pi), -1), 1.0, atol=1e-6)


@pytest.mark.parametrize("tuned", [False, True])
def test_lemma2_lossy_is_tran_thien(tuned):
  """Alg. 4 with π_Lossy accepts w.p. min(1, p/((1−α)q)) and resamples norm(max(0, p/β − q))."""
  rng = np.random.default_rng(4)
  q, p, q_raw, p_raw = _distributions(5, shape=(256, 6))
  alpha = jnp.asarray(rng.uniform(0.0, 0.9, size=256), jnp.float32)
  if tuned:
    beta = targets.lossy_beta(q, p, alpha)
    pi = targets.target_distribution("lossy_tuned", q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
  else:
    # β ∈ [1 − α, 1] ⊂ [1 − α, β*]: beyond β* Tran-Thien's residual can be empty (Σπ < 1).
    beta = jnp.asarray(rng.uniform(1.0 - np.asarray(alpha), 1.0), jnp.float32)
    pi = targets.target_distribution("lossy", q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha, beta=beta)
  want_accept = np.minimum(1.0, p / ((1.0 - alpha[:, None]) * q))
  np.testing.assert_allclose(verify.acceptance_probability(q, pi), want_accept, rtol=1e-5, atol=1e-6)
  want_res = np.maximum(0.0, p / beta[:, None] - q)
  got_res = verify.residual(pi, q)
  rejects = np.sum(q * (1 - want_accept), -1) > 1e-5
  assert rejects.sum() > 100
  got_res, want_res = np.asarray(got_res)[rejects], want_res[rejects]
  np.testing.assert_allclose(got_res / got_res.sum(-1, keepdims=True),
                             want_res / want_res.sum(-1, keepdims=True), atol=2e-5)


def test_tuned_beta_solves_balance_condition():
  q, p, _, _ = _distributions(6, shape=(512, 8), temperature=0.7)
  alpha = jnp.linspace(0.0, 0.95, 512)
  beta = targets.lossy_beta(q, p, alpha)
  assert np.all(np.asarray(beta) >= 1.0)
  lhs = np.sum(np.maximum(0.0, q - p / (1 - alpha[:, None])), -1)
  rhs = np.sum(np.maximum(0.0, p / beta[:, None] - q), -1)
  np.testing.assert_allclose(rhs, lhs, atol=2e-6)
  np.testing.assert_allclose(np.sum(targets.lossy_target(q, p, alpha, beta), -1), 1.0, atol=2e-6)


@pytest.mark.parametrize("vocab", [5, 64, 1000])
def test_tuned_beta_newton_equals_float64_bisection(vocab):
  """Newton's β* against a 200-step float64 bisection on Σ max(0, p/β − q) = Σ max(0, q − p/(1−α)), and
  the smallest solution max(1, max p/q) where the left side is 0 (q = p, or α large)."""
  rng = np.random.default_rng(vocab)
  q, p, _, _ = _distributions(vocab, shape=(128, vocab), scale=3.0)
  q = q.at[:8].set(p[:8])  # lhs = 0: β* = max(1, max p/q) = 1
  alpha = jnp.asarray(rng.uniform(0.0, 0.99, size=128), jnp.float32)
  got = np.asarray(targets.lossy_beta(q, p, alpha))
  q64, p64, a64 = (np.asarray(x, np.float64) for x in (q, p, alpha))
  lhs = np.maximum(q64 - p64 / (1 - a64[:, None]), 0).sum(-1)
  lo, hi = np.ones(128), np.full(128, 1e12)
  for _ in range(200):
    mid = np.sqrt(lo * hi)
    too_small = np.maximum(p64 / mid[:, None] - q64, 0).sum(-1) > lhs
    lo, hi = np.where(too_small, mid, lo), np.where(too_small, hi, mid)
  tuned = lhs > 0
  assert tuned.sum() > 64 and (~tuned).sum() >= 8
  np.testing.assert_allclose(got[tuned], hi[tuned], rtol=2e-6)
  smallest = np.clip(np.max(p64 / np.maximum(q64, 1e-38), -1), 1.0, 1e12)
  np.testing.assert_allclose(got[~tuned], smallest[~tuned], rtol=1e-6)


@pytest.mark.parametrize("rule", targets.CASCADE_RULES)
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.5, 0.7)])
def test_lemma3_rejection_rate_is_delta_times_tv(rule, temperature, top_p):
  pair = _distributions(7, shape=(256, 6), temperature=temperature, top_p=top_p)
  q, p, q_raw, p_raw = pair
  pi = _target(rule, pair, _alpha(rule, 0.1))
  delta = targets.deferral(rule, q_raw=q_raw, p_raw=p_raw, q=q, p=p, alpha=_alpha(rule, 0.1))
  assert 0 < np.mean(delta) < 1, "the fixture must exercise both deferral outcomes"
  p_reject = 1.0 - np.sum(np.minimum(q, pi), -1)
  np.testing.assert_allclose(p_reject, theory.rejection_rate(delta, p, q), atol=1e-6)


# Hand-made cases: q_raw, p_raw, α and the deferral the paper's formula gives.
_Q = [0.6, 0.3, 0.1]
_P = [0.9, 0.05, 0.05]
_H_Q = -sum(x * np.log(x) for x in _Q)  # 0.898
_H_P = -sum(x * np.log(x) for x in _P)  # 0.394
_TV = 0.3


@pytest.mark.parametrize("rule, alpha, defers", [
    ("chow", 0.3, True), ("chow", 0.45, False),                         # 0.6 < 1 − α
    ("chow_log", 0.85, True), ("chow_log", 0.95, False),                # H(q) > α
    ("diff", 0.25, True), ("diff", 0.35, False),                        # 0.6 < 0.9 − α
    ("diff_log", 0.45, True), ("diff_log", 0.55, False),                # H(p) < H(q) − α
    ("opt", 0.9, True), ("opt", 0.99, True), ("opt", 0.5, True),         # 0.6 < 0.9 − 0.3α always (α<1)
    ("opt_log", 0.9 * 0.5 / _TV, True), ("opt_log", 1.1 * 0.504 / _TV, False),  # H(p) < H(q) − α·TV
    ("bild", 1.2, True), ("bild", 1.3, False),                          # −Σ q log p = 1.2618
])
def test_deferral_rules_follow_table3(rule, alpha, defers):
  q_raw, p_raw = jnp.array(_Q), jnp.array(_P)
  got = targets.deferral(rule, q_raw=q_raw, p_raw=p_raw, q=q_raw, p=p_raw, alpha=alpha)
  assert bool(got) == defers
  pi = targets.target_distribution(rule, q=q_raw, p=p_raw, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
  np.testing.assert_allclose(pi, _P if defers else _Q, atol=1e-7)


@pytest.mark.parametrize("alpha, defers", [(0.4, True), (0.49, True), (0.51, False), (0.9, False)])
def test_opt_cost_term_flips_the_decision(alpha, defers):
  """max q = .5 < max p − α·D_TV(p, q) = .6 − .2α  <=>  α < .5 (eq. 10)."""
  q_raw, p_raw = jnp.array([0.5, 0.3, 0.2]), jnp.array([0.6, 0.1, 0.3])
  got = targets.deferral("opt", q_raw=q_raw, p_raw=p_raw, q=q_raw, p=p_raw, alpha=alpha)
  assert bool(got) == defers


def test_bild_discrepancy_is_cross_entropy_and_greedy_log_loss():
  q, p = jnp.array(_Q), jnp.array(_P)
  want = -np.sum(np.array(_Q) * np.log(_P))
  np.testing.assert_allclose(targets.bild_discrepancy(q, p), want, rtol=1e-6)
  one_hot = sampling.transform(jnp.log(q), 0.0)
  np.testing.assert_allclose(targets.bild_discrepancy(one_hot, p), -np.log(0.9), rtol=1e-6)


def test_deferral_uses_untransformed_distributions():
  """Chow defers on max q_raw: the same decision at every temperature (App. C.1)."""
  lq, lp = jnp.log(jnp.array(_Q)), jnp.log(jnp.array(_P))
  for t in (0.0, 0.3, 1.0, 3.0):
    q, p = sampling.transform(lq, t), sampling.transform(lp, t)
    pi = targets.target_distribution("chow", q=q, p=p, q_raw=jnp.array(_Q), p_raw=jnp.array(_P), alpha=0.3)
    np.testing.assert_allclose(pi, p, atol=1e-7)


@pytest.mark.parametrize("rule, important", [
    ("token_v1", [True, True, False, False]),   # T_α = {v: q_raw(v) ≥ max p_raw − α = 0.25}
    ("token_v2", [True, False, True, False]),   # T_α = {v: p_raw(v) ≥ 0.25}
    ("token_v3", [True, False, False, False]),  # T_α = {v: p_raw(v) ≥ 0.5·(1 − α) = 0.375}
])
def test_token_rules_eq16(rule, important):
  """π(v) = S(q)(v)·1(v ∈ T_α) + S(p)(v)·Σ_{v' ∉ T_α} S(q)(v'), T_α on the raw distributions."""
  q_raw = np.array([0.4, 0.3, 0.2, 0.1])
  p_raw = np.array([0.5, 0.05, 0.36, 0.09])
  alpha = 0.25
  q = sampling.transform(jnp.log(jnp.asarray(q_raw)), 0.5)  # interleave transformed distributions
  p = sampling.transform(jnp.log(jnp.asarray(p_raw)), 0.5)
  pi = targets.target_distribution(rule, q=q, p=p, q_raw=jnp.asarray(q_raw), p_raw=jnp.asarray(p_raw),
                                   alpha=alpha)
  t = np.asarray(important)
  want = np.where(t, q, 0.0) + np.asarray(p) * np.sum(np.where(t, 0.0, q))
  np.testing.assert_allclose(pi, want, atol=1e-7)


@pytest.mark.parametrize("tuned", [False, True])
def test_lemma6_lossy_at_temperature_zero_is_greedy_p(tuned):
  rule = "lossy_tuned" if tuned else "lossy"
  pair = _distributions(8, shape=(512, 7), temperature=0.0)
  for alpha in (0.0, 0.3, 0.9):
    np.testing.assert_allclose(_target(rule, pair, alpha), pair[1], atol=1e-6)


def test_lemma7_token_v3_greedy_accepts_iff_p_of_draft_within_1_minus_alpha_of_max():
  q, p, q_raw, p_raw = _distributions(9, shape=(2048, 5), temperature=0.0, scale=1.0)
  draft = jnp.argmax(q, -1)
  alpha = jnp.asarray(np.random.default_rng(9).uniform(0, 1, size=2048), jnp.float32)
  pi = targets.target_distribution("token_v3", q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)
  accept = jnp.take_along_axis(verify.acceptance_probability(q, pi), draft[:, None], -1)[:, 0]
  want = np.take_along_axis(np.asarray(p_raw), np.asarray(draft)[:, None], -1)[:, 0] >= (
      (1 - alpha) * np.max(p_raw, -1))
  assert 0.2 < want.mean() < 0.8
  np.testing.assert_array_equal(np.asarray(accept), want.astype(np.float32))
  # On rejection the replacement is argmax p (Leviathan's lossy greedy variant, App. C.4).
  res = verify.residual(pi, q)
  np.testing.assert_array_equal(np.argmax(res, -1)[~want], np.argmax(p_raw, -1)[~want])
  n_acc, nxt = verify.verify_block(jax.random.PRNGKey(0), draft[:, None], q[:, None], jnp.stack([pi, p], 1))
  np.testing.assert_array_equal(np.asarray(n_acc), want)
  np.testing.assert_array_equal(np.asarray(nxt)[~want], np.argmax(p_raw, -1)[~want])


def test_lemma10_opt_equals_diff_at_temperature_zero():
  pair = _distributions(10, shape=(4096, 5), temperature=0.0, scale=1.0)
  q = pair[0]
  for alpha in (0.05, 0.2, 0.5):
    pi_opt, pi_diff = _target("opt", pair, alpha), _target("diff", pair, alpha)
    np.testing.assert_allclose(verify.acceptance_probability(q, pi_opt), verify.acceptance_probability(q, pi_diff))
    np.testing.assert_allclose(verify.verification_law(q, pi_opt), verify.verification_law(q, pi_diff))
  # ... and the limit: at T = 1e-3 the laws coincide wherever the decision is not within 1e-3 of
  # its threshold and the top two logits are 0.05 apart (S_T is then one-hot to e^-50).
  small = _distributions(10, shape=(4096, 5), temperature=1e-3, scale=1.0)
  _, _, q_raw, p_raw = small
  top2 = lambda x: np.diff(np.sort(np.log(np.asarray(x)), -1)[:, -2:], axis=-1)[:, 0]
  margin = np.abs(np.max(q_raw, -1) - (np.max(p_raw, -1) - 0.2))
  clear = (top2(q_raw) > 0.05) & (top2(p_raw) > 0.05) & (margin > 1e-3)
  assert clear.mean() > 0.8
  np.testing.assert_allclose(verify.verification_law(small[0], _target("opt", small, 0.2))[clear],
                             verify.verification_law(small[0], _target("diff", small, 0.2))[clear],
                             atol=1e-5)


def test_alpha_and_beta_are_traced():
  traces = []

  @jax.jit
  def f(q, p, alpha, beta):
    traces.append(1)
    return (targets.target_distribution("lossy_tuned", q=q, p=p, q_raw=q, p_raw=p, alpha=alpha),
            targets.target_distribution("lossy", q=q, p=p, q_raw=q, p_raw=p, alpha=alpha, beta=beta))

  q, p, _, _ = _distributions(11)
  outs = [f(q, p, alpha, beta) for alpha in np.linspace(0, 0.95, 20) for beta in (1.0, 1.5)]
  assert len(traces) == 1
  np.testing.assert_allclose(outs[-1][1], targets.lossy_target(q, p, 0.95, 1.5), atol=1e-6)


@pytest.mark.parametrize("rule, alpha", [
    ("lossy", 1.0), ("chow", -0.1), ("token_v3", 1.0), ("opt", 1.5), ("bild", -1.0),
    ("diff", float("nan")),
])
def test_alpha_out_of_range_raises(rule, alpha):
  pair = _distributions(12)
  with pytest.raises(ValueError, match="alpha"):
    _target(rule, pair, alpha)


def test_unknown_rule_and_bad_beta_raise():
  pair = _distributions(13)
  with pytest.raises(ValueError, match="unknown rule"):
    _target("speculative", pair, 0.1)
  with pytest.raises(ValueError, match="beta"):
    _target("lossy", pair, 0.2, beta=0.5)
  with pytest.raises(ValueError, match="needs p_raw"):
    targets.deferral("diff", q_raw=pair[2], alpha=0.1)


def test_nats_rules_accept_large_alpha():
  pi = _target("bild", _distributions(14), 7.5)  # BiLD's threshold range is [0, 10] (App. F.1)
  assert np.isfinite(np.asarray(pi)).all()


def test_rule_records_say_what_the_loops_need():
  """The properties the decode loops read instead of rule names (`targets.Rule`)."""
  assert targets.sequential_rules() == ("chow", "chow_log")
  assert set(targets.CASCADE_RULES) == {"bild", "chow", "chow_log", "diff", "diff_log", "opt", "opt_log"}
  no_bonus_q = {name for name, rule in targets.RULES.items() if not rule.needs_bonus_q}
  assert no_bonus_q == {"spec", "lossy", "lossy_tuned"}
  assert [name for name, rule in targets.RULES.items() if rule.lossless] == ["spec"]
  assert {name for name, rule in targets.RULES.items() if rule.alpha_unit == "nats"} == {
      "chow_log", "diff_log", "opt_log", "bild"}
  with pytest.raises(ValueError, match="already registered"):
    targets.register_rule(targets.RULES["spec"])
  with pytest.raises(ValueError, match="bonus is 'target' or 'p'"):
    targets.Rule("bad", targets.RULES["spec"].target, reads=frozenset({"p"}), summary="", bonus="q")
  with pytest.raises(ValueError, match="subsets of q, p, q_raw, p_raw"):
    targets.Rule("bad", targets.RULES["spec"].target, reads=frozenset({"logits"}), summary="")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moves_mass_is_relative_to_the_dtype(dtype):
  """π ≠ q counts a move of small mass (1e-8 of a 1e-7 probability, which the old absolute 1e-6 hid) in both
  dtypes, and not a few ulps of rounding of either dtype."""
  q = jnp.asarray([[1e-7, 0.25, 0.75 - 1e-7]], dtype)
  eps = float(jnp.finfo(dtype).eps)
  rounded = q * jnp.asarray([1.0 + eps, 1.0 - eps, 1.0], dtype)
  assert not bool(targets.moves_mass(rounded, q)[0])
  small_move = q + jnp.asarray([[1e-8, -1e-8, 0.0]], dtype)
  assert float(jnp.max(jnp.abs(small_move - q))) < 1e-6 and bool(targets.moves_mass(small_move, q)[0])
  assert bool(targets.moves_mass(jnp.asarray([[0.0, 0.25, 0.75]], dtype), q)[0])
