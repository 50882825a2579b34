"""Multi-draft speculative decoding: SpecTr (Sun et al., 2023), SpecInfer's token trees (Miao et al.) and
EAGLE-2's dynamic draft tree (Li et al., EMNLP 2024).

One block, shared by the three methods:

  1. `IIDDrafts` draws K drafts of γ tokens, i.i.d. given the prefix (SpecTr Alg. 5's draft set): the
     drafter's state holds K copies of every row, so each position is ONE batched call over [B·K] rows
     (the drafter: a model that scores trees, or a feature drafter, `Drafter.keeps_copies`);
  2. the drafts' prefix tree (`tree.build_tree`, shared prefixes deduplicated) is scored by the verifier
     in ONE call with tree attention: p at every draft prefix — only as many nodes as the largest tree of
     the batch holds, from a few static widths (at T = 0 the K drafts coincide and the tree is one chain
     of γ + 1 nodes, as in `speculative`);
  3. a selection rule picks how much of which draft to keep and the token after it —
       spectr     DraftSelection with K-SEQ at every depth (SpecTr Alg. 3, `spectr.draft_selection`);
       specinfer  SpecInfer's iterative speculative sampling over the tree, one round per original draft
                  (`tree.verify_tree`; merging identical sampled children would break exactness);
       dynamic_tree  the drafts are instead the K beams of a beam search over the drafter's confidence
                  (`BeamDrafts`, `drafters.BeamSearch`: EAGLE-2's expansion of the most confident branches),
                  deterministic given the drafter's state, so each is verified as a proposal q = δ_x by the
                  same `tree.verify_tree`: a child x is accepted with probability p_cur(x) and a rejection
                  removes x from p_cur, which keeps p's law whatever the candidates (EAGLE-2 verifies its
                  tree the same way; it also reranks the expanded nodes, which is not done here: the tree is
                  the beams' prefix tree, so every accepted path is a prefix of a beam the drafter holds);
     at T = 0 both keep the longest draft prefix that matches the verifier's argmaxes
     (`tree.verify_tree_greedy`), and at K = 1 both are speculative sampling (`verify.verify_block`, so
     K = 1 gives `speculative`'s tokens for the same key);
  4. both keep the chosen path: the verifier's tree entries are compacted onto consecutive slots and the
     drafter's K copies take the chosen copy's (`Drafter.keep_copy`: a model's `copy_slots`; a feature
     drafter re-reads the path from the verifier's hidden states along it), then both roll back.

Every method is lossless: the output follows S(p), the verifier's sampling law.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specdec import rng
from specdec import sampling as sampling_lib
from specdec import spectr as spectr_lib
from specdec import targets
from specdec import tree as tree_lib
from specdec import verify
from specdec.decoding import common
from specdec.decoding.drafters import BeamSearch, Draft, Drafter, ModelDrafter, Verified, as_drafter
from specdec.decoding.methods import GAMMA, Method, Param, count_bounds, register
from specdec.decoding.speculative import PairState, commit
from specdec.models.base import Model

Array = jax.Array

SELECTION_RULES = ("spectr", "specinfer", "dynamic_tree")


@struct.dataclass
class DraftSet:
  """K drafts per row: tokens [B, K, γ], the drafter's S(q) at their γ+1 positions [B, K, γ+1, V], the
  drafter calls each row needed [B] (each a batched call over the K copies), and the drafter's state."""
  tokens: Array
  q: Array
  calls: Array
  state: Any


