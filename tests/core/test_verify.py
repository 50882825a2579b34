"""verify_block (Algorithm 4) by Monte Carlo against its exact law, for every target rule."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling, targets, verify
from tests.stats import assert_binomial, assert_law

N = 100_000
GAMMA = 3
V = 5


def _block(rule, seed, temperature=1.0, top_p=1.0, draft_ids=None):
  """One block's q [γ, V] and π [γ+1, V] (different per position), from random logits; with `draft_ids`, q as a
  head with that draft vocabulary drafts (FR-Spec): 0 outside those tokens.

  The first seed from `seed` on whose block has π ≠ q at some draft position is used, so that the
  block can reject (a cascade rule may by chance defer nowhere), and whose whole block is accepted with
  probability ≥ 1 % (Π_j Σ_v min(q_j, π_j)), so that the bonus token is drawn often enough to test.
  """
  while True:
    q, pi = _random_block(rule, seed, temperature, top_p, draft_ids)
    whole_block = np.prod(np.sum(np.minimum(np.asarray(q), np.asarray(pi[:GAMMA])), -1))
    if np.abs(np.asarray(pi[:GAMMA] - q)).max() > 1e-3 and whole_block >= 0.01:
      return q, pi
    seed += 1


def _random_block(rule, seed, temperature, top_p, draft_ids=None):
  rng = np.random.default_rng(seed)
  lq = jnp.asarray(rng.normal(size=(GAMMA + 1, V)), jnp.float32)
  if draft_ids is not None:
    lq = jnp.where(jnp.isin(jnp.arange(V), jnp.asarray(draft_ids)), lq, jnp.finfo(jnp.float32).min)
  lp = jnp.asarray(rng.normal(size=(GAMMA + 1, V)), jnp.float32)
  q, p = sampling.transform(lq, temperature, top_p), sampling.transform(lp, temperature, top_p)
  # One α per position, spread over the rule's range, so that cascade rules defer at some positions.
  lo, hi = {"chow_log": (0.5, 1.5), "diff_log": (0.0, 0.3), "opt_log": (0.0, 1.0), "bild": (1.0, 3.0)}.get(
      rule, (0.0, 0.6))
  alpha = jnp.linspace(lo, hi, GAMMA + 1)
  pi = targets.target_distribution(rule, q=q, p=p, q_raw=jax.nn.softmax(lq), p_raw=jax.nn.softmax(lp),
                                   alpha=alpha)
  if rule == "lossy":  # the bonus row of a lossy block is p (Tran-Thien), not π_Lossy (DESIRED)
    pi = pi.at[GAMMA].set(p[GAMMA])
  return q[:GAMMA], pi


def _run(q, pi, key):
  """Drafts x_j ~ q_j independently per row (q_j fixed per position), then one verify_block."""
  k_draft, k_verify = jax.random.split(key)
  drafts = jax.random.categorical(k_draft, jnp.log(q), shape=(N, GAMMA)).astype(jnp.int32)
  n_acc, nxt = jax.jit(verify.verify_block)(k_verify, drafts, jnp.broadcast_to(q, (N, GAMMA, V)),
                                             jnp.broadcast_to(pi, (N, GAMMA + 1, V)))
  return np.asarray(drafts), np.asarray(n_acc), np.asarray(nxt)


@pytest.mark.parametrize("rule", targets.RULES)
@pytest.mark.parametrize("temperature, top_p, draft_ids", [(1.0, 1.0, None), (0.7, 0.9, None), (1.0, 1.0, (0, 2)),
                                                           (0.7, 0.9, (0, 1, 3, 4))])
def test_monte_carlo_law_per_position(rule, temperature, top_p, draft_ids):
  """Given the first j drafts accepted, the token at position j follows the verification law π_j,
  and P(n_accepted ≥ j) = Π_{i<j} Σ_v min(q_i, π_i). With a draft vocabulary (q = 0 outside `draft_ids`) too: the
  other tokens come from the residual, and the law, enumerated exactly, is still π_j for every lossless rule."""
  seed = zlib.crc32(f"{rule}/{temperature}/{top_p}/{draft_ids}".encode())
  q, pi = _block(rule, seed=seed, temperature=temperature, top_p=top_p, draft_ids=draft_ids)
  drafts, n_acc, nxt = _run(q, pi, jax.random.PRNGKey(seed))
  laws = np.asarray(verify.verification_law(q, pi[:GAMMA]))
  # The law by enumeration: draft x ~ q, kept with min(1, π(x)/q(x)), else a draw from the residual (π − q)+.
  q64, pi64 = np.asarray(q, np.float64), np.asarray(pi[:GAMMA], np.float64)
  residual = np.maximum(pi64 - q64, 0.0)
  enumerated = np.minimum(q64, pi64) + (1 - np.minimum(q64, pi64).sum(-1, keepdims=True)) * residual / np.maximum(
      residual.sum(-1, keepdims=True), 1e-30)
  if rule != "lossy":
    np.testing.assert_allclose(laws, pi[:GAMMA], atol=1e-6)
    np.testing.assert_allclose(enumerated, pi64, atol=1e-6)
  if draft_ids is not None:
    outside = np.setdiff1d(np.arange(V), draft_ids)
    assert np.all(np.asarray(q)[:, outside] == 0) and np.isin(drafts, draft_ids).all()
    if pi64[:, outside].sum() > 0.05:   # (under top-P π may hold none of them)
      assert np.isin(nxt, outside).any(), "the residual must emit tokens outside the draft vocabulary"
  accept_rate = np.sum(np.minimum(q, pi[:GAMMA]), -1)
  reach = 1.0
  for j in range(GAMMA + 1):
    assert_binomial(np.sum(n_acc >= j), N, min(reach, 1.0), what=f"{rule}: P(n_accepted >= {j})")
    rows = n_acc >= j
    if j < GAMMA:
      token = np.where(n_acc[rows] > j, drafts[rows, j], nxt[rows])
      assert_law(token, laws[j], what=f"{rule}: position {j}")
      reach *= accept_rate[j]
    else:
      assert rows.sum() >= 100, "the fixture must accept whole blocks often enough to test the bonus"
      assert_law(nxt[rows], np.asarray(pi[GAMMA]), what=f"{rule}: bonus token")
  assert len(np.unique(n_acc)) >= 2, "the block must exercise acceptance and rejection"


def test_rows_with_fewer_drafts_stop_there_and_draw_the_bonus_from_pi():
  """n_drafted [B]: a row with n drafts never accepts beyond them, and its token at position n follows
  π_n (no draft there: no residual); positions before n keep the law of the full block."""
  q, pi = _block("spec", seed=5)
  k_draft, k_verify = jax.random.split(jax.random.PRNGKey(5))
  drafts = jax.random.categorical(k_draft, jnp.log(q), shape=(N, GAMMA)).astype(jnp.int32)
  n_drafted = jnp.asarray(np.arange(N) % (GAMMA + 1), jnp.int32)            # 0 … γ drafts, a quarter each
  n_acc, nxt = verify.verify_block(k_verify, drafts, jnp.broadcast_to(q, (N, GAMMA, V)),
                                   jnp.broadcast_to(pi, (N, GAMMA + 1, V)), n_drafted)
  drafts, n_acc, nxt, n_drafted = map(np.asarray, (drafts, n_acc, nxt, n_drafted))
  assert np.all(n_acc <= n_drafted)
  for n in range(GAMMA + 1):
    rows = (n_drafted == n) & (n_acc == n)                                # every draft accepted
    assert_law(nxt[rows], np.asarray(pi[n]), what=f"bonus after {n} drafts")
    rows = (n_drafted == n) & (n_acc >= n - 1) if n else None
    if n:   # the last draft's position: accepted draft or residual, π_{n-1} in law
      token = np.where(n_acc[rows] > n - 1, drafts[rows, n - 1], nxt[rows])
      assert_law(token, np.asarray(pi[n - 1]), what=f"last of {n} drafts")
  with pytest.raises(ValueError, match="n_drafted"):
    verify.verify_block(k_verify, drafts[:2], q[None].repeat(2, 0), pi[None].repeat(2, 0), jnp.asarray([1, 4]))


def test_monte_carlo_detects_a_wrong_residual():
  """The check above has power: resampling from π instead of the residual fails it."""
  q, pi = _block("spec", seed=1)
  drafts, n_acc, nxt = _run(q, pi, jax.random.PRNGKey(1))
  rows = n_acc == 0
  wrong_next = np.asarray(jax.random.categorical(jax.random.PRNGKey(2), jnp.log(pi[0]), shape=(N,)))
  token = np.where(n_acc > 0, drafts[:, 0], wrong_next)
  with pytest.raises(AssertionError):
    assert_law(token, np.asarray(pi[0]))
  assert rows.any()


def test_greedy_verification_is_longest_matching_prefix():
  """With one-hot q and π = S_0(p): accept while x_j = argmax p_j, then emit argmax p (notes App. A)."""
  rng = np.random.default_rng(3)
  b = 512
  lp = jnp.asarray(rng.normal(size=(b, GAMMA + 1, V)), jnp.float32)
  p = sampling.transform(lp, 0.0)
  greedy = np.argmax(np.asarray(lp), -1)
  drafts = np.where(rng.random((b, GAMMA)) < 0.7, greedy[:, :GAMMA], rng.integers(0, V, (b, GAMMA)))
  q = jax.nn.one_hot(drafts, V)
  n_acc, nxt = verify.verify_block(jax.random.PRNGKey(0), jnp.asarray(drafts, jnp.int32), q, p)
  match = drafts == greedy[:, :GAMMA]
  want_n = np.argmin(np.concatenate([match, np.zeros((b, 1), bool)], 1), axis=1)
  np.testing.assert_array_equal(n_acc, want_n)
  np.testing.assert_array_equal(nxt, greedy[np.arange(b), want_n])
  assert len(set(want_n.tolist())) == GAMMA + 1


def test_same_key_same_output_and_keys_matter():
  q, pi = _block("token_v3", seed=4)
  a = _run(q, pi, jax.random.PRNGKey(7))
  b = _run(q, pi, jax.random.PRNGKey(7))
  c = _run(q, pi, jax.random.PRNGKey(8))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(a[2], c[2])


def test_residual_falls_back_to_pi_when_empty():
  q = jnp.array([0.5, 0.5, 0.0])
  np.testing.assert_array_equal(verify.residual(q, q), q)
  np.testing.assert_allclose(verify.residual(jnp.array([0.2, 0.8, 0.0]), q), [0, 0.3, 0])


def test_bad_shapes_and_nan_raise():
  q = jnp.full((2, 3, 4), 0.25)
  pi = jnp.full((2, 4, 4), 0.25)
  drafts = jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="expects"):
    verify.verify_block(jax.random.PRNGKey(0), drafts, q, pi[:, :3])
  with pytest.raises(ValueError, match="expects"):
    verify.verify_block(jax.random.PRNGKey(0), drafts, q[..., :3], pi)
  with pytest.raises(ValueError, match="pi contains NaN"):
    verify.verify_block(jax.random.PRNGKey(0), drafts, q, pi.at[1, 2, 0].set(jnp.nan))


def test_nan_inside_jit_is_flagged_per_row():
  """Inside jit a row is flagged when NaN reaches an entry the step reads: π(x_j) here (row 1) or the
  row the next token is drawn from (row 2: all accepted, NaN in the bonus row); row 3's NaN sits in an
  entry no draw reads and does not change its outcome."""
  q = jnp.full((4, 2, 4), 0.25)
  pi = jnp.full((4, 3, 4), 0.25)
  pi = pi.at[1, 0, 0].set(jnp.nan).at[2, 2, 3].set(jnp.nan).at[3, 0, 2].set(jnp.nan)
  n_acc, nxt = jax.jit(verify.verify_block)(jax.random.PRNGKey(0), jnp.zeros((4, 2), jnp.int32), q, pi)
  np.testing.assert_array_equal(n_acc, [2, -1, -1, 2])
  np.testing.assert_array_equal(np.asarray(nxt)[[1, 2]], [-1, -1])
  assert nxt[0] >= 0 and nxt[3] >= 0
