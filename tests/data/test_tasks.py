"""Local tasks as token rows: formats, budgets, loss weights, decoding prompts, the training data source."""

import dataclasses

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


def test_t5_row_is_the_t5_input_then_start_token_target_and_eos():
  task = tasks.TASKS["debian_en_de"]
  records = [{"package": "p", "en": "Creates menus.", "de": "Erzeugt Menüs für Größen.", "unit": "synopsis"},
             {"package": "q", "en": "Tiny.", "de": "Winzig klein, sehr klein.", "unit": "synopsis"}]
  prompt, target = tasks.encode_example(task, VOCAB, records[0], encoder_decoder=True)
  assert prompt == VOCAB.encode("translate English to German: Creates menus.")   # no " German:"
  assert target == VOCAB.encode("Erzeugt Menüs für Größen.") + [VOCAB.eos_id]
  rows = tasks.tokenize(task, VOCAB, records, encoder_decoder=True)
  batch = rows.seq2seq(encoder_len=9, decoder_len=11)
  short_prompt = VOCAB.encode("translate English to German: Tiny.")
  short_target = VOCAB.encode("Winzig klein, sehr klein.") + [VOCAB.eos_id]
  assert len(prompt) > 9 > len(short_prompt) and len(target) > 10 > len(short_target)
  # Row 0 is cut to the widths; row 1 fits and is padded with 0.
  assert batch["encoder_inputs"].tolist() == [prompt[:9], short_prompt + [0] * (9 - len(short_prompt))]
  assert batch["encoder_lengths"].tolist() == [9, len(short_prompt)]
  assert batch["inputs"].tolist() == [[0] + target[:10], [0] + short_target + [0] * (10 - len(short_target))]
  assert batch["weights"].tolist() == [[0.0] + [1.0] * 10,
                                       [0.0] + [1.0] * len(short_target) + [0.0] * (10 - len(short_target))]
  assert {k: v.dtype for k, v in batch.items()} == {"encoder_inputs": np.int32, "encoder_lengths": np.int32,
                                                    "inputs": np.int32, "weights": np.float32}
  # Default widths: the longest prompt and 1 + the longest target; references and prompts as for decoder-only.
  full = rows.seq2seq()
  assert full["encoder_inputs"].shape == (2, len(prompt)) and full["inputs"].shape == (2, 1 + len(target))
  assert full["inputs"][0, 1:].tolist() == target and rows.targets()[0] == target[:-1]
  assert rows.prompts()[0][0].tolist() == prompt


def test_long_input_is_cut_before_the_separator_and_long_target_keeps_eos():
  task = tasks.TASKS["debian_synopsis"]
  record = {"package": "p", "document": "word " * 2000, "summary": "summary " * 200}
  prompt, target = tasks.encode_example(task, VOCAB, record)
  assert len(prompt) == task.max_input_tokens
  assert VOCAB.decode(prompt).endswith("word synopsis:") and VOCAB.decode(prompt).startswith("summarize: word")
  assert len(target) == task.max_target_tokens and target[-1] == VOCAB.eos_id


class _ChatVocabulary:
  """The shipped vocabulary with a chat template of two markers (an instruct model's GGUF vocabulary's interface)."""
  chat_template = "user: {content} assistant:"
  eos_id, prompt_start = VOCAB.eos_id, [VOCAB.eos_id + 1]
  encode, decode = staticmethod(VOCAB.encode), staticmethod(VOCAB.decode)

  def chat_prompt(self, text):
    return self.prompt_start + VOCAB.encode(f"user: {text} assistant:")


