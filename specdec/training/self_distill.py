"""Self-distillation data for a feature head (EAGLE-2/3, SpecForge): chat prompts of many kinds, answered by the
verifier itself (layer 4). A head learns the verifier's own continuations, on the kind of requests users send.

  write_prompts(out, verifier, vocab, n=2000)     # out/prompts.jsonl: {id, kind, text}
  write_responses(out, verifier, vocab)           # out/responses.jsonl: {id, kind, temperature, prompt_ids, response_ids}

Prompt kinds, in the turns of `MIX`: summaries, questions, translations and rewrites of Debian packages' shipped
descriptions, general how-tos, code, explanations, lists, creative writing, comparisons and advice (seeds in
data/prompts/seeds.json), and questions the verifier writes itself when asked for one about one of 130 topics
(`SELF_WRITTEN`, sampled at T = 0.7: at T = 1 a 135M model's are mostly not questions): users ask anything, and the
head learns only what its data shows it. The verifier answers each through its chat template,
greedy or sampled (`temperatures`, in turn by batch), up to EOS or `max_new_tokens`. Both files are appended batch
by batch, whole lines only: an interrupted run (Ctrl-C) keeps what it finished and the same call resumes after it.
A finished set is kept as a corpus (`export_corpus`, gzipped JSONL) that seeds a later run's `out` (`seed_from`),
so that data written in one session need not be written again in the next.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding
from specdec.data import debian, gguf_vocab, shipped

PROMPTS, RESPONSES = "prompts.jsonl", "responses.jsonl"
SELF_WRITTEN = "self_written"
KINDS = ("summary", "package_question", "how_to", "code", "explain", "list", "translation", "rewrite", "creative",
         "compare", "advice", SELF_WRITTEN)
# The kind prompt i takes, MIX[i % len(MIX)]: 4/15 self-written, 4/15 about Debian packages, 7/15 general templates.
MIX = (SELF_WRITTEN, "how_to", "summary", "creative", "explain", SELF_WRITTEN, "code", "compare", "list",
       SELF_WRITTEN, "package_question", "advice", "translation", SELF_WRITTEN, "rewrite")
SELF_WRITTEN_TEMPERATURE = 0.7
MAX_DOCUMENT_CHARS = 1200   # a description's text in a prompt (long ones cut at a word)
_LANGUAGES = ("French", "German", "Spanish", "Italian")


def _seeds() -> dict[str, list[str]]:
  with open(shipped.path("data", "prompts", "seeds.json")) as f:
    return json.load(f)


def _cut(text: str, limit: int = MAX_DOCUMENT_CHARS) -> str:
  return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " …"


def templated_prompt(kind: str, rng: random.Random, seeds: dict[str, list[str]], packages: Sequence[dict]) -> str:
  """One prompt of `kind` (not SELF_WRITTEN) from the seeds and a random Debian package's description."""
  package = rng.choice(packages)
  name, document, synopsis = package["package"], _cut(package["document"]), package["summary"]
  if kind == "summary":
    return f"Summarize this software description in one sentence:\n\n{document}"
  if kind == "package_question":
    return rng.choice([f"What is {name} used for? Here is its description:\n\n{document}",
                       f"Would {name} be useful to me? Its description says:\n\n{document}\n\nExplain briefly.",
                       f"Here is a description of the program {name}:\n\n{document}\n\nWho is it for?"])
  if kind == "how_to":
    return rng.choice(["How do I {}?", "What is the best way to {}?", "Give me step-by-step instructions to {}."]
                      ).format(rng.choice(seeds["tasks"]))
  if kind == "code":
    return f"Write a Python function that {rng.choice(seeds['code_tasks'])}."
  if kind == "explain":
    return rng.choice(["Explain {} in simple terms.", "What is {}?", "Explain {} to a ten-year-old."]
                      ).format(rng.choice(seeds["concepts"]))
  if kind == "list":
    return f"List {rng.choice(['three', 'four', 'five'])} {rng.choice(seeds['things'])}."
  if kind == "translation":
    return f"Translate into {rng.choice(_LANGUAGES)}: {synopsis[:1].upper() + synopsis[1:]}."
  if kind == "rewrite":
    return rng.choice(["Rewrite this more formally: {}.", "Make this sentence more exciting: {}.",
                       "Turn this into a full sentence: {}."]).format(synopsis)
  if kind == "creative":
    return rng.choice(["Write {} about {}.", "Could you write {} about {}?", "I need {} about {}."]
                      ).format(rng.choice(seeds["creative_forms"]), rng.choice(seeds["creative_subjects"]))
  if kind == "compare":
    first, second = rng.sample(rng.choice(seeds["comparisons"]), 2)
    return rng.choice(["What are the differences between {} and {}?", "Compare {} and {}.",
                       "Which is better, {} or {}? Explain why."]).format(first, second)
  if kind == "advice":
    return rng.choice(["{}. What should I do?", "{}. Any advice?", "{}. How can I deal with this?"]
                      ).format(rng.choice(seeds["situations"]))
  raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")


