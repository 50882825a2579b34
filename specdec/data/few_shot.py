"""The few-shot benchmarks of the speculative-cascades paper's Gemma experiments (§6 Figure 3, App. F.7).

Eight benchmarks (`BENCHMARKS`, App. F.1's output budgets), each read from its tfds dataset without
downloading (MBPP from its release's `mbpp.jsonl`: tfds has no MBPP), plus a local one built from the
shipped Debian sample for the CPU miniature:

  name                      data (eval split / shot split)                shots  output  metric
  fewshot_wmt_ende          wmt14_translate/de-en (test / train)             5      80    bleu
  fewshot_cnn_dailymail     cnn_dailymail (test / train)                     1     128    rouge2
  fewshot_gsm8k             gsm8k (test / train)                             8     320    gsm8k_exact_match
  fewshot_mbpp              mbpp.jsonl (test: tasks 11–510 / tasks 2–4)      3     320    pass_at_1
  fewshot_squad_v2          squad/v2.0 (validation / train)                  3       5    exact_match
  fewshot_web_questions     web_questions (test / train)                     5       5    exact_match
  fewshot_natural_questions natural_questions_open (validation / train)     5       5    exact_match
  fewshot_trivia_qa         trivia_qa/rc.nocontext (validation / train)      5       5    exact_match
  fewshot_debian_synopsis   the shipped debian_synopsis (any / train)        2      32    rouge2

The paper gives no shot counts; these are the usual ones (8-shot chain of thought for GSM8K, MBPP's own
3-shot prompt of tasks 2–4, 5-shot for the short-answer sets and WMT, one CNN/DM article to leave room).
The shots are the shot split's first examples in the dataset's order (MBPP: tasks 2, 3, 4), the same for
every query; the evaluated prompts are a seeded sample of `n_examples` of the eval split ("we sample 1,000
prompts"; MBPP's test split has 500, all of them).

Prompt, as a pre-trained model reads it:

    <instruction>\\n\\n<shot query><sep><shot answer>\\n\\n … \\n\\n<query>

and with `chat_template` (instruction-tuned Gemma) the same text as one user turn,
`<start_of_turn>user\\n<prompt><end_of_turn>\\n<start_of_turn>model\\n`, generation stopping at
<end_of_turn> (`stop_id`). Shots are dropped from the last until the prompt fits the benchmark's input
budget, then the query's long part (an article, a context paragraph) is cut. A response is cut at the
benchmark's `stop` text (where a pre-trained model goes on to write the next shot) before scoring
(`Task.response`); with the chat template only single-line answers are cut (`chat_stop`).
SQuAD 2.0's unanswerable questions have the answer "unanswerable" in shots and references.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from etils import epath

from specdec.data import debian
from specdec.data.tasks import Task, Tokenized
from specdec.data.vocab import Vocabulary

START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
UNANSWERABLE = "unanswerable"
MBPP_FILE = "mbpp.jsonl"
# MBPP's splits by task id (Austin et al., 2021, §2.1): the few-shot prompt uses tasks 2, 3 and 4.
MBPP_SPLITS = {"prompt": range(1, 11), "test": range(11, 511), "validation": range(511, 601),
               "train": range(601, 975)}
MBPP_SHOTS = (2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Example:
  """A record as text: `body` (the long part a prompt may cut: an article, a context; "" if none), then `cue`
  (what the model answers: "\\nQuestion: …\\nAnswer:"), the reference `answer` a shot shows, and the
  `references` the metric compares with (answers, a target text, MBPP's test program)."""
  body: str
  cue: str
  answer: str
  references: str | tuple[str, ...]   # MBPP: (setup code, asserts)


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """A few-shot benchmark: where its records are, how one reads as an `Example`, the prompt's frame and
  budgets (tokens; `max_new_tokens` is the paper's output length), and its metric (`evaluation.metrics`)."""
  name: str
  dataset: str                      # tfds 'name[/config]:version', 'mbpp' or a `debian.DATASETS` name
  split: str                        # evaluated
  shot_split: str
  n_shots: int
  metric: str
  max_new_tokens: int
  max_input_tokens: int
  instruction: str
  read: Callable[[dict[str, Any]], Example]
  separator: str = " "              # between a shot's cue and its answer
  stop: str = "\n\n"                # a response ends where this text starts (the next shot's start)
  chat_stop: str = ""               # the same with the chat template, whose turn ends at <end_of_turn>:
                                    # only single-line answers are cut (a worked answer keeps its blank lines)

  def task(self, chat_template: bool = False) -> Task:
    """The benchmark as the sweep's `Task`: prompts are whole few-shot texts, references the metric's."""
    return Task(name=self.name, dataset=self.dataset, metric=self.metric, input_field="prompt",
                target_field="references", max_input_tokens=self.max_input_tokens,
                max_target_tokens=self.max_new_tokens, stop=self.chat_stop if chat_template else self.stop)


def _qa(question_key: str, answers: Callable[[dict], Sequence[str]]) -> Callable[[dict], Example]:
  def read(record: dict) -> Example:
    found = tuple(answers(record)) or ("",)
    return Example("", f"Question: {record[question_key]}\nAnswer:", found[0], found)
  return read


def _squad(record: dict) -> Example:
  answers = tuple(record["answers"]["text"]) or (UNANSWERABLE,)
  return Example(f"Context: {record['context']}", f"\nQuestion: {record['question']}\nAnswer:", answers[0], answers)


def _trivia_answers(record: dict) -> list[str]:
  answer = record["answer"]
  return [answer["value"], *(alias for alias in answer["aliases"] if alias != answer["value"])]


def _mbpp(record: dict) -> Example:
  """References: (setup code, the asserts), run around the response's code by `pass_at_1`."""
  tests = "\n".join(record["test_list"])
  cue = (f"You are an expert Python programmer, and here is your task: {record['text']} "
         f"Your code should pass these tests:\n\n{tests}\n")
  return Example("", cue, f"[BEGIN]\n{record['code']}\n[DONE]", (record.get("test_setup_code", ""), tests))


def _gsm8k(record: dict) -> Example:
  # The solutions' calculator annotations ("<<48/2=24>>") are tool calls, not text a model should imitate.
  answer = re.sub(r"<<[^>]*>>", "", record["answer"])
  return Example("", f"Question: {record['question']}\nAnswer:", answer, answer)


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("fewshot_wmt_ende", "wmt14_translate/de-en:1.0.0", "test", "train", 5, "bleu", 80, 1024,
              "Translate English to German.",
              lambda r: Example("", f"English: {r['en']}\nGerman:", r["de"], r["de"]), stop="\n", chat_stop="\n"),
    Benchmark("fewshot_cnn_dailymail", "cnn_dailymail:3.4.0", "test", "train", 1, "rouge2", 128, 2048,
              "Summarize the article in a few sentences.",
              lambda r: Example(f"Article: {r['article']}", "\nSummary:", " ".join(r["highlights"].split()),
                                r["highlights"])),
    Benchmark("fewshot_gsm8k", "gsm8k:1.0.0", "test", "train", 8, "gsm8k_exact_match", 320, 2048,
              "Solve each problem step by step; end with '#### ' and the final number.",
              _gsm8k),
    Benchmark("fewshot_mbpp", "mbpp", "test", "shots", 3, "pass_at_1", 320, 1024, "", _mbpp, separator="",
              stop="[DONE]"),
    Benchmark("fewshot_squad_v2", "squad/v2.0:3.0.0", "validation", "train", 3, "exact_match", 5, 1536,
              f"Answer from the context, or say '{UNANSWERABLE}'.", _squad, stop="\n", chat_stop="\n"),
    Benchmark("fewshot_web_questions", "web_questions:1.0.0", "test", "train", 5, "exact_match", 5, 512,
              "Answer the question.", _qa("question", lambda r: r["answers"]), stop="\n", chat_stop="\n"),
    Benchmark("fewshot_natural_questions", "natural_questions_open:1.0.0", "validation", "train", 5,
              "exact_match", 5, 512, "Answer the question.", _qa("question", lambda r: r["answer"]), stop="\n",
              chat_stop="\n"),
    Benchmark("fewshot_trivia_qa", "trivia_qa/rc.nocontext:1.1.0", "validation", "train", 5, "exact_match", 5,
              512, "Answer the question.", _qa("question", _trivia_answers), stop="\n", chat_stop="\n"),
    Benchmark("fewshot_debian_synopsis", "debian_synopsis", "validation", "train", 2, "rouge2", 32, 512,
              "Write the one-line synopsis of each package description.",
              lambda r: Example(f"Description: {r['document']}", "\nSynopsis:", r["summary"], r["summary"]),
              stop="Description:"),   # the shipped vocabulary writes newlines as spaces
]}


