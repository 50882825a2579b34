"""The model contract (`specdec.models.base`) that every model family keeps, one suite for all: a family runs it by
listing itself in `CONTRACT` (its tiny preset is read from the family registry).

On a tiny random model of each family, the cached path equals teacher forcing (`logits`): a prefill of prompts of
different lengths per row, scores of n tokens at per-row positions, a rollback followed by other tokens (no stale
entry is read), a token tree scored in one call (each node as its root-to-node chain) and one path of it kept by
`copy_slots`; each row scores as if alone, its prompt's padding unread; the feature members read the logits from
the hidden states; `init_cache` lays out one array per layer in each cache layout, and every layout scores alike.
Family-specific behaviour (checkpoints, soft caps, windows, parity with Hugging Face) is in the family's own file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models import base, families, t5
from tests.backends import tolerance

V, B, W, T = 48, 3, 8, 20      # vocabulary, rows, prompt width, decoder tokens per row
CACHE, MAX_LENGTH = 24, 32
PROMPT_LENGTHS = np.array([3, 8, 1], np.int32)
ROWS = np.arange(B)[:, None]
ATOL = tolerance(2e-5)
# A token tree of 7 nodes with two roots: 0 (children 1, 2; grandchildren 3 under 1, 4 under 2) and 5 (child 6).
PARENTS = (-1, 0, 0, 1, 2, -1, 5)


@dataclasses.dataclass(frozen=True)
class Batch:
  """What `prefill` reads and the decoder tokens that the cached path must score as teacher forcing does."""
  prompts: np.ndarray          # [B, W] each row's prompt, padded with junk past prompt_lengths
  prompt_lengths: np.ndarray   # [B]
  stream: np.ndarray           # [B, T] the decoder's tokens: after prefill row b's pending token is stream[b, start[b]]
  start: np.ndarray            # [B] the cache lengths after prefill

  def row(self, b: int) -> Batch:
    """Row b alone, its prompt cut to its own length (no padding)."""
    return Batch(self.prompts[b:b + 1, :self.prompt_lengths[b]], self.prompt_lengths[b:b + 1],
                 self.stream[b:b + 1], self.start[b:b + 1])


def _with_junk(rng: np.random.Generator, prompts: np.ndarray, low: int) -> np.ndarray:
  return np.where(np.arange(W) < PROMPT_LENGTHS[:, None], prompts, rng.integers(low, V, (B, W))).astype(np.int32)


_decoder_logits = jax.jit(lambda model, stream, hidden: model.logits(stream, return_hidden=hidden), static_argnums=2)
_encoder_decoder_logits = jax.jit(lambda model, stream, prompts, lengths: model.logits(
    stream, encoder_tokens=prompts, encoder_lengths=lengths))


class DecoderPrefix:
  """A decoder-only family's calls: the prompt is the first prompt_lengths[b] decoder tokens, of which `prefill`
  caches all but the last (the pending token); teacher forcing is `logits(stream)`, with hidden states too."""
  encoder_decoder = False
  teacher_hidden = True

  @staticmethod
  def batch(rng: np.random.Generator) -> Batch:
    stream = rng.integers(0, V, (B, T)).astype(np.int32)
    return Batch(_with_junk(rng, stream[:, :W], 0), PROMPT_LENGTHS, stream, PROMPT_LENGTHS - 1)

  @staticmethod
  def logits(model, batch: Batch, *, return_hidden: bool = False):
    return _decoder_logits(model, batch.stream, return_hidden)


class EncoderInput:
  """An encoder-decoder family's calls: the prompt is the encoder's input, `prefill` leaves the decoder cache empty
  with the start token pending; teacher forcing is `logits(stream, encoder_tokens=, encoder_lengths=)`."""
  encoder_decoder = True
  teacher_hidden = False   # its `logits` returns no hidden states

  @staticmethod
  def batch(rng: np.random.Generator) -> Batch:
    stream = rng.integers(1, V, (B, T)).astype(np.int32)
    stream[:, 0] = t5.DECODER_START_TOKEN
    return Batch(_with_junk(rng, rng.integers(2, V, (B, W)), 1), PROMPT_LENGTHS, stream, np.zeros(B, np.int32))

  @staticmethod
  def logits(model, batch: Batch):
    return _encoder_decoder_logits(model, batch.stream, batch.prompts, batch.prompt_lengths)


# Every model family, by its name in `families.FAMILIES`, and how the contract calls it.
CONTRACT = {
    "transformer": DecoderPrefix,
    "t5": EncoderInput,
    "gemma2": DecoderPrefix,
    "llama": DecoderPrefix,
}


def _tiny_preset(name: str) -> str:
  """The family's test-sized preset: "tiny" or "<something>_tiny"."""
  found = [preset for preset in families.get(name).presets if preset == "tiny" or preset.endswith("_tiny")]
  assert len(found) == 1, f"family {name} needs one tiny preset for the contract tests; has {found}"
  return found[0]


