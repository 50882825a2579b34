"""T5 v1.1: T5X's parameter tree and sizes, the decoder's hidden states and encoder padding, Hugging Face import
gives PyTorch's logits and greedy outputs, T5X checkpoints round-trip, bad checkpoints raise, and the
decode loops drive a T5 pair exactly (greedy equality, whole-sequence laws by enumeration). Its cached path (per-row
lengths, rollback, token trees) is the model contract's: tests/models/test_contract.py.

torch/transformers are only needed by the tests comparing with PyTorch (skipped without them).
"""

import itertools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import save_file

from specdec import decoding, models, sampling, targets, verify
from specdec.models import base, t5
from specdec.training import CheckpointError, convert
from tests.backends import tolerance
from tests.stats import assert_law
from tests.t5_data import ENCODER_LENGTHS, assert_hf_logits_equal, t5_batch, teacher_forced
from tests.toy_models import tiny_pair

_prefill = jax.jit(base.prefill)

V = 32


@pytest.fixture(scope="module")
def model():
  return models.build("t5_tiny", vocab_size=V, seed=0, max_length=32)


# --- the network ---------------------------------------------------------------------------------------

def test_parameter_tree_is_t5x_v1_1():
  config = t5.config(V, **t5.PRESETS["t5_tiny"])
  abstract = jax.eval_shape(lambda: t5.init(config, jax.random.PRNGKey(0)))
  shapes = {jax.tree_util.keystr(p, simple=True, separator="/"): leaf.shape
            for p, leaf in jax.tree_util.tree_flatten_with_path(abstract.params)[0]}
  e, j, f = 32, 2 * 16, 64
  attention = {f"{p}/kernel": (e, j) for p in ("query", "key", "value")} | {"out/kernel": (j, e)}
  mlp = {"mlp/wi_0/kernel": (e, f), "mlp/wi_1/kernel": (e, f), "mlp/wo/kernel": (f, e)}
  want = {"token_embedder/embedding": (V, e), "encoder/relpos_bias/rel_embedding": (2, 32),
          "encoder/encoder_norm/scale": (e,), "decoder/relpos_bias/rel_embedding": (2, 32),
          "decoder/decoder_norm/scale": (e,), "decoder/logits_dense/kernel": (e, V)}
  for i in range(2):
    enc, dec = f"encoder/layers_{i}", f"decoder/layers_{i}"
    want |= {f"{enc}/pre_attention_layer_norm/scale": (e,), f"{enc}/pre_mlp_layer_norm/scale": (e,)}
    want |= {f"{enc}/attention/{k}": s for k, s in attention.items()} | {f"{enc}/{k}": s for k, s in mlp.items()}
    want |= {f"{dec}/{norm}/scale": (e,) for norm in ("pre_self_attention_layer_norm",
                                                      "pre_cross_attention_layer_norm", "pre_mlp_layer_norm")}
    want |= {f"{dec}/{att}/{k}": s for att in ("self_attention", "encoder_decoder_attention")
             for k, s in attention.items()} | {f"{dec}/{k}": s for k, s in mlp.items()}
  assert shapes == want


def test_presets_have_the_t5_v1_1_sizes():
  """google/t5-v1_1-* configs (d_model, num_heads, num_layers, d_kv, d_ff) and the parameter counts of
  small and base (tracing large and xl takes seconds); `build` knows the presets."""
  hf = {"t5_small": (512, 6, 8, 64, 1024), "t5_base": (768, 12, 12, 64, 2048),
        "t5_large": (1024, 16, 24, 64, 2816), "t5_xl": (2048, 32, 24, 64, 5120)}
  for preset, (d_model, heads, layers, d_kv, d_ff) in hf.items():
    assert t5.PRESETS[preset] == dict(embed_dim=d_model, num_heads=heads, num_encoder_layers=layers,
                                      num_decoder_layers=layers, head_dim=d_kv, hidden_dim=d_ff)
  for preset, count in {"t5_small": 76_961_152, "t5_base": 247_577_856}.items():
    assert models.count_params(jax.eval_shape(lambda p=preset: models.build(p, vocab_size=32128))) == count
  assert isinstance(models.build("t5_tiny", vocab_size=V), t5.T5)
  with pytest.raises(ValueError, match="known presets: .*97m.*t5_tiny, t5_mini, t5_25m, t5_small"):
    models.build("t5_huge", vocab_size=V)


