"""One entry for every model a user can name (layer 4): `load_model(path_or_name)`.

  a GGUF file                          `gguf_checkpoints.load_gguf` (llama.cpp's format: the Llama family)
  a directory with model.json          an export (`checkpoint.save_params`)
  a directory with config.json         a Hugging Face save_pretrained directory (`convert.load_hf`: T5, Gemma 2, Llama)
  a pretrained checkpoint's name       its cached file (`data.pretrained`: "smollm2")
  a shipped model's name               data/models/<name> of the checkout or the installed package
(`data.pretrained.resolve`)
"""

from __future__ import annotations

import os
from typing import Any

from specdec import models
from specdec.data import formats, pretrained
from specdec.training import checkpoint, convert, gguf_checkpoints
from specdec.training.checkpoint import CheckpointError


def load_model(path_or_name: str | os.PathLike, *, dtype: Any = None, max_length: int | None = None,
               host: bool = False) -> Any:
  """The model at `path_or_name` (`data.pretrained.resolve`; the formats in the module docstring), float32 or computing in `dtype`
  (`models.with_dtype`). `max_length`: the largest cache length of a GGUF or Hugging Face decoder (default its
  context length); `host`: parameters left in host memory (GGUF, Hugging Face) for `partitioning.shard_model`.
  Raises CheckpointError in one line naming the file and what is wrong."""
  path = pretrained.resolve(path_or_name)
  if formats.is_gguf(path):
    model = gguf_checkpoints.load_gguf(path, max_length=max_length, host=host)
  elif os.path.isdir(path) and not os.path.exists(os.path.join(path, "model.json")) \
      and os.path.exists(os.path.join(path, "config.json")):
    model = convert.load_hf(path, host=host, **({} if max_length is None else {"max_length": max_length}))
  elif os.path.isdir(path) or "://" in path:   # gs://…: an export, read through etils.epath
    model = checkpoint.load_export(path)
  else:
    raise CheckpointError(f"{path} is neither a GGUF file nor a model directory (an export with model.json, a "
                          f"save_pretrained directory with config.json), nor a pretrained checkpoint's name "
                          f"({', '.join(pretrained.CHECKPOINTS)})")
  return model if dtype is None else models.with_dtype(model, dtype)