def answer(verifier: Any, vocab: Any, texts: Sequence[str], *, temperature: float, max_new_tokens: int, seed: int,
           batch_size: int) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, response ids) of each text answered by `verifier` through the chat template, up to and without
  EOS. The batch is padded to `batch_size` rows (one compiled program per prompt width)."""
  padded = list(texts) + [texts[-1]] * (batch_size - len(texts))
  prompts, lengths = gguf_vocab.chat_batch(vocab, padded)
  out = decoding.generate(jax.random.PRNGKey(seed), None, verifier, jnp.asarray(prompts), jnp.asarray(lengths),
                          method="autoregressive", temperature=temperature, max_new_tokens=max_new_tokens,
                          eos_id=vocab.eos_id)
  tokens, counts = np.asarray(out.tokens), np.asarray(out.lengths)
  answers = []
  for row in range(len(texts)):
    response = tokens[row, :counts[row]].tolist()
    if vocab.eos_id in response:
      response = response[:response.index(vocab.eos_id)]
    answers.append((prompts[row, :lengths[row]].tolist(), response))
  return answers


def _question(written: str) -> str:
  """The request in what the verifier wrote when asked for one: its first line, the quoted part if it quotes."""
  line = written.strip().split("\n")[0].strip()
  quoted = line.split('"')
  return quoted[1].strip() if len(quoted) >= 3 and quoted[1].strip() else line


def _done(path: str) -> list[dict]:
  """The whole lines of a JSONL file an earlier run appended to (a line cut short is dropped from the file)."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  whole = data[:data.rfind(b"\n") + 1]
  if len(whole) != len(data):
    with open(path, "r+b") as f:
      f.truncate(len(whole))
  return [json.loads(line) for line in whole.decode("utf-8").splitlines()]


def _jsonl(records: Sequence[dict]) -> str:
  return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def _append(path: str, records: Sequence[dict]) -> None:
  with open(path, "a", encoding="utf-8") as f:
    f.write(_jsonl(records))
    f.flush()
    os.fsync(f.fileno())


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
  for start in range(0, len(items), size):
    yield items[start:start + size]