def test_score_returns_the_decoder_hidden_states_the_logits_are_read_from(model):
  encoder, decoder = t5_batch(1)
  _, cache = _prefill(model, model.init_cache(3, 16), encoder, ENCODER_LENGTHS)
  scored = model.score(cache, decoder[:, :4])
  logits, hidden = scored.logits, scored.hidden
  assert hidden.shape == (3, 4, model.config.embed_dim)
  kernel = np.asarray(model.params["decoder"]["logits_dense"]["kernel"])
  np.testing.assert_allclose(logits, np.asarray(hidden, np.float32) @ kernel, rtol=0, atol=tolerance(1e-5))


def test_padding_and_other_rows_do_not_change_a_row(model):
  encoder, decoder = t5_batch(1)
  junk = np.where(np.arange(7) < ENCODER_LENGTHS[:, None], encoder, 1)
  batched = np.asarray(teacher_forced(model, decoder, encoder, ENCODER_LENGTHS))
  np.testing.assert_array_equal(teacher_forced(model, decoder, junk, ENCODER_LENGTHS), batched)
  for b in range(3):
    width = ENCODER_LENGTHS[b]
    alone = teacher_forced(model, decoder[b:b + 1], encoder[b:b + 1, :width], ENCODER_LENGTHS[b:b + 1])
    np.testing.assert_allclose(alone[0], batched[b], rtol=0, atol=tolerance(1e-5))


# --- Hugging Face -------------------------------------------------------------------------------------