@struct.dataclass
class IIDDrafts:
  """K i.i.d. drafts from one drafter: its state's rows are replicated K times (row b·K + k is copy k of row
  b, as t5x's `flat_batch_beam_expand` lays out beams) and every copy samples independently. It answers
  start / propose / rollback / verified like a `Drafter`, but `propose` gives a `DraftSet` (K drafts per row):
  it is the multi-draft loop's own, not a drafter for the other methods. The drafter is a model's
  (`ModelDrafter`: the kept copy's cache entries are copied to the others) or any drafter that
  `keeps_copies` (a feature drafter re-reads the kept path from the verifier's features)."""
  drafter: Drafter
  num_drafts: int = struct.field(pytree_node=False)

  @property
  def reads_verifier(self) -> bool:
    return self.drafter.reads_verifier

  def verified(self, state: Any, block: Verified) -> Any:
    """Every copy of row b reads row b's verified block."""
    return self.drafter.verified(state, jax.tree.map(self._expand, block))

  def _expand(self, x: Array) -> Array:
    return jnp.repeat(x, self.num_drafts, axis=0)

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[Any, Array]:
    """The drafter's state for [B·K] rows after the prompts, and each row's pending token [B]."""
    state, last = self.drafter.start(self._expand(prompts), self._expand(prompt_lengths), cache_length, layout)
    return state, last[::self.num_drafts]

  def propose(self, key: Array, state: Any, last: Array, *, max_drafts: int, sampling: sampling_lib.Sampling
              ) -> DraftSet:
    """K drafts of γ tokens after `last` [B] (`key`: one per row [B]), and S(q) at their γ + 1 positions
    (a model drafter: γ+1 calls over [B·K] rows, the last one scores d_γ, so the cache covers a fully
    accepted draft). Unlike `speculative`, the call on d_γ is made in every block: a call after selection,
    only where a whole draft was kept, put a `lax.cond` around the [B·K] cache update, and XLA copied the
    cache in its branches."""
    # Copies draw from keys derived from their row's key alone (`rng.expand`); with K = 1, as `speculative`.
    drafted = self.drafter.propose(rng.expand(key, self.num_drafts), state, self._expand(last),
                                   max_drafts=max_drafts, sampling=sampling)
    batch, k, gamma = last.shape[0], self.num_drafts, max_drafts
    return DraftSet(tokens=drafted.tokens.reshape(batch, k, gamma),
                    q=drafted.q.reshape(batch, k, gamma + 1, -1), calls=drafted.calls[::k], state=drafted.state)

  def keep(self, state: Any, draft_index: Array, start: Array, width: int) -> Any:
    """Every copy of row b takes copy draft_index[b]'s entries at positions start[b] … start[b] + width − 1."""
    source = self._expand(jnp.arange(draft_index.shape[0]) * self.num_drafts + draft_index)
    return self.drafter.keep_copy(state, source, self._expand(start), width)

  def rollback(self, state: Any, lengths: Array) -> Any:
    return self.drafter.rollback(state, self._expand(lengths))


@struct.dataclass
class BeamDrafts(IIDDrafts):
  """K drafts per row that are the K beams of a beam search over the drafter's confidence (EAGLE-2's
  dynamic tree, `drafters.BeamSearch`), in `IIDDrafts`' layout: a function of the drafter's state."""

  def propose(self, key: Array, state: Any, last: Array, *, max_drafts: int, sampling: sampling_lib.Sampling
              ) -> DraftSet:
    """The K beams of γ tokens after `last` [B], and S(q) at their γ + 1 positions (as `IIDDrafts.propose`)."""
    drafted = self.drafter.propose(rng.expand(key, self.num_drafts), state, self._expand(last),
                                   max_drafts=max_drafts, sampling=sampling, beam=BeamSearch(self.num_drafts))
    batch, k, gamma = last.shape[0], self.num_drafts, max_drafts
    return DraftSet(tokens=drafted.tokens.reshape(batch, k, gamma),
                    q=drafted.q.reshape(batch, k, gamma + 1, -1), calls=drafted.calls[::k], state=drafted.state)


