"""What kind of file a path is, read from its first bytes (no heavy imports: the command lines ask before JAX loads)."""

from __future__ import annotations

import os

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
  """Whether `path` is a file that starts with GGUF's magic bytes (llama.cpp's checkpoints)."""
  try:
    with open(path, "rb") as f:
      return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
  except OSError:
    return False
