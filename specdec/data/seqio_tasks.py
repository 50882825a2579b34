"""seqio tasks: the local Debian tasks, and the tfds tasks of the papers for machines that have the data.

Every task reads a record as text with a `specdec.data.tasks.Task` (`Task.inputs_and_targets`, T5's
prefixes), then tokenizes (`seqio.preprocessors.tokenize`, keeping '<feature>_pretokenized'), and appends
eos after trimming to the sequence length (`append_eos_after_trim`). The text step is the plain-Python
`text_example`, mapped over the dataset with `tf.numpy_function`, so the formats exist once.

Tasks (seqio name = "specdec_" + the text task's name; `feature_lengths` gives the sequence lengths):
- Local, from `debian.load` through a `seqio.FunctionDataSource`, in the shipped vocabulary:
  `specdec_debian_synopsis`, `specdec_debian_en_de`, `specdec_debian_lm`, `specdec_debian_lm_prefix`.
- tfds (nothing is downloaded here; give `tfds_data_dir`, e.g. a GCS bucket on a Cloud TPU):
  `specdec_wmt_t2t_ende` (wmt_t2t_translate/de-en: newstest2013 validation, newstest2014 test) and
  `specdec_wmt14_ende` (wmt14_translate/de-en), 80/80 tokens; `specdec_xsum` 1024/64;
  `specdec_cnn_dailymail` 2048/128 (the speculative-cascades paper's lengths, §F.1); `specdec_lm1b` and
  `specdec_lm1b_prefix` (SpecTr's LM1B experiment prompts a decoder with the start of a sentence).
  Their vocabulary is T5's SentencePiece model at `t5_vocab_path` (else $SPECDEC_T5_VOCAB), with T5's 100
  sentinel ids (32100, as T5 checkpoints); with neither set, the shipped vocabulary.

LM tasks have the single feature 'targets' = the text, what seqio's `LMFeatureConverter` (and
`DecoderFeatureConverter` given no 'inputs' length) expects. The '_prefix' variants split the text after
`LM_PREFIX_WORDS` words: 'inputs' = the first words without eos, 'targets' = the rest with eos, so
`PrefixLMFeatureConverter` concatenates them back into the text + eos and weights the loss on the
continuation only. Splitting at a space keeps the tokens those of the whole text (SentencePiece pieces
do not cross spaces).

Few-shot benchmarks (the Gemma experiments, `specdec.data.few_shot`): `register_few_shot_tasks` adds
'specdec_fewshot_<benchmark>' (decoder-only prompts in a given vocabulary, e.g. Gemma's).

Training on a task (T5 fine-tuning, `scripts/train.py`): `seqio_batches` is a `specdec.training` DataSource
of its examples, gin-configurable as `seqio_batches.task = 'wmt_t2t_ende'`.

Usage: `register_tasks(...)`, then `seqio.get_mixture_or_task(name).get_dataset(feature_lengths(name),
split)` or a T5X gin file naming the task. seqio is optional (`pip install -e '.[seqio]'`): this module
imports without it, and only `register_tasks` needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from typing import Iterator, Sequence

import numpy as np

from specdec.data import debian, few_shot
from specdec.data.tasks import TASKS, Task
from specdec.data.vocab import load_vocabulary, seqio_vocabulary

T5_VOCAB_ENV = "SPECDEC_T5_VOCAB"
T5_EXTRA_IDS = 100
# ≈ 8 tokens of the shipped vocabulary (1.55 tokens per word on debian_lm), debian_lm's `lm_prompt_tokens`.
LM_PREFIX_WORDS = 6
LM_PREFIX_TOKENS = 16  # the 'inputs' length of the '_prefix' tasks


@dataclasses.dataclass(frozen=True)
class SeqioTask:
  """A seqio task: `text` reads its records (`text.dataset`: a `debian.DATASETS` name, or a tfds name
  with version) and gives its lengths in tokens; `prefix_words` > 0 splits an LM text into a prompt."""
  text: Task
  prefix_words: int = 0

  @property
  def name(self) -> str:
    return "specdec_" + self.text.name

  @property
  def is_local(self) -> bool:
    return self.text.dataset in debian.DATASETS


def _tfds(task: Task, name: str, dataset: str, **changes) -> Task:
  """`task`'s text format for a tfds dataset."""
  return dataclasses.replace(task, name=name, dataset=dataset, **changes)


