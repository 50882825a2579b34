"""Decode texts with a drafter/verifier pair and time it.

  specdec-generate --drafter data/models/debian_drafter --verifier data/models/debian_verifier \
      --task debian_synopsis --method speculative --gamma 3 --temperature 0 --compare \
      --prompt "A command-line tool that converts images between many formats."

`--input FILE` reads one prompt per line (blank lines skipped). With `--task` each prompt is formatted as
that task's input ("summarize: … synopsis:"); without it the text is continued as it is. Prints each
decoded text with its counters, then a summary: compile and decode seconds and tokens/s (`--compare`: the
verifier alone on the same prompts, and the speed-up). `--output FILE.jsonl` writes one JSON object per
prompt. Model directories are paths, or names of the shipped models (debian_drafter, debian_verifier,
debian_drafter_distilled). Compiled programs are kept in a persistent cache (`--cache_dir`), so an
identical second call does not compile again. At T > 0 a prompt's sample depends on --seed and its text
(and how often the same text came before it), not on its place in the input or the batch size.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from specdec import cli, decoding
from specdec.data import load_vocabulary, shipped, tasks
from specdec.models.base import is_encoder_decoder
from specdec.training import exports
from specdec.training.convert import load_any

PROG = "specdec-generate"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                "/jax/compilation_cache/cache_hits": "hits"}
_compile_seconds = [0.0]
_cache_counts = {"requests": 0, "hits": 0}


@functools.cache
def _count_compilations() -> None:
  """From now on, JAX's compilation durations (tracing, lowering, XLA) add up in `_compile_seconds`, and
  the programs it looked up in (and found in) the persistent cache in `_cache_counts`."""
  def on_duration(event: str, duration: float, **_: Any) -> None:
    if event in COMPILE_EVENTS:
      _compile_seconds[0] += duration

  def on_event(event: str, **_: Any) -> None:
    if event in CACHE_EVENTS:
      _cache_counts[CACHE_EVENTS[event]] += 1
  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)


def default_cache_dir() -> str:
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specdec", "jax")


def _method_help(name: str) -> str:
  """A parameter's meaning, range and default in each method that takes it (`Param.help`)."""
  takers: dict[tuple[str, str], list[str]] = {}
  for method in decoding.METHODS.values():
    for param in method.params:
      if param.name == name:
        takers.setdefault((param.help, repr(param.default)), []).append(method.name)
  return "; ".join(f"{meaning} [default {default}: {', '.join(names)}]"
                   for (meaning, default), names in takers.items()).replace("%", "%%")


def _parser() -> argparse.ArgumentParser:
  parser = cli.parser(PROG, __doc__)
  models = parser.add_argument_group("models")
  models.add_argument("--verifier", required=True, metavar="DIR", help="the verifier: an exported model directory, or a "
                      "Hugging Face save_pretrained directory (T5, Gemma 2)")
  models.add_argument("--drafter", metavar="DIR", help="the drafter (every method but autoregressive)")
  models.add_argument("--head", metavar="DIR", help="a directory holding the parts of the drafter's export that "
                      + ", ".join(f"{m.name} reads ({', '.join(m.export_parts)}/)" for m in decoding.METHODS.values()
                                  if m.export_parts) + " (default: the drafter's own directory)")
  models.add_argument("--vocab", metavar="PATH", help="a SentencePiece .model file (default: the shipped one)")
  text = parser.add_argument_group("prompts").add_mutually_exclusive_group(required=True)
  text.add_argument("--prompt", action="append", help="a prompt text (repeatable)")
  text.add_argument("--input", metavar="FILE", help="a UTF-8 file with one prompt per line")
  run = parser.add_argument_group("decoding")
  run.add_argument("--task", choices=list(tasks.TASKS), help="format prompts as this task's inputs")
  run.add_argument("--truncate", action="store_true",
                   help="cut prompts longer than the task's input budget as training does (default: an error)")
  run.add_argument("--method", default="speculative", choices=list(decoding.METHODS),
                   help="the decoding method (default: %(default)s)")
  run.add_argument("--temperature", type=float, default=1.0,
                   help="T >= 0; 0 is greedy (default: %(default)s, as decoding.generate)")
  run.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: %(default)s)")
  run.add_argument("--top_k", type=int, default=0, help="keep the k likeliest tokens, 0: all (default: %(default)s)")
  run.add_argument("--max_new_tokens", type=int, help="default: the task's target budget, else 64")
  run.add_argument("--no_eos", action="store_true", help="do not stop at the vocabulary's end-of-sequence")
  run.add_argument("--seed", type=int, default=0, help="the sampling key (default: %(default)s)")
  run.add_argument("--batch_size", type=int, default=8, help="prompts decoded together (default: %(default)s)")
  out = parser.add_argument_group("output and timing")
  out.add_argument("--output", metavar="FILE.jsonl", help="write one JSON object per prompt: prompt, text, "
                   "tokens, counters, ms_per_token")
  out.add_argument("--compare", action="store_true", help="also decode with the verifier alone; print the speed-up")
  out.add_argument("--cache_dir", help=f"the persistent compilation cache (default: {default_cache_dir()}; the "
                   "first call of a process sets it for the process)")
  out.add_argument("--no_cache", action="store_true", help="do not read or write the compilation cache")
  params = parser.add_argument_group("method parameters", "each method takes the ones its entry in "
                                     "specdec.decoding.generate lists; the others are an error")
  for name in decoding.methods.all_param_names():
    value_type = next(p.value_type for m in decoding.METHODS.values() for p in m.params if p.name == name)
    params.add_argument(f"--{name}", type=value_type, default=None, help=_method_help(name))
  return parser


