"""Few-shot benchmarks (specdec.data.few_shot): every tfds benchmark yields prompts from tfds's mock data, MBPP
from a JSONL file of its release's format, budgets drop shots before cutting the query, Gemma's chat turns."""

import dataclasses
import io
import json
import re

import numpy as np
import pytest
import sentencepiece as spm

from specdec.data import few_shot, seqio_tasks, tasks, vocab

TFDS = [b for b in few_shot.BENCHMARKS.values() if b.dataset not in ("mbpp", "debian_synopsis")]
SHIPPED = vocab.load_vocabulary()


def _flat(text: str) -> str:
  return " ".join(text.split())   # the shipped vocabulary writes every run of whitespace as one space


@pytest.fixture(scope="module")
def tfds_mock():
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(num_examples=10, policy=tfds.testing.MockPolicy.USE_CODE):
    yield tfds


def test_the_paper_benchmarks_and_budgets():
  assert {b.name for b in TFDS} | {"fewshot_mbpp"} == {
      "fewshot_wmt_ende", "fewshot_cnn_dailymail", "fewshot_gsm8k", "fewshot_mbpp", "fewshot_squad_v2",
      "fewshot_web_questions", "fewshot_natural_questions", "fewshot_trivia_qa"}
  budgets = {name: few_shot.BENCHMARKS[name].max_new_tokens for name in ("fewshot_wmt_ende", "fewshot_cnn_dailymail",
                                                                          "fewshot_gsm8k", "fewshot_mbpp")}
  assert budgets == {"fewshot_wmt_ende": 80, "fewshot_cnn_dailymail": 128, "fewshot_gsm8k": 320, "fewshot_mbpp": 320}
  assert all(b.max_new_tokens == 5 for b in TFDS if b.metric == "exact_match")


@pytest.mark.parametrize("benchmark", TFDS, ids=lambda b: b.name)
def test_every_tfds_benchmark_yields_few_shot_prompts_from_tfds_mock_data(tfds_mock, benchmark):
  shots = [benchmark.read(r) for r in few_shot.read_records(benchmark, benchmark.shot_split, limit=benchmark.n_shots)]
  records = few_shot.read_records(benchmark, benchmark.split)
  queries = [benchmark.read(records[i]) for i in few_shot.sample_rows(len(records), 4, seed=0)]
  split = few_shot.tokenized(benchmark, SHIPPED, benchmark.split, 4)
  assert len(split) == 4 and len(shots) == benchmark.n_shots
  assert (split.prompt_lengths <= benchmark.max_input_tokens).all()
  for row, record in enumerate(split.records):
    text = _flat(record["prompt"])
    assert text.startswith(_flat(benchmark.instruction))
    # every shot, in order, with its answer, then the query's cue
    position = 0
    for shot in shots:
      position = text.index(_flat(shot.cue + benchmark.separator + shot.answer), position) + 1
    assert text.endswith(_flat(queries[row].body + queries[row].cue))
    assert record["references"] == queries[row].references
    target = split.tokens[row, split.prompt_lengths[row]:split.lengths[row]]
    assert target[-1] == SHIPPED.eos_id and len(target) <= benchmark.max_new_tokens
    assert split.tokens[row, :split.prompt_lengths[row]].tolist() == SHIPPED.encode(record["prompt"])


def _mbpp_record(task_id: int) -> dict:
  return {"task_id": task_id, "text": f"Write a function to add {task_id} to a number.",
          "code": f"def add_{task_id}(x):\n    return x + {task_id}",
          "test_list": [f"assert add_{task_id}(1) == {1 + task_id}", f"assert add_{task_id}(-{task_id}) == 0"],
          "test_setup_code": "", "challenge_test_list": []}


def test_mbpp_reads_its_release_file_with_the_papers_shots_and_the_references_run(tmp_path):
  with open(tmp_path / few_shot.MBPP_FILE, "w") as f:
    for task_id in [*range(1, 16), 600, 601]:
      f.write(json.dumps(_mbpp_record(task_id)) + "\n")
  benchmark = few_shot.get_benchmark("fewshot_mbpp")
  assert [r["task_id"] for r in few_shot.read_mbpp("shots", data_dir=tmp_path)] == [2, 3, 4]
  assert [r["task_id"] for r in few_shot.read_mbpp("train", data_dir=tmp_path)] == [601]
  rows = few_shot.examples(benchmark, SHIPPED, "test", 3, data_dir=tmp_path, seed=1)
  assert len(rows) == 3 and all("[BEGIN] def add_2(x)" in _flat(row.text) for row in rows)
  from specdec.evaluation import metrics
  task_ids = [int(re.search(r"add_(\d+)", row.references[1]).group(1)) for row in rows]
  assert all(11 <= task_id <= 15 for task_id in task_ids)   # the test split: tasks 11–510
  solution = [f"[BEGIN]\n{_mbpp_record(task_id)['code']}\n[DONE]" for task_id in task_ids]
  wrong = ["[BEGIN]\ndef nothing():\n    pass\n[DONE]"] * 3
  references = [row.references for row in rows]
  assert metrics.example_statistics("pass_at_1", solution, references)[:, 0].tolist() == [100.0] * 3
  assert metrics.example_statistics("pass_at_1", wrong, references)[:, 0].tolist() == [0.0] * 3
  # MBPP's setup code runs first, then the program, then the asserts
  assert metrics.example_statistics("pass_at_1", ["X = SETUP + 1"], [("SETUP = 1", "assert X == 2")])[0, 0] == 100.0
  with pytest.raises(FileNotFoundError, match="mbpp.jsonl"):
    few_shot.read_mbpp("test", data_dir=tmp_path / "elsewhere")


