r"""Decode texts with a drafter/verifier pair and time it.

  specdec-generate --drafter debian_drafter --verifier debian_verifier --task debian_synopsis \
      --method speculative --gamma 3 --temperature 0 --compare \
      --prompt "A command-line tool that converts images between many formats."
  specdec-generate --verifier smollm2 --method autoregressive --chat --temperature 0 \
      --prompt "Give me three tips for writing clear commit messages."

`--input FILE` reads one prompt per line (blank lines skipped; `-` reads stdin). With `--task` each prompt
is formatted as that task's input ("summarize: … synopsis:"); without it the text is continued as it is.
Prints each decoded text with its counters, then a summary: compile and decode seconds and tokens/s
(`--compare`: the verifier alone on the same prompts, and the speed-up); an input of more than one batch
shows a progress bar with tokens/s on stderr. Models are directories (exports, Hugging Face save_pretrained
directories), GGUF files, names of the shipped models (debian_drafter, debian_verifier, debian_drafter_distilled)
or of the pretrained checkpoints (smollm2: fetch it once with `python -m specdec.data.pretrained smollm2`). The
vocabulary is the verifier's own where its file carries one (GGUF), else the shipped one (--vocab overrides);
`--chat` formats each prompt as a user's turn of that vocabulary's chat template (instruct models).

`--output FILE.jsonl` writes one JSON object per prompt: its text, tokens, counters, new tokens and decode
seconds, and the run (method, parameters, sampling, seed, models). They are streamed to FILE.jsonl.partial
batch by batch, renamed to FILE.jsonl once every prompt is done: a run that fails leaves FILE.jsonl as it
was, and Ctrl-C keeps every finished prompt; the same command then resumes where it stopped.

Compiled programs are kept in a persistent cache (`--cache_dir`). Prompts are padded to the task's input
budget (without a task: a power of two) and batches to --batch_size (a single prompt: one row), so another
prompt set, temperature, top-p, α or seed reuses the compiled programs; another method, γ, top-k,
max_new_tokens or --no_eos compiles its own once. At T > 0 a prompt's sample depends on --seed and its text
(and how often the same text came before it), not on its place in the input or the batch size.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specdec import cli
from specdec.cli import registry
from specdec.cli.generate_output import (  # noqa: F401 (StreamedOutput, _print_record: this module's API)
    StreamedOutput, Tally, batch_records, finish_output, kept_message, print_record as _print_record, print_summary)
from specdec.data import formats, pretrained, shipped

PROG = "specdec-generate"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                "/jax/compilation_cache/cache_hits": "hits"}
# Prompts are padded to at least this width (and, without a task, to a power of two above it).
MIN_PROMPT_WIDTH = 32
_compile_seconds = [0.0]
_cache_counts = {"requests": 0, "hits": 0}


@functools.cache
def _count_compilations() -> None:
  """From now on, JAX's compilation durations (tracing, lowering, XLA) add up in `_compile_seconds`, and
  the programs it looked up in (and found in) the persistent cache in `_cache_counts`."""
  import jax

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


def _note(message: str) -> None:
  print(f"{PROG}: note: {message}", file=sys.stderr)


# --- options --------------------------------------------------------------------------------------------

def _method_help(name: str) -> str:
  """A parameter's meaning, range and default in each method that takes it (`Param.help`)."""
  takers: dict[tuple[str, str], list[str]] = {}
  for method_name, method in registry.load()["methods"].items():
    for param in method["params"]:
      if param["name"] == name:
        takers.setdefault((param["help"], repr(param["default"])), []).append(method_name)
  return "; ".join(f"{meaning} [default {default}: {', '.join(names)}]"
                   for (meaning, default), names in takers.items()).replace("%", "%%")


def _param_names() -> list[str]:
  """Every method parameter's name, in the registry's order."""
  return list(dict.fromkeys(p["name"] for m in registry.load()["methods"].values() for p in m["params"]))


def _ranged(convert: Callable[[str], Any], lo: float, hi: float, *, lo_open: bool = False, what: str = ""
            ) -> Callable[[str], Any]:
  """An argparse type: `convert(text)` within [lo, hi] ((lo, hi] with `lo_open`), else argparse's one-line
  error, which names the option."""
  def parse(text: str) -> Any:
    value = convert(text)
    if not (lo < value if lo_open else lo <= value) or not value <= hi:
      raise argparse.ArgumentTypeError(f"must be {what}; got {text}")
    return value
  parse.__name__ = convert.__name__   # argparse names the type in "invalid int value"
  return parse