def _method_params(args: argparse.Namespace, method: decoding.Method) -> dict[str, Any]:
  """The method parameters given, checked: one the method does not take is an error; one it takes but
  that does not change this run (Param.used) gets a note."""
  given = {name: getattr(args, name) for name in decoding.methods.all_param_names() if getattr(args, name) is not None}
  taken = [p.name for p in method.params]
  foreign = [name for name in given if name not in taken]
  if foreign:
    raise ValueError(f"--{foreign[0]} is not a parameter of --method {method.name} (it takes "
                     f"{', '.join('--' + n for n in taken) or 'none'})")
  resolved = method.resolve(given)
  for param in method.params:
    if param.name in given and not param.used(resolved):
      print(f"{PROG}: note: --{param.name} does not change a {method.name} run with these parameters", file=sys.stderr)
  return given


def _read_prompts(args: argparse.Namespace) -> list[str]:
  if args.prompt is not None:
    empty = [i for i, text in enumerate(args.prompt, 1) if not text.strip()]
    if empty:
      raise ValueError(f"--prompt number {empty[0]} is empty")
    return args.prompt
  try:
    with open(args.input, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except UnicodeDecodeError as e:
    raise ValueError(f"--input {args.input} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                     "convert it, e.g. `iconv -f latin1 -t utf-8`") from None
  texts = [line for line in lines if line.strip()]
  if not texts:
    raise ValueError(f"--input {args.input} holds no prompt (one per line; blank lines are skipped)")
  return texts


def row_ids(texts: Sequence[str]) -> np.ndarray:
  """Each prompt's randomness id: crc32 of (how many times its text came before, the text)."""
  seen: dict[str, int] = {}
  ids = []
  for text in texts:
    ids.append(zlib.crc32(f"{seen.get(text, 0)}\0{text}".encode("utf-8")))
    seen[text] = seen.get(text, 0) + 1
  return np.array(ids, np.uint32)


def _model_directory(path: str, role: str) -> str:
  """A model directory given as a path (local or gs://…) or a shipped model's name."""
  found = shipped.find(path, os.path.join("data", "models"))
  if "://" not in found and not os.path.exists(found):
    raise FileNotFoundError(f"--{role} {path}: no such model directory (nor a shipped model of that name)")
  return found


def _drafter(args: argparse.Namespace, method: decoding.Method):
  if method.drafter == "none":
    for option in ("drafter", "head"):
      if getattr(args, option):
        raise ValueError(f"--{option} is not used by --method {method.name} (the verifier decodes alone)")
    return None
  if not args.drafter:
    raise ValueError(f"--method {method.name} needs --drafter DIR")
  if args.head and not method.export_parts:
    users = [m.name for m in decoding.METHODS.values() if m.export_parts]
    raise ValueError(f"--head is used by --method {' or '.join(users)} only, not {method.name}")
  directory = _model_directory(args.drafter, "drafter")
  parts = exports.load_parts(_model_directory(args.head, "head") if args.head else directory, method.export_parts,
                             user=f"--method {method.name}", option="--head DIR")
  return exports.drafter_for(method, load_any(directory), parts)


def _decode(drafter, verifier, batches, *, method: str, params: dict[str, Any], settings: dict[str, Any]
            ) -> tuple[list[decoding.Output], list[float], float]:
  """Every batch decoded: outputs (real rows only), decode seconds per batch (compilation excluded), compile
  seconds."""
  outputs, seconds, compile_seconds = [], [], 0.0
  for prompts, lengths, ids, _ in batches:
    compiled_before, start = _compile_seconds[0], time.perf_counter()
    out = decoding.generate(jax.random.PRNGKey(settings["seed"]), drafter, verifier, prompts, lengths,
                            row_ids=ids, method=method, temperature=settings["temperature"],
                            top_p=settings["top_p"], top_k=settings["top_k"],
                            max_new_tokens=settings["max_new_tokens"], eos_id=settings["eos_id"], **params)
    jax.block_until_ready(out)
    compiling = _compile_seconds[0] - compiled_before
    outputs.append(jax.tree.map(lambda x: np.asarray(x)[:batches[len(outputs)][3]], out))
    seconds.append(time.perf_counter() - start - compiling)
    compile_seconds += compiling
  return outputs, seconds, compile_seconds


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Decodes the prompts; returns one record per prompt (what --output writes)."""
  args = _parser().parse_args(argv)
  method = decoding.methods.get(args.method)
  params = _method_params(args, method)
  texts = _read_prompts(args)
  if args.batch_size < 1:
    raise ValueError(f"--batch_size must be >= 1; got {args.batch_size}")
  if args.no_cache and args.cache_dir:
    raise ValueError("--cache_dir and --no_cache contradict each other")
  if args.truncate and (args.task is None or tasks.get_task(args.task).input_field is None):
    raise ValueError("--truncate cuts prompts to a task's input budget: it needs --task with inputs "
                     f"({', '.join(name for name, task in tasks.TASKS.items() if task.input_field)})")
  output = open(args.output, "w", encoding="utf-8") if args.output else None   # a bad path fails before decoding
  cache_dir = args.cache_dir or default_cache_dir()
  if args.no_cache:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Every program, small ones too: a second identical call then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  _count_compilations()
  cache_before = dict(_cache_counts)
  vocab = load_vocabulary(args.vocab)
  verifier = load_any(_model_directory(args.verifier, "verifier"))
  drafter = _drafter(args, method)
  if vocab.vocab_size > verifier.vocab_size:
    raise ValueError(f"--vocab has {vocab.vocab_size} pieces, more than the verifier's {verifier.vocab_size} "
                     "embeddings: it is not the models' vocabulary")
  encoder_decoder = is_encoder_decoder(verifier)
  settings = dict(seed=args.seed, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else
                  tasks.get_task(args.task).max_target_tokens if args.task else 64,
                  eos_id=None if args.no_eos else vocab.eos_id)
  # One width and one batch size (the last batch padded with its final row) for all: one compiled program.
  prompts, lengths = tasks.prompt_batch(texts, task=args.task, vocab=vocab, encoder_decoder=encoder_decoder,
                                        truncate=args.truncate)
  ids = row_ids(texts)
  batch_size = min(args.batch_size, len(texts))
  batches = []
  for start in range(0, len(texts), batch_size):
    rows = np.minimum(np.arange(start, start + batch_size), len(texts) - 1)
    batches.append((prompts[rows], lengths[rows], ids[rows], min(batch_size, len(texts) - start)))
  outputs, seconds, compile_seconds = _decode(drafter, verifier, batches, method=args.method, params=params,
                                              settings=settings)
  records = []
  for out, batch_seconds in zip(outputs, seconds):
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    stats = {name: np.asarray(getattr(out.stats, name)) for name in decoding.common.STAT_NAMES}
    for i in range(len(n)):
      text = texts[len(records)]
      counters = {name: int(stats[name][i]) for name in decoding.common.STAT_NAMES}
      record = {"prompt": text, "text": vocab.decode(tokens[i, :n[i]].tolist()), "tokens": tokens[i, :n[i]].tolist(),
                "counters": counters, "ms_per_token": 1000 * batch_seconds / max(int(n[i]), 1)}
      records.append(record)
      shown = " ".join(f"{name}={count}" for name, count in counters.items())
      if counters["drafted"]:
        shown += f" acceptance={counters['accepted'] / counters['drafted']:.2f}"
      print(f"> {text}\n{record['text']}\n  [{shown}]", flush=True)
  if output is not None:
    with output:
      for record in records:
        output.write(json.dumps(record, ensure_ascii=False) + "\n")
  n_tokens = sum(int(np.sum(out.lengths)) for out in outputs)
  decode_seconds = sum(seconds)
  cached = {name: _cache_counts[name] - cache_before[name] for name in _cache_counts}
  cache = "" if args.no_cache else f" ({cached['hits']} of {cached['requests']} programs from the cache {cache_dir})"
  print(f"{args.method}: {len(texts)} prompt{'s' * (len(texts) > 1)}, {n_tokens} new tokens; compile {compile_seconds:.1f} s{cache}, "
        f"decode {decode_seconds:.2f} s: "
        f"{n_tokens / decode_seconds:.1f} tokens/s, {1000 * decode_seconds / max(n_tokens, 1):.1f} ms/token",
        flush=True)
  if args.compare:
    alone, alone_seconds, alone_compile = _decode(None, verifier, batches, method="autoregressive", params={},
                                                  settings=settings)
    alone_tokens, alone_decode = sum(int(np.sum(out.lengths)) for out in alone), sum(alone_seconds)
    print(f"verifier alone: {alone_tokens} new tokens; compile {alone_compile:.1f} s, decode {alone_decode:.2f} s: "
          f"{alone_tokens / alone_decode:.1f} tokens/s; speed-up of {args.method} (ms/token, decode only): "
          f"{(alone_decode / max(alone_tokens, 1)) / (decode_seconds / max(n_tokens, 1)):.2f}x", flush=True)
  return records


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