@functools.lru_cache(maxsize=None)
def _model(name: str):
  return families.get(name).build(_tiny_preset(name), vocab_size=V, seed=0, max_length=MAX_LENGTH)


@pytest.fixture(scope="module", params=sorted(CONTRACT))
def family(request):
  """(model, how the contract calls it) of each listed family."""
  return _model(request.param), CONTRACT[request.param]


_prefill = jax.jit(base.prefill, static_argnames="return_hidden")
_score = jax.jit(lambda model, cache, tokens, positions=None, tree_mask=None: model.score(
    cache, tokens, positions=positions, tree_mask=tree_mask))
_copy_slots = jax.jit(lambda model, cache, *slots: model.copy_slots(cache, *slots))


def _prefilled(model, batch: Batch, layout: str | None = None):
  """(pending tokens [B], cache) of `prefill` into an empty cache of `layout` (None: the platform's)."""
  cache = model.init_cache(len(batch.prompts), CACHE, layout=layout)
  return _prefill(model, cache, batch.prompts, batch.prompt_lengths)


def _close(got, want) -> None:
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)


# --- each case: (what the cached path gives, what teacher forcing or a chain gives) ----------------------------

def _after_prefill(model, prompting, batch, layout=None):
  pending, cache = _prefilled(model, batch, layout)
  np.testing.assert_array_equal(pending, batch.stream[np.arange(B), batch.start])
  np.testing.assert_array_equal(cache.lengths, batch.start)
  got = _score(model, cache, np.asarray(pending)[:, None]).logits[:, 0]
  return [(got, np.asarray(prompting.logits(model, batch))[np.arange(B), batch.start])]


def _ragged(model, prompting, batch, n, layout=None):
  """Three calls of n tokens each; after each, rows roll back by different amounts (0 … n−1)."""
  reference, pairs = np.asarray(prompting.logits(model, batch)), []
  _, cache = _prefilled(model, batch, layout)
  for step in range(3):
    positions = np.asarray(cache.lengths)[:, None] + np.arange(n)
    scored = _score(model, cache, batch.stream[ROWS, positions])
    np.testing.assert_array_equal(scored.cache.lengths, positions[:, -1] + 1)
    pairs.append((scored.logits, reference[ROWS, positions]))
    cache = base.rollback(scored.cache, positions[:, -1] + 1 - (step + np.arange(B)) % n)
  return pairs


def _rolled_back(model, prompting, batch, layout=None):
  """4 tokens scored, rows rolled back to keep 0, 2 and 3 of them, then other tokens: 2, and 2 more. The first
  pair leaves stale entries of the discarded tokens beyond it (rows 0 and 1)."""
  _, cache = _prefilled(model, batch, layout)
  scored = _score(model, cache, batch.stream[ROWS, batch.start[:, None] + np.arange(4)])
  kept = batch.start + np.array([0, 2, 3])
  cache = base.rollback(scored.cache, kept)
  other = batch.stream.copy()
  other[ROWS, kept[:, None] + np.arange(4)] = (batch.stream[ROWS, kept[:, None] + np.arange(4)] + 1 + ROWS) % V
  reference, pairs = np.asarray(prompting.logits(model, dataclasses.replace(batch, stream=other))), []
  for i in (0, 2):
    positions = kept[:, None] + i + np.arange(2)
    scored = _score(model, cache, other[ROWS, positions])
    pairs.append((scored.logits, reference[ROWS, positions]))
    cache = scored.cache
  return pairs


def _tree_mask() -> np.ndarray:
  """[n, n]: node i sees itself and its ancestors."""
  mask = np.eye(len(PARENTS), dtype=bool)
  for i in range(len(PARENTS)):
    j = PARENTS[i]
    while j >= 0:
      mask[i, j], j = True, PARENTS[j]
  return mask


def _tree(model, batch, layout=None):
  """(cache before the tree, tree tokens [B, n], the tree's `Scored`) after 2 decoder tokens past the prefill."""
  _, cache = _prefilled(model, batch, layout)
  cache = _score(model, cache, batch.stream[ROWS, batch.start[:, None] + np.arange(2)]).cache
  mask = _tree_mask()
  tokens = np.random.default_rng(7).integers(1, V, (B, len(PARENTS))).astype(np.int32)
  positions = np.asarray(cache.lengths)[:, None] + mask.sum(1) - 1      # a node's position: its depth past the cache
  return cache, tokens, _score(model, cache, tokens, positions, np.broadcast_to(mask, (B,) + mask.shape))


