"""Local tasks as token rows: formats, budgets, loss weights, decoding prompts, the training data source."""

import numpy as np
import pytest

from specdec.data import load_vocabulary, tasks

VOCAB = load_vocabulary()


def test_seq2seq_row_is_prefix_input_separator_then_target_and_eos():
  task = tasks.TASKS["debian_en_de"]
  record = {"package": "p", "en": "Creates menus.", "de": "Erzeugt Menüs für Größen.", "unit": "synopsis"}
  prompt, target = tasks.encode_example(task, VOCAB, record)
  assert VOCAB.decode(prompt) == "translate English to German: Creates menus. German:"
  assert prompt[-len(VOCAB.encode(" German:")):] == VOCAB.encode(" German:")
  assert target[-1] == VOCAB.eos_id and VOCAB.decode(target) == "Erzeugt Menüs für Größen."
  assert task.inputs_and_targets(record) == ("translate English to German: Creates menus.",
                                             "Erzeugt Menüs für Größen.")


def test_long_input_is_cut_before_the_separator_and_long_target_keeps_eos():
  task = tasks.TASKS["debian_synopsis"]
  record = {"package": "p", "document": "word " * 2000, "summary": "summary " * 200}
  prompt, target = tasks.encode_example(task, VOCAB, record)
  assert len(prompt) == task.max_input_tokens
  assert VOCAB.decode(prompt).endswith("word synopsis:") and VOCAB.decode(prompt).startswith("summarize: word")
  assert len(target) == task.max_target_tokens and target[-1] == VOCAB.eos_id


def test_lm_task_prompt_is_the_first_tokens_and_training_rows_weight_the_whole_text():
  task = tasks.TASKS["debian_lm"]
  records = [{"package": "p", "text": "A library for parsing command line options in C programs."},
             {"package": "q", "text": "Tiny."}]
  rows = tasks.tokenize(task, VOCAB, records)
  ids = VOCAB.encode(records[0]["text"]) + [VOCAB.eos_id]
  assert rows.prompt_lengths[0] == task.lm_prompt_tokens and rows.lengths[0] == len(ids)
  assert rows.tokens[0, :len(ids)].tolist() == ids and not rows.tokens[0, len(ids):].any()
  short = VOCAB.encode("Tiny.") + [VOCAB.eos_id]
  assert rows.prompt_lengths[1] == len(short) - 1   # at least one target token (eos) is left
  prompts, lengths = rows.prompts()
  assert prompts.shape == (2, task.lm_prompt_tokens) and lengths.tolist() == [task.lm_prompt_tokens, len(short) - 1]
  assert prompts[0].tolist() == ids[:task.lm_prompt_tokens]
  assert rows.targets()[0] == ids[task.lm_prompt_tokens:-1]
  weights = rows.weights()
  assert weights[0].tolist() == [0.0] * task.lm_prompt_tokens + [1.0] * (len(ids) - task.lm_prompt_tokens) + \
      [0.0] * (task.seq_len - len(ids))


def test_tokenized_sample_split_weights_and_prompts():
  rows = tasks.tokenized("debian_synopsis", "validation", source="sample")
  assert len(rows) == len(rows.records) > 0 and rows.tokens.shape[1] == tasks.TASKS["debian_synopsis"].seq_len
  weights = rows.weights()
  assert np.array_equal(weights.sum(1), rows.lengths - rows.prompt_lengths)
  for i in range(3):
    assert VOCAB.decode(rows.targets([i])[0]) == " ".join(rows.records[i]["summary"].split())
    assert rows.tokens[i, rows.lengths[i] - 1] == VOCAB.eos_id
  prompts, lengths = rows.prompts(np.arange(4))
  assert prompts.shape[1] == lengths.max() and not (prompts * (np.arange(prompts.shape[1]) >= lengths[:, None])).any()


def test_disk_cache_round_trips(tmp_path):
  first = tasks.tokenized("debian_en_de", "test", source="sample", cache_dir=tmp_path)
  assert len(list(tmp_path.glob("debian_en_de.test.*.npz"))) == 1
  tasks._tokenized.cache_clear()
  again = tasks.tokenized("debian_en_de", "test", source="sample", cache_dir=tmp_path)
  assert np.array_equal(first.tokens, again.tokens) and np.array_equal(first.lengths, again.lengths)


def test_prefix_lm_batches_are_a_resumable_pure_function_of_the_index():
  kwargs = dict(batch_size=16, seq_len=64, vocab_size=VOCAB.vocab_size, source="sample")
  stream = tasks.prefix_lm_batches("train", **kwargs)
  batches = [next(stream) for _ in range(6)]
  resumed = tasks.prefix_lm_batches("train", start=4, **kwargs)
  for expected in batches[4:]:
    got = next(resumed)
    assert np.array_equal(got["inputs"], expected["inputs"]) and np.array_equal(got["weights"], expected["weights"])
  assert batches[0]["inputs"].shape == (16, 64) and batches[0]["inputs"].dtype == np.int32
  # Every example appears once per epoch: count rows over one epoch of a small pool.
  pool = sum(len(tasks.tokenized(t, "validation", source="sample", training=True)) for t in tasks.TASKS)
  seen = np.concatenate([b["inputs"] for b in
                         _take(tasks.prefix_lm_batches("validation", **{**kwargs, "batch_size": pool}), 1)])
  assert len({row.tobytes() for row in seen}) == len({row.tobytes() for row in _all_rows(64)})


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _all_rows(seq_len):
  rows = [tasks.tokenized(t, "validation", source="sample", training=True).tokens for t in tasks.TASKS]
  return [row for part in rows for row in tasks._fit(part, seq_len)]


def test_bad_input():
  with pytest.raises(ValueError, match="unknown task"):
    tasks.get_task("wmt")
  with pytest.raises(ValueError, match="split"):
    tasks.tokenized("debian_lm", "dev", source="sample")
  with pytest.raises(ValueError, match="outside the model's vocabulary"):
    next(tasks.prefix_lm_batches("validation", batch_size=2, seq_len=16, vocab_size=100, source="sample"))
