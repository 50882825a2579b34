"""Prefix trees of K drafts, SpecInfer tree verification and greedy tree verification (notes §2, App. A)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import sampling, tree, verify
from tests.stats import assert_law, chi2_pvalue, draw, random_distributions

N_SAMPLES = 100_000


def _random_drafts(rng, batch, n_drafts, gamma, vocab):
  return rng.integers(0, vocab, size=(batch, n_drafts, gamma)).astype(np.int32)


def _prefix_codes(tokens, vocab):
  """Code Σ_{i<j} x_i·V^i of every prefix x_{<j}, j = 0 … L: [..., L] -> [..., L+1]."""
  codes = np.cumsum(tokens * vocab ** np.arange(tokens.shape[-1]), axis=-1)
  return np.concatenate([np.zeros(tokens.shape[:-1] + (1,), np.int64), codes], axis=-1)


def _prefix_tables(rng, n_tables, gamma, vocab, concentration):
  """Random next-token laws table[t, j, code(x_{<j})] [n_tables, γ+1, V^γ, V]."""
  return random_distributions(rng, (n_tables, gamma + 1, vocab ** gamma, vocab),
                              concentration=concentration).astype(np.float64)


def _sequence_law(table, vocab, length):
  """Law of x_1 … x_length under table [γ+1, V^γ, V], indexed by Σ x_i·V^i."""
  law = np.zeros(vocab ** length)
  for seq in itertools.product(range(vocab), repeat=length):
    codes = _prefix_codes(np.array(seq), vocab)
    law[codes[-1]] = np.prod([table[j, codes[j], seq[j]] for j in range(length)])
  return law


# ---------------------------------------------------------------- build_tree

def _brute_force_tree(drafts_row):
  """Distinct prefixes (the empty one included) and the ancestor-or-self relation between them."""
  prefixes = sorted({tuple(d[:j]) for d in drafts_row.tolist() for j in range(len(d) + 1)})
  ancestor = {(a, b) for a in prefixes for b in prefixes if a[:len(b)] == b}
  return prefixes, ancestor


def test_tree_deduplicates_prefixes_and_mask_is_the_ancestor_relation():
  rng = np.random.default_rng(0)
  batch, n_drafts, gamma = 64, 4, 3
  drafts = _random_drafts(rng, batch, n_drafts, gamma, vocab=2)
  root_token = rng.integers(0, 2, size=batch)
  root_position = rng.integers(0, 50, size=batch)
  t = jax.tree.map(np.asarray, tree.build_tree(drafts, root_token, root_position))
  n_max = 1 + n_drafts * gamma
  assert t.tokens.shape == (batch, n_max) and t.attention_mask.shape == (batch, n_max, n_max)

  for b in range(batch):
    prefixes, ancestor = _brute_force_tree(drafts[b])
    assert t.n_nodes[b] == len(prefixes)
    np.testing.assert_array_equal(t.valid[b], np.arange(n_max) < len(prefixes))
    node = {}  # prefix -> node, checking that one prefix always maps to one node and back
    for k in range(n_drafts):
      for j in range(gamma + 1):
        prefix = tuple(drafts[b, k, :j].tolist())
        assert node.setdefault(prefix, t.node_of[b, k, j]) == t.node_of[b, k, j]
    assert sorted(node.values()) == list(range(len(prefixes)))
    for prefix, i in node.items():
      assert t.depth[b, i] == len(prefix)
      assert t.positions[b, i] == root_position[b] + len(prefix)
      assert t.tokens[b, i] == (prefix[-1] if prefix else root_token[b])
      assert t.parent[b, i] == (node[prefix[:-1]] if prefix else -1)
      assert t.parent[b, i] < i  # parents precede children
      for other, j in node.items():
        assert t.attention_mask[b, i, j] == ((prefix, other) in ancestor)
    padding = np.arange(len(prefixes), n_max)
    np.testing.assert_array_equal(t.attention_mask[b][np.ix_(padding, np.arange(n_max))],
                                  np.eye(n_max, dtype=bool)[padding])
    assert not t.attention_mask[b][:len(prefixes), len(prefixes):].any()


def test_identical_drafts_make_a_causal_chain():
  drafts = np.tile(np.array([[[4, 1, 1, 3]]], np.int32), (2, 5, 1))
  t = tree.build_tree(drafts, np.array([7, 7]), np.array([0, 12]))
  gamma = 4
  np.testing.assert_array_equal(t.n_nodes, [gamma + 1] * 2)
  np.testing.assert_array_equal(t.tokens[:, :gamma + 1], [[7, 4, 1, 1, 3]] * 2)
  np.testing.assert_array_equal(t.positions[:, :gamma + 1], [np.arange(5), 12 + np.arange(5)])
  np.testing.assert_array_equal(t.node_of, np.broadcast_to(np.arange(gamma + 1), (2, 5, gamma + 1)))
  np.testing.assert_array_equal(t.attention_mask[:, :gamma + 1, :gamma + 1],
                                np.broadcast_to(np.tri(gamma + 1, dtype=bool), (2, gamma + 1, gamma + 1)))


def test_scoring_the_tree_once_gives_every_draft_prefix_score():
  """A toy verifier that reads (token, position) of every attended key, run once on the tree and
  gathered per draft, equals the same verifier run causally on each draft."""
  rng = np.random.default_rng(1)
  vocab, gamma = 3, 3
  drafts = _random_drafts(rng, 16, 3, gamma, vocab)
  root_token, root_position = rng.integers(0, vocab, size=16), rng.integers(0, 9, size=16)
  t = tree.build_tree(drafts, root_token, root_position)

  def toy_verifier(tokens, positions, mask, offset):  # [B, L], [B, L], [B, L, L]
    code = (tokens + 1) * (vocab + 1) ** (positions - offset[:, None])
    return jnp.sum(jnp.where(mask, code[:, None, :], 0), axis=-1)

  on_tree = tree.gather_nodes(toy_verifier(t.tokens, t.positions, t.attention_mask, root_position), t)
  sequences = np.concatenate([np.broadcast_to(root_token[:, None, None], (16, 3, 1)), drafts], axis=-1)
  causal = np.tri(gamma + 1, dtype=bool)
  for k in range(3):
    per_draft = toy_verifier(sequences[:, k], root_position[:, None] + np.arange(gamma + 1),
                             np.broadcast_to(causal, (16, gamma + 1, gamma + 1)), root_position)
    np.testing.assert_array_equal(on_tree[:, k], per_draft)
  np.testing.assert_array_equal(tree.gather_nodes(t.tokens, t), sequences)


# ---------------------------------------------------------------- verify_tree

def test_iterative_speculative_sampling_at_one_node_follows_p():
  """γ = 1: K proposals x_k ~ q_k, one round each in random order (notes §2); the token follows p."""
  rng = np.random.default_rng(2)
  n_drafts, vocab = 3, 6
  q_k = random_distributions(rng, (n_drafts, vocab))
  p0, p1 = random_distributions(rng, (2, vocab))
  drafts = draw(rng, np.broadcast_to(q_k, (N_SAMPLES, n_drafts, vocab)))[..., None].astype(np.int32)
  q = np.broadcast_to(q_k[None, :, None], (N_SAMPLES, n_drafts, 1, vocab))
  p = np.broadcast_to(np.stack([p0, p1])[None, None], (N_SAMPLES, n_drafts, 2, vocab))
  n, k, next_token = map(np.asarray, tree.verify_tree(jax.random.key(0), drafts, q, p))
  rows = np.arange(N_SAMPLES)
  first = np.where(n == 1, drafts[rows, k, 0], next_token)
  assert_law(first, p0, what="token at the node")
  assert_law(next_token[n == 1], p1, what="bonus token after acceptance")


def _tree_outputs(key, drafter, target, *, n_drafts, gamma, vocab, seed, masked=False):
  """Samples drafts from `drafter` tables, verifies them against `target`, completes every output to
  γ+1 tokens with target samples; returns the sequence codes [N_SAMPLES] and the verifier's outputs."""
  rng = np.random.default_rng(seed)
  drafts = np.zeros((N_SAMPLES, n_drafts, gamma), np.int32)
  q = np.zeros((N_SAMPLES, n_drafts, gamma, vocab), np.float32)
  which = np.arange(n_drafts) % drafter.shape[0]  # one table for i.i.d. drafts, else one per draft
  for j in range(gamma):
    code = _prefix_codes(drafts[..., :j], vocab)[..., -1]
    q[:, :, j] = drafter[which[None, :], j, code]
    drafts[:, :, j] = draw(rng, q[:, :, j])
  codes = _prefix_codes(drafts, vocab)
  p = target[np.arange(gamma + 1), codes].astype(np.float32)
  draft_mask = rng.random((N_SAMPLES, n_drafts)) < 0.7 if masked else None
  n, k, next_token = map(np.asarray, tree.verify_tree(key, drafts, q, p, draft_mask))

  rows = np.arange(N_SAMPLES)
  sequence = np.zeros((N_SAMPLES, gamma + 1), np.int64)
  for j in range(gamma + 1):
    code = _prefix_codes(sequence[:, :j], vocab)[:, -1]
    completion = draw(rng, target[j, code])
    sequence[:, j] = np.where(j < n, drafts[rows, k, np.minimum(j, gamma - 1)],
                              np.where(j == n, next_token, completion))
  return _prefix_codes(sequence, vocab)[:, -1], (n, k, draft_mask)


