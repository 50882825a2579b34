"""The feature drafter (EAGLE, Li et al., ICML 2024): drafts from the verifier's own hidden states through a
one-layer head (`models.feature_head`), read out by the verifier's own output layer (layer 3).

State: the head's KV cache over the committed positions (each written from the verifier's real features)
and the pending pair's feature f_T, the verifier's last hidden state at the last committed position, the one
that predicts the pending token x_T+1 = `last`. A block of γ drafts:

  f̂ = head(f_T, e(last)),  q_1 = S(softmax(out(f̂))),  d_1 ~ q_1;  f̂' = head(f̂, e(d_1)),  q_2, d_2 …

(γ head calls, γ + 1 where the target reads q at the bonus position). After verification (`verified`) the
head's cache is cut back to the committed positions and re-reads the accepted drafts with the verifier's
real features, (f(last), d_1) … (f(d_{a−1}), d_a), in one call; f(d_a), the verifier's feature under the
new pending token, becomes the pending feature. After the prefill the same call reads the prompt. A head reading
fused features (EAGLE-3, `FeatureHead.reduce`) needs the verifier to return them: the loop decodes with
`decoding_verifier(verifier)`, and the head reads them reduced to E.

Every lossless rule keeps the verifier's law with it (only the verifier's acceptance test decides what is
emitted), and it meets every target rule of `speculative` and BiLD like any other drafter.

With a draft vocabulary (`FeatureHead.draft_ids`, k tokens) a draft step reads only those k rows of the verifier's
output layer (taken once per generation, in `start`), and the whole draft step — S(·), the draw, EAGLE-2's beams —
works on those k columns; the block's q is then placed at their ids, exactly 0 elsewhere (`to_vocabulary`): S(·)
of the full logits with every other token at 0 probability, the q the draft is sampled from and the verifier's
test reads (a token outside the draft vocabulary is then never drafted, only emitted by the verifier's residual or
bonus draw).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specdec import rng
from specdec import sampling as sampling_lib
from specdec.decoding.drafters import BeamSearch, Draft, Drafter, Verified
from specdec.models.base import Cache, Features, Model, rollback
from specdec.models.feature_head import FeatureHead, verifier_fingerprint

Array = jax.Array

# What a feature drafter reads of its verifier (`base.Features`, declared by `feature_access`; `check_features`).
VERIFIER_METHODS = ("token_embeddings", "output_logits", "output_table")


@struct.dataclass
class FeatureState:
  """The head's cache [B, …] over committed positions, the pending pair's verifier feature [B, E] (`reduce`d) and,
  with a draft vocabulary, the verifier's output rows of its tokens [k, E] (None: the whole output layer)."""
  cache: Cache
  feature: Array
  table: Array | None = None


