"""The tokenizer a GGUF file describes in its metadata, built with the `tokenizers` library, behind `Vocabulary`'s
interface (layer 4), and its chat template.

A byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2': GPT-2, SmolLM2, Llama 3, …) is the file's tokens and
merges: a BPE model over GPT-2's byte alphabet (a token written outside it is respelled byte by byte), split
into words by GPT-2's pattern (or the pattern its tokenizer.ggml.pre names: Llama 3's), decoded byte-level;
tokens typed CONTROL (3) are special tokens matched whole in the text, USER_DEFINED (4) are added tokens; BOS is
prepended where tokenizer.ggml.add_bos_token says so. The chat template (tokenizer.chat_template, Jinja) is
rendered in a sandbox, as transformers' `apply_chat_template` renders it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CONTROL, USER_DEFINED = 3, 4
# tokenizer.ggml.pre -> the pattern that splits text into words before BPE (default: GPT-2's, in ByteLevel).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
         "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
         "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
         "tokenizer.chat_template")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's map of the 256 bytes to printable characters: printable Latin-1 bytes stand for themselves, the
  others for the characters from U+0100 on, in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  extra = (b for b in range(256) if b not in printable)
  return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def read_metadata(path: str | os.PathLike) -> dict:
  """The tokenizer's metadata of a GGUF file ({key: value} of `_KEYS` it holds). ValueError if it has none."""
  try:
    reader = gguf.GGUFReader(path)
  except Exception as e:   # ValueError, KeyError, IndexError on bad or truncated files
    raise ValueError(f"{path} cannot be read as a GGUF file ({type(e).__name__}: {e})") from e
  metadata = {key: reader.fields[key].contents() for key in _KEYS if key in reader.fields}
  if "tokenizer.ggml.tokens" not in metadata:
    raise ValueError(f"{path} holds no tokenizer (no tokenizer.ggml.tokens in its metadata)")
  return metadata


def build_tokenizer(metadata: Mapping) -> Tokenizer:
  """A `tokenizers.Tokenizer` of a GGUF byte-level BPE vocabulary's metadata."""
  kind = metadata.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"tokenizer.ggml.model {kind!r}: only byte-level BPE ('gpt2') vocabularies are built here")
  alphabet = _byte_alphabet()
  spelled = set(alphabet.values())
  tokens = list(metadata["tokenizer.ggml.tokens"])
  vocab = {(token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode("utf-8"))): index
           for index, token in enumerate(tokens)}
  merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", ())]
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  split = SPLITS.get(metadata.get("tokenizer.ggml.pre"))
  if split is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  types = list(metadata.get("tokenizer.ggml.token_type", ()))
  # A CONTROL token spelled outside the byte alphabet is a mislabel (llama.cpp's); adding it would grow the vocabulary.
  tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                for token, kind in zip(tokens, types) if kind == CONTROL and set(token) <= spelled])
  tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                        for token, kind in zip(tokens, types) if kind == USER_DEFINED and token in vocab])
  return tokenizer


class GGUFVocabulary:
  """A GGUF file's tokenizer as str <-> list of ids (`vocab.Vocabulary`'s interface), with its chat template."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    if not self.path.is_file():
      raise FileNotFoundError(f"no GGUF file at {self.path}")
    metadata = read_metadata(self.path)
    self._tokenizer = build_tokenizer(metadata)
    self._tokens = list(metadata["tokenizer.ggml.tokens"])
    self._ids = {token: index for index, token in enumerate(self._tokens)}
    self._special = {index for index, kind in enumerate(metadata.get("tokenizer.ggml.token_type", ()))
                     if kind == CONTROL}
    self._bos = metadata.get("tokenizer.ggml.bos_token_id")
    self._eos = metadata.get("tokenizer.ggml.eos_token_id")
    self._unk = metadata.get("tokenizer.ggml.unknown_token_id")
    self._pad = metadata.get("tokenizer.ggml.padding_token_id", self._eos)
    self._add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    self.chat_template = metadata.get("tokenizer.chat_template")

  @property
  def vocab_size(self) -> int:
    return len(self._tokens)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def eos_id(self) -> int:
    return self._eos

  @property
  def unk_id(self) -> int | None:
    return self._unk

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def special_ids(self) -> list[int]:
    """The ids of the special (CONTROL) tokens: EOS, the chat template's markers, …"""
    return sorted(self._special)

  @property
  def prompt_start(self) -> list[int]:
    """[bos] where the file says to prepend it (tokenizer.ggml.add_bos_token), else nothing."""
    return [self._bos] if self._add_bos and self._bos is not None else []

  def piece_id(self, piece: str) -> int | None:
    """The id of a token as the file spells it (e.g. '<|im_end|>'), None if it has none."""
    return self._ids.get(piece)

  def encode(self, text: str) -> list[int]:
    """Ids of `text` (special tokens written in it, e.g. '<|im_start|>', are matched whole), without BOS/EOS."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`, stopping after the first EOS; special tokens (CONTROL) left out unless asked for, ids past
    the vocabulary dropped."""
    ids = [int(i) for i in ids]
    if self._eos in ids:
      ids = ids[:ids.index(self._eos)]
    return self._tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size],
                                  skip_special_tokens=skip_special_tokens)

  def format_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """The chat template rendered for `messages` ([{'role': 'user', 'content': …}, …]): the text the model was
    trained on for a conversation, ending where the assistant's answer starts (`add_generation_prompt`)."""
    if not self.chat_template:
      raise ValueError(f"{self.path} has no chat template (tokenizer.chat_template)")
    return _render(self.chat_template, messages=list(messages), add_generation_prompt=add_generation_prompt,
                   bos_token=self._token(self._bos), eos_token=self._token(self._eos))

  def chat_prompt(self, text: str) -> list[int]:
    """Ids of `text` as one user turn (`format_chat`), after BOS where the file asks for it: what the model reads
    before its answer."""
    return self.prompt_start + self.encode(self.format_chat([{"role": "user", "content": text}]))

  def _token(self, index: int | None) -> str:
    return "" if index is None else self._tokens[index]

  def __repr__(self) -> str:
    return f"GGUFVocabulary({str(self.path)!r}, vocab_size={self.vocab_size})"


def chat_batch(vocab: "GGUFVocabulary", texts: Sequence[str], width_step: int = 64) -> tuple[np.ndarray, np.ndarray]:
  """Texts as user turns of the vocabulary's chat template: ids [B, W] (zeros after each row's end; W a multiple of
  `width_step`: few compiled widths) and lengths [B]. ValueError for a vocabulary without a chat template."""
  if vocab.chat_template is None:
    raise ValueError(f"{vocab!r} has no chat template: an instruct model's GGUF file carries one")
  ids = [vocab.chat_prompt(text) for text in texts]
  width = -(-max(map(len, ids)) // width_step) * width_step
  prompts = np.zeros((len(ids), width), np.int32)
  for row, row_ids in enumerate(ids):
    prompts[row, :len(row_ids)] = row_ids
  return prompts, np.asarray([len(row_ids) for row_ids in ids], np.int32)


def _render(template: str, **variables) -> str:
  from jinja2 import TemplateError
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message: str) -> None:
    raise TemplateError(message)

  environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  environment.globals["raise_exception"] = raise_exception
  return environment.from_string(template).render(**variables)