@pytest.mark.parametrize("n_drafts,gamma,independent_drafters,masked", [
    (2, 3, False, False),
    (4, 2, False, False),
    (3, 2, True, True),
])
def test_tree_verification_is_exact(n_drafts, gamma, independent_drafters, masked):
  """Output x_1 … x_{n+1}, completed from p, follows Π_j p(x_j|x_{<j}) (notes §2.1). With V = 3 and
  drafters that put half their mass where p has little, drafts often collide and are often rejected,
  so per-draft rounds matter: merging identical drafts into one round fails this test."""
  vocab = 3
  rng = np.random.default_rng(3 + n_drafts)
  target = _prefix_tables(rng, 1, gamma, vocab, concentration=1.0)[0]
  unlikely = (1 - target) ** 4 / np.sum((1 - target) ** 4, axis=-1, keepdims=True)
  drafter = 0.5 * unlikely + 0.5 * _prefix_tables(rng, n_drafts if independent_drafters else 1, gamma, vocab,
                                                  concentration=1.0)
  sequences, (n, k, draft_mask) = _tree_outputs(jax.random.key(n_drafts), drafter, target,
                                                n_drafts=n_drafts, gamma=gamma, vocab=vocab, seed=gamma,
                                                masked=masked)
  assert_law(sequences, _sequence_law(target, vocab, gamma + 1), what="tree verification")
  assert 0 < np.mean(n) < gamma
  if masked:
    assert np.all(draft_mask[np.arange(N_SAMPLES), k][n > 0])


