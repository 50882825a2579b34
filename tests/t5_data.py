"""T5 test data: encoder inputs padded with junk past their lengths, decoder inputs, teacher-forced logits,
and the check that transformers' T5 gives our logits (tests/models/test_t5.py, tests/training/test_hf_export.py)."""

import jax
import numpy as np

from specdec.models import t5
from tests.backends import tolerance

ENCODER_LENGTHS = np.array([7, 3, 1], np.int32)

teacher_forced = jax.jit(lambda model, decoder_tokens, encoder_tokens, encoder_lengths: model.logits(
    decoder_tokens, encoder_tokens=encoder_tokens, encoder_lengths=encoder_lengths))


def t5_batch(seed, batch=3, width=7, n_decoder=9, vocab=32):
  """Encoder inputs [B, width] padded with junk beyond ENCODER_LENGTHS, decoder inputs [B, n] starting
  with the start token 0."""
  rng = np.random.default_rng(seed)
  encoder = rng.integers(2, vocab, size=(batch, width)).astype(np.int32)
  decoder = rng.integers(1, vocab, size=(batch, n_decoder)).astype(np.int32)
  decoder[:, 0] = t5.DECODER_START_TOKEN
  return encoder, decoder


def assert_hf_logits_equal(hf, ours, vocab):
  """transformers' teacher-forced logits equal ours (1e-4) on encoder inputs padded with junk past
  ENCODER_LENGTHS (the attention mask must hide it)."""
  import torch
  encoder, decoder = t5_batch(3, vocab=vocab)
  mask = np.arange(encoder.shape[1]) < ENCODER_LENGTHS[:, None]
  with torch.no_grad():
    want = hf(input_ids=torch.from_numpy(encoder).long(), attention_mask=torch.from_numpy(mask).long(),
              decoder_input_ids=torch.from_numpy(decoder).long()).logits.numpy()
  got = np.asarray(teacher_forced(ours, decoder, encoder, ENCODER_LENGTHS))
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, rtol=0, atol=tolerance(1e-4))