def _parser() -> cli.ArgumentParser:
  table = registry.load()
  parser = cli.parser(PROG, __doc__)
  models = parser.add_argument_group("models")
  models.add_argument("--verifier", required=True, metavar="MODEL", help="the verifier: an exported model directory, "
                      "a Hugging Face save_pretrained directory (T5, Gemma 2, Llama), a GGUF file, or a shipped or "
                      "pretrained model's name (debian_verifier, smollm2)")
  models.add_argument("--drafter", metavar="DIR", help="the drafter (every method but autoregressive; default for "
                      "--verifier smollm2: the shipped head trained for it, smollm2_eagle)")
  models.add_argument("--head", metavar="DIR", help="a directory holding the parts of the drafter's export that "
                      + ", ".join(f"{name} reads ({', '.join(m['export_parts'])}/)"
                                  for name, m in table["methods"].items() if m["export_parts"])
                      + " (default: the drafter's own directory)")
  models.add_argument("--vocab", metavar="PATH", help="a SentencePiece .model file or a GGUF file (default: the "
                      "verifier's own tokenizer where its GGUF file has one, else the shipped vocabulary)")
  text = parser.add_argument_group("prompts").add_mutually_exclusive_group(required=True)
  text.add_argument("--prompt", action="append", help="a prompt text (repeatable)")
  text.add_argument("--input", metavar="FILE", help="a UTF-8 file with one prompt per line; - reads stdin")
  run = parser.add_argument_group("decoding")
  run.add_argument("--task", choices=list(table["tasks"]), help="format prompts as this task's inputs")
  run.add_argument("--chat", action="store_true", help="format each prompt as a user's turn of the vocabulary's "
                   "chat template (an instruct model's, e.g. smollm2's ChatML)")
  run.add_argument("--truncate", action="store_true",
                   help="cut prompts longer than the task's input budget as training does (default: an error)")
  run.add_argument("--method", default="speculative", choices=list(table["methods"]),
                   help="the decoding method (default: %(default)s)")
  run.add_argument("--temperature", type=_ranged(float, 0, float("inf"), what="a float >= 0"), default=1.0,
                   help="T >= 0; 0 is greedy (default: %(default)s, as decoding.generate)")
  run.add_argument("--top_p", type=_ranged(float, 0, 1, lo_open=True, what="a float in (0, 1]"), default=1.0,
                   help="nucleus mass in (0, 1] (default: %(default)s)")
  run.add_argument("--top_k", type=_ranged(int, 0, float("inf"), what="an int >= 0"), default=0,
                   help="keep the k likeliest tokens, 0: all (default: %(default)s)")
  run.add_argument("--max_new_tokens", type=_ranged(int, 1, float("inf"), what="an int >= 1"),
                   help="default: the task's target budget, else 64")
  run.add_argument("--no_eos", action="store_true", help="do not stop at the vocabulary's end-of-sequence")
  run.add_argument("--seed", type=int, default=0, help="the sampling key (default: %(default)s)")
  run.add_argument("--batch_size", type=_ranged(int, 1, float("inf"), what="an int >= 1"), default=8,
                   help="prompts decoded together (default: %(default)s)")
  out = parser.add_argument_group("output and timing")
  out.add_argument("--output", metavar="FILE.jsonl", help="write one JSON object per prompt (streamed to "
                   "FILE.jsonl.partial, renamed at the end; the same command resumes an interrupted run)")
  out.add_argument("--compare", action="store_true", help="also decode with the verifier alone; print the speed-up")
  out.add_argument("--cache_dir", help=f"the persistent compilation cache (default: {default_cache_dir()}; the "
                   "first call of a process sets it for the process)")
  out.add_argument("--no_cache", action="store_true", help="do not read or write the compilation cache")
  params = parser.add_argument_group("method parameters", "each method takes the ones its entry in "
                                     "specdec.decoding.generate lists; the others are an error")
  types = {"int": int, "float": float, "str": str}
  for name in _param_names():
    value_type = next(types[p["type"]] for m in table["methods"].values() for p in m["params"] if p["name"] == name)
    params.add_argument(f"--{name}", type=value_type, default=None, help=_method_help(name))
  return parser


