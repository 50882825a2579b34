"""The local Debian-text tasks as token arrays: T5-style inputs/targets, prefix-LM and seq2seq rows, training
batches.

A `Task` fixes how a record becomes text (T5's task prefixes) and how long each side may be (in tokens of
the vocabulary). Decoder-only models read one row per example,

    [prompt tokens][target tokens][eos][pad …]      prompt = "<prefix><input><separator>"

e.g. "summarize: <document> synopsis:" followed by the synopsis, or "translate English to German: <en>
German:" followed by the German; the loss weights are 1 on the target tokens and eos, 0 on the prompt
and padding (`specdec.training.train`'s convention). An input longer than its budget is cut before the
separator is appended, so every prompt ends with it. The LM task's rows are the text itself, all weighted;
its decoding prompt is the text's first `lm_prompt_tokens` tokens (LM1B-style continuation).

Encoder-decoder models (T5) read the same rows tokenized with `encoder_decoder=True`: the prompt is T5's
encoder input, "<prefix><input>" without the separator (`Task.inputs_and_targets`), and
`Tokenized.seq2seq` turns rows into a T5 batch, encoder input = the prompt, decoder = [0] + target + eos.

`prefix_lm_batches` and `seq2seq_batches` are `specdec.training.DataSource`s over a mixture of tasks
(examples-proportional, as T5's multi-task mixtures), each batch a pure function of its index
(resumable); no packing, because the models have no segment ids. `tokenized` caches a task split's arrays
in memory and, given a `cache_dir`, in `.npz` files that carry a fingerprint of the data and vocabulary (a
stale file is rebuilt).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from specdec.data import debian
from specdec.data.vocab import Vocabulary, load_vocabulary
from specdec.models.t5 import DECODER_START_TOKEN


@dataclasses.dataclass(frozen=True)
class Task:
  """How a dataset's records are read as text, and each side's budget in tokens (of the shipped
  vocabulary for the local tasks; `seqio_tasks` reuses the formats for tfds datasets with the papers'
  lengths in T5 tokens)."""
  name: str
  dataset: str                 # a `debian.DATASETS` name (seqio_tasks: a tfds name with version)
  metric: str                  # 'rouge2' | 'bleu' | 'log_likelihood' (of the generated text, by the verifier)
  input_field: str | None      # None: a language-modelling task (the text is the target)
  target_field: str
  prefix: str = ""             # T5's task prefix
  separator: str = ""          # ends a decoder-only prompt: the model writes the target after it
  max_input_tokens: int = 0    # prompt budget, prefix and separator included
  max_target_tokens: int = 0   # target budget, eos included (= max_new_tokens when decoding)
  lm_prompt_tokens: int = 0    # LM task: tokens of the text given as the decoding prompt
  stop: str = ""               # few-shot (`few_shot`): a response is cut where this text starts, then scored
  chat: bool = False           # the prompt is "<prefix><input>" as one user turn of the vocabulary's chat template

  def inputs_and_targets(self, record: dict) -> tuple[str, str]:
    """T5-style (inputs, targets) strings of a record, e.g. ("summarize: <document>", "<synopsis>")."""
    if self.input_field is None:
      return "", record[self.target_field]
    return self.prefix + record[self.input_field], record[self.target_field]

  def response(self, text: str) -> str:
    """A decoded output as the metric reads it: cut where `stop` starts and stripped (few-shot), else as is."""
    return text.lstrip().split(self.stop)[0].strip() if self.stop else text

  @property
  def seq_len(self) -> int:
    """Row length of a tokenized example."""
    return self.max_input_tokens + self.max_target_tokens


# Budgets: every row fits 256 tokens, and ≥ 95% of the training examples fit untruncated (measured by
# `python -m specdec.data.tasks`: synopsis inputs 95.9%, targets 99.9%; en-de 98.9% / 97.8%; LM 97.4%).
# A long input loses its end, never the separator; a long target keeps its eos.
TASKS: dict[str, Task] = {
    "debian_synopsis": Task(
        name="debian_synopsis", dataset="debian_synopsis", metric="rouge2", input_field="document",
        target_field="summary", prefix="summarize: ", separator=" synopsis:", max_input_tokens=224,
        max_target_tokens=32),
    "debian_en_de": Task(
        name="debian_en_de", dataset="debian_en_de", metric="bleu", input_field="en", target_field="de",
        prefix="translate English to German: ", separator=" German:", max_input_tokens=128,
        max_target_tokens=128),
    # debian_synopsis for an instruct model (SmolLM2's GGUF vocabulary): asked through its chat template, scored
    # against the same synopsis. Budgets in the model's tokens: the template (≈ 30 tokens with SmolLM2's system
    # turn) and the request are inside max_input_tokens; the synopsis has 32 tokens as for debian_synopsis.
    "debian_synopsis_chat": Task(
        name="debian_synopsis_chat", dataset="debian_synopsis", metric="rouge2", input_field="document",
        target_field="summary", prefix="Write the one-line synopsis of this Debian package, as in the package "
        "lists: a short noun phrase, no full stop.\n\n", chat=True, max_input_tokens=320, max_target_tokens=32),
    "debian_lm": Task(
        name="debian_lm", dataset="debian_lm", metric="log_likelihood", input_field=None, target_field="text",
        max_input_tokens=0, max_target_tokens=128, lm_prompt_tokens=8),
}


# The shipped vocabulary's tasks: the training mixture of the shipped pair (the chat tasks need a model's own).
SHIPPED_VOCABULARY_TASKS = tuple(name for name, task in TASKS.items() if not task.chat)


def get_task(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
  return TASKS[name]


def encode_example(task: Task, vocab: Vocabulary, record: dict, *, encoder_decoder: bool = False,
                   encoder_eos: bool = False) -> tuple[list[int], list[int]]:
  """(prompt ids, target ids ending in eos) of a record, each within its budget.

  The prompt is the decoder-only one ("<prefix><input><separator>", after the vocabulary's
  `prompt_start`: <bos> where it has one), or with `encoder_decoder` T5's encoder input ("<prefix><input>",
  + eos with `encoder_eos`, as seqio's tasks and so the T5 models fine-tuned on them have it). An LM task's
  prompt is its text's first tokens either way.
  """
  if task.chat:
    return _chat_example(task, vocab, record, encoder_decoder)
  start = [] if encoder_decoder else vocab.prompt_start
  if task.input_field is None:
    text = vocab.encode(record[task.target_field])[:task.max_target_tokens - 1] + [vocab.eos_id]
    cut = min(task.lm_prompt_tokens, len(text) - 1)
    return start + text[:cut], text[cut:]
  separator = [] if encoder_decoder else vocab.encode(task.separator)
  if encoder_decoder and encoder_eos:
    separator = [vocab.eos_id]
  inputs = vocab.encode(task.inputs_and_targets(record)[0])[:task.max_input_tokens - len(separator) - len(start)]
  targets = vocab.encode(record[task.target_field])[:task.max_target_tokens - 1] + [vocab.eos_id]
  return start + inputs + separator, targets


def _chat_example(task: Task, vocab: Vocabulary, record: dict, encoder_decoder: bool) -> tuple[list[int], list[int]]:
  """`encode_example` of a chat task: "<prefix><input>" as one user turn of the vocabulary's chat template, the input's
  end cut until the whole prompt fits `max_input_tokens`."""
  if encoder_decoder or vocab.chat_template is None:
    raise ValueError(f"task {task.name} asks an instruct model through its chat template: it needs a decoder-only "
                     f"model and a vocabulary with a chat template (an instruct model's GGUF file); got {vocab!r}"
                     + (" for an encoder-decoder" if encoder_decoder else ""))
  document = vocab.encode(record[task.input_field])
  keep = task.max_input_tokens - len(vocab.chat_prompt(task.prefix))
  if keep < 1:
    raise ValueError(f"task {task.name}: its request through the chat template alone takes "
                     f"{task.max_input_tokens - keep} tokens, more than max_input_tokens={task.max_input_tokens}")
  prompt = vocab.chat_prompt(task.prefix + vocab.decode(document[:keep]))
  while len(prompt) > task.max_input_tokens:   # re-encoding the cut text can merge or split a token or two
    keep = max(keep - (len(prompt) - task.max_input_tokens), 0)
    prompt = vocab.chat_prompt(task.prefix + vocab.decode(document[:keep]))
  return prompt, vocab.encode(record[task.target_field])[:task.max_target_tokens - 1] + [vocab.eos_id]


def bucket_width(longest: int, bucket: int = 32) -> int:
  """The width prompts are padded to: the longest rounded up to a multiple of `bucket`, so that prompt sets of
  nearby lengths run the same compiled programs."""
  return -(-int(longest) // bucket) * bucket


def prompt_batch(texts: Sequence[str], *, task: str | None = None, vocab: Vocabulary | None = None,
                 encoder_decoder: bool = False, bucket: int = 32, truncate: bool = False
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Texts as a decoding batch: prompts [B, W] int32 right-padded with 0 and prompt_lengths [B].

  With a `task`, each text is the task's input, formatted and cut as in training ("summarize: <text>
  synopsis:"; `encode_example`); without one, the text's tokens as they are. Decoder-only prompts start
  with the vocabulary's `prompt_start` (<bos> for Gemma's; nothing for the shipped one). W is the longest prompt
  rounded up to a multiple of `bucket`, so prompts of new lengths reuse the loops compiled for their
  bucket instead of compiling again. `vocab` defaults to the shipped vocabulary. An empty text, or one
  longer than the task's input budget (`Task.max_input_tokens`) unless `truncate` (cut as in training),
  raises ValueError naming it.
  """
  if isinstance(texts, str) or not all(isinstance(text, str) for text in texts) or not texts:
    raise ValueError(f"texts must be a non-empty list of strings; got {texts!r:.80}")
  if not isinstance(bucket, int) or bucket < 1:
    raise ValueError(f"bucket must be an int >= 1; got {bucket!r}")
  vocab = vocab or load_vocabulary()
  ids = [vocab.encode(text) for text in texts]
  empty = [i for i, row in enumerate(ids) if not row]
  if empty:   # checked before formatting: a task's prefix alone is not a prompt
    raise ValueError(f"texts {empty} (0-based) encode to no tokens; a prompt needs at least one")
  spec = None if task is None else get_task(task)
  if spec is not None and spec.input_field is not None:   # an LM task continues the text itself
    def formatted(spec: Task) -> list[list[int]]:
      return [encode_example(spec, vocab, {spec.input_field: text, spec.target_field: ""},
                             encoder_decoder=encoder_decoder)[0] for text in texts]
    ids = formatted(spec)
    whole = formatted(dataclasses.replace(spec, max_input_tokens=sys.maxsize))
    cut = [i for i, (kept, full) in enumerate(zip(ids, whole)) if len(kept) < len(full)]
    if cut and not truncate:
      raise ValueError(f"texts {cut} (0-based) are longer than task {task}'s input budget: {spec.max_input_tokens} tokens "
                       f"with its prefix and separator, text {cut[0]} needs {len(whole[cut[0]])}; shorten them, "
                       "or cut them as training does (truncate=True; specdec-generate --truncate)")
  elif not encoder_decoder:
    ids = [vocab.prompt_start + row for row in ids]
  lengths = np.array([len(row) for row in ids], np.int32)
  width = bucket_width(lengths.max(), bucket)
  prompts = np.zeros((len(ids), width), np.int32)
  for i, row in enumerate(ids):
    prompts[i, :len(row)] = row
  return prompts, lengths