# A tfds task reads its text as the Debian task it mirrors (same T5 prefix; XSum, WMT and LM1B even share
# the field names); its budgets are the papers' lengths. `separator` (decoder-only prompts) is unused here.
_SYNOPSIS, _EN_DE, _LM = TASKS["debian_synopsis"], TASKS["debian_en_de"], TASKS["debian_lm"]
_PREFIX_LM = dataclasses.replace(_LM, name="debian_lm_prefix", max_input_tokens=LM_PREFIX_TOKENS)

SEQIO_TASKS: dict[str, SeqioTask] = {task.name: task for task in [
    SeqioTask(_SYNOPSIS),
    SeqioTask(_EN_DE),
    SeqioTask(_LM),
    SeqioTask(_PREFIX_LM, prefix_words=LM_PREFIX_WORDS),
    SeqioTask(_tfds(_EN_DE, "wmt_t2t_ende", "wmt_t2t_translate/de-en:1.0.0", max_input_tokens=80,
                    max_target_tokens=80)),
    SeqioTask(_tfds(_EN_DE, "wmt14_ende", "wmt14_translate/de-en:1.0.0", max_input_tokens=80,
                    max_target_tokens=80)),
    SeqioTask(_tfds(_SYNOPSIS, "xsum", "xsum:1.1.0", max_input_tokens=1024, max_target_tokens=64)),
    SeqioTask(_tfds(_SYNOPSIS, "cnn_dailymail", "cnn_dailymail:3.4.0", input_field="article",
                    target_field="highlights", max_input_tokens=2048, max_target_tokens=128)),
    SeqioTask(_tfds(_LM, "lm1b", "lm1b:1.1.0")),
    SeqioTask(_tfds(_PREFIX_LM, "lm1b_prefix", "lm1b:1.1.0"), prefix_words=LM_PREFIX_WORDS),
]}


def get_seqio_task(name: str) -> SeqioTask:
  if name not in SEQIO_TASKS:
    raise ValueError(f"unknown seqio task {name!r}; known: {', '.join(SEQIO_TASKS)}")
  return SEQIO_TASKS[name]


def feature_lengths(name: str) -> dict[str, int]:
  """seqio `task_feature_lengths` (eos included): {'inputs', 'targets'}, or {'targets'} for LM."""
  text = get_seqio_task(name).text
  lengths = {"inputs": text.max_input_tokens, "targets": text.max_target_tokens}
  return {feature: length for feature, length in lengths.items() if length}


def split_prefix(text: str, words: int) -> dict[str, str]:
  """{'inputs': the first `words` words, 'targets': the rest, verbatim}; the target keeps ≥ 1 word."""
  cut = min(words, len(text.split()) - 1)
  if cut <= 0:
    return {"inputs": "", "targets": text}
  *head, rest = text.split(None, cut)
  return {"inputs": " ".join(head), "targets": rest}


def text_example(name: str, record: dict[str, str]) -> dict[str, str]:
  """The strings a seqio task tokenizes, e.g. {'inputs': "summarize: <document>", 'targets': <summary>}."""
  task = get_seqio_task(name)
  inputs, targets = task.text.inputs_and_targets(record)
  if task.text.input_field is not None:
    return {"inputs": inputs, "targets": targets}
  if task.prefix_words:
    return split_prefix(targets, task.prefix_words)
  return {"targets": targets}


# ---------------------------------------------------------------------------------------------------
# The seqio / TensorFlow layer.


def _fields(task: SeqioTask) -> list[str]:
  return [field for field in (task.text.input_field, task.text.target_field) if field is not None]


def _debian_dataset(split: str, shuffle_files: bool, seed: int | None = None, *, task: SeqioTask,
                    source: str):
  """`FunctionDataSource` function: a local dataset split as string features (the fields `text` reads)."""
  import tensorflow as tf
  del shuffle_files, seed  # one in-memory list; `seqio.Task.get_dataset` shuffles the examples
  records = debian.load(task.text.dataset, split, source=source)
  return tf.data.Dataset.from_tensor_slices(
      {field: tf.constant([r[field] for r in records], tf.string) for field in _fields(task)})


def _text_preprocessor(dataset, *, name: str):
  """seqio preprocessor: `text_example` on every example (in Python, through `tf.numpy_function`)."""
  import tensorflow as tf
  fields, features = _fields(get_seqio_task(name)), list(feature_lengths(name))

  def to_text(*values: bytes) -> list[bytes]:
    example = text_example(name, {f: v.decode("utf-8") for f, v in zip(fields, values)})
    return [example[feature].encode("utf-8") for feature in features]

  def map_fn(example):
    texts = tf.numpy_function(to_text, [example[f] for f in fields], [tf.string] * len(features),
                              stateful=False)
    return {feature: tf.ensure_shape(text, []) for feature, text in zip(features, texts)}

  return dataset.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)