@pytest.mark.parametrize("words", [3, 2000])
def test_a_chat_task_asks_through_the_template_and_cuts_the_document_to_fit(words):
  task = tasks.TASKS["debian_synopsis_chat"]
  vocab = _ChatVocabulary()
  record = {"package": "p", "document": "Parses the word " * words, "summary": "word parser"}
  prompt, target = tasks.encode_example(task, vocab, record)
  assert prompt[0] == vocab.prompt_start[0] and len(prompt) <= task.max_input_tokens
  text = VOCAB.decode(prompt[1:])
  assert text.startswith("user: " + task.prefix.split("\n")[0]) and text.endswith(" assistant:")
  assert (len(prompt) >= task.max_input_tokens - 2) == (words > 100)   # cut only where it does not fit
  assert target == VOCAB.encode("word parser") + [VOCAB.eos_id]
  with pytest.raises(ValueError, match="debian_synopsis_chat asks an instruct model through its chat template"):
    tasks.encode_example(task, VOCAB, record)
  assert "debian_synopsis_chat" not in tasks.SHIPPED_VOCABULARY_TASKS and len(tasks.SHIPPED_VOCABULARY_TASKS) == 3
  with pytest.raises(ValueError, match="through the chat template alone takes .* more than max_input_tokens=8"):
    tasks.encode_example(dataclasses.replace(task, max_input_tokens=8), vocab, record)


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
  pool = sum(len(tasks.tokenized(t, "validation", source="sample", training=True)) for t in tasks.SHIPPED_VOCABULARY_TASKS)
  seen = np.concatenate([b["inputs"] for b in
                         _take(tasks.prefix_lm_batches("validation", **{**kwargs, "batch_size": pool}), 1)])
  assert len({row.tobytes() for row in seen}) == len({row.tobytes() for row in _all_rows(64)})


def test_seq2seq_batches_are_resumable_and_hold_the_prefix_lm_examples_in_the_same_order():
  kwargs = dict(batch_size=16, vocab_size=VOCAB.vocab_size, source="sample", tasks=tasks.SEQ2SEQ_TASKS)
  batches = _take(tasks.seq2seq_batches("train", seq_len=129, **kwargs), 4)
  resumed = next(tasks.seq2seq_batches("train", seq_len=129, start=3, **kwargs))
  assert all(np.array_equal(resumed[key], batches[3][key]) for key in batches[3])
  assert {key: value.shape for key, value in batches[0].items()} == {
      "encoder_inputs": (16, 224), "encoder_lengths": (16,), "inputs": (16, 129), "weights": (16, 129)}
  assert not batches[0]["inputs"][:, 0].any() and not batches[0]["weights"][:, 0].any()
  # The shared mixture order: batch i holds the same examples as prefix_lm_batches' batch i, so the
  # decoder's weighted tokens (target + eos) are the prefix-LM rows' weighted tokens.
  for seq2seq, prefix_lm in zip(batches, _take(tasks.prefix_lm_batches("train", seq_len=256, **kwargs), 4)):
    for row in range(16):
      assert (seq2seq["inputs"][row][seq2seq["weights"][row] > 0].tolist()
              == prefix_lm["inputs"][row][prefix_lm["weights"][row] > 0].tolist())
  with pytest.raises(ValueError, match="outside the model's vocabulary"):
    next(tasks.seq2seq_batches("validation", batch_size=2, seq_len=16, vocab_size=100, source="sample"))


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _all_rows(seq_len):
  rows = [tasks.tokenized(t, "validation", source="sample", training=True).tokens
          for t in tasks.SHIPPED_VOCABULARY_TASKS]
  return [row for part in rows for row in tasks._fit(part, seq_len)]


def test_bad_input():
  with pytest.raises(ValueError, match="unknown task"):
    tasks.get_task("wmt")
  with pytest.raises(ValueError, match="split"):
    tasks.tokenized("debian_lm", "dev", source="sample")
  with pytest.raises(ValueError, match="outside the model's vocabulary"):
    next(tasks.prefix_lm_batches("validation", batch_size=2, seq_len=16, vocab_size=100, source="sample"))


def test_length_buckets_regroup_the_same_examples_with_less_padding_and_resume():
  kwargs = dict(batch_size=8, seq_len=256, vocab_size=VOCAB.vocab_size, source="sample", seed=3)
  plain = _take(tasks.prefix_lm_batches("train", **kwargs), 8)
  bucketed = _take(tasks.prefix_lm_batches("train", length_window=4, **kwargs), 8)
  for window in (slice(0, 4), slice(4, 8)):   # each window of 4 batches holds the same 32 examples
    rows = lambda batches: sorted(np.trim_zeros(row, "b").tobytes() for b in batches for row in b["inputs"])
    assert rows(plain[window]) == rows(bucketed[window])
  for batch in bucketed:
    width = batch["inputs"].shape[1]
    longest = max(len(np.trim_zeros(row, "b")) for row in batch["inputs"])
    assert width % 32 == 0 and longest <= width < longest + 32
    assert batch["weights"].shape == batch["inputs"].shape
  assert sum(b["inputs"].size for b in bucketed) < 0.6 * sum(b["inputs"].size for b in plain)
  resumed = _take(tasks.prefix_lm_batches("train", length_window=4, start=5, **kwargs), 3)
  assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(resumed, bucketed[5:]))