def _given_params(args: argparse.Namespace) -> dict[str, Any]:
  """The method parameters given; one the method does not take is an error."""
  given = {name: getattr(args, name) for name in _param_names() if getattr(args, name) is not None}
  taken = [p["name"] for p in registry.load()["methods"][args.method]["params"]]
  foreign = [name for name in given if name not in taken]
  if foreign:
    raise ValueError(f"--{foreign[0]} is not a parameter of --method {args.method} (it takes "
                     f"{', '.join('--' + n for n in taken) or 'none'})")
  return given


def _resolve_params(method, given: dict[str, Any]) -> dict[str, Any]:
  """All of the method's parameters (`Method.resolve`: defaults, range checks), a note for each one given
  that does not change this run (`Param.used`). A range error shows the value as given (`got 9`, where
  `checks.check_range` reads values as floats: `got [9.0]`)."""
  try:
    resolved = method.resolve(given)
  except ValueError as e:
    name = next((name for name in given if str(e).startswith(name)), None)
    if name is None:
      raise
    raise ValueError(re.sub(r"got \[[^\]]*\]$", f"got {given[name]}", str(e))) from None
  for param in method.params:
    if param.name in given and not param.used(resolved):
      _note(f"--{param.name} does not change a {method.name} run with these parameters")
  return resolved


def _read_prompts(args: argparse.Namespace) -> list[str]:
  if args.prompt is not None:
    empty = [i for i, text in enumerate(args.prompt, 1) if not text.strip()]
    if empty:
      raise ValueError(f"--prompt number {empty[0]} is empty")
    return args.prompt
  source = "stdin" if args.input == "-" else args.input
  if os.path.isdir(args.input):
    raise ValueError(f"--input {args.input} is a directory; give a file with one prompt per line")
  try:
    lines = (sys.stdin.buffer.read() if args.input == "-" else pathlib.Path(args.input).read_bytes()
             ).decode("utf-8").splitlines()
  except FileNotFoundError:
    raise FileNotFoundError(f"--input {args.input}: no such file") from None
  except PermissionError:
    raise PermissionError(f"--input {args.input} is not readable") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"--input {source} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                     "convert it, e.g. `iconv -f latin1 -t utf-8`") from None
  texts = [line for line in lines if line.strip()]
  if not texts:
    raise ValueError(f"--input {source} holds no prompt (one per line; blank lines are skipped)")
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
  """A model given as a path (a directory, local or gs://…, or a GGUF file), a pretrained checkpoint's name (its
  cached file; FileNotFoundError naming the command that fetches it) or a shipped model's name."""
  try:
    found = pretrained.resolve(path)
  except FileNotFoundError as e:   # a pretrained checkpoint not fetched yet
    raise FileNotFoundError(f"--{role} {path}: {e}") from None
  if "://" not in found and not os.path.isdir(found) and not formats.is_gguf(found):
    raise FileNotFoundError(f"--{role} {path}: no such model directory or GGUF file (nor a shipped or pretrained "
                            f"model of that name: {', '.join(pretrained.CHECKPOINTS)})")
  return found



def _drafter_directories(args: argparse.Namespace) -> tuple[str | None, str | None]:
  """(the drafter's directory, the directory of the export parts its method reads); None where unused."""
  table = registry.load()
  method = table["methods"][args.method]
  if method["drafter"] == "none":
    ignored = [f"--{option}" for option in ("drafter", "head") if getattr(args, option)]
    if ignored:
      _note(f"{' and '.join(ignored)} ignored: --method {args.method} decodes with the verifier alone")
    return None, None
  if not args.drafter:
    args.drafter = pretrained.default_drafter(args.verifier)
    if not args.drafter:
      raise ValueError(f"--method {args.method} needs --drafter DIR")
    _note(f"--drafter {args.drafter}: the shipped drafter for {args.verifier}")
  if args.head and not method["export_parts"]:
    users = [name for name, m in table["methods"].items() if m["export_parts"]]
    raise ValueError(f"--head is used by --method {' or '.join(users)} only, not {args.method}")
  drafter = _model_directory(args.drafter, "drafter")
  parts = _model_directory(args.head, "head") if args.head else drafter
  for part in method["export_parts"]:
    if "://" not in parts and not os.path.isdir(os.path.join(parts, part)):
      models = shipped.path("data", "models")
      having = sorted(d.parent.name for d in models.glob(f"*/{part}") if d.is_dir()) if models.is_dir() else []
      hint = (f"the shipped {having[0]} has one (--drafter {having[0]}, or --head {having[0]})" if having
              else "give --head DIR holding one")
      raise FileNotFoundError(f"--method {args.method} needs the drafter's {table['parts'][part]}: {parts} holds "
                              f"no {part}/; {hint}")
  return drafter, parts