def register_tasks(*, source: str | os.PathLike = "auto", t5_vocab_path: str | None = None,
                   tfds_data_dir: str | None = None) -> list[str]:
  """Registers (or re-registers) every task in `SEQIO_TASKS` with `seqio.TaskRegistry`; returns the names.

  `source`: the local tasks' records, as in `debian.load`. `t5_vocab_path`: a local copy of T5's
  SentencePiece model for the tfds tasks (default $SPECDEC_T5_VOCAB, else the shipped vocabulary).
  `tfds_data_dir`: where the tfds data lives (default: tfds's own, $TFDS_DATA_DIR).
  """
  import seqio
  local_vocab = seqio_vocabulary()
  t5_vocab_path = t5_vocab_path or os.environ.get(T5_VOCAB_ENV)
  tfds_vocab = seqio_vocabulary(t5_vocab_path, extra_ids=T5_EXTRA_IDS) if t5_vocab_path else local_vocab
  for task in SEQIO_TASKS.values():
    if task.is_local:
      vocab = local_vocab
      data_source = seqio.FunctionDataSource(
          functools.partial(_debian_dataset, task=task, source=str(source)), splits=debian.SPLITS)
    else:
      vocab = tfds_vocab
      data_source = seqio.TfdsDataSource(tfds_name=task.text.dataset, tfds_data_dir=tfds_data_dir)
    output_features = {  # a prefix is continued by the targets: no eos between them
        feature: seqio.Feature(vocab, add_eos=not (feature == "inputs" and task.prefix_words))
        for feature in feature_lengths(task.name)}
    seqio.TaskRegistry.remove(task.name)
    seqio.TaskRegistry.add(
        task.name, source=data_source, output_features=output_features,
        preprocessors=[functools.partial(_text_preprocessor, name=task.name), seqio.preprocessors.tokenize,
                       seqio.CacheDatasetPlaceholder(), seqio.preprocessors.append_eos_after_trim])
  return list(SEQIO_TASKS)


def register_few_shot_tasks(vocab_path: str | None = None, *, data_dir: str | None = None, source: str = "auto",
                            chat_template: bool = False, n_examples: int = 1000, sample_seed: int = 0) -> list[str]:
  """Registers every few-shot benchmark (`few_shot.BENCHMARKS`) as the seqio task 'specdec_<name>' ('…_chat'
  with `chat_template`), for decoder-only models in the SentencePiece vocabulary at `vocab_path` (Gemma's).

  The examples are `few_shot.examples` (the sweep's prompts, token for token): 'inputs' the few-shot
  prompt's ids (<bos> first where the vocabulary has it, no eos: the model continues it), 'targets' the
  reference answer (eos appended by `append_eos_after_trim`), and their '_pretokenized' texts; the one split
  is the benchmark's evaluated split (`Benchmark.split`), `n_examples` of it sampled with `sample_seed`
  (the sweep's `Experiment.seed`). `data_dir`: tfds's data (and MBPP's mbpp.jsonl).
  """
  import seqio
  import tensorflow as tf
  vocab, output_vocab = load_vocabulary(vocab_path), seqio_vocabulary(vocab_path)
  ids, text = tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.string)
  names = []
  for benchmark in few_shot.BENCHMARKS.values():
    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None, *, benchmark=benchmark):
      del shuffle_files, seed   # one in-memory list; the sample is `sample_seed`'s, as in the sweep
      rows = few_shot.examples(benchmark, vocab, split, n_examples, data_dir=data_dir, source=source,
                               seed=sample_seed, chat_template=chat_template)
      return tf.data.Dataset.from_generator(
          lambda: ({"inputs": row.prompt, "targets": row.target[:-1], "inputs_pretokenized": row.text,
                    "targets_pretokenized": vocab.decode(row.target)} for row in rows),
          output_signature={"inputs": ids, "targets": ids, "inputs_pretokenized": text,
                            "targets_pretokenized": text})
    name = f"specdec_{benchmark.name}" + ("_chat" if chat_template else "")
    seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name, source=seqio.FunctionDataSource(dataset_fn, splits=[benchmark.split]),
        output_features={"inputs": seqio.Feature(output_vocab, add_eos=False),
                         "targets": seqio.Feature(output_vocab, add_eos=True)},
        preprocessors=[seqio.CacheDatasetPlaceholder(), seqio.preprocessors.append_eos_after_trim])
    names.append(name)
  return names