def _tree_nodes(model, batch, layout=None):
  cache, tokens, scored = _tree(model, batch, layout)
  np.testing.assert_array_equal(scored.cache.lengths, np.asarray(cache.lengths) + len(PARENTS))
  return [(scored.logits[:, i], _score(model, cache, tokens[:, np.flatnonzero(path)]).logits[:, -1])
          for i, path in enumerate(_tree_mask())]


def _kept_path(model, batch, layout=None):
  """Row b keeps the path to node 1, 2 or 6 (copied to the tree's first slots), then scores one more token."""
  cache, tokens, scored = _tree(model, batch, layout)
  paths = np.stack([np.flatnonzero(_tree_mask()[node]) for node in (1, 2, 6)])     # [B, 2] root-to-node
  lengths = np.asarray(cache.lengths)
  kept = _copy_slots(model, scored.cache, np.arange(B), lengths[:, None] + paths, lengths[:, None] + np.arange(2))
  following = np.array([[5], [6], [7]], np.int32)
  got = _score(model, base.rollback(kept, lengths + 2), following).logits[:, 0]
  chain = np.concatenate([tokens[ROWS, paths], following], axis=1)
  return [(got, _score(model, cache, chain).logits[:, -1])]


def _assert_pairs(pairs) -> None:
  for got, want in pairs:
    _close(got, want)


# --- the contract ----------------------------------------------------------------------------------------------

def test_every_registered_family_is_in_the_contract():
  """A new family in `families.FAMILIES` must list itself in CONTRACT, with the calls of its kind of model."""
  assert set(CONTRACT) == set(families.FAMILIES)
  for name, prompting in CONTRACT.items():
    assert _model(name).encoder_decoder == prompting.encoder_decoder, name


def test_prefill_leaves_the_next_positions_logits_to_teacher_forcing(family):
  """After `prefill` of prompts of lengths 3, 8 and 1 (padded with junk), the pending token is the row's next decoder
  token, the cache holds each row's own length, and scoring the pending token gives the teacher-forced logits at
  that row's position."""
  model, prompting = family
  _assert_pairs(_after_prefill(model, prompting, prompting.batch(np.random.default_rng(0))))


@pytest.mark.parametrize("n", [1, 4])
def test_scores_at_per_row_positions_are_teacher_forcing(family, n):
  """`score` of n tokens appended at each row's own length gives the teacher-forced logits at those positions and
  advances each row by n; rows rolled back by different amounts after each call keep doing so."""
  model, prompting = family
  _assert_pairs(_ragged(model, prompting, prompting.batch(np.random.default_rng(1)), n))


def test_after_a_rollback_no_discarded_token_is_read(family):
  """Scores after a per-row rollback and other tokens are the teacher-forced logits of the sequence that never had
  the discarded tokens, while their stale entries still lie beyond the new ones in the cache."""
  model, prompting = family
  _assert_pairs(_rolled_back(model, prompting, prompting.batch(np.random.default_rng(2))))


def test_a_token_tree_scores_each_node_as_its_chain(family):
  """A tree of 7 nodes (two roots, siblings at one position) scored in one call with its tree mask: each node's
  logits are those of its root-to-node path scored as a chain; lengths advance by the tree's size."""
  model, prompting = family
  if not model.scores_trees:
    pytest.skip("the family declares no token trees")
  _assert_pairs(_tree_nodes(model, prompting.batch(np.random.default_rng(3))))


def test_copy_slots_keeps_one_path_of_a_scored_tree(family):
  """After a tree, `copy_slots` moves each row's chosen path (a different one per row) to the tree's first slots
  and a rollback drops the rest: the next token scores as after the path scored as a chain."""
  model, prompting = family
  if not model.scores_trees:
    pytest.skip("the family declares no token trees")
  _assert_pairs(_kept_path(model, prompting.batch(np.random.default_rng(4))))


def test_each_row_scores_as_if_alone_and_never_reads_its_padding(family):
  """The scores of a batch equal each row's own, prefilled alone from its prompt without padding."""
  model, prompting = family
  batch = prompting.batch(np.random.default_rng(5))
  tokens = batch.stream[ROWS, batch.start[:, None] + np.arange(3)]
  together = _score(model, _prefilled(model, batch)[1], tokens).logits
  for b in range(B):
    alone = _score(model, _prefilled(model, batch.row(b))[1], tokens[b:b + 1]).logits
    _close(together[b:b + 1], alone)