def _check_options(args: argparse.Namespace) -> None:
  if args.no_cache and args.cache_dir:
    raise ValueError("--cache_dir and --no_cache contradict each other")
  if args.chat and args.task:
    raise ValueError("--chat and --task format prompts each their own way: give one")
  if args.truncate and not (args.task and registry.load()["tasks"][args.task]["inputs"]):
    raise ValueError("--truncate cuts prompts to a task's input budget: it needs --task with inputs "
                     f"({', '.join(name for name, task in registry.load()['tasks'].items() if task['inputs'])})")


def unknown_characters(texts: Sequence[str], vocab) -> list[list[str]]:
  """Per text, its characters that the vocabulary has no piece for: encoded as <unk> or as byte pieces
  (SentencePiece's byte fallback), which a model trained on the vocabulary's languages has rarely seen."""
  unknown_ids = {vocab.unk_id} | {vocab.piece_id(f"<0x{byte:02X}>") for byte in range(256)}

  @functools.cache
  def unknown(character: str) -> bool:
    return bool(unknown_ids & set(vocab.encode(character)))
  return [[c for c in text if unknown(c)] for text in texts]


# --- decoding -------------------------------------------------------------------------------------------

def prompt_width(longest: int, task_budget: int | None, fits: Callable[[int], bool]) -> int:
  """The width prompts are padded to: the task's input budget (any prompt set of the task then runs the
  same compiled programs), else the longest prompt rounded up to a power of two >= MIN_PROMPT_WIDTH (a few
  programs in all); the longest rounded up to a multiple of MIN_PROMPT_WIDTH where those would leave too
  little room in the models' caches for max_new_tokens."""
  power = max(MIN_PROMPT_WIDTH, 1 << (longest - 1).bit_length())
  for width in ([task_budget] if task_budget else []) + [power]:
    if width >= longest and fits(width):
      return width
  from specdec.data import tasks
  return tasks.bucket_width(longest, MIN_PROMPT_WIDTH)


def batch_rows(n_prompts: int, batch_size: int) -> list[np.ndarray]:
  """Row indices of each batch: `batch_size` rows (one for a single prompt), the last batch padded with its
  final row, so that any number of prompts runs the same compiled programs (padding rows are discarded)."""
  size = 1 if n_prompts == 1 else batch_size
  return [np.minimum(np.arange(start, start + size), n_prompts - 1) for start in range(0, n_prompts, size)]


def _warn_of_unknown_characters(texts: Sequence[str], vocab) -> list[int]:
  """One warning line for the characters of `texts` the vocabulary cannot spell; their count per text."""
  unknown = unknown_characters(texts, vocab)
  if any(unknown):
    examples = " ".join(dict.fromkeys(c for row in unknown for c in row))
    n_prompts = sum(map(bool, unknown))
    print(f"{PROG}: warning: {sum(map(len, unknown))} characters of {n_prompts} prompt{'s' * (n_prompts > 1)} are "
          f"not in the vocabulary and became unknown (byte) tokens, which the models rarely saw: {examples[:40]}",
          file=sys.stderr)
  return [len(row) for row in unknown]


