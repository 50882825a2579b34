"""SentencePiece vocabularies: the one shipped in data/vocab/, or any model file such as T5's.

The shipped model is trained by `scripts/train_vocab.py` on the train splits of the Debian-description
datasets (English and German, one shared vocabulary; data/vocab/README.md has the size, the corpus and
the measurements). It uses T5's special ids (pad 0, eos 1, unk 2, no bos) and T5's normalisation
(`nmt_nfkc`: NFKC, and every run of whitespace, newlines included, becomes one space), plus byte
fallback: a character outside the vocabulary is encoded as its UTF-8 bytes, so any text decodes back to
its normalised form and never to <unk>. A real T5 vocabulary (e.g. `gs://t5-data/vocabs/cc_all.32000/
sentencepiece.model`, copied to a local path) loads through the same `load_vocabulary(path)`.

`seqio_vocabulary` wraps a model as a `seqio.SentencePieceVocabulary` for seqio tasks; seqio (and the
TensorFlow it needs) is optional and imported only there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from typing import TYPE_CHECKING

import sentencepiece as spm

from specdec.data import formats, shipped

if TYPE_CHECKING:
  from specdec.data.gguf_vocab import GGUFVocabulary

DEFAULT_VOCAB_PATH = shipped.path("data", "vocab", "debian_en_de_8192.model")
MISSING_HINT = ("pass the path of a local SentencePiece .model file (for T5's: `gsutil cp "
                "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model .`), or leave `path` unset for the "
                "vocabulary shipped in data/vocab/ (`python scripts/train_vocab.py` rebuilds it)")


def _model_path(path: str | os.PathLike | None) -> Path:
  """The local model file `path` names (the shipped one for None), which must exist."""
  model = DEFAULT_VOCAB_PATH if path is None else Path(path)
  if not model.is_file():
    raise FileNotFoundError(f"no SentencePiece model at {model}: {MISSING_HINT}")
  return model


class Vocabulary:
  """A SentencePiece model as str <-> list of ids, with seqio's decoding conventions."""

  chat_template: str | None = None   # a SentencePiece model carries none (a GGUF file's tokenizer may)

  def __init__(self, path: str | os.PathLike | None = None):
    self.path = _model_path(path)
    self._processor = spm.SentencePieceProcessor()
    try:
      self._processor.LoadFromSerializedProto(self.path.read_bytes())
    except RuntimeError as e:
      raise ValueError(f"{self.path} is not a SentencePiece model: {e}") from e

  @property
  def vocab_size(self) -> int:
    """Number of pieces, special ids included (a model's embedding may be padded beyond it)."""
    return self._processor.GetPieceSize()

  @property
  def pad_id(self) -> int:
    return self._processor.pad_id()

  @property
  def eos_id(self) -> int:
    return self._processor.eos_id()

  @property
  def unk_id(self) -> int:
    return self._processor.unk_id()

  @property
  def bos_id(self) -> int | None:
    """The beginning-of-sequence id (Gemma's <bos>), or None for a vocabulary without one (T5's, ours)."""
    return None if self._processor.bos_id() < 0 else self._processor.bos_id()

  @property
  def special_ids(self) -> list[int]:
    """The ids of pad, eos, unk and (where the model has one) bos."""
    ids = {self.pad_id, self.eos_id, self.unk_id} | ({self.bos_id} if self.bos_id is not None else set())
    return sorted(i for i in ids if i >= 0)

  @property
  def prompt_start(self) -> list[int]:
    """What a decoder-only prompt starts with: [bos] where the vocabulary has one (models trained with it,
    e.g. Gemma, expect it), else nothing."""
    return [] if self.bos_id is None else [self.bos_id]

  def piece_id(self, piece: str) -> int | None:
    """The id of a piece of the model (e.g. Gemma's '<end_of_turn>'), None if it has none."""
    found = self._processor.PieceToId(piece)
    return found if self._processor.IdToPiece(found) == piece else None

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without eos (seqio appends it in preprocessing, as here the caller does)."""
    return self._processor.EncodeAsIds(text)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`, as seqio decodes: stop after the first eos, pad decodes to nothing, and an id past
    the vocabulary (a model's padded embedding rows) reads as unk."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._processor.DecodeIds([i if 0 <= i < self.vocab_size else self.unk_id for i in ids])

  def __repr__(self) -> str:
    return f"Vocabulary({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_vocabulary(path: str | os.PathLike | None = None) -> "Vocabulary | GGUFVocabulary":
  """The vocabulary at `path`: a SentencePiece model, or the tokenizer in a GGUF checkpoint's metadata
  (`gguf_vocab.GGUFVocabulary`; a pretrained checkpoint's name, e.g. "smollm2", names its cached file); the shipped
  SentencePiece one (data/vocab/) when `path` is None."""
  from specdec.data import pretrained   # not at the top: `python -m specdec.data.pretrained` imports this module
  if path is not None:
    path = pretrained.resolve(path)
  if path is not None and formats.is_gguf(path):
    from specdec.data import gguf_vocab   # the `gguf` and `tokenizers` packages: only for GGUF checkpoints
    return gguf_vocab.GGUFVocabulary(path)
  return Vocabulary(path)


def seqio_vocabulary(path: str | os.PathLike | None = None, extra_ids: int = 0):
  """`seqio.SentencePieceVocabulary` of the same model, for seqio tasks and feature converters.

  `extra_ids`: sentinel ids appended after the model's pieces; T5's pretrained checkpoints use 100
  (vocabulary 32100), our own models 0. Needs `pip install seqio` (it brings TensorFlow).
  """
  try:
    import seqio  # optional: a few GB with TensorFlow, and only seqio tasks need it
  except ImportError as e:
    raise ImportError("seqio_vocabulary needs seqio: `pip install seqio` (it installs tensorflow and "
                      "tensorflow-text); `load_vocabulary` works without it") from e
  return seqio.SentencePieceVocabulary(str(_model_path(path)), extra_ids=extra_ids)