HF_SIZES = dict(vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=3)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  """A random float32 `T5ForConditionalGeneration` (v1.1: gated-GELU, untied head) saved as safetensors."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  config = transformers.T5Config(**HF_SIZES, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  # transformers ≥ 5 ties lm_head to `shared` at init even for v1.1; give it its own weights as v1.1 has.
  hf.lm_head.weight = torch.nn.Parameter(torch.randn(HF_SIZES["vocab_size"], HF_SIZES["d_model"]))
  directory = str(tmp_path_factory.mktemp("hf_t5"))
  hf.save_pretrained(directory, safe_serialization=True)
  return hf, directory


def test_relative_position_buckets_match_hugging_face():
  torch = pytest.importorskip("torch")
  modeling_t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
  relative = np.arange(-400, 401)
  for bidirectional in (True, False):
    want = modeling_t5.T5Attention._relative_position_bucket(torch.from_numpy(relative),
                                                             bidirectional=bidirectional).numpy()
    got = t5.relative_position_bucket(jnp.asarray(relative), bidirectional=bidirectional)
    np.testing.assert_array_equal(got, want)


def test_hf_import_gives_pytorch_logits_with_padded_encoder_inputs(hf_model):
  hf, directory = hf_model
  ours = convert.load_hf_t5(directory)
  assert ours.config == t5.T5Config(vocab_size=64, embed_dim=32, num_heads=4, num_encoder_layers=2,
                                    num_decoder_layers=3, head_dim=8, hidden_dim=48)
  assert_hf_logits_equal(hf, ours, vocab=64)


def test_greedy_generate_equals_hugging_face_generate(hf_model, eos_id=None):
  import torch
  hf, directory = hf_model
  ours = convert.load_hf_t5(directory)
  n_new = 10
  encoder = t5_batch(4, batch=6, vocab=64)[0]
  lengths = np.array([7, 5, 3, 1, 6, 2], np.int32)
  mask = np.arange(7) < lengths[:, None]
  # use_cache=False: transformers 5.23 sizes generate's cache by the encoder's num_layers (2 here, 3 decoder
  # layers) and fails; without a cache it rescores the prefix, the same greedy tokens.
  with torch.no_grad():
    want = hf.generate(input_ids=torch.from_numpy(encoder).long(), attention_mask=torch.from_numpy(mask).long(),
                       do_sample=False, num_beams=1, max_new_tokens=n_new, eos_token_id=1, pad_token_id=0,
                       decoder_start_token_id=0, use_cache=False, eos_id=None).numpy()[:, 1:]
  want = np.pad(want, ((0, 0), (0, n_new - want.shape[1])))
  out = decoding.generate(jax.random.PRNGKey(0), None, ours, encoder, lengths, method="autoregressive",
                          temperature=0.0, max_new_tokens=n_new, eos_id=1)
  np.testing.assert_array_equal(out.tokens, want)


def _write_hf(directory, model, *, drop=None, reshape=None):
  """A safetensors checkpoint in Hugging Face's names written from our model (no torch needed)."""
  cfg = model.config
  params = {jax.tree_util.keystr(p, simple=True, separator="/"): np.asarray(leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]}
  tensors = {name: np.ascontiguousarray(params[path].T if transposed else params[path])
             for path, (name, transposed) in convert.hf_names(cfg).items() if name != drop}
  if reshape:
    tensors[reshape] = np.zeros((3, 5), np.float32)
  os.makedirs(directory)
  save_file(tensors, os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(dict(vocab_size=cfg.vocab_size, d_model=cfg.embed_dim, d_kv=cfg.head_dim, num_heads=cfg.num_heads,
                   d_ff=cfg.hidden_dim, num_layers=cfg.num_encoder_layers, num_decoder_layers=cfg.num_decoder_layers,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False), f)


def test_hf_missing_or_misshaped_tensor_raises_naming_it(model, tmp_path):
  _write_hf(tmp_path / "ok", model)
  loaded = convert.load_hf_t5(tmp_path / "ok", max_length=32)
  for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(a, b)
  missing = "decoder.block.1.layer.1.EncDecAttention.k.weight"
  _write_hf(tmp_path / "missing", model, drop=missing)
  with pytest.raises(CheckpointError, match=f"tensor {missing} is missing"):
    convert.load_hf_t5(tmp_path / "missing")
  misshaped = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
  _write_hf(tmp_path / "misshaped", model, reshape=misshaped)
  with pytest.raises(CheckpointError, match=rf"tensor {misshaped} has shape \(3, 5\), expected \(32, 64\)"):
    convert.load_hf_t5(tmp_path / "misshaped")
  (tmp_path / "v1_0").mkdir()
  (tmp_path / "v1_0" / "config.json").write_text(json.dumps({"feed_forward_proj": "relu"}))
  with pytest.raises(CheckpointError, match="only T5 v1.1"):
    convert.load_hf_t5(tmp_path / "v1_0")


# --- T5X ----------------------------------------------------------------------------------------------

def test_t5x_checkpoints_restore_identical_logits(model, tmp_path):
  """Our writer's native layout (msgpack + zarr per parameter) and T5X's Orbax layout (state/)."""
  step_directory = convert.save_t5x(tmp_path / "native", model.params, step=1000)
  assert os.path.basename(step_directory) == "checkpoint_1000"
  assert os.path.isdir(os.path.join(step_directory, "target.decoder.layers_1.encoder_decoder_attention.key.kernel"))
  ocp.PyTreeCheckpointer().save(tmp_path / "orbax" / "checkpoint_7" / "state",
                                {"target": model.params, "state": {"step": 7}})
  encoder, decoder = t5_batch(5)
  want = np.asarray(teacher_forced(model, decoder, encoder, ENCODER_LENGTHS))
  for restored in (convert.load_t5x(tmp_path / "native", model.config),      # newest step of a model directory
                   convert.load_t5x(step_directory, model.config),
                   convert.load_t5x(tmp_path / "orbax", model.config)):
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(model.params)):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(teacher_forced(restored, decoder, encoder, ENCODER_LENGTHS), want)


def test_t5x_missing_misshaped_or_unreadable_parameter_raises_naming_it(model, tmp_path):
  params = jax.tree.map(np.asarray, model.params)
  del params["decoder"]["layers_1"]["mlp"]["wo"]
  convert.save_t5x(tmp_path / "missing", params)
  with pytest.raises(CheckpointError, match=r"missing \(1\): decoder/layers_1/mlp/wo/kernel"):
    convert.load_t5x(tmp_path / "missing", model.config)
  params = jax.tree.map(np.asarray, model.params)
  params["encoder"]["relpos_bias"]["rel_embedding"] = np.zeros((2, 16), np.float32)
  convert.save_t5x(tmp_path / "misshaped", params)
  with pytest.raises(CheckpointError, match=r"encoder/relpos_bias/rel_embedding: \(2, 16\) instead of \(2, 32\)"):
    convert.load_t5x(tmp_path / "misshaped", model.config)
  step_directory = convert.save_t5x(tmp_path / "damaged", model.params)
  shutil.rmtree(os.path.join(step_directory, "target.token_embedder.embedding"))
  with pytest.raises(CheckpointError, match="parameter token_embedder/embedding cannot be read"):
    convert.load_t5x(tmp_path / "damaged", model.config)
  with pytest.raises(CheckpointError, match="not a T5X checkpoint"):
    convert.load_t5x(tmp_path, model.config)