def test_deterministic_copies_of_a_soft_draft_are_not_exact():
  """Why drafts must be independent: a copy re-proposes the rejected x against p1 with p1(x) = 0.
  p = (.6, .4, 0), q = (.2, .3, .5): the copy pushes every rejection to token 0, law (.7, .3, 0)."""
  p = np.array([0.6, 0.4, 0.0], np.float32)
  q = np.array([0.2, 0.3, 0.5], np.float32)
  drafts = draw(np.random.default_rng(4), np.broadcast_to(q, (N_SAMPLES, 3)))
  drafts = np.broadcast_to(drafts[:, None, None], (N_SAMPLES, 2, 1)).astype(np.int32)
  n, k, next_token = map(np.asarray, tree.verify_tree(
      jax.random.key(4), drafts, np.broadcast_to(q, (N_SAMPLES, 2, 1, 3)),
      np.broadcast_to(p, (N_SAMPLES, 2, 2, 3))))
  first = np.where(n == 1, drafts[:, 0, 0], next_token)
  assert chi2_pvalue(first, p) < 1e-6
  assert_law(first, [0.7, 0.3, 0.0], what="law of copied drafts")


def _one_draft_law(draft, p):
  """Exact law of (n_accepted, next_token) of Algorithm 4 with a one-hot q on `draft` [γ], p [γ+1, V],
  indexed by n·V + next_token."""
  gamma, vocab = draft.size, p.shape[-1]
  law = np.zeros((gamma + 1, vocab))
  reach = 1.0
  for j, x in enumerate(draft):
    res = verify.residual(p[j], np.eye(vocab)[x])
    law[j] = reach * (1 - p[j, x]) * np.asarray(res) / np.sum(res)
    reach *= p[j, x]
  law[gamma] = reach * p[gamma]
  return law.ravel()