@struct.dataclass
class FeatureDrafter(Drafter):
  """EAGLE's drafter (module docstring): `head` reads `verifier`'s hidden states, embeddings and output
  layer (shared: the verifier's own parameters). `bonus_q` False: γ calls per block, no q at the bonus
  position (for the targets that do not read it; `speculative` sets it)."""
  head: FeatureHead
  verifier: Features
  bonus_q: bool = struct.field(pytree_node=False, default=True)

  @property
  def vocab_size(self) -> int:
    return self.verifier.vocab_size

  @property
  def max_length(self) -> int:
    return min(self.head.max_length, self.verifier.max_length)

  @property
  def reads_verifier(self) -> bool:
    return True

  @property
  def encoder_decoder(self) -> bool:
    """A T5 verifier's: the head reads its decoder's hidden states, at its decoder positions."""
    return self.verifier.encoder_decoder

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return self.verifier.prompt_cache_positions(prompt_width)

  def decoding_verifier(self, verifier: Model) -> Model:
    """`verifier` returning as its hidden states the features the head reads: its `feature_layers`' outputs
    beside its last hidden state (`Decoder.with_feature_layers`); itself for a head without them. ValueError
    naming the verifier where it cannot return them."""
    layers = self.head.config.feature_layers
    if not layers:
      return verifier
    check_features(verifier)
    return verifier.with_feature_layers(layers)

  def check_verifier(self, verifier: Model) -> None:
    check_pair(self.head, verifier)
    if verifier is not self.verifier and verifier_fingerprint(verifier) != verifier_fingerprint(self.verifier):
      raise ValueError("the feature drafter reads another verifier's output layer than the one decoding: build "
                       "it with feature_drafter.FeatureDrafter(head, verifier) for the verifier you decode with")

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[FeatureState, Array]:
    """An empty head cache; the prompt is read by `verified` from the verifier's prefill (a T5 verifier's
    decoder reads nothing of it: the loop hands over its decoder start token as the pending token)."""
    batch = prompts.shape[0]
    last = prompts[jnp.arange(batch), prompt_lengths - 1].astype(jnp.int32)
    feature = jnp.zeros((batch, self.head.config.embed_dim), jnp.float32)
    ids = self.head.draft_ids
    table = None if ids is None else jnp.take(self.verifier.output_table(), ids, axis=0)
    return FeatureState(cache=self.head.init_cache(batch, cache_length, layout), feature=feature, table=table), last

  def draft_logits(self, predicted: Array, table: Array | None) -> Array:
    """Next-token logits of predicted features [B, 1, E] over the tokens the head drafts among: [B, V] through the
    whole output layer (`table` None), or [B, k] through the draft vocabulary's rows `table` [k, E]
    (`FeatureState.table`, gathered once per decode), column i for token draft_ids[i]."""
    return self.verifier.output_logits(predicted, table)[:, 0]

  def to_vocabulary(self, x: Array) -> Array:
    """Distributions over the draft vocabulary's columns [..., k] as distributions over the whole vocabulary
    [..., V], 0 at every token outside it (without a draft vocabulary: x as it is)."""
    ids = self.head.draft_ids
    if ids is None:
      return x
    return jnp.zeros(x.shape[:-1] + (self.vocab_size,), x.dtype).at[..., ids].set(x)

  @property
  def keeps_copies(self) -> bool:
    return True

  def keep_copy(self, state: FeatureState, source_rows: Array, start: Array, width: int) -> FeatureState:
    """As it is: `verified` drops every drafted entry and re-reads the kept path from the verifier's own
    features, so no copy's drafted entries are kept."""
    return state

  def rollback(self, state: FeatureState, lengths: Array) -> FeatureState:
    """Keeps the head's entries of the first lengths[b] − 1 positions (position 0 has no pair)."""
    return state.replace(cache=rollback(state.cache, jnp.maximum(jnp.asarray(lengths, jnp.int32) - 1, 0)))

  def verified(self, state: FeatureState, block: Verified) -> FeatureState:
    """Re-reads the committed part of the block with the verifier's features (module docstring): from the
    committed length before the block, pairs (hidden[i], tokens[i + 1]) in one head call, kept for
    i < count − 1; the pending feature becomes hidden[count − 1] (kept where a row committed nothing).
    The head holds one entry per committed position but the first: lengths − 1."""
    if block.hidden is None:
      raise ValueError("a FeatureDrafter needs the verifier's hidden states: the loop must ask for them "
                       "(Drafter.reads_verifier)")
    # Before the block the head held lengths − count entries (its first call in `propose`, on the
    # pending pair with the verifier's own feature, included): the drafted entries after it are dropped.
    cache = rollback(state.cache, jnp.maximum(block.lengths - block.count, 0))
    width = block.tokens.shape[1]
    hidden = self.head.reduce(block.hidden)
    if width > 1:
      _, cache = self.head.score(cache, hidden[:, :-1], self.verifier.token_embeddings(block.tokens[:, 1:]))
    cache = rollback(cache, jnp.maximum(block.lengths - 1, 0))
    index = jnp.clip(block.count - 1, 0, width - 1)
    feature = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
    return state.replace(cache=cache, feature=jnp.where((block.count > 0)[:, None], feature, state.feature))

  def propose(self, key: Array, state: FeatureState, last: Array, *, max_drafts: int,
              sampling: sampling_lib.Sampling, keep_drafting: Callable[[Array], Array] | None = None,
              beam: BeamSearch | None = None) -> Draft:
    """γ = max_drafts drafts, each from the head's predicted feature (γ + 1 calls with `bonus_q`). A row
    that stops (keep_drafting False: BiLD's fallback, a confidence stop) drafts no more; calls run for the whole
    batch until every row has stopped (its q at the position where it stopped is computed: the bonus q). With
    `beam` the copies draft as beams (EAGLE-2's dynamic tree): each takes its parent beam's head cache and
    predicted feature after every call."""
    batch = last.shape[0]
    ids = self.head.draft_ids
    columns = self.vocab_size if ids is None else ids.shape[0]
    calls = max_drafts + 1 if self.bonus_q else max_drafts
    keys = rng.split(key, max_drafts + 1)

    def body(carry):
      step, cache, feature, token, tokens, q, q_raw, drafting, n_drafted, log_values = carry
      predicted, cache = self.head.score(cache, feature[:, None], self.verifier.token_embeddings(token[:, None]))
      # Over the draft vocabulary's k columns: S(·) of logits with every other token at 0 probability is S(·) of
      # these, placed at their ids (`to_vocabulary`), and a draw or a beam's column i is token draft_ids[i].
      q_raw_j, q_j = sampling.distributions(self.draft_logits(predicted, state.table))
      keep = drafting[:, None]
      q = q.at[:, step].set(jnp.where(keep, q_j, q[:, step]))
      q_raw = q_raw.at[:, step].set(jnp.where(keep, q_raw_j, q_raw[:, step]))
      go_on = drafting & (step < max_drafts)
      if keep_drafting is not None:
        go_on &= keep_drafting(q_raw_j)
      predicted = predicted[:, 0]
      if beam is None:
        x = sampling_lib.sample(keys[step], q_j)
      else:   # the copies draft in step (no keep_drafting with beams): go_on is the same for all
        x, parent, log_values = beam.step(log_values, q_raw_j)
        parent = jnp.where(go_on, parent, jnp.arange(batch) % beam.num_beams)
        cache, predicted, tokens, q, q_raw = beam.reorder((cache, predicted, tokens, q, q_raw), parent)
      x = x if ids is None else ids[x]
      slot = jnp.minimum(step, max_drafts - 1)
      tokens = tokens.at[:, slot].set(jnp.where(go_on, x, tokens[:, slot]))
      return (step + 1, cache, predicted, jnp.where(go_on, x, token), tokens, q, q_raw, go_on, n_drafted + go_on,
              log_values)

    zeros = jnp.zeros((batch, max_drafts + 1, columns), jnp.float32)
    carry = (jnp.int32(0), state.cache, state.feature, last, jnp.zeros((batch, max_drafts), jnp.int32), zeros, zeros,
             jnp.ones((batch,), bool), jnp.zeros((batch,), jnp.int32),
             jnp.zeros((batch,), jnp.float32) if beam is None else beam.start(batch))
    if keep_drafting is None:   # a static trip count: no device-to-host read of a loop condition per call
      running = lambda carry: carry[0] < calls
    else:   # after the call where the last row stopped, every later call would change nothing that is read
      running = lambda carry: (carry[0] < calls) & jnp.any(carry[7])
    steps, cache, _, _, tokens, q, q_raw, _, n_drafted, _ = jax.lax.while_loop(running, body, carry)
    # Charged with the head call of `verified` that follows: it re-reads the accepted drafts.
    return Draft(tokens=tokens, q=self.to_vocabulary(q), q_raw=self.to_vocabulary(q_raw), n_drafted=n_drafted,
                 calls=jnp.full((batch,), steps + 1, jnp.int32), state=state.replace(cache=cache))


def check_features(verifier: Model) -> None:
  """Raises ValueError naming `verifier`'s class where it does not declare `feature_access` (`base.Features`)."""
  if not verifier.feature_access:
    raise ValueError(f"a feature drafter reads the verifier's hidden states through {', '.join(VERIFIER_METHODS)}, "
                     f"which {type(verifier).__name__} does not have (it declares feature_access False)")


def check_pair(head: FeatureHead, verifier: Model) -> None:
  """Raises ValueError naming both when `head` was not trained for `verifier` (its hidden size, vocabulary
  or output layer's fingerprint), or when `verifier` lacks what a feature drafter reads (`check_features`)."""
  check_features(verifier)
  config = head.config
  if (config.embed_dim, config.vocab_size) != (verifier.hidden_size, verifier.vocab_size):
    raise ValueError(f"the feature head reads hidden size {config.embed_dim} and vocabulary {config.vocab_size}; "
                     f"the verifier has {verifier.hidden_size} and {verifier.vocab_size}")
  if config.fingerprint and config.fingerprint != verifier_fingerprint(verifier):
    raise ValueError(f"the feature head was trained for the verifier with output layer {config.fingerprint}; "
                     f"this verifier's is {verifier_fingerprint(verifier)}")