def _select(rule: str, key: Array, drafts: DraftSet, p: Array, temperature: Array) -> tuple[Array, Array, Array]:
  """(n_accepted, draft_index, next_token) [B] of `rule` for drafts [B, K, γ] and p [B, K, γ+1, V]."""
  tokens, q = drafts.tokens, drafts.q[:, :, :-1]
  if rule == "dynamic_tree":   # deterministic drafts: each is a proposal δ_x (module docstring)
    q = jax.nn.one_hot(tokens, q.shape[-1], dtype=q.dtype)
  if tokens.shape[1] == 1:
    n_accepted, next_token = verify.verify_block(key, tokens[:, 0], q[:, 0], p[:, 0])
    return n_accepted, jnp.zeros_like(n_accepted), next_token

  def sampled(_):
    if rule == "spectr":
      return spectr_lib.draft_selection(key, tokens, q, p)
    return tree_lib.verify_tree(key, tokens, q, p)    # specinfer, dynamic_tree

  # At T = 0, p and q are one-hot and both rules reduce to the longest argmax-matching draft prefix.
  return jax.lax.cond(temperature <= 0.0, lambda _: tree_lib.verify_tree_greedy(tokens, p), sampled, None)


def multi_draft(key: Array, drafter: Model | Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                sampling: sampling_lib.Sampling, rule: str, num_drafts: int, gamma: int, max_new_tokens: int,
                eos_id: int | None, cache_length: int, program: common.Program) -> common.Output:
  """Multi-draft speculative decoding (module docstring) with selection `rule` ∈ SELECTION_RULES: K =
  `num_drafts` drafts of γ = `gamma` tokens (SpecTr's L) per block, one verifier call on their tree
  (`dynamic_tree`: the drafts are K beams)."""
  if rule not in SELECTION_RULES:
    raise ValueError(f"multi-draft selection rule must be one of {SELECTION_RULES}; got {rule!r}")
  drafter = as_drafter(drafter)
  if not verifier.scores_trees:
    raise ValueError(f"method {rule!r} needs a verifier that scores token trees and keeps one path "
                     f"(`copy_slots`, models.base); {type(verifier).__name__} has none")
  if not drafter.keeps_copies:
    what = type(drafter.model if isinstance(drafter, ModelDrafter) else drafter).__name__
    raise ValueError(f"method {rule!r} needs a drafter that drafts K copies of a row and keeps one: a model that "
                     f"scores token trees (`copy_slots`, models.base; no acceptance head) or a feature drafter; "
                     f"{what} is neither")
  drafts_of = (BeamDrafts if rule == "dynamic_tree" else IIDDrafts)(drafter, num_drafts)
  batch, rows = prompts.shape[0], jnp.arange(prompts.shape[0])
  # Tree widths to choose from: one chain, then trees of 2, 4, … drafts' worth of distinct nodes.
  widths = tuple(1 + k * gamma for k in (1, 2, 4, 8, 16, 32) if k < num_drafts)

  def step(state: PairState, done: Array) -> tuple[PairState, common.Emission]:
    key, key_draft, key_select = rng.split(state.key, 3)
    drafts = drafts_of.propose(key_draft, state.drafter_state, state.last, max_drafts=gamma, sampling=sampling)
    start = state.verifier_cache.lengths
    tree = tree_lib.build_tree(drafts.tokens, state.last, start)
    needed = jnp.where(done, 1, tree.n_nodes)
    scored, _ = common.score_prefix(verifier, state.verifier_cache, tree.tokens, needed, widths,
                                    narrow=program.narrow_calls, positions=tree.positions,
                                    tree_mask=tree.attention_mask, return_hidden=drafts_of.reads_verifier)
    logits = scored.logits
    _, p = sampling.distributions(tree_lib.gather_nodes(logits, tree))            # [B, K, γ+1, V]
    n_accepted, draft_index, next_token = _select(rule, key_select, drafts, p, sampling.temperature)
    failed = (n_accepted < 0) | common.has_nan(logits) | common.has_nan(drafts.q)
    draft_index = jnp.maximum(draft_index, 0)
    # The chosen path's tree entries move to consecutive slots; the drafter's copies take the chosen one.
    path = tree.node_of[rows, draft_index]                                         # [B, γ+1]
    # A drafter reading the verifier gets its hidden states along the kept path (the verified block).
    path_hidden = None if scored.hidden is None else scored.hidden[rows[:, None], path]
    verifier_cache = verifier.copy_slots(scored.cache, rows, start[:, None] + path,
                                         start[:, None] + jnp.arange(gamma + 1))
    chosen_q, chosen_p = drafts.q[rows, draft_index], p[rows, draft_index]
    chosen = Draft(tokens=drafts.tokens[rows, draft_index], q=chosen_q, q_raw=chosen_q,
                   n_drafted=jnp.full((batch,), num_drafts * gamma, jnp.int32), calls=drafts.calls,
                   state=drafts_of.keep(drafts.state, draft_index, start, gamma + 1))
    deferred = targets.moves_mass(chosen_p, chosen_q)                               # π = p ≠ q
    width = common.covering_width(needed, widths, tree.tokens.shape[1])
    new_state, emission = commit(state, key, drafts_of, chosen, verifier_cache, n_accepted, next_token,
                                 deferred, failed, done, width, hidden=path_hidden)
    # `drafted` counts all K·γ draft tokens; a block is rejected when the kept path is shorter than γ.
    rejected = (jnp.maximum(n_accepted, 0) < gamma).astype(jnp.int32)
    return new_state, emission.replace(counters={**emission.counters, "rejected": rejected})

  start = PairState.start(key, drafts_of, verifier, prompts, prompt_lengths, cache_length, program.cache_layout)
  output, _ = common.decode_loop(start, step, batch_size=batch, max_new_tokens=max_new_tokens, eos_id=eos_id)
  return output