def test_identical_one_hot_drafts_sample_like_one_draft():
  """K copies of a greedy (one-hot q) draft: copies are rejected without effect, so verify_tree's law
  of (n_accepted, next_token) is verify_block's on one draft."""
  rng = np.random.default_rng(5)
  n_drafts, gamma, vocab = 3, 3, 5
  p = random_distributions(rng, (gamma + 1, vocab), sparsity=0.0)
  draft = np.argsort(p[:gamma], axis=-1)[:, -2].astype(np.int32)  # second most likely: n is spread out
  law = _one_draft_law(draft, p.astype(np.float64))
  one_hot = np.eye(vocab, dtype=np.float32)[draft]

  drafts = np.broadcast_to(draft, (N_SAMPLES, n_drafts, gamma))
  n, k, next_token = map(np.asarray, tree.verify_tree(
      jax.random.key(5), drafts, np.broadcast_to(one_hot, (N_SAMPLES, n_drafts, gamma, vocab)),
      np.broadcast_to(p, (N_SAMPLES, n_drafts, gamma + 1, vocab))))
  assert_law(n * vocab + next_token, law, what="verify_tree on copies")
  n1, next1 = map(np.asarray, jax.jit(verify.verify_block)(
      jax.random.key(6), np.broadcast_to(draft, (N_SAMPLES, gamma)),
      np.broadcast_to(one_hot, (N_SAMPLES, gamma, vocab)), np.broadcast_to(p, (N_SAMPLES, gamma + 1, vocab))))
  assert_law(n1 * vocab + next1, law, what="verify_block on one draft")


def test_jit_matches_eager():
  rng = np.random.default_rng(6)
  drafts = _random_drafts(rng, 8, 3, 4, 4)
  q = random_distributions(rng, (8, 3, 4, 4))
  p = random_distributions(rng, (8, 3, 5, 4))
  root = np.zeros(8, np.int32)
  for fn, args in [(tree.build_tree, (drafts, root, root)),
                   (tree.verify_tree, (jax.random.key(7), drafts, q, p)),
                   (tree.verify_tree_greedy, (drafts, p))]:
    for a, b in zip(jax.tree.leaves(fn(*args)), jax.tree.leaves(jax.jit(fn)(*args))):
      np.testing.assert_array_equal(a, b)


def test_nan_rows_are_flagged_inside_jit():
  rng = np.random.default_rng(7)
  drafts = _random_drafts(rng, 2, 2, 2, 3)
  q = random_distributions(rng, (2, 2, 2, 3))
  p = random_distributions(rng, (2, 2, 3, 3))
  p[1, 0, 1, 2] = np.nan
  outputs = jax.jit(tree.verify_tree)(jax.random.key(0), drafts, q, p)
  assert all(int(x[1]) == -1 and int(x[0]) >= 0 for x in outputs)


# ---------------------------------------------------------------- greedy

def _greedy_tables(rng, batch, gamma, vocab):
  """argmax p(·|x_{<j}) for every prefix, per row: [B, γ+1, V^γ] (consistent across drafts)."""
  return rng.integers(0, vocab, size=(batch, gamma + 1, vocab ** gamma))