def test_a_long_prompt_drops_shots_from_the_last_then_cuts_the_query_body():
  benchmark = few_shot.get_benchmark("fewshot_debian_synopsis")
  shots = [few_shot.Example(f"Description: {'word ' * 20}{i}", "\nSynopsis:", f"answer {i}", "") for i in range(2)]
  query = few_shot.Example("Description: " + "long text " * 200, "\nSynopsis:", "", "")
  whole = len(SHIPPED.encode(few_shot.render(benchmark, dataclasses.replace(query, body="short"), shots)))
  one_shot = few_shot.prompt_ids(benchmark, dataclasses.replace(query, body="short"), shots, SHIPPED, max_input_tokens=whole - 1)
  assert "answer 0" in SHIPPED.decode(one_shot) and "answer 1" not in SHIPPED.decode(one_shot)
  cut = few_shot.prompt_ids(benchmark, query, shots, SHIPPED, max_input_tokens=64)
  assert len(cut) <= 64 and "answer 0" not in SHIPPED.decode(cut)
  assert SHIPPED.decode(cut).endswith("Synopsis:") and "long text" in SHIPPED.decode(cut)
  with pytest.raises(ValueError, match="input budget is 3"):
    few_shot.prompt_ids(benchmark, query, shots, SHIPPED, max_input_tokens=3)


def _chat_vocabulary(tmp_path) -> vocab.Vocabulary:
  model = io.BytesIO()
  text = ["Write the one-line synopsis of each package description.", "a tool to edit text files",
          "Description: a library for parsing Synopsis: parser library"] * 20
  spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=80,
                                 hard_vocab_limit=False, minloglevel=2, add_dummy_prefix=False,  # as Gemma's
                                 user_defined_symbols=[few_shot.START_OF_TURN, few_shot.END_OF_TURN])
  (tmp_path / "chat.model").write_bytes(model.getvalue())
  return vocab.load_vocabulary(tmp_path / "chat.model")


def test_chat_template_wraps_the_prompt_in_gemma_turns_and_stops_at_end_of_turn(tmp_path):
  chat = _chat_vocabulary(tmp_path)
  benchmark = few_shot.get_benchmark("fewshot_debian_synopsis")
  shots = [few_shot.Example("Description: a tool", "\nSynopsis:", "editor", "")]
  query = few_shot.Example("Description: a library", "\nSynopsis:", "", "")
  text = few_shot.render(benchmark, query, shots, chat_template=True)
  assert text == ("<start_of_turn>user\nWrite the one-line synopsis of each package description.\n\nDescription: a tool"
                  "\nSynopsis: editor\n\nDescription: a library\nSynopsis:<end_of_turn>\n<start_of_turn>model\n")
  ids = few_shot.prompt_ids(benchmark, query, shots, chat, chat_template=True)
  start, end = chat.piece_id(few_shot.START_OF_TURN), chat.piece_id(few_shot.END_OF_TURN)
  assert ids[0] == chat.bos_id and ids[1] == start and ids.count(start) == 2 and ids.count(end) == 1
  assert few_shot.stop_id(chat, chat_template=True) == end and few_shot.stop_id(chat, False) == chat.eos_id
  with pytest.raises(ValueError, match="<end_of_turn>"):
    few_shot.stop_id(SHIPPED, chat_template=True)


def test_responses_are_cut_at_the_stop_text_and_samples_are_seeded():
  gsm8k = few_shot.get_benchmark("fewshot_gsm8k")
  assert gsm8k.task().response(" 3 + 4 = 7\n#### 7\n\nQuestion: next") == "3 + 4 = 7\n#### 7"
  # an instruction-tuned model's turn ends at <end_of_turn>: a worked answer keeps its blank lines
  assert gsm8k.task(chat_template=True).response("Step 1.\n\nSo 7.") == "Step 1.\n\nSo 7."
  assert few_shot.get_benchmark("fewshot_trivia_qa").task(chat_template=True).response("Paris\nIt is") == "Paris"
  assert tasks.get_task("debian_synopsis").response(" as is ") == " as is "
  rows = few_shot.sample_rows(100, 10, seed=3)
  assert len(set(rows)) == 10 and (np.diff(rows) > 0).all() and (rows == few_shot.sample_rows(100, 10, 3)).all()
  assert few_shot.sample_rows(5, 10, 0).tolist() == [0, 1, 2, 3, 4]


def test_seqio_task_decodes_the_sweeps_prompts(tfds_mock):
  import seqio
  benchmark = few_shot.get_benchmark("fewshot_gsm8k")
  names = seqio_tasks.register_few_shot_tasks(n_examples=3)   # seqio passes a seed to the source: accepted
  assert f"specdec_{benchmark.name}" in names and len(names) == len(few_shot.BENCHMARKS)
  dataset = seqio.get_mixture_or_task(f"specdec_{benchmark.name}").get_dataset(
      {"inputs": benchmark.max_input_tokens, "targets": benchmark.max_new_tokens}, split="test", shuffle=False,
      seed=0)
  got = list(dataset.as_numpy_iterator())
  want = few_shot.examples(benchmark, SHIPPED, "test", 3)
  assert [example["inputs"].tolist() for example in got] == [row.prompt for row in want]
  assert [example["targets"].tolist() for example in got] == [row.target for row in want]


def test_the_t5_tasks_tfds_records_are_text_fields(tfds_mock):
  records = seqio_tasks.tfds_records("specdec_wmt14_ende", "test", limit=3)
  assert len(records) == 3 and all(set(r) == {"en", "de"} and all(isinstance(v, str) and v for v in r.values())
                                   for r in records)