def test_feature_members_read_the_logits_from_the_hidden_states(family):
  """For a family declaring `feature_access`: `score`'s hidden states [B, n, hidden_size] through `output_logits`
  give its logits (through rows of `output_table()` [V, E] those rows' logits), `token_embeddings` are [B, n, E]
  float32, one row per token."""
  model, prompting = family
  if not model.feature_access:
    pytest.skip("the family declares no feature access")
  batch = prompting.batch(np.random.default_rng(6))
  tokens = batch.stream[ROWS, batch.start[:, None] + np.arange(3)]
  scored = _score(model, _prefilled(model, batch)[1], tokens)
  e = model.hidden_size
  assert scored.hidden.shape == (B, 3, e)
  table = model.output_table()
  assert table.shape == (V, e)
  _close(model.output_logits(scored.hidden), scored.logits)
  ids = np.array([5, 0, V - 1, 5])
  _close(model.output_logits(scored.hidden, table[ids]), np.asarray(scored.logits)[..., ids])
  embedded = np.asarray(model.token_embeddings(jnp.asarray([[3, 4, 3]])))
  assert embedded.shape == (1, 3, e) and embedded.dtype == np.float32
  np.testing.assert_array_equal(embedded[0, 0], embedded[0, 2])
  assert not np.array_equal(embedded[0, 0], embedded[0, 1])


def test_teacher_forced_hidden_states_are_the_ones_the_logits_are_read_from(family):
  """For a family declaring `feature_access` whose `logits` returns hidden states: `logits(tokens,
  return_hidden=True)` gives the plain logits and hidden states that `output_logits` reads them from, and
  `prefill(…, return_hidden=True)` the same hidden states at each row's prompt positions."""
  model, prompting = family
  if not (model.feature_access and prompting.teacher_hidden):
    pytest.skip("the family's teacher forcing returns no hidden states (an encoder-decoder)")
  batch = prompting.batch(np.random.default_rng(7))
  logits, hidden = prompting.logits(model, batch, return_hidden=True)
  _close(logits, prompting.logits(model, batch))
  _close(model.output_logits(hidden), logits)
  cache = model.init_cache(B, CACHE)
  *_, prompt_hidden = _prefill(model, cache, batch.prompts, batch.prompt_lengths, return_hidden=True)
  for b, length in enumerate(batch.prompt_lengths):
    _close(prompt_hidden[b, :length], hidden[b, :length])


@pytest.mark.parametrize("layout", base.CACHE_LAYOUTS)
def test_init_cache_holds_one_array_per_layer_in_the_layout(family, layout):
  """`init_cache` in a layout (its `layout` argument; the platform's by default): the cache says which; keys and values, one
  array per layer, [B, K, C, D] ("heads") or [C, B, K·D] ("slots") with K = config.cache_heads and D =
  config.head_dim, all zero; lengths [B] int32 zeros; cache lengths outside [1, max_length] are refused."""
  model, _ = family
  cache = model.init_cache(B, CACHE, layout=layout)
  for length in (0, model.max_length + 1):
    with pytest.raises(ValueError, match="cache_length must lie in"):
      model.init_cache(B, length, layout=layout)
  k, d = model.config.cache_heads, model.config.head_dim
  shape = {"heads": (B, k, CACHE, d), "slots": (CACHE, B, k * d)}[layout]
  assert len(cache.kv["keys"]) == len(cache.kv["values"]) > 0
  for array in cache.kv["keys"] + cache.kv["values"]:
    assert array.shape == shape and not np.any(np.asarray(array))
  assert cache.layout == layout and base.cache_slots(cache) == CACHE
  assert cache.lengths.dtype == jnp.int32
  np.testing.assert_array_equal(cache.lengths, np.zeros(B))


def test_every_cache_layout_scores_alike(family):
  """Every case above (prefill, per-row scores, rollback, a tree and a kept path) run from a cache of each layout
  gives the logits of the "heads" one, to float32 rounding (the slot-major layout is attended by XLA on a CPU)."""
  model, prompting = family
  batch = prompting.batch(np.random.default_rng(8))

  def run(layout):
    cases = [_after_prefill(model, prompting, batch, layout), _ragged(model, prompting, batch, 4, layout),
             _rolled_back(model, prompting, batch, layout)]
    if model.scores_trees:
      cases += [_tree_nodes(model, batch, layout), _kept_path(model, batch, layout)]
    return [np.asarray(got) for pairs in cases for got, _ in pairs]
  heads = run("heads")
  for layout in [layout for layout in base.CACHE_LAYOUTS if layout != "heads"]:
    for got, want in zip(run(layout), heads, strict=True):
      np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(1e-5))
