"""The lm1b-style transformer: presets have the SpecTr sizes, parameters load by path and shape, it runs inside
`lax.while_loop`, its logits are lm1b's read of the hidden states, and bfloat16 weights stay close to float32. Its
cached path (per-row lengths, rollback, token trees) is the model contract's: tests/models/test_contract.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import models
from specdec.models import base
from tests.backends import tolerance

V = 61
B = 3
CACHE = 24
PROMPT_LENGTHS = np.array([3, 7, 5], np.int32)
ROWS = np.arange(B)[:, None]
ATOL = tolerance(1e-5)

_logits = jax.jit(lambda model, tokens: model.logits(tokens))


@jax.jit
def _score(model, cache, tokens, positions=None, tree_mask=None):
  """`score`'s logits and cache."""
  scored = model.score(cache, tokens, positions=positions, tree_mask=tree_mask)
  return scored.logits, scored.cache


_prefill = jax.jit(base.prefill)


@pytest.fixture(scope="module")
def model():
  return models.build("tiny", vocab_size=V, seed=0)


def _data(seed=0):
  """Sequences [B, 20] and prompts [B, 8] = their first PROMPT_LENGTHS tokens padded with junk."""
  rng = np.random.default_rng(seed)
  seqs = rng.integers(0, V, size=(B, 20)).astype(np.int32)
  junk = rng.integers(0, V, size=(B, 8)).astype(np.int32)
  prompts = np.where(np.arange(8) < PROMPT_LENGTHS[:, None], seqs[:, :8], junk)
  return seqs, prompts


def _prefilled(model, prompts, prompt_lengths=PROMPT_LENGTHS):
  return _prefill(model, model.init_cache(len(prompts), CACHE), prompts, prompt_lengths)


def test_presets_have_the_spectr_lm1b_sizes():
  targets = {"2m": 2e6, "6m": 6e6, "20m": 20e6, "97m": 97e6}
  for preset, target in targets.items():
    # eval_shape: counts shapes without materialising 97M random numbers.
    count = models.count_params(jax.eval_shape(lambda p=preset: models.build(p, vocab_size=32_000)))
    print(f"{preset}: {count:,} parameters at vocab 32000 (target {target:,.0f})")
    assert abs(count - target) / target < 0.15


def test_unknown_preset_names_the_known_ones():
  with pytest.raises(ValueError, match="unknown model preset 'huge'.*tiny, 2m, 6m, 15m, 20m, 97m, t5_tiny"):
    models.build("huge", vocab_size=V)


def test_with_params_checks_paths_and_shapes(model):
  params = jax.tree.map(np.asarray, model.params)
  loaded = models.with_params(models.build("tiny", vocab_size=V, seed=1), params)
  tokens = _data()[0]
  np.testing.assert_array_equal(_logits(loaded, tokens), _logits(model, tokens))

  wrong_shape = jax.tree.map(lambda x: x, params)
  wrong_shape["embed"]["embedding"] = np.zeros((V + 1, 32), np.float32)
  with pytest.raises(ValueError, match=r"wrong shape \(1\): embed/embedding: \(62, 32\) instead of \(61, 32\)"):
    models.with_params(model, wrong_shape)
  missing = {k: v for k, v in params.items() if k != "final_norm"}
  with pytest.raises(ValueError, match="missing \\(2\\): final_norm/bias, final_norm/scale"):
    models.with_params(model, missing)


def test_greedy_decoding_inside_a_jitted_while_loop(model):
  seqs, prompts = _data(4)
  steps = 6

  @jax.jit
  def greedy(model, prompts, prompt_lengths):
    token, cache = base.prefill(model, model.init_cache(B, CACHE), prompts, prompt_lengths)

    def body(state):
      i, cache, token, out = state
      scored = model.score(cache, token[:, None])
      logits, cache = scored.logits, scored.cache
      token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
      return i + 1, cache, token, out.at[:, i].set(token)

    init = (0, cache, token, jnp.zeros((B, steps), jnp.int32))
    return jax.lax.while_loop(lambda state: state[0] < steps, body, init)[3]

  generated = np.asarray(greedy(model, prompts, PROMPT_LENGTHS))
  full = np.zeros((B, 7 + steps), np.int32)
  for b in range(B):
    full[b, :PROMPT_LENGTHS[b]] = prompts[b, :PROMPT_LENGTHS[b]]
    full[b, PROMPT_LENGTHS[b]:PROMPT_LENGTHS[b] + steps] = generated[b]
  argmax = np.asarray(jnp.argmax(_logits(model, full), axis=-1))
  np.testing.assert_array_equal(generated, argmax[ROWS, PROMPT_LENGTHS[:, None] - 1 + np.arange(steps)])


def test_score_returns_the_hidden_states_the_logits_are_read_from(model):
  seqs, prompts = _data(5)
  _, cache = _prefilled(model, prompts)
  tokens = seqs[ROWS, np.asarray(cache.lengths)[:, None] + np.arange(3)]
  scored = model.score(cache, tokens)
  logits, hidden = scored.logits, scored.hidden
  assert hidden.shape == tokens.shape + (model.config.embed_dim,)
  # lm1b's output layer: logits = hidden · embeddingᵀ / √E.
  embedding = np.asarray(model.params["embed"]["embedding"])
  np.testing.assert_allclose(logits, np.asarray(hidden) @ embedding.T / np.sqrt(model.config.embed_dim), atol=ATOL)


@pytest.mark.parametrize("preset", ["tiny", "t5_tiny"])
def test_bfloat16_weights_and_cache_give_float32_logits_close_to_float32(preset):
  f32 = models.build(preset, vocab_size=V, seed=0)
  bf16 = models.with_dtype(f32, jnp.bfloat16)
  assert {leaf.dtype for leaf in jax.tree.leaves(bf16.params)} == {jnp.dtype(jnp.bfloat16)}
  seqs, prompts = _data(6)
  logits = []
  for model in (f32, bf16):
    _, cache = _prefilled(model, prompts)
    scored, cache = _score(model, cache, seqs[:, 8:12])
    logits.append(np.asarray(scored))
  assert scored.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(cache.kv) if jnp.issubdtype(x.dtype, jnp.floating)} == {
      jnp.dtype(jnp.bfloat16)}
  assert not np.array_equal(logits[0], logits[1])  # the bfloat16 path really ran
  np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=0.05 * np.abs(logits[0]).max())


def test_with_dtype_rejects_a_non_float_dtype(model):
  with pytest.raises(ValueError, match="dtype must be a floating-point type"):
    models.with_dtype(model, jnp.int32)