def get_benchmark(name: str) -> Benchmark:
  if name not in BENCHMARKS:
    raise ValueError(f"unknown few-shot benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
  return BENCHMARKS[name]


# --- records --------------------------------------------------------------------------------------------

def _python(value: Any) -> Any:
  """A tfds numpy example as Python values: bytes -> str, arrays -> lists, dicts recursively."""
  if isinstance(value, dict):
    return {key: _python(item) for key, item in value.items()}
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    return [_python(item) for item in value.tolist()] if value.ndim else _python(value.item())
  return value


def _data_dir(data_dir: str | os.PathLike | None) -> str:
  return str(data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets"))


def read_mbpp(split: str, *, data_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
  """MBPP's records of `split` (`MBPP_SPLITS`, or 'shots': tasks 2, 3, 4) from `<data_dir>/mbpp.jsonl`, the file
  of MBPP's release (data_dir default: $TFDS_DATA_DIR, else ~/tensorflow_datasets)."""
  path = epath.Path(_data_dir(data_dir)) / MBPP_FILE    # a local path or gs://…
  if not path.exists():
    raise FileNotFoundError(f"no {path}: copy MBPP's {MBPP_FILE} (its release on GitHub, "
                            "google-research/mbpp) there; nothing is downloaded")
  ids = MBPP_SHOTS if split == "shots" else MBPP_SPLITS.get(split)
  if ids is None:
    raise ValueError(f"MBPP split must be one of {', '.join(MBPP_SPLITS)}, shots; got {split!r}")
  records = {record["task_id"]: record for record in map(json.loads, filter(str.strip, path.read_text().splitlines()))}
  return [records[i] for i in ids if i in records]


def read_tfds(dataset: str, split: str, *, data_dir: str | os.PathLike | None = None, limit: int | None = None
              ) -> list[dict[str, Any]]:
  """The first `limit` examples of a tfds dataset's split (`name[/config]:version`) in the dataset's order,
  as Python values. Needs tensorflow_datasets and the data in `data_dir` (default: tfds's own); nothing
  is downloaded."""
  import tensorflow_datasets as tfds   # optional: `pip install -e '.[seqio]'`
  examples = tfds.load(dataset, split=split, data_dir=data_dir, shuffle_files=False, download=False)
  if limit is not None:
    examples = examples.take(limit)
  return [_python(example) for example in tfds.as_numpy(examples)]


def read_records(benchmark: Benchmark, split: str, *, data_dir: str | os.PathLike | None = None,
                 limit: int | None = None, source: str = "auto") -> list[dict[str, Any]]:
  """The first `limit` records of a benchmark's split in the dataset's order, as Python values: tfds
  (`read_tfds`), MBPP's JSONL or the local Debian sample (`source` as `debian.load`)."""
  if benchmark.dataset in debian.DATASETS:
    return list(debian.load(benchmark.dataset, split, source=source)[:limit])
  if benchmark.dataset == "mbpp":
    return read_mbpp(split, data_dir=data_dir)[:limit]
  return read_tfds(benchmark.dataset, split, data_dir=data_dir, limit=limit)


def sample_rows(n_records: int, n_examples: int, seed: int) -> np.ndarray:
  """`n_examples` distinct row indices of `n_records`, a seeded sample in increasing order (all rows when
  there are no more)."""
  if n_examples >= n_records:
    return np.arange(n_records)
  return np.sort(np.random.default_rng(seed).choice(n_records, n_examples, replace=False))


# --- prompts ----------------------------------------------------------------------------------------------

def render(benchmark: Benchmark, query: Example, shots: Sequence[Example], *, chat_template: bool = False) -> str:
  """The prompt text (module docstring): instruction, shots, the query's body and cue."""
  blocks = [benchmark.instruction] if benchmark.instruction else []
  blocks += [shot.body + shot.cue + benchmark.separator + shot.answer for shot in shots]
  text = "\n\n".join(blocks + [query.body + query.cue])
  if chat_template:
    return f"{START_OF_TURN}user\n{text}{END_OF_TURN}\n{START_OF_TURN}model\n"
  return text


def prompt_ids(benchmark: Benchmark, query: Example, shots: Sequence[Example], vocab: Vocabulary, *,
               chat_template: bool = False, max_input_tokens: int | None = None) -> list[int]:
  """The prompt's ids (after the vocabulary's `prompt_start`, <bos> for Gemma's) within the input budget:
  shots dropped from the last, then the query's body cut at its end (in tokens)."""
  budget = (max_input_tokens or benchmark.max_input_tokens) - len(vocab.prompt_start)

  def encoded(query: Example, n_shots: int) -> list[int]:
    return vocab.encode(render(benchmark, query, shots[:n_shots], chat_template=chat_template))

  for n_shots in range(len(shots), -1, -1):
    ids = encoded(query, n_shots)
    if len(ids) <= budget:
      return vocab.prompt_start + ids
  body = vocab.encode(query.body)
  keep = max(len(body) - (len(ids) - budget), 0)
  while True:   # cutting tokens may re-tokenize the cut's neighbours: shorten until it fits
    ids = encoded(dataclasses.replace(query, body=vocab.decode(body[:keep])), 0)
    if len(ids) <= budget:
      return vocab.prompt_start + ids
    if keep == 0:
      raise ValueError(f"{benchmark.name}: the prompt without shots and body needs {len(ids)} tokens; the "
                       f"input budget is {budget + len(vocab.prompt_start)}")
    keep = max(keep - max(len(ids) - budget, 1), 0)


def stop_id(vocab: Vocabulary, chat_template: bool) -> int:
  """Where generation stops: eos, or <end_of_turn> for a chat-template prompt (Gemma's instruction-tuned
  models end their turn with it)."""
  if not chat_template:
    return vocab.eos_id
  end = vocab.piece_id(END_OF_TURN)
  if end is None:
    raise ValueError(f"chat_template needs a vocabulary with the piece {END_OF_TURN} (Gemma's); "
                     f"{vocab.path} has none")
  return end


@dataclasses.dataclass(frozen=True)
class Prompted:
  """One evaluated example: `prompt` ids (within the budget, after `prompt_start`), `target` ids (the
  reference answer + eos, cut to `max_new_tokens`), the prompt's `text` and the metric's `references`."""
  prompt: list[int]
  target: list[int]
  text: str
  references: str | tuple[str, ...]


def examples(benchmark: Benchmark, vocab: Vocabulary, split: str, n_examples: int, *,
             data_dir: str | os.PathLike | None = None, source: str = "auto", seed: int = 0,
             chat_template: bool = False, max_input_tokens: int | None = None) -> list[Prompted]:
  """`n_examples` sampled queries of a benchmark's split (`sample_rows`), each with the few-shot prompt of
  the shot split's first `n_shots` examples (`prompt_ids`)."""
  shots = [benchmark.read(r) for r in read_records(benchmark, benchmark.shot_split, data_dir=data_dir,
                                                      limit=benchmark.n_shots, source=source)]
  if len(shots) < benchmark.n_shots:
    raise ValueError(f"{benchmark.name}: {benchmark.shot_split} has {len(shots)} examples for "
                     f"{benchmark.n_shots} shots")
  records = read_records(benchmark, split, data_dir=data_dir, source=source)
  prompted = []
  for i in sample_rows(len(records), n_examples, seed):
    query = benchmark.read(records[i])
    prompt = prompt_ids(benchmark, query, shots, vocab, chat_template=chat_template,
                        max_input_tokens=max_input_tokens)
    target = vocab.encode(query.answer)[:benchmark.max_new_tokens - 1] + [vocab.eos_id]
    prompted.append(Prompted(prompt, target, vocab.decode(prompt[len(vocab.prompt_start):]), query.references))
  return prompted


def tokenized(benchmark: Benchmark, vocab: Vocabulary, split: str, n_examples: int, **options) -> Tokenized:
  """`examples` as the sweep's `Tokenized` (rows prompt + target), records {'prompt': the prompt text,
  'references': what the metric compares with}; `options` as `examples`."""
  rows = examples(benchmark, vocab, split, n_examples, **options)
  tokens = np.zeros((len(rows), max(len(row.prompt) + len(row.target) for row in rows)), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row.prompt) + len(row.target)] = row.prompt + row.target
  return Tokenized(tokens, np.array([len(row.prompt) for row in rows], np.int32),
                   np.array([len(row.prompt) + len(row.target) for row in rows], np.int32),
                   tuple({"prompt": row.text, "references": row.references} for row in rows))