def _decode(drafter, verifier, prompts: np.ndarray, lengths: np.ndarray, ids: np.ndarray, *, method: str,
            params: dict[str, Any], settings: dict[str, Any]):
  """One batch decoded (`decoding.generate`): its output as NumPy arrays, decode seconds (compilation
  excluded) and compile seconds."""
  import jax
  from specdec import decoding
  compiled_before, start = _compile_seconds[0], time.perf_counter()
  out = decoding.generate(jax.random.PRNGKey(settings["seed"]), drafter, verifier, prompts, lengths, row_ids=ids,
                          method=method, temperature=settings["temperature"], top_p=settings["top_p"],
                          top_k=settings["top_k"], max_new_tokens=settings["max_new_tokens"],
                          eos_id=settings["eos_id"], **params)
  out = jax.tree.map(np.asarray, out)
  compiling = _compile_seconds[0] - compiled_before
  return out, time.perf_counter() - start - compiling, compiling


def _configure_cache(args: argparse.Namespace) -> str:
  """Sets JAX's persistent compilation cache (or turns it off with --no_cache); its directory."""
  import jax
  cache_dir = args.cache_dir or default_cache_dir()
  if args.no_cache:
    jax.config.update("jax_enable_compilation_cache", False)
  else:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    # Every program, small ones too: a second identical call then compiles nothing.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  _count_compilations()
  return cache_dir


def _load_models(args: argparse.Namespace, method, verifier_directory: str, drafter_directory: str | None,
                 parts_directory: str | None):
  """(vocab, verifier, drafter or None), checked against each other and the options."""
  from specdec.data import load_vocabulary
  from specdec.training import exports, load_model
  vocab = load_vocabulary(args.vocab or (verifier_directory if formats.is_gguf(verifier_directory) else None))
  if args.chat and vocab.chat_template is None:
    raise ValueError(f"--chat: the vocabulary {vocab.path} has no chat template; an instruct model's GGUF file "
                     "carries one (--verifier smollm2)")
  verifier = load_model(verifier_directory)
  drafter = None
  if drafter_directory is not None:
    parts = exports.load_parts(parts_directory, method.export_parts, user=f"--method {method.name}",
                               option="--head DIR")
    if exports.is_feature_head(drafter_directory):
      exports.check_feature_drafter_method(method, f"--drafter {args.drafter}")
    drafter = exports.drafter_for(method, exports.load_drafter(drafter_directory, verifier), parts)
  if vocab.vocab_size > verifier.vocab_size:
    raise ValueError(f"--vocab has {vocab.vocab_size} pieces, more than the verifier's {verifier.vocab_size} "
                     "embeddings: it is not the models' vocabulary")
  return vocab, verifier, drafter


def _settings_and_run(args: argparse.Namespace, method, params: dict[str, Any], vocab, drafter
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the sampling settings `_decode` takes, the run each record carries)."""
  from specdec.data import tasks
  settings = dict(seed=args.seed, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None else
                  tasks.get_task(args.task).max_target_tokens if args.task else 64,
                  eos_id=None if args.no_eos else vocab.eos_id)
  run = {"method": method.name, "params": params,
         "sampling": {name: settings[name] for name in ("temperature", "top_p", "top_k")},
         **{name: settings[name] for name in ("seed", "max_new_tokens", "eos_id")},
         "task": args.task, "truncate": args.truncate, "drafter": args.drafter if drafter is not None else None,
         "head": args.head if drafter is not None else None, "verifier": args.verifier, "vocab": args.vocab,
         "chat": args.chat}
  return settings, run


def _prompt_arrays(args: argparse.Namespace, texts: Sequence[str], vocab, verifier, drafter, method,
                   params: dict[str, Any], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(prompts padded to `prompt_width`, their lengths, each text's count of unknown characters)."""
  from specdec import decoding
  from specdec.data import tasks
  model_texts = [vocab.format_chat([{"role": "user", "content": text}]) for text in texts] if args.chat else texts
  prompts, lengths = tasks.prompt_batch(model_texts, task=args.task, vocab=vocab, truncate=args.truncate,
                                        encoder_decoder=verifier.encoder_decoder)
  unknown = _warn_of_unknown_characters(texts, vocab)
  budget = registry.load()["tasks"][args.task]["max_input_tokens"] if args.task else None
  cache_room = min(model.max_length for model in (verifier, drafter) if model is not None)
  width = prompt_width(int(lengths.max()), budget, lambda width: decoding.required_cache_length(
      method, params, verifier, drafter, width, max_new_tokens) <= cache_room)
  columns = min(width, prompts.shape[1])   # beyond the longest prompt: padding
  prompts = np.pad(prompts[:, :columns], ((0, 0), (0, width - columns)))
  return prompts, lengths, unknown


