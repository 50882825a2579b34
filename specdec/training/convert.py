"""Checkpoints of other libraries (layer 4), one module per format, and `load_hf`, which reads any Hugging Face
`save_pretrained` directory by its config's model_type:

  hf_t5_checkpoints       Hugging Face T5 (safetensors) <-> `models.t5.T5`: load_hf_t5, save_hf_t5, hf_names
  t5x_checkpoints         T5X (native msgpack + zarr, and Orbax) <-> `models.t5.T5`: load_t5x, save_t5x
  decoder_checkpoints     Hugging Face Gemma 2 and Llama (safetensors), the gemma library's Orbax layout ->
                          `models.decoder.Decoder`: load_hf_decoder, load_gemma
  gguf_checkpoints        llama.cpp's GGUF files <-> the Llama family: load_gguf, save_gguf

  model = load_hf(directory)                # t5, gemma2 or llama, by config.json's model_type

The T5 formats' functions are read through this module too (`convert.load_hf_t5`, `convert.save_t5x`, …).
"""

from __future__ import annotations

import os
from typing import Any

from specdec.models import decoder, families, t5
from specdec.training.checkpoint import CheckpointError, hf_config
from specdec.training.decoder_checkpoints import load_hf_decoder
# load_hf_t5 is load_hf's T5 loader; it and the others are read through this module too (`convert.load_t5x`, …).
from specdec.training.hf_t5_checkpoints import config_from_hf, config_to_hf, hf_names, load_hf_t5, save_hf_t5
from specdec.training.t5x_checkpoints import load_t5x, save_t5x


def load_hf(directory: str, **kwargs: Any) -> t5.T5 | decoder.Decoder:
  """The model `save_pretrained` wrote to `directory`, by its config's model_type: the family that reads it
  (`families.for_hf_model_type`: t5, gemma2, llama) and its architecture's loader (`load_hf_t5`,
  `decoder_checkpoints.load_hf_decoder`); `kwargs` (max_length, host) go to that loader."""
  model_type = hf_config(os.path.abspath(directory)).get("model_type")
  try:
    family = families.for_hf_model_type(model_type)
  except ValueError as e:
    raise CheckpointError(f"{directory}: config.json's {e}") from None
  loaders = {t5: load_hf_t5, decoder: load_hf_decoder}   # by architecture
  return loaders[family.architecture](directory, **kwargs)
