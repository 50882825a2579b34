"""Multi-draft verification on a prefix tree (speculative-decoding notes §2, §2.1 and App. A).

K drafts of γ tokens each are packed into a prefix tree so that the verifier scores every draft prefix in
one call (tree attention), then verified either by SpecInfer's iterative speculative sampling (exact: the
output follows p) or greedily (the output is p's greedy continuation).

Trees have a static size N = 1 + K·γ (the root plus one slot per draft token); a batch row with shared
prefixes uses fewer nodes, the rest is padding marked by `valid`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec import checks, rng, sampling, verify

Array = jax.Array


class Tree(NamedTuple):
  """A batch of prefix trees of K drafts [B, K, γ]; N = 1 + K·γ node slots per row.

  Node 0 is the root (the last context token); valid nodes come first, ordered by depth (so parents
  precede children), then padding. Padding nodes have token 0, depth 0, the root's position, parent −1,
  and attend only to themselves.
  """
  tokens: Array          # [B, N] int32 token of each node
  positions: Array       # [B, N] int32 root_position + depth
  depth: Array           # [B, N] int32, 0 at the root
  parent: Array          # [B, N] int32, −1 at the root and at padding
  valid: Array           # [B, N] bool, True for the first n_nodes slots
  n_nodes: Array         # [B] int32 number of distinct draft prefixes, the empty one included
  node_of: Array         # [B, K, γ+1] int32 node of draft k's prefix of length j (j = 0: the root)
  attention_mask: Array  # [B, N, N] bool, query i may attend key j iff j is an ancestor-or-self of i


def _check_drafts(drafts) -> tuple[int, int, int]:
  """Checks that drafts is an integer array [B, K, γ] with K ≥ 1 and γ ≥ 1; returns (B, K, γ)."""
  if np.ndim(drafts) != 3 or not jnp.issubdtype(jnp.result_type(drafts), jnp.integer):
    raise ValueError(f"drafts must be an integer array [B, K, γ]; got shape {np.shape(drafts)}, "
                     f"dtype {jnp.result_type(drafts)}")
  batch, n_drafts, gamma = np.shape(drafts)
  if n_drafts < 1:
    raise ValueError("drafts must hold at least one draft (K ≥ 1)")
  checks.check_gamma(gamma)
  return batch, n_drafts, gamma


def build_tree(drafts: Array, root_token: Array, root_position: Array) -> Tree:
  """Prefix tree of K drafts (notes §2.1, step 2): identical prefixes share one node.

  Args:
    drafts: [B, K, γ] draft tokens x_1^{(k)} … x_γ^{(k)}.
    root_token: [B] the last context token u_0 (the verifier's output there is p for draft position 1).
    root_position: [B] position of u_0; a node at depth t sits at root_position + t.
  Returns:
    A `Tree` with N = 1 + K·γ node slots per row.
  """
  batch, _, _ = _check_drafts(drafts)
  checks.check_shape("root_token", root_token, (batch,), "[B]")
  checks.check_shape("root_position", root_position, (batch,), "[B]")
  return _build_tree(jnp.asarray(drafts, jnp.int32), jnp.asarray(root_token, jnp.int32),
                     jnp.asarray(root_position, jnp.int32))


@jax.jit
def _build_tree(drafts: Array, root_token: Array, root_position: Array) -> Tree:
  batch, n_drafts, gamma = drafts.shape
  n_max = 1 + n_drafts * gamma
  rows = jnp.arange(batch)[:, None, None]

  # same[b, k, k', j]: drafts k and k' share their first j+1 tokens. The node of a prefix is named after
  # its lowest-index draft (the representative); a slot is new iff it is its own representative.
  same = jnp.cumprod(drafts[:, :, None, :] == drafts[:, None, :, :], axis=-1).astype(bool)
  representative = jnp.argmax(same, axis=2)                                    # [B, K, γ]
  is_new = representative == jnp.arange(n_drafts)[None, :, None]
  # Number new slots depth-major (j, then k): parents precede children.
  new_by_depth = jnp.swapaxes(is_new, 1, 2).reshape(batch, gamma * n_drafts)
  ids = jnp.swapaxes(jnp.cumsum(new_by_depth, axis=-1).reshape(batch, gamma, n_drafts), 1, 2)
  node_of = jnp.concatenate(
      [jnp.zeros((batch, n_drafts, 1), jnp.int32),
       jnp.take_along_axis(ids, representative, axis=1).astype(jnp.int32)], axis=-1)
  n_nodes = (1 + jnp.sum(is_new, axis=(1, 2))).astype(jnp.int32)

  # Slots sharing a node write identical values, so scattering every slot is well defined.
  child = node_of[:, :, 1:]
  tokens = jnp.zeros((batch, n_max), jnp.int32).at[:, 0].set(root_token)
  tokens = tokens.at[rows, child].set(drafts)
  depth = jnp.zeros((batch, n_max), jnp.int32).at[rows, child].set(
      jnp.broadcast_to(jnp.arange(1, gamma + 1, dtype=jnp.int32), drafts.shape))
  parent = jnp.full((batch, n_max), -1, jnp.int32).at[rows, child].set(node_of[:, :, :-1])
  # The row of a prefix's node is the set of nodes on that prefix's path from the root.
  on_path = jnp.cumsum(jax.nn.one_hot(node_of, n_max, dtype=jnp.int32), axis=2) > 0
  attention_mask = jnp.broadcast_to(jnp.eye(n_max, dtype=bool), (batch, n_max, n_max))
  attention_mask = attention_mask.at[rows, node_of].set(on_path)
  return Tree(
      tokens=tokens,
      positions=root_position[:, None] + depth,
      depth=depth,
      parent=parent,
      valid=jnp.arange(n_max)[None, :] < n_nodes[:, None],
      n_nodes=n_nodes,
      node_of=node_of,
      attention_mask=attention_mask)


def gather_nodes(values: Array, tree: Tree) -> Array:
  """Per-draft view of per-node values: [B, N, ...] -> [B, K, γ+1, ...], out[b, k, j] = values at the
  node of draft k's prefix of length j (e.g. the verifier's p(·|u, x_{≤j}^{(k)}) for `verify_tree`)."""
  batch, n_max = tree.tokens.shape
  if tuple(np.shape(values))[:2] != (batch, n_max):
    raise ValueError(f"values must have shape [B, N, ...] = ({batch}, {n_max}, ...); "
                     f"got {tuple(np.shape(values))}")
  return jnp.asarray(values)[jnp.arange(batch)[:, None, None], tree.node_of]


class _Walk(NamedTuple):
  """Loop state of `verify_tree`: one round of iterative speculative sampling per iteration."""
  depth: Array     # [B] tokens accepted so far (the current node's depth)
  leader: Array    # [B] a draft whose prefix is the accepted path (the last one accepted)
  active: Array    # [B, K] drafts whose prefix equals the accepted path
  tried: Array     # [B, K] active drafts already rejected at the current node
  p_cur: Array     # [B, V] current node's p after the residual updates of its rejected rounds
  n_rounds: Array  # [] rounds played so far (each row plays at most K·γ)


def verify_tree(key: Array, drafts: Array, q: Array, p: Array,
                draft_mask: Array | None = None) -> tuple[Array, Array, Array]:
  """SpecInfer tree verification (notes §2.1, step 4) by iterative speculative sampling (notes §2).

  At the current node each still-active draft gets one round, in random order: its next token x is
  accepted with probability min(1, p_cur(x)/q_k(x)), q_k being that draft's own proposal; acceptance
  moves to the child x (every draft whose next token is x stays active, tried or not), rejection sets
  p_cur ← norm(max(p_cur − q_k, 0)). When no draft is accepted the next token is drawn from p_cur; at
  depth γ it is the bonus token drawn from p at the leaf. The output x_1 … x_n, next_token follows p.

  The rounds are per original draft, not per distinct child: drafts that share a token each get their
  own round and residual update. Merging them breaks exactness (DESIGN, pitfalls).

  Drafts must be independent samples (i.i.d. from one drafter or from independent drafters): each round
  needs a fresh x ~ q_k independent of the rounds before it. A deterministic copy of a draft re-proposes
  the x just rejected; p_cur(x) is then 0, so the copy is rejected, but its round subtracts q_k from the
  residual a second time and the final draw no longer has the law that makes the output follow p (with
  p = (.6, .4, 0), q = (.2, .3, .5) two copies give (.7, .3, 0)). Pass such a draft once, or mask its
  copies out with `draft_mask`. With a one-hot q_k (greedy drafting) copies are harmless: the copy's
  round removes only x, where p_cur is already 0, so it changes nothing.

  Args:
    key: PRNG key.
    drafts: [B, K, γ] draft tokens; x_j^{(k)} was drawn from q[b, k, j−1].
    q: [B, K, γ, V] proposal distributions q_k(·|u, x_{<j}^{(k)}).
    p: [B, K, γ+1, V] target distributions p(·|u, x_{≤j}^{(k)}) (j = 0 … γ), e.g. `gather_nodes` of the
      verifier's output on `build_tree(drafts, …)`; drafts sharing a prefix must agree there.
    draft_mask: [B, K] bool, False drafts take no part (a row with none left samples from p at the root).
  Returns:
    n_accepted: [B] int32 in [0, γ].
    draft_index: [B] int32, a draft whose first n_accepted tokens are the accepted ones.
    next_token: [B] int32, the token after them. The output is
      drafts[b, draft_index, :n_accepted] + [next_token].
    Rows whose q or p contain NaN get −1 in all three (the in-jit flag; outside jit NaN raises).
  """
  batch, n_drafts, gamma = _check_drafts(drafts)
  checks.check_shape("q", q, (batch, n_drafts, gamma, None), "[B, K, γ, V]")
  vocab = np.shape(q)[-1]
  checks.check_shape("p", p, (batch, n_drafts, gamma + 1, vocab), "[B, K, γ+1, V]")
  checks.check_range("drafts", drafts, 0, vocab - 1)
  checks.check_probs("q", q)
  checks.check_probs("p", p)
  if draft_mask is None:
    draft_mask = jnp.ones((batch, n_drafts), bool)
  checks.check_shape("draft_mask", draft_mask, (batch, n_drafts), "[B, K]")
  return _verify_tree(key, jnp.asarray(drafts, jnp.int32), jnp.asarray(q, jnp.float32),
                      jnp.asarray(p, jnp.float32), jnp.asarray(draft_mask, bool))


@jax.jit
def _verify_tree(key: Array, drafts: Array, q: Array, p: Array,
                 draft_mask: Array) -> tuple[Array, Array, Array]:
  batch, n_drafts, gamma = drafts.shape
  key_uniform, key_next = rng.split(key)
  rows = jnp.arange(batch)

  # One uniform draw (each random op adds a threefry kernel to compile) gives priorities [B, γ, K], a
  # random order of each node's rounds that ignores the tokens, and coins [B, K·γ], the rounds'
  # acceptance uniforms: a row plays at most K rounds at each of its γ inner nodes.
  uniforms = rng.uniform(key_uniform, (batch, 2, gamma, n_drafts))
  priority, coins = uniforms[:, 0], uniforms[:, 1].reshape(batch, gamma * n_drafts)

  def has_round(s: _Walk) -> Array:
    return (s.depth < gamma) & jnp.any(s.active & ~s.tried, axis=-1)

  def one_round(s: _Walk) -> _Walk:
    live = has_round(s)
    d = jnp.minimum(s.depth, gamma - 1)
    k = jnp.argmin(jnp.where(s.active & ~s.tried, priority[rows, d], jnp.inf), axis=-1)
    x = drafts[rows, k, d]
    q_k = q[rows, k, d]
    # u < p/q  <=>  u·q < p, as in verify.verify_block.
    accept = live & (coins[:, s.n_rounds] * q_k[rows, x] < s.p_cur[rows, x])
    reject = live & ~accept
    res = verify.residual(s.p_cur, q_k)
    res = res / jnp.sum(res, axis=-1, keepdims=True)
    # Drafts already rejected here but sharing x stay active: their continuations are fresh draws from
    # q_k(·|path, x), independent of this node's coin flips.
    same_child = drafts[rows, :, d] == x[:, None]
    return _Walk(
        depth=s.depth + accept,
        leader=jnp.where(accept, k, s.leader),
        active=jnp.where(accept[:, None], s.active & same_child, s.active),
        tried=jnp.where(accept[:, None], False,
                        s.tried | (reject[:, None] & (jnp.arange(n_drafts) == k[:, None]))),
        p_cur=jnp.where(accept[:, None], p[rows, k, d + 1], jnp.where(reject[:, None], res, s.p_cur)),
        n_rounds=s.n_rounds + 1)

  leader = jnp.argmax(draft_mask, axis=-1).astype(jnp.int32)
  start = _Walk(depth=jnp.zeros((batch,), jnp.int32), leader=leader, active=draft_mask,
                tried=jnp.zeros((batch, n_drafts), bool), p_cur=p[rows, leader, 0],
                n_rounds=jnp.zeros((), jnp.int32))
  end = jax.lax.while_loop(lambda s: jnp.any(has_round(s)), one_round, start)
  next_token = sampling.sample(key_next, end.p_cur)

  bad = jnp.any(jnp.isnan(q), axis=(1, 2, 3)) | jnp.any(jnp.isnan(p), axis=(1, 2, 3))
  return (jnp.where(bad, -1, end.depth).astype(jnp.int32),
          jnp.where(bad, -1, end.leader).astype(jnp.int32),
          jnp.where(bad, -1, next_token).astype(jnp.int32))


def verify_tree_greedy(drafts: Array, p: Array) -> tuple[Array, Array, Array]:
  """Greedy tree verification (notes App. A, with step 4 corrected to append ν.y).

  Greedy decoding is deterministic, so at each node at most one child matches argmax p: the walk of
  App. A ends at the deepest node whose whole path matches, i.e. the longest draft prefix x_{≤n}^{(k)}
  with x_j^{(k)} = argmax p(·|u, x_{<j}^{(k)}) for every j ≤ n; then it appends argmax p at that node.

  Args:
    drafts: [B, K, γ] draft tokens.
    p: [B, K, γ+1, V] target distributions p(·|u, x_{≤j}^{(k)}), or their argmax tokens [B, K, γ+1]
      (int). argmax takes the lowest index on ties, like `sampling.transform` at temperature 0.
  Returns:
    n_accepted [B], draft_index [B] (the lowest-index draft with the longest accepted prefix) and
    next_token [B], all int32, as in `verify_tree`. Rows whose p contains NaN get −1.
  """
  batch, n_drafts, gamma = _check_drafts(drafts)
  if np.ndim(p) == 4:
    checks.check_shape("p", p, (batch, n_drafts, gamma + 1, None), "[B, K, γ+1, V]")
    checks.check_probs("p", p)
    checks.check_range("drafts", drafts, 0, np.shape(p)[-1] - 1)
    p = jnp.asarray(p)
    greedy = sampling.argmax(p)   # XLA:CPU's (value, index) argmax took 1.3 ms per block over [1, 4, 3, 49152]
    bad = jnp.any(jnp.isnan(p), axis=(1, 2, 3))
  elif np.ndim(p) == 3 and jnp.issubdtype(jnp.result_type(p), jnp.integer):
    checks.check_shape("p", p, (batch, n_drafts, gamma + 1), "[B, K, γ+1] (argmax tokens)")
    greedy = p
    bad = jnp.zeros((batch,), bool)
  else:
    raise ValueError(f"p must be distributions [B, K, γ+1, V] or integer argmax tokens [B, K, γ+1]; "
                     f"got shape {np.shape(p)}, dtype {jnp.result_type(p)}")
  return _longest_greedy_path(jnp.asarray(drafts, jnp.int32), jnp.asarray(greedy, jnp.int32), bad)


@jax.jit
def _longest_greedy_path(drafts: Array, greedy: Array, bad: Array) -> tuple[Array, Array, Array]:
  batch, _, gamma = drafts.shape
  rows = jnp.arange(batch)
  n_matching = jnp.sum(jnp.cumprod(drafts == greedy[:, :, :gamma], axis=-1), axis=-1)   # [B, K]
  draft_index = jnp.argmax(n_matching, axis=-1).astype(jnp.int32)
  n_accepted = n_matching[rows, draft_index].astype(jnp.int32)
  next_token = greedy[rows, draft_index, n_accepted]
  return (jnp.where(bad, -1, n_accepted), jnp.where(bad, -1, draft_index),
          jnp.where(bad, -1, next_token))