def spectr(key: Array, drafter: Model | Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, **kw
           ) -> common.Output:
  """SpecTr: K i.i.d. drafts, DraftSelection with K-SEQ (Sun et al., Alg. 3 + Alg. 2)."""
  return multi_draft(key, drafter, verifier, prompts, prompt_lengths, rule="spectr", **kw)


def specinfer(key: Array, drafter: Model | Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, **kw
              ) -> common.Output:
  """SpecInfer: K i.i.d. drafts as a token tree, verified by iterative speculative sampling."""
  return multi_draft(key, drafter, verifier, prompts, prompt_lengths, rule="specinfer", **kw)


def dynamic_tree(key: Array, drafter: Model | Drafter, verifier: Model, prompts: Array, prompt_lengths: Array, **kw
                 ) -> common.Output:
  """EAGLE-2's dynamic draft tree: the K beams of a beam search over the drafter's confidence, their token
  tree verified with each draft a deterministic proposal (module docstring)."""
  return multi_draft(key, drafter, verifier, prompts, prompt_lengths, rule="dynamic_tree", **kw)


NUM_DRAFTS = Param("num_drafts", 4, traced=False, bounds=count_bounds(1, label="num_drafts (K drafts per block)"),
                   help="K i.i.d. drafts per block, an int >= 1")
NUM_BEAMS = Param("num_drafts", 4, traced=False, bounds=count_bounds(1, label="num_drafts (K beams per block)"),
                  help="K beams per block (the tree's width at every depth), an int >= 1")


def _tree_overhang(params) -> int:   # the verifier writes the whole tree, 1 + K·γ slots, before keeping one path
  return params["num_drafts"] * params["gamma"] + 1


register(Method("spectr", decode=spectr, drafter="any", cache_overhang=_tree_overhang, params=(NUM_DRAFTS, GAMMA),
                summary="SpecTr (lossless): K i.i.d. drafts of γ tokens, their token tree scored in one verifier "
                        "call, DraftSelection with K-SEQ"))
register(Method("specinfer", decode=specinfer, drafter="any", cache_overhang=_tree_overhang,
                params=(NUM_DRAFTS, GAMMA),
                summary="the same block verified by SpecInfer's iterative speculative sampling over the tree"))
register(Method("dynamic_tree", decode=dynamic_tree, drafter="any", cache_overhang=_tree_overhang,
                params=(NUM_BEAMS, GAMMA),
                summary="EAGLE-2's dynamic draft tree (lossless): the K beams of a beam search over the drafter's "
                        "confidence, their token tree scored in one verifier call and verified exactly"))
