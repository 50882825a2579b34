"""seqio tasks: every task's text is T5's format (exact strings, always run); with seqio installed, the
registered tasks turn examples into int32 token features that end in eos and fit the sequence lengths."""

import subprocess
import sys

import pytest

from specdec.data import debian
from specdec.data.seqio_tasks import (SEQIO_TASKS, T5_VOCAB_ENV, feature_lengths, register_tasks, seq2seq_rows,
                                      split_prefix, text_example)
from specdec.data.tasks import TASKS
from specdec.data.vocab import load_vocabulary

KILO = "Kilo is a small text editor for the terminal.\n\nIt has syntax highlighting."
EN, DE = "The font size can be changed.", "Die Schriftgröße lässt sich ändern."
STORM = "A storm hit the coast. Roads were closed."
SENTENCE = "The Fed said on Tuesday that it would keep interest rates unchanged ."
LONG_WORDS = 3000  # longer than every task's budget

# Per task: an example as its source gives it (tfds examples with their other fields), the expected text.
EXAMPLES = {
    "specdec_debian_synopsis": ({"package": "kilo", "document": KILO, "summary": "small terminal editor"},
                                {"inputs": "summarize: " + KILO, "targets": "small terminal editor"}),
    "specdec_debian_en_de": ({"package": "kilo", "en": EN, "de": DE, "unit": "sentence"},
                             {"inputs": "translate English to German: " + EN, "targets": DE}),
    "specdec_debian_lm": ({"package": "kilo", "text": KILO}, {"targets": KILO}),
    "specdec_debian_lm_prefix": ({"package": "kilo", "text": KILO},
                                 {"inputs": "Kilo is a small text editor",
                                  "targets": "for the terminal.\n\nIt has syntax highlighting."}),
    "specdec_wmt_t2t_ende": ({"en": EN, "de": DE},
                             {"inputs": "translate English to German: " + EN, "targets": DE}),
    "specdec_wmt14_ende": ({"en": EN, "de": DE},
                           {"inputs": "translate English to German: " + EN, "targets": DE}),
    "specdec_xsum": ({"document": STORM, "summary": "A storm closed roads."},
                     {"inputs": "summarize: " + STORM, "targets": "A storm closed roads."}),
    "specdec_cnn_dailymail": ({"article": STORM, "highlights": "Storm hits coast .\nRoads shut .",
                               "id": "0a1b", "publisher": "cnn"},
                              {"inputs": "summarize: " + STORM, "targets": "Storm hits coast .\nRoads shut ."}),
    "specdec_lm1b": ({"text": SENTENCE}, {"targets": SENTENCE}),
    "specdec_lm1b_prefix": ({"text": SENTENCE}, {"inputs": "The Fed said on Tuesday that",
                                                 "targets": "it would keep interest rates unchanged ."}),
}


def test_every_task_has_an_example():
  assert set(EXAMPLES) == set(SEQIO_TASKS)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_text_example_is_t5_format(name):
  example, expected = EXAMPLES[name]
  assert text_example(name, example) == expected


def test_sequence_lengths_are_the_papers():
  assert feature_lengths("specdec_wmt_t2t_ende") == feature_lengths("specdec_wmt14_ende") == {
      "inputs": 80, "targets": 80}
  assert feature_lengths("specdec_xsum") == {"inputs": 1024, "targets": 64}
  assert feature_lengths("specdec_cnn_dailymail") == {"inputs": 2048, "targets": 128}
  assert feature_lengths("specdec_lm1b") == {"targets": 128}
  assert feature_lengths("specdec_lm1b_prefix") == {"inputs": 16, "targets": 128}
  assert feature_lengths("specdec_debian_synopsis") == {"inputs": 224, "targets": 32}


def test_lm_prefix_split_keeps_the_rest_verbatim_and_a_target_word():
  assert split_prefix("a b  c\nd ", 2) == {"inputs": "a b", "targets": "c\nd "}
  assert split_prefix("one two three", 6) == {"inputs": "one two", "targets": "three"}
  assert split_prefix("alone", 6) == {"inputs": "", "targets": "alone"}


@pytest.mark.parametrize("dataset", debian.DATASETS)
def test_local_tasks_read_records_as_the_tasks_module(dataset):
  for record in debian.load(dataset, "validation", source="sample")[:50]:
    inputs, targets = TASKS[dataset].inputs_and_targets(record)
    expected = {"inputs": inputs, "targets": targets} if inputs else {"targets": targets}
    assert text_example("specdec_" + dataset, record) == expected


def test_module_imports_without_seqio_or_tensorflow():
  code = ("import sys, specdec.data.seqio_tasks; "
          "assert not {'seqio', 'tensorflow'} & set(sys.modules), 'imported eagerly'")
  subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------
# With seqio installed (`pip install -e '.[seqio]'`).


@pytest.fixture(scope="module")
def seqio():
  seqio = pytest.importorskip("seqio")
  with pytest.MonkeyPatch.context() as patch:
    patch.delenv(T5_VOCAB_ENV, raising=False)  # every task in the shipped vocabulary
    register_tasks(source="sample")
  return seqio