# --- decoding -----------------------------------------------------------------------------------------

N_NEW = 12


def _t5_pair(vocab, max_length=32, logit_scale=1.0):
  """Two random t5_tiny models (`tiny_pair`: drafter seed 1, verifier seed 2), logits scaled by `logit_scale`."""
  def scaled(m):
    params = jax.tree.map(lambda x: x, m.params)
    params["decoder"]["logits_dense"]["kernel"] = logit_scale * params["decoder"]["logits_dense"]["kernel"]
    return m.replace(params=params)
  return tuple(scaled(m) for m in tiny_pair(vocab, max_length, seeds=(1, 2), preset="t5_tiny"))


def _assert_same_greedy(got, want, verifier, prompts, lengths, *, tie_tolerance=tolerance(1e-4)):
  """Token-for-token equality of tokens [B, N], except after a near-tie of the verifier's top-2 logits
  (float rounding of γ+1-token and 1-token scoring may flip it); returns the number of such rows."""
  got, want = np.asarray(got), np.asarray(want)
  ambiguous = 0
  for b in np.nonzero(np.any(got != want, axis=1))[0]:
    t = int(np.argmax(got[b] != want[b]))
    decoder = np.concatenate([[t5.DECODER_START_TOKEN], want[b, :t]])[None]
    logits = np.asarray(verifier.logits(jnp.asarray(decoder), encoder_tokens=jnp.asarray(prompts[b:b + 1]),
                                        encoder_lengths=jnp.asarray(lengths[b:b + 1])))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < tie_tolerance, f"row {b} differs at token {t} without a tie"
    ambiguous += 1
  return ambiguous


# γ = 3 in the default run; γ = 1 (the same loop with one draft per block, which tests/decoding/test_decoding.py
# checks at batch 8 for decoder-only pairs) is slow (make test-slow).
@pytest.mark.parametrize("gamma", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_greedy_speculative_equals_verifier_greedy(gamma):
  """8 prompts at batch 4 and one at a time, against the verifier's greedy decoding at batch 4. The encoder
  inputs (width 40) are longer than the decoder cache (max_length 32): an encoder-decoder's prompt takes one
  decoder position."""
  drafter, verifier = _t5_pair(V)
  rng = np.random.default_rng(0)
  ambiguous = rejected = 0
  for _ in range(2):
    lengths = rng.integers(1, 41, size=4).astype(np.int32)
    prompts = np.where(np.arange(40) < lengths[:, None], rng.integers(2, V, size=(4, 40)), 0).astype(np.int32)
    want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive",
                             temperature=0.0, max_new_tokens=N_NEW, eos_id=None)
    for rows in [slice(0, 4)] + [slice(b, b + 1) for b in range(4)]:
      got = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts[rows], lengths[rows],
                              method="speculative", gamma=gamma, temperature=0.0, max_new_tokens=N_NEW, eos_id=None)
      ambiguous += _assert_same_greedy(got.tokens, want.tokens[rows], verifier, prompts[rows], lengths[rows])
      rejected += int(np.asarray(got.stats.rejected).sum())
      np.testing.assert_array_equal(got.lengths, N_NEW)
  assert ambiguous <= 1 and rejected > 0