@dataclasses.dataclass(frozen=True)
class Tokenized:
  """A task split as arrays: row i is prompt + target + eos, right-padded with 0.

  tokens [N, seq_len] int32; prompt_lengths [N] (prompt tokens, 0 for LM training rows); lengths [N]
  (prompt + target + eos); records: the source records, for references.
  """
  tokens: np.ndarray
  prompt_lengths: np.ndarray
  lengths: np.ndarray
  records: tuple[dict, ...]

  def __len__(self) -> int:
    return len(self.tokens)

  def weights(self, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Loss weights [n, seq_len]: 1 on target tokens and eos, 0 on the prompt and padding."""
    positions = np.arange(self.tokens.shape[1])
    return ((positions >= self.prompt_lengths[rows, None])
            & (positions < self.lengths[rows, None])).astype(np.float32)

  def prompts(self, rows: np.ndarray | slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """Decoding prompts [n, width] (right-padded, width = the longest) and their lengths [n]."""
    lengths = self.prompt_lengths[rows]
    return self.tokens[rows, :max(int(lengths.max()), 1)] * (
        np.arange(max(int(lengths.max()), 1)) < lengths[:, None]), lengths

  def targets(self, rows: np.ndarray | slice = slice(None)) -> list[list[int]]:
    """Reference target ids (eos excluded) of each row."""
    tokens, starts, ends = self.tokens[rows], self.prompt_lengths[rows], self.lengths[rows]
    return [row[s:e - 1].tolist() for row, s, e in zip(tokens, starts, ends)]

  def seq2seq(self, rows: np.ndarray | slice = slice(None), *, encoder_len: int | None = None,
              decoder_len: int | None = None) -> dict[str, np.ndarray]:
    """The rows as an encoder-decoder (T5) batch: encoder input = the prompt, decoder = [0] + target + eos.

    Returns 'encoder_inputs' [n, encoder_len] int32 (right-padded with 0; default width: the longest
    prompt), 'encoder_lengths' [n], 'inputs' [n, decoder_len] int32 (the decoder tokens, starting with T5's
    decoder start token 0; default width: 1 + the longest target) and 'weights' [n, decoder_len] float32
    (1 on the target tokens and eos: `specdec.training.train`'s convention). Longer prompts and targets are
    cut to the widths.
    """
    tokens, starts, ends = self.tokens[rows], self.prompt_lengths[rows], self.lengths[rows]
    if encoder_len is None:
      encoder_len = max(int(starts.max(initial=0)), 1)
    if decoder_len is None:
      decoder_len = 1 + int((ends - starts).max(initial=0))
    encoder_lengths = np.minimum(starts, encoder_len).astype(np.int32)
    encoder_inputs = _fit(tokens, encoder_len) * (np.arange(encoder_len) < encoder_lengths[:, None])
    offsets = np.arange(decoder_len - 1)
    in_target = offsets < (ends - starts)[:, None]                                  # [n, decoder_len − 1]
    target = np.take_along_axis(tokens, np.minimum(starts[:, None] + offsets, tokens.shape[1] - 1), axis=1)
    start = np.full((len(tokens), 1), DECODER_START_TOKEN, np.int32)
    return {"encoder_inputs": encoder_inputs.astype(np.int32), "encoder_lengths": encoder_lengths,
            "inputs": np.concatenate([start, target * in_target], axis=1).astype(np.int32),
            "weights": np.concatenate([np.zeros_like(start, np.float32), in_target.astype(np.float32)], axis=1)}


def tokenize(task: Task, vocab: Vocabulary, records: Sequence[dict], *, encoder_decoder: bool = False,
             encoder_eos: bool = False) -> Tokenized:
  """Encodes records with `encode_example` into a `Tokenized` of row length `task.seq_len`."""
  tokens = np.zeros((len(records), task.seq_len), np.int32)
  prompt_lengths = np.zeros(len(records), np.int32)
  lengths = np.zeros(len(records), np.int32)
  for i, record in enumerate(records):
    prompt, target = encode_example(task, vocab, record, encoder_decoder=encoder_decoder, encoder_eos=encoder_eos)
    row = prompt + target
    tokens[i, :len(row)] = row
    prompt_lengths[i], lengths[i] = len(prompt), len(row)
  return Tokenized(tokens, prompt_lengths, lengths, tuple(records))


def _fingerprint(task: Task, vocab: Vocabulary, records: Sequence[dict], encoder_decoder: bool) -> str:
  fields = {name: value for name, value in dataclasses.asdict(task).items() if name != "chat" or value}
  digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())   # the tasks before `chat` keep theirs
  if encoder_decoder:   # the decoder-only rows keep their earlier fingerprints
    digest.update(b"encoder_decoder")
  digest.update(hashlib.sha256(vocab.path.read_bytes()).digest())
  for record in records:
    digest.update(json.dumps(record, sort_keys=True).encode())
  return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=32)
def _tokenized(task_name: str, split: str, source: str, vocab_path: str | None, cache_dir: str | None,
               training: bool, encoder_decoder: bool) -> Tokenized:
  task = get_task(task_name)
  vocab = load_vocabulary(vocab_path)
  records = debian.load(task.dataset, split, source=source)
  fingerprint = _fingerprint(task, vocab, records, encoder_decoder)
  path = None
  if cache_dir is not None:
    path = Path(cache_dir) / f"{task_name}.{split}.{fingerprint}.npz"
    if path.is_file():
      with np.load(path) as stored:
        result = Tokenized(stored["tokens"], stored["prompt_lengths"], stored["lengths"], tuple(records))
      return _as_training(result) if training else result
  result = tokenize(task, vocab, records, encoder_decoder=encoder_decoder)
  if path is not None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp.npz")
    np.savez_compressed(temporary, tokens=result.tokens, prompt_lengths=result.prompt_lengths,
                        lengths=result.lengths)
    os.replace(temporary, path)
  return _as_training(result) if training else result


def _as_training(tokenized: Tokenized) -> Tokenized:
  """An LM task's rows as training rows: the whole text is the target (prompt length 0)."""
  return dataclasses.replace(tokenized, prompt_lengths=np.zeros_like(tokenized.prompt_lengths))


def tokenized(task: str, split: str, *, source: str | os.PathLike = "auto", vocab_path: str | None = None,
              cache_dir: str | os.PathLike | None = None, training: bool = False,
              encoder_decoder: bool = False) -> Tokenized:
  """A task split tokenized (memoised per process; on disk under `cache_dir` when given).

  `source` as in `debian.load`. `training=True` gives training rows: for the LM task the whole text is a
  target; the seq2seq tasks are the same either way. `encoder_decoder=True` gives T5's prompts (the encoder
  inputs, no separator; `encode_example`).
  """
  debian.check_choice("split", split, debian.SPLITS)
  uses_lm_prompt = get_task(task).input_field is None and training
  return _tokenized(task, split, str(source), vocab_path, None if cache_dir is None else str(cache_dir),
                    uses_lm_prompt, encoder_decoder)


def generated_chunk_path(directory: str | os.PathLike, task: str, split: str, index: int) -> Path:
  """Where chunk `index` of a task split's generated continuations lives (`specdec.training.distill.write`)."""
  return Path(directory) / f"{task}.{split}.{index:05d}.npz"


def read_generated(directory: str | os.PathLike, task: str, split: str) -> Tokenized:
  """A task split's prompts with a model's own continuations as targets, as written by
  `specdec.training.distill.write` (records are not kept)."""
  paths = sorted(p for p in Path(directory).glob(f"{task}.{split}.[0-9]*.npz") if ".partial" not in p.name)
  if not paths:
    raise FileNotFoundError(f"no generated {task}/{split} examples in {directory} (scripts/make_distill_data.py)")
  arrays = [np.load(p) for p in paths]
  return Tokenized(tokens=np.concatenate([a["tokens"] for a in arrays]),
                   prompt_lengths=np.concatenate([a["prompt_lengths"] for a in arrays]),
                   lengths=np.concatenate([a["lengths"] for a in arrays]), records=())


def prefix_lm_batches(split: str, *, batch_size: int, seq_len: int, vocab_size: int, start: int = 0,
                      tasks: Sequence[str] = SHIPPED_VOCABULARY_TASKS, source: str = "auto",
                      vocab_path: str | None = None, cache_dir: str | None = None, seed: int = 0, length_window: int = 0,
                      generated: str | None = None) -> Iterator[dict[str, np.ndarray]]:
  """A `specdec.training.DataSource` of prefix-LM rows from a mixture of tasks.

  The tasks' examples are pooled (examples-proportional mixing) and visited in a fresh permutation per
  epoch, seeded by (seed, split, epoch); batch i holds positions [i·B, (i+1)·B) of that endless stream,
  so it depends on i alone. Rows are cut or padded to `seq_len`. Yields {'inputs' [B, seq_len] int32,
  'weights' [B, seq_len] float32}.

  `length_window` W > 0 buckets by length: each run of W batches of that stream is regrouped into W
  batches of rows of similar length (sorted, then the W batches in a seeded random order), each cut to
  its longest row rounded up to a multiple of 32 — the same examples with far less padding (the local
  tasks' rows average ~70 of 256 tokens), at most seq_len/32 shapes to compile. Still a pure function of
  the batch index.

  `generated`: a directory of `read_generated` continuations (sequence-level distillation data) to use
  instead of the tasks' references.
  """
  if generated is not None:
    parts = [read_generated(generated, name, split) for name in tasks]
  else:
    parts = [tokenized(name, split, source=source, vocab_path=vocab_path, cache_dir=cache_dir, training=True)
             for name in tasks]
  pool = {"inputs": np.concatenate([_fit(part.tokens, seq_len) for part in parts]),
          "weights": np.concatenate([_fit(part.weights(), seq_len) for part in parts])}
  make = lambda first: _mixture_batches(pool, split, tasks=tasks, batch_size=batch_size, start=first,
                                        vocab_size=vocab_size, seed=seed)
  if length_window <= 0:
    return make(start)
  return _length_bucketed(make, start=start, window=length_window, batch_size=batch_size, seed=seed)


def _length_bucketed(make: Callable[[int], Iterator[dict[str, np.ndarray]]], *, start: int, window: int,
                     batch_size: int, seed: int, multiple: int = 32) -> Iterator[dict[str, np.ndarray]]:
  """`prefix_lm_batches`' length buckets over the stream `make(first_batch)`."""
  first_window, skip = divmod(start, window)
  stream = make(first_window * window)
  for index in itertools.count(first_window):
    chunk = [next(stream) for _ in range(window)]
    pool = {key: np.concatenate([batch[key] for batch in chunk]) for key in chunk[0]}
    nonzero = pool["inputs"] != 0
    lengths = np.where(nonzero.any(axis=1), nonzero.shape[1] - np.argmax(nonzero[:, ::-1], axis=1), 0)
    by_length = np.argsort(lengths, kind="stable").reshape(window, batch_size)
    for group in np.random.default_rng([seed, index]).permutation(window)[skip:]:
      rows = by_length[group]
      width = min(pool["inputs"].shape[1], max(multiple, -(-int(lengths[rows].max()) // multiple) * multiple))
      yield {key: array[rows, :width] for key, array in pool.items()}
    skip = 0


SEQ2SEQ_TASKS = ("debian_synopsis", "debian_en_de")


def seq2seq_batches(split: str, *, batch_size: int, seq_len: int, vocab_size: int, start: int = 0,
                    tasks: Sequence[str] = SEQ2SEQ_TASKS, encoder_len: int | None = None, source: str = "auto",
                    vocab_path: str | None = None, cache_dir: str | None = None, seed: int = 0
                    ) -> Iterator[dict[str, np.ndarray]]:
  """A `specdec.training.DataSource` of encoder-decoder (T5) rows from a mixture of tasks.

  The mixture and its order are `prefix_lm_batches`' (the same pool of examples visits the same positions
  of the stream). Each row is `Tokenized.seq2seq` of the `encoder_decoder` rows: encoder input = T5's
  inputs ("summarize: <document>"), decoder = [0] + target + eos. `seq_len` is the decoder's width,
  `encoder_len` the encoder's (default: the tasks' largest input budget). Yields {'encoder_inputs'
  [B, encoder_len] int32, 'encoder_lengths' [B] int32, 'inputs' [B, seq_len] int32, 'weights' [B, seq_len]
  float32}.
  """
  if encoder_len is None:
    encoder_len = max(get_task(name).max_input_tokens for name in tasks)
  parts = [tokenized(name, split, source=source, vocab_path=vocab_path, cache_dir=cache_dir, training=True,
                     encoder_decoder=True).seq2seq(encoder_len=encoder_len, decoder_len=seq_len)
           for name in tasks]
  pool = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]} if parts else {}
  return _mixture_batches(pool, split, tasks=tasks, batch_size=batch_size, start=start, vocab_size=vocab_size,
                          seed=seed)


def _mixture_batches(pool: dict[str, np.ndarray], split: str, *, tasks: Sequence[str], batch_size: int, start: int,
                     vocab_size: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
  """Batches of a pool of examples (arrays with one row per example): a fresh permutation of the pool per
  epoch, seeded by (seed, split, epoch); batch i holds positions [i·B, (i+1)·B) of that endless stream."""
  count = len(next(iter(pool.values()))) if pool else 0
  if count == 0:
    raise ValueError(f"tasks {list(tasks)} have no {split} examples")
  largest = max(int(pool[key].max(initial=0)) for key in ("inputs", "encoder_inputs") if key in pool)
  if largest >= vocab_size:
    raise ValueError(f"token id {largest} is outside the model's vocabulary ({vocab_size})")
  split_id = zlib.crc32(split.encode())
  orders: dict[int, np.ndarray] = {}

  def order(epoch: int) -> np.ndarray:
    if epoch not in orders:
      orders.clear()   # the stream only moves forward: one or two epochs are ever needed at once
      orders[epoch] = np.random.default_rng([seed, split_id, epoch]).permutation(count)
    return orders[epoch]

  position = start * batch_size
  while True:
    positions = np.arange(position, position + batch_size)
    epochs = positions // count
    indices = np.concatenate([order(int(e))[positions[epochs == e] % count] for e in np.unique(epochs)])
    yield {key: array[indices] for key, array in pool.items()}
    position += batch_size


def _fit(array: np.ndarray, width: int) -> np.ndarray:
  if array.shape[1] >= width:
    return array[:, :width]
  return np.pad(array, ((0, 0), (0, width - array.shape[1])))


def _budget_report(source: str = "auto") -> None:
  """Prints, per task of the shipped vocabulary, the share of training examples that fit the budgets untruncated."""
  vocab = load_vocabulary()
  for task in map(get_task, SHIPPED_VOCABULARY_TASKS):
    records = debian.load(task.dataset, "train", source=source)
    inputs, targets = [], []
    for record in records:
      source_text, target_text = task.inputs_and_targets(record)
      inputs.append(len(vocab.encode(source_text + task.separator)) if task.input_field else 0)
      targets.append(len(vocab.encode(target_text)) + 1)
    inputs, targets = np.array(inputs), np.array(targets)
    print(f"{task.name}: {len(records)} examples; inputs p50/p95/max {np.percentile(inputs, 50):.0f}/"
          f"{np.percentile(inputs, 95):.0f}/{inputs.max()} (fit {np.mean(inputs <= task.max_input_tokens):.1%});"
          f" targets p50/p95/max {np.percentile(targets, 50):.0f}/{np.percentile(targets, 95):.0f}/"
          f"{targets.max()} (fit {np.mean(targets <= task.max_target_tokens):.1%})")


if __name__ == "__main__":
  _budget_report()