def _check_features(name: str, features: dict, texts: dict[str, str]) -> None:
  """int32 vectors within the lengths, eos last where the feature has it; when short, the ids of `texts`."""
  vocab = load_vocabulary()
  output_features = sorted(feature_lengths(name))
  assert sorted(k for k in features if not k.endswith("_pretokenized")) == output_features
  for feature, length in feature_lengths(name).items():
    ids, has_eos = features[feature], not (feature == "inputs" and SEQIO_TASKS[name].prefix_words)
    assert ids.dtype == "int32" and ids.ndim == 1 and 0 < len(ids) <= length
    assert (ids[-1] == vocab.eos_id) == has_eos
    assert features[feature + "_pretokenized"].decode("utf-8") == texts[feature]
    expected = vocab.encode(texts[feature]) + [vocab.eos_id] * has_eos
    if len(expected) <= length:
      assert ids.tolist() == expected


@pytest.mark.parametrize("name", [name for name, task in SEQIO_TASKS.items() if task.is_local])
def test_local_task_through_seqio(seqio, name):
  task = seqio.get_mixture_or_task(name)
  dataset = task.get_dataset(feature_lengths(name), split="validation", shuffle=False, seed=0)  # as T5X
  records = debian.load(SEQIO_TASKS[name].text.dataset, "validation", source="sample")
  for features, record in zip(dataset.take(5).as_numpy_iterator(), records):
    _check_features(name, features, text_example(name, record))


@pytest.mark.parametrize("name", [name for name, task in SEQIO_TASKS.items() if not task.is_local])
def test_tfds_task_preprocesses_in_memory_examples(seqio, name):
  import tensorflow as tf
  example, _ = EXAMPLES[name]
  long_example = {field: " ".join(["word"] * LONG_WORDS) for field in example}
  task = seqio.get_mixture_or_task(name)
  for raw in (example, long_example):
    dataset = task.preprocess_precache(tf.data.Dataset.from_tensors(raw))
    dataset = task.preprocess_postcache(dataset, feature_lengths(name))
    [features] = list(dataset.as_numpy_iterator())
    _check_features(name, features, text_example(name, raw))
  assert len(features["targets"]) == feature_lengths(name)["targets"]  # the long one, trimmed


def test_prefix_and_continuation_tokenize_as_the_whole_text(seqio):
  name = "specdec_debian_lm_prefix"
  dataset = seqio.get_mixture_or_task(name).get_dataset(feature_lengths(name), split="validation",
                                                        shuffle=False)
  vocab = load_vocabulary()
  records = debian.load("debian_lm", "validation", source="sample")
  for features, record in zip(dataset.take(20).as_numpy_iterator(), records):
    whole = vocab.encode(record["text"]) + [vocab.eos_id]
    if len(whole) <= feature_lengths(name)["targets"]:
      assert features["inputs"].tolist() + features["targets"].tolist() == whole


def test_tfds_names_and_fields_exist(seqio, tmp_path):
  import tensorflow_datasets as tfds
  for task in SEQIO_TASKS.values():
    if not task.is_local:
      builder = tfds.builder(task.text.dataset, data_dir=str(tmp_path))  # reads no data
      assert {task.text.input_field or "text", task.text.target_field} <= set(builder.info.features.keys())


def test_seqio_examples_become_the_t5_training_batch_of_the_local_tasks():
  """`seq2seq_rows` (what `seqio_batches` yields) lays out seqio's {'inputs', 'targets'} as
  `tasks.seq2seq_batches` does: the encoder input and its length, the start token 0 then the targets with
  weight 1, zero padding; a source longer than its width is cut."""
  vocab = load_vocabulary()
  record = EXAMPLES["specdec_debian_synopsis"][0]
  task = TASKS["debian_synopsis"]
  inputs, targets = (vocab.encode(text) + [vocab.eos_id] for text in task.inputs_and_targets(record))
  batch = seq2seq_rows([{"inputs": inputs, "targets": targets}, {"inputs": inputs[:3], "targets": targets[:2]}],
                       encoder_len=16, decoder_len=8)
  assert {k: v.shape for k, v in batch.items()} == {"encoder_inputs": (2, 16), "encoder_lengths": (2,),
                                                     "inputs": (2, 8), "weights": (2, 8)}
  assert batch["encoder_inputs"][0].tolist() == inputs[:16] and batch["encoder_lengths"].tolist() == [16, 3]
  assert len(inputs) > 16 and len(targets) == 4
  assert batch["inputs"][0].tolist() == [0] + targets + [0] * 3
  assert batch["weights"][0].tolist() == [0] + [1] * 4 + [0] * 3
  assert batch["inputs"][1].tolist() == [0] + targets[:2] + [0] * 5
  assert batch["weights"][1].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
  assert batch["encoder_inputs"][1].tolist() == inputs[:3] + [0] * 13