@pytest.mark.parametrize("method", ["spectr", "specinfer"])
def test_greedy_multi_draft_equals_verifier_greedy(method):
  """K = 3 drafts of γ = 3 on a token tree, 4 ragged prompts, against the verifier's greedy decoding."""
  drafter, verifier = _t5_pair(V)
  rng = np.random.default_rng(1)
  lengths = rng.integers(1, 41, size=4).astype(np.int32)
  prompts = np.where(np.arange(40) < lengths[:, None], rng.integers(2, V, size=(4, 40)), 0).astype(np.int32)
  kw = dict(temperature=0.0, max_new_tokens=N_NEW, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  got = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method=method, num_drafts=3,
                          gamma=3, **kw)
  assert _assert_same_greedy(got.tokens, want.tokens, verifier, prompts, lengths) <= 1
  assert int(np.asarray(got.stats.rejected).sum()) > 0


def test_mixed_encoder_decoder_and_decoder_only_pair_raises():
  # shapes only: the check comes before any computation
  drafter = jax.eval_shape(lambda: models.build("t5_tiny", vocab_size=V, max_length=32))
  verifier = jax.eval_shape(lambda: models.build("tiny", vocab_size=V, max_length=32))
  prompts, lengths = np.ones((1, 3), np.int32), np.array([3], np.int32)
  with pytest.raises(ValueError, match="decoder-only or both encoder-decoder"):
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, method="speculative",
                      max_new_tokens=4, eos_id=None)


LAW_V, LAW_NEW, LAW_SAMPLES = 4, 3, 20_000
LAW_PROMPT, LAW_LENGTH = np.array([1, 2, 3, 0], np.int32), 3


@pytest.mark.parametrize("method, rule, alpha, gamma", [
    ("autoregressive", "spec", 0.0, 1), ("speculative", "spec", 0.0, 3), ("speculative", "chow", 0.3, 2),
    pytest.param("specinfer", "spec", 0.0, 2, marks=pytest.mark.slow)])
def test_sequence_law_matches_enumeration(method, rule, alpha, gamma):
  """P(x_1 x_2 x_3) over all V^3 continuations from teacher-forced logits (T = 1, top-P 0.9): p for
  autoregressive and the lossless methods (specinfer: 4 drafts on a token tree, which T5's relative
  position biases must see as siblings; slow, 20k rows of 4 drafts: the default run checks T5's token trees by
  `test_greedy_multi_draft_equals_verifier_greedy` and specinfer's law on the other models), the Alg. 4 law of
  π = T(q, p) per position for speculative decoding."""
  temperature, top_p = 1.0, 0.9
  drafter, verifier = _t5_pair(LAW_V, logit_scale=2.0)
  seqs = np.array(list(itertools.product(range(LAW_V), repeat=LAW_NEW)))
  decoder = jnp.asarray(np.concatenate([np.zeros((len(seqs), 1), np.int32), seqs[:, :-1]], 1))
  encoder = jnp.asarray(np.broadcast_to(LAW_PROMPT, (len(seqs), 4)))
  lengths = jnp.full((len(seqs),), LAW_LENGTH)
  lq, lp = teacher_forced(drafter, decoder, encoder, lengths), teacher_forced(verifier, decoder, encoder, lengths)
  q, p = sampling.transform(lq, temperature, top_p), sampling.transform(lp, temperature, top_p)
  if method in ("autoregressive", "specinfer"):
    law = p
  else:
    pi = targets.target_distribution(rule, q=q, p=p, q_raw=jax.nn.softmax(lq), p_raw=jax.nn.softmax(lp),
                                     alpha=alpha)
    law = verify.verification_law(q, pi)
  probs = np.take_along_axis(np.asarray(law), seqs[:, :, None], -1)[..., 0].prod(1)
  np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-5)

  out = decoding.generate(jax.random.PRNGKey(gamma), drafter, verifier,
                          np.broadcast_to(LAW_PROMPT, (LAW_SAMPLES, 4)), np.full((LAW_SAMPLES,), LAW_LENGTH),
                          method=method, rule=rule, alpha=alpha, gamma=gamma, temperature=temperature,
                          top_p=top_p, max_new_tokens=LAW_NEW, eos_id=None)
  np.testing.assert_array_equal(out.lengths, LAW_NEW)
  codes = np.asarray(out.tokens) @ LAW_V ** np.arange(LAW_NEW - 1, -1, -1)
  assert_law(codes, probs / probs.sum(), what=f"{method}/{rule}")
  if method != "autoregressive":
    assert 0 < np.asarray(out.stats.rejected).mean()