def write_prompts(out: str, verifier: Any, vocab: Any, *, n: int = 2000, seed: int = 0, source: str = "auto",
                  batch_size: int = 16, self_written_tokens: int = 48, log: Callable[[str], None] = print) -> list[dict]:
  """`n` prompts in out/prompts.jsonl (resumed where a run stopped): the kinds of `MIX` in turn, the templated
  ones drawn with `seed` from the seeds and the Debian packages of `source`'s train split, the self-written ones
  sampled from `verifier` at SELF_WRITTEN_TEMPERATURE. Returns the first `n`. ValueError if the prompts already
  there are not the ones these settings draw (a resumed run must go on with the data it started with)."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, PROMPTS)
  records = _done(path)
  rng, seeds = random.Random(seed), _seeds()
  packages = debian.load("debian_synopsis", "train", source=source)
  kinds = [MIX[i % len(MIX)] for i in range(n)]
  # Every templated text is drawn whatever was resumed, so that a resumed run writes what an uninterrupted one would.
  texts = [None if kind == SELF_WRITTEN else templated_prompt(kind, rng, seeds, packages) for kind in kinds]
  topics = [rng.choice(seeds["topics"]) for _ in kinds]
  for record, kind, text in zip(records, kinds, texts):   # what is resumed must be what these seeds draw
    if record["kind"] != kind or (text is not None and record["text"] != text):
      raise ValueError(f"{path}: prompt {record['id']} is not the one seed {seed}, source {source!r} and "
                       f"data/prompts/seeds.json draw ({kind}: {text!r}); it was written with other settings: "
                       "give another out directory")
  pending = list(range(len(records), n))
  for batch_index, rows in enumerate(_batches(pending, batch_size)):
    asks = [f"Write one question that a curious person might ask an AI assistant about {topics[i]}. Write only the "
            "question." for i in rows if kinds[i] == SELF_WRITTEN]
    written = iter(answer(verifier, vocab, asks, temperature=SELF_WRITTEN_TEMPERATURE,
                          max_new_tokens=self_written_tokens, seed=seed * 100_003 + rows[0], batch_size=batch_size)
                   if asks else [])
    batch = []
    for i in rows:
      text = texts[i] if kinds[i] != SELF_WRITTEN else _question(vocab.decode(next(written)[1]))
      batch.append({"id": i, "kind": kinds[i], "text": text or f"Tell me something interesting about {topics[i]}."})
    _append(path, batch)
    records += batch
    log(f"prompts: {len(records)}/{n}")
  return records[:n]


def write_responses(out: str, verifier: Any, vocab: Any, *, n: int | None = None,
                    temperatures: Sequence[float] = (0.0, 1.0), max_new_tokens: int = 192, batch_size: int = 32,
                    seed: int = 0, log: Callable[[str], None] = print) -> list[dict]:
  """The verifier's answer to each of the first `n` prompts of out/prompts.jsonl (None: all) in
  out/responses.jsonl (resumed where a run stopped), batch k at temperatures[k % len(temperatures)]. Returns the
  first `n`."""
  prompts = _done(os.path.join(out, PROMPTS))[:n]
  path = os.path.join(out, RESPONSES)
  records = _done(path)[:n]
  start = len(records)
  for batch_index, batch in enumerate(_batches(prompts[start:], batch_size), start // batch_size):
    temperature = float(temperatures[batch_index % len(temperatures)])
    answers = answer(verifier, vocab, [p["text"] for p in batch], temperature=temperature,
                     max_new_tokens=max_new_tokens, seed=seed * 100_003 + batch[0]["id"], batch_size=batch_size)
    finished = [{"id": p["id"], "kind": p["kind"], "temperature": temperature, "prompt_ids": prompt_ids,
                 "response_ids": response_ids} for p, (prompt_ids, response_ids) in zip(batch, answers)]
    _append(path, finished)
    records += finished
    log(f"responses: {len(records)}/{len(prompts)}, {sum(len(r['response_ids']) for r in records)} tokens")
  return records


def export_corpus(out: str, corpus: str) -> list[str]:
  """out/prompts.jsonl and out/responses.jsonl (their whole lines) gzipped into the folder `corpus`, replacing what
  was there. Returns the paths written."""
  os.makedirs(corpus, exist_ok=True)
  paths = []
  for name in (PROMPTS, RESPONSES):
    records = _done(os.path.join(out, name))
    path = os.path.join(corpus, name + ".gz")
    partial = path + ".partial"
    with gzip.open(partial, "wt", encoding="utf-8", compresslevel=9) as f:
      f.write(_jsonl(records))
    os.replace(partial, path)
    paths.append(path)
  return paths


def seed_from(corpus: str, out: str) -> int:
  """Starts out/ from the corpus `export_corpus` wrote, where out/ has no prompts yet (a run in progress is left as
  it is): `write_prompts` and `write_responses` then resume after the corpus' records. Returns the number of
  responses out/ then holds. FileNotFoundError naming the file if the corpus lacks one."""
  os.makedirs(out, exist_ok=True)
  if not os.path.exists(os.path.join(out, PROMPTS)):
    for name in (PROMPTS, RESPONSES):
      source = os.path.join(corpus, name + ".gz")
      if not os.path.exists(source):
        raise FileNotFoundError(f"{source}: a corpus holds {PROMPTS}.gz and {RESPONSES}.gz (export_corpus)")
      with gzip.open(source, "rt", encoding="utf-8") as f:
        _append(os.path.join(out, name), [json.loads(line) for line in f])
  return len(_done(os.path.join(out, RESPONSES)))
