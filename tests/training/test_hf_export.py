"""Hugging Face export (`convert.save_hf_t5`): our T5 round-trips bit-identically, transformers loads it with
every weight in place, computes our logits, and decodes our greedy tokens, alone and as assisted generation.

The round trip and the error cases need no torch; the comparisons with PyTorch skip without torch/transformers.
"""

import contextlib
import dataclasses
import logging
import warnings

import jax
import numpy as np
import pytest

from specdec import decoding, models
from specdec.models import t5
from specdec.training import convert, save_hf_t5
from tests.t5_data import assert_hf_logits_equal, t5_batch

V = 64
# Fewer decoder than encoder layers, as the drafters cut from a verifier: HF must size its caches by the decoder.
CONFIG = t5.T5Config(vocab_size=V, embed_dim=32, num_heads=4, num_encoder_layers=3, num_decoder_layers=2, head_dim=8,
                     hidden_dim=48, max_len=32)


@pytest.fixture(scope="module")
def ours():
  return t5.init(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def exported(ours, tmp_path_factory):
  return save_hf_t5(ours, tmp_path_factory.mktemp("hf_export") / "verifier")


@contextlib.contextmanager
def _transformers_log():
  """Collects transformers' log records (its library logger does not propagate to pytest's caplog)."""
  records = []
  handler = logging.Handler(logging.WARNING)
  handler.emit = records.append
  logger = logging.getLogger("transformers")
  logger.addHandler(handler)
  try:
    yield records
  finally:
    logger.removeHandler(handler)


def _from_pretrained(directory):
  """(HF model, loading info, warning messages: transformers' log and Python warnings)."""
  transformers = pytest.importorskip("transformers")
  with _transformers_log() as records, warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hf, info = transformers.T5ForConditionalGeneration.from_pretrained(directory, output_loading_info=True)
  return hf.eval(), info, [r.getMessage() for r in records] + [str(w.message) for w in caught]


def test_round_trip_is_bit_identical(ours, exported, tmp_path):
  assert convert.config_from_hf(convert.config_to_hf(CONFIG), max_length=CONFIG.max_len) == CONFIG
  loaded = convert.load_hf_t5(exported, max_length=CONFIG.max_len)
  assert loaded.config == CONFIG
  for path, leaf in jax.tree_util.tree_flatten_with_path(ours.params)[0]:
    reloaded = loaded.params
    for key in path:
      reloaded = reloaded[key.key]
    assert reloaded.dtype == np.float32
    np.testing.assert_array_equal(reloaded, leaf, err_msg=jax.tree_util.keystr(path))
  # bfloat16 parameters (a bf16 export of `save_params`) come back as the same values in float32.
  bf16 = ours.replace(params=jax.tree.map(lambda x: x.astype("bfloat16"), ours.params))
  back = convert.load_hf_t5(save_hf_t5(bf16, tmp_path / "bf16"), max_length=CONFIG.max_len)
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(bf16.params)):
    np.testing.assert_array_equal(a, np.asarray(b, np.float32))


def test_export_refuses_a_decoder_only_model_and_a_non_empty_directory(ours, exported, tmp_path):
  with pytest.raises(ValueError, match="exports a specdec.models.t5.T5; got TransformerLM"):
    save_hf_t5(jax.eval_shape(lambda: models.build("tiny", vocab_size=V)), tmp_path / "lm")
  with pytest.raises(FileExistsError, match="exists and is not empty"):
    save_hf_t5(ours, exported)
  (tmp_path / "empty").mkdir()
  save_hf_t5(ours, tmp_path / "empty")


def test_transformers_loads_every_weight_with_an_untied_unscaled_head(ours, exported):
  pytest.importorskip("torch")
  hf, info, messages = _from_pretrained(exported)
  assert not any(info.values()), info        # missing, unexpected, mismatched keys, error messages
  problems = ("missing", "unexpected", "newly initialized", "not used", "not initialized", "mismatch")
  assert not [m for m in messages if any(p in m.lower() for p in problems)], messages
  # transformers ≥ 5 forces T5's tie_word_embeddings=True; with both tensors present and different it keeps
  # them apart and says so (as for Google's own v1.1 checkpoints). The head must be ours, unscaled.
  assert not hf.config.scale_decoder_outputs
  head, shared = hf.lm_head.weight.detach().numpy(), hf.shared.weight.detach().numpy()
  np.testing.assert_array_equal(head, np.asarray(ours.params["decoder"]["logits_dense"]["kernel"]).T)
  np.testing.assert_array_equal(shared, np.asarray(ours.params["token_embedder"]["embedding"]))
  assert hf.encoder.embed_tokens.weight.data_ptr() == hf.shared.weight.data_ptr()
  assert hf.decoder.embed_tokens.weight.data_ptr() == hf.shared.weight.data_ptr()


def test_transformers_logits_equal_ours_on_padded_encoder_inputs(ours, exported):
  pytest.importorskip("torch")
  hf, _, _ = _from_pretrained(exported)
  assert_hf_logits_equal(hf, ours, vocab=V)


def test_transformers_greedy_and_assisted_generate_equal_our_greedy(ours, exported, tmp_path):
  """Cached greedy `generate` at batch 6, and assisted generation (batch 1: a 1-decoder-layer drafter cut from
  the verifier, 3 drafts per block; lossless, so the same tokens) equal our greedy decoding. (Our speculative
  greedy equals our greedy: tests/models/test_t5.py.)"""
  torch = pytest.importorskip("torch")
  hf, _, _ = _from_pretrained(exported)
  drafter = t5.T5(params={**ours.params, "decoder": {k: v for k, v in ours.params["decoder"].items()
                                                     if k != "layers_1"}},
                  config=dataclasses.replace(CONFIG, num_decoder_layers=1))
  hf_drafter, info, _ = _from_pretrained(save_hf_t5(drafter, tmp_path / "drafter"))
  assert not any(info.values())
  hf_drafter.generation_config.update(num_assistant_tokens=3, num_assistant_tokens_schedule="constant",
                                      assistant_confidence_threshold=0.0)
  n_new = 10
  encoder = t5_batch(4, batch=6, vocab=V)[0]
  lengths = np.array([7, 5, 3, 1, 6, 2], np.int32)
  mask = np.arange(7) < lengths[:, None]
  settings = dict(do_sample=False, num_beams=1, max_new_tokens=n_new, eos_token_id=1, pad_token_id=0,
                  decoder_start_token_id=0)
  with torch.no_grad():
    greedy = hf.generate(input_ids=torch.from_numpy(encoder).long(), attention_mask=torch.from_numpy(mask).long(),
                         use_cache=True, **settings).numpy()[:, 1:]
    assisted = [hf.generate(input_ids=torch.from_numpy(encoder[b:b + 1, :lengths[b]]).long(),
                            assistant_model=hf_drafter, **settings).numpy()[0, 1:] for b in range(6)]
  out = decoding.generate(jax.random.PRNGKey(0), None, ours, encoder, lengths, method="autoregressive",
                          temperature=0.0, max_new_tokens=n_new, eos_id=1)
  np.testing.assert_array_equal(out.tokens, np.pad(greedy, ((0, 0), (0, n_new - greedy.shape[1]))))
  for b in range(6):
    np.testing.assert_array_equal(out.tokens[b, :out.lengths[b]], assisted[b])