def test_greedy_tree_verification_accepts_the_longest_greedy_path():
  rng = np.random.default_rng(8)
  batch, n_drafts, gamma, vocab = 300, 4, 3, 2
  drafts = _random_drafts(rng, batch, n_drafts, gamma, vocab)
  table = _greedy_tables(rng, batch, gamma, vocab)
  greedy = table[np.arange(batch)[:, None, None], np.arange(gamma + 1), _prefix_codes(drafts, vocab)]
  n, k, next_token = map(np.asarray, tree.verify_tree_greedy(drafts, greedy.astype(np.int32)))
  from_probs = tree.verify_tree_greedy(drafts, np.eye(vocab, dtype=np.float32)[greedy])
  for a, b in zip((n, k, next_token), from_probs):
    np.testing.assert_array_equal(a, b)

  for b in range(batch):  # App. A: follow argmax p while some draft continues the path with it
    path = []
    while len(path) < gamma:
      y = table[b, len(path), _prefix_codes(np.array(path, int), vocab)[-1]]
      if not any(list(d[:len(path) + 1]) == path + [y] for d in drafts[b].tolist()):
        break
      path.append(y)
    assert n[b] == len(path) and list(drafts[b, k[b], :n[b]]) == path
    assert next_token[b] == table[b, len(path), _prefix_codes(np.array(path, int), vocab)[-1]]


def test_greedy_with_one_draft_is_verify_block_at_temperature_zero():
  rng = np.random.default_rng(9)
  batch, gamma, vocab = 512, 4, 3
  logits = rng.normal(size=(batch, gamma + 1, vocab)).astype(np.float32)
  argmax = np.argmax(logits, axis=-1)
  # Drafts agree with argmax p at most positions, so every n_accepted in [0, γ] occurs.
  drafts = np.where(rng.random((batch, gamma)) < 0.75, argmax[:, :gamma],
                    rng.integers(0, vocab, size=(batch, gamma))).astype(np.int32)
  pi = sampling.transform(jnp.asarray(logits), 0.0)
  n1, next1 = jax.jit(verify.verify_block)(jax.random.key(0), drafts, jax.nn.one_hot(drafts, vocab), pi)
  n, k, next_token = tree.verify_tree_greedy(drafts[:, None], pi[:, None])
  np.testing.assert_array_equal(n, n1)
  np.testing.assert_array_equal(next_token, next1)
  np.testing.assert_array_equal(k, 0)
  assert set(np.asarray(n).tolist()) == set(range(gamma + 1))

  copies = tree.verify_tree_greedy(np.repeat(drafts[:, None], 3, axis=1), np.repeat(pi[:, None], 3, axis=1))
  for a, b in zip(copies, (n, k, next_token)):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- bad input

def _valid_inputs():
  rng = np.random.default_rng(10)
  return (_random_drafts(rng, 2, 3, 2, 4), random_distributions(rng, (2, 3, 2, 4)),
          random_distributions(rng, (2, 3, 3, 4)))


@pytest.mark.parametrize("call,match", [
    (lambda d, q, p: tree.build_tree(d[0], np.zeros(2), np.zeros(2)), "drafts"),
    (lambda d, q, p: tree.build_tree(d.astype(np.float32), np.zeros(2), np.zeros(2)), "drafts"),
    (lambda d, q, p: tree.build_tree(d, np.zeros(3), np.zeros(2)), "root_token"),
    (lambda d, q, p: tree.build_tree(d, np.zeros(2), np.zeros((2, 1))), "root_position"),
    (lambda d, q, p: tree.build_tree(d[:, :, :0], np.zeros(2), np.zeros(2)), "gamma"),
    (lambda d, q, p: tree.gather_nodes(np.zeros((2, 5)), tree.build_tree(d, np.zeros(2), np.zeros(2))),
     "values"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q[:, :, :1], p), "q"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q, p[..., :3]), "p"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q, p[:, :, :2]), "p"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d + 4, q, p), "drafts"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, np.full_like(q, np.nan), p), "q contains NaN"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q, np.full_like(p, np.nan)), "p contains NaN"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q, -p), "p must be"),
    (lambda d, q, p: tree.verify_tree(jax.random.key(0), d, q, p, np.ones((2, 2), bool)), "draft_mask"),
    (lambda d, q, p: tree.verify_tree_greedy(d, p[:, :, :2]), "p"),
    (lambda d, q, p: tree.verify_tree_greedy(d, p[..., 0]), "p must be"),
    (lambda d, q, p: tree.verify_tree_greedy(d, np.full_like(p, np.nan)), "p contains NaN"),
    (lambda d, q, p: tree.verify_tree_greedy(d + 4, p), "drafts"),
])
def test_bad_input_raises_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call(*_valid_inputs())