def seq2seq_rows(examples: Sequence[dict[str, np.ndarray]], *, encoder_len: int, decoder_len: int
                 ) -> dict[str, np.ndarray]:
  """seqio examples {'inputs': ids, 'targets': ids} (eos appended) as one T5 training batch, the layout of
  `specdec.data.tasks.seq2seq_batches`: 'encoder_inputs' [B, encoder_len] and 'encoder_lengths' [B],
  decoder 'inputs' [B, decoder_len] = [T5's start token 0] + targets, 'weights' 1 on the target tokens
  (module docstring of `specdec.training.train`); longer sides are cut, shorter ones padded with 0."""
  rows = len(examples)
  batch = {"encoder_inputs": np.zeros((rows, encoder_len), np.int32), "encoder_lengths": np.zeros(rows, np.int32),
           "inputs": np.zeros((rows, decoder_len), np.int32), "weights": np.zeros((rows, decoder_len), np.float32)}
  for row, example in enumerate(examples):
    inputs = np.asarray(example["inputs"], np.int32)[:encoder_len]
    targets = np.asarray(example["targets"], np.int32)[:decoder_len - 1]
    batch["encoder_inputs"][row, :len(inputs)] = inputs
    batch["encoder_lengths"][row] = len(inputs)
    batch["inputs"][row, 1:1 + len(targets)] = targets   # position 0: the start token (0)
    batch["weights"][row, 1:1 + len(targets)] = 1.0
  return batch


def seqio_batches(split: str, *, batch_size: int, seq_len: int, vocab_size: int, start: int = 0, task: str,
                  encoder_len: int | None = None, tfds_data_dir: str | None = None, t5_vocab_path: str | None = None,
                  seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
  """A `specdec.training` DataSource of a seqio task's examples (`SEQIO_TASKS`, e.g. 'wmt_t2t_ende', 'xsum',
  'cnn_dailymail'), as T5 batches (`seq2seq_rows`): decoder width `seq_len` (start token + targets),
  encoder width `encoder_len` (default: the task's input budget). The training split is shuffled with
  `seed` and repeated; batch i is examples [i·B, (i+1)·B) of that deterministic stream, so a resumed run
  (`start`) skips what it has seen. Needs seqio (`pip install -c constraints.txt -e '.[seqio]'`)."""
  import seqio
  name = task if task.startswith("specdec_") else "specdec_" + task
  text = get_seqio_task(name).text
  if text.input_field is None:
    raise ValueError(f"seqio_batches trains encoder-decoder models; {task!r} is a language-modelling task")
  encoder_len = encoder_len or text.max_input_tokens
  register_tasks(t5_vocab_path=t5_vocab_path, tfds_data_dir=tfds_data_dir)
  training = split == "train"
  dataset = seqio.get_mixture_or_task(name).get_dataset(
      {"inputs": encoder_len, "targets": seq_len - 1}, split=split, shuffle=training, seed=seed,
      num_epochs=None if training else 1)
  examples = dataset.skip(start * batch_size).as_numpy_iterator()
  while batch := list(itertools.islice(examples, batch_size)):
    rows = seq2seq_rows(batch, encoder_len=encoder_len, decoder_len=seq_len)
    largest = int(max(rows["inputs"].max(initial=0), rows["encoder_inputs"].max(initial=0)))
    if largest >= vocab_size:
      raise ValueError(f"token id {largest} of {name} is outside the model's vocabulary ({vocab_size})")
    yield rows


def tfds_records(name: str, split: str, *, data_dir: str | None = None, limit: int | None = None
                 ) -> list[dict[str, str]]:
  """The first `limit` records of a tfds task's split (`SEQIO_TASKS`, e.g. 'specdec_wmt_t2t_ende') as text
  fields, in the dataset's order: what the sweeps decode. Needs tensorflow_datasets and the data in
  `data_dir` (default: tfds's own); nothing is downloaded."""
  task = get_seqio_task(name)
  if task.is_local:
    raise ValueError(f"{name} is a local task: read it with specdec.data.load")
  return [{field: example[field] for field in _fields(task)}
          for example in few_shot.read_tfds(task.text.dataset, split, data_dir=data_dir, limit=limit)]