def _decode_batches(args: argparse.Namespace, texts: Sequence[str], batches: list[np.ndarray], arrays, models,
                    method, params: dict[str, Any], settings: dict[str, Any], run: dict[str, Any],
                    output: StreamedOutput | None, records: list[dict[str, Any]]) -> tuple[Tally, Tally]:
  """Decodes the batches, appending each prompt's record to `records` (and --output) and printing it;
  (the method's tally, the verifier alone's with --compare)."""
  import tqdm
  prompts, lengths, ids, unknown = arrays
  drafter, verifier, vocab = models
  bar = tqdm.tqdm(total=sum(min(len(rows), len(texts) - rows[0]) for rows in batches), desc=method.name,
                  unit="prompt", file=sys.stderr, disable=len(batches) <= 1)
  tally, alone = Tally(), Tally()
  for rows in batches:
    try:
      out, seconds, compiling = _decode(drafter, verifier, prompts[rows], lengths[rows], ids[rows],
                                        method=method.name, params=params, settings=settings)
    except FloatingPointError as e:   # NaN logits: the finished prompts are kept all the same
      raise FloatingPointError(f"{e} ({kept_message(output, len(records), len(texts))})"
                               if output is not None and output.kept() else str(e)) from None
    if args.compare:   # the batch again by the verifier alone, right after (`bench.interleaved`'s protocol)
      alone_out, alone_seconds, alone_compiling = _decode(None, verifier, prompts[rows], lengths[rows], ids[rows],
                                                          method="autoregressive", params={}, settings=settings)
      alone.add(int(np.sum(alone_out.lengths[:len(texts) - rows[0]])), alone_seconds, alone_compiling)
    finished = batch_records(out, rows, texts, vocab, seconds, unknown, run)
    if output is not None:
      output.append(finished)
    records += finished
    bar.clear()
    for record in finished:
      _print_record(record)
    tally.add(sum(record["new_tokens"] for record in finished), seconds, compiling)
    bar.update(len(finished))
    bar.set_postfix_str(f"{tally.tokens / max(tally.decode_seconds, 1e-9):.1f} tokens/s")
  bar.close()
  return tally, alone


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """Decodes the prompts; returns one record per prompt (what --output writes)."""
  # Everything the arguments alone decide is checked before JAX is imported (a fraction of a second).
  args = _parser().parse_args(argv)
  given = _given_params(args)
  registry.check_params(args.method, given)
  texts = _read_prompts(args)
  _check_options(args)
  verifier_directory = _model_directory(args.verifier, "verifier")
  drafter_directory, parts_directory = _drafter_directories(args)
  output = StreamedOutput(args.output) if args.output else None

  from specdec import decoding
  method = decoding.methods.get(args.method)
  params = _resolve_params(method, given)
  cache_dir = _configure_cache(args)
  cache_before = dict(_cache_counts)
  vocab, verifier, drafter = _load_models(args, method, verifier_directory, drafter_directory, parts_directory)
  settings, run = _settings_and_run(args, method, params, vocab, drafter)
  prompts, lengths, unknown = _prompt_arrays(args, texts, vocab, verifier, drafter, method, params,
                                             settings["max_new_tokens"])
  records = output.resume(texts, run) if output else []
  resumed = len(records)
  if resumed:
    print(f"{PROG}: resuming: {resumed} of {len(texts)} prompts are already in {output.partial}", file=sys.stderr)
  batches = [resumed + rows for rows in batch_rows(len(texts) - resumed, args.batch_size)]
  cli.on_interrupt(lambda: kept_message(output, len(records), len(texts)))
  tally, alone = _decode_batches(args, texts, batches, (prompts, lengths, row_ids(texts), unknown),
                                 (drafter, verifier, vocab), method, params, settings, run, output, records)
  if output is not None:
    finish_output(output, len(texts))
  cached = {name: _cache_counts[name] - cache_before[name] for name in _cache_counts}
  cache = "" if args.no_cache else f" ({cached['hits']} of {cached['requests']} programs from the cache {cache_dir})"
  print_summary(method.name, len(texts), resumed, tally, cache, alone if args.compare else None)
  return records


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