def test_generated_continuations_round_trip_resume_and_train_like_a_task(tmp_path):
  import jax
  from specdec import decoding, models
  from specdec.training import distill
  model = models.build("tiny", vocab_size=VOCAB.vocab_size, seed=0)
  write = lambda: distill.write(tmp_path, model, "debian_synopsis", "validation", 3, source="sample",
                                eos_id=VOCAB.eos_id, batch_size=2)
  write()
  chunk = tasks.generated_chunk_path(tmp_path, "debian_synopsis", "validation", 0)
  written = chunk.stat().st_mtime_ns
  write()   # resumes: the finished chunk is kept, not regenerated
  assert chunk.stat().st_mtime_ns == written
  generated = tasks.read_generated(tmp_path, "debian_synopsis", "validation")
  split = tasks.tokenized("debian_synopsis", "validation", source="sample")
  rows = np.load(chunk)["rows"]
  prompts, lengths = split.prompts(rows)
  for i, row in enumerate(rows):   # the prompt, then what greedy decoding of that prompt alone writes
    n = int(lengths[i])
    assert generated.tokens[i, :n].tolist() == prompts[i, :n].tolist()
    alone = decoding.generate(jax.random.PRNGKey(0), None, model, prompts[i:i + 1, :n], lengths[i:i + 1],
                              method="autoregressive", temperature=0.0, max_new_tokens=32, eos_id=VOCAB.eos_id)
    expected = np.asarray(alone.tokens)[0, :int(alone.lengths[0])].tolist()
    assert generated.tokens[i, n:generated.lengths[i]].tolist() == expected
  batch = next(tasks.prefix_lm_batches("validation", batch_size=3, seq_len=256, vocab_size=VOCAB.vocab_size,
                                       tasks=["debian_synopsis"], generated=str(tmp_path)))
  assert batch["weights"].sum() == (generated.lengths - generated.prompt_lengths).sum()
  with pytest.raises(FileNotFoundError, match="make_distill_data"):
    tasks.read_generated(tmp_path, "debian_en_de", "validation")


def test_prompt_batch_formats_texts_as_the_task_and_buckets_the_width():
  texts = ["A tool to frobnicate files.", "Another package, with a much longer description of what it does."]
  prompts, lengths = tasks.prompt_batch(texts, task="debian_synopsis")
  task = tasks.get_task("debian_synopsis")
  for i, text in enumerate(texts):
    expected, _ = tasks.encode_example(task, VOCAB, {"document": text, "summary": ""})
    assert prompts[i, :lengths[i]].tolist() == expected and not prompts[i, lengths[i]:].any()
  assert prompts.shape[1] % 32 == 0 and prompts.shape[1] - 32 < lengths.max() <= prompts.shape[1]
  assert VOCAB.decode(prompts[0, :lengths[0]].tolist()).endswith("synopsis:")
  raw, raw_lengths = tasks.prompt_batch(["hello world"], bucket=8)
  assert raw.shape == (1, 8) and raw[0, :raw_lengths[0]].tolist() == VOCAB.encode("hello world")
  with pytest.raises(ValueError, match="texts must be a non-empty list of strings"):
    tasks.prompt_batch("just one string")
  with pytest.raises(ValueError, match="encode to no tokens"):
    tasks.prompt_batch(["ok", ""])


def test_prompt_batch_refuses_what_it_would_alter_silently():
  """An empty text with a task encoded as the prefix alone ("summarize: synopsis:") and decoded as if it
  were text; an over-long one was cut without notice."""
  with pytest.raises(ValueError, match=r"texts \[1\] \(0-based\) encode to no tokens"):
    tasks.prompt_batch(["ok", ""], task="debian_synopsis")
  long = "word " * 300
  with pytest.raises(ValueError, match=r"texts \[1\] \(0-based\) are longer than task debian_synopsis's input "
                                       r"budget: 224 tokens .* text 1 needs 3\d\d.*truncate=True"):
    tasks.prompt_batch(["ok", long], task="debian_synopsis")
  prompts, lengths = tasks.prompt_batch(["ok", long], task="debian_synopsis", truncate=True)
  assert lengths[1] == tasks.get_task("debian_synopsis").max_input_tokens
