"""The benchmark harness: what every measurement of specdec shares, once.

- **The record** of a run: the machine (`machine`, `device`), the code (`git_commit`), the command and the rows
  measured (`new_record`, `write_record`: FILE.json and FILE.md, the markdown headed by the same three facts).
- **Timing** of jitted calls (`median_seconds`) and the cost of a model's `score` of n tokens after a prefix
  (`score_seconds`, with the one jitted logits-only `score_logits` and `cache_after`), the c and c_γ of the
  wall-time formulas (Leviathan et al., §3.4).
- **The interleaved protocol** (`interleaved`): several runs timed item by item, one after another, so that a
  ratio of two of them comes from timings taken seconds apart (on a shared machine, timings taken minutes
  apart disagree by more than the effects measured). The sweep's latency (App. F.1 of the cascades paper)
  uses it too.
- **Before/after** of two revisions (`revision_tree`, `run_in_tree`, `compare`): each side measured by a fresh
  process with one revision's `specdec` on its path and this checkout's benchmark code (`HARNESS_FILES`
  copied over it), sides alternating round by round.

This module imports JAX and NumPy only: a revision measured by `revision_tree` runs it over its own library.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# This checkout's benchmark code, copied over a revision's tree by `revision_tree` (folders whole).
HARNESS_FILES = ("specdec/evaluation/bench.py", "specdec/evaluation/hlo.py", "specdec/evaluation/hlo_parse.py",
                 "specdec/cli/bench")
_START = time.monotonic()


# --- the record -------------------------------------------------------------------------------------------

def git_commit(root: str | os.PathLike = REPO_ROOT) -> str | None:
  """HEAD of the repository at `root`, with '-dirty' when tracked files differ from it; None outside git."""
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("-dirty" if dirty else "")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


# Variables that change what a measurement measures (`models.cpu_kernel`'s switch, XLA's flags, matmul precision).
ENVIRONMENT = ("SPECDEC_CPU_KERNEL", "XLA_FLAGS", "JAX_DEFAULT_MATMUL_PRECISION")


def machine() -> dict[str, Any]:
  """The machine a measurement runs on: JAX's backend and devices, the CPU, the platform and versions, and the
  `ENVIRONMENT` variables set."""
  first = jax.devices()[0]
  return {"backend": jax.default_backend(), "device": first.device_kind, "devices": jax.device_count(),
          "cpu": _cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
          "python": platform.python_version(), "jax": jax.__version__,
          "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ}}


def device() -> str:
  """`machine` in one line: the first JAX device and their count, the CPU and the JAX version."""
  m = machine()
  return f"{m['backend']}:{m['device']} x{m['devices']} | {platform.machine()} {m['cpus']} cpus | jax {m['jax']}"


def command_line(argv: Sequence[str] | None = None, prog: str = "specdec-bench") -> str:
  """The command that reproduces a run: `prog` and its arguments (default: this process's)."""
  return " ".join([prog, *(sys.argv[1:] if argv is None else argv)])


def new_record(benchmark: str, command: str, keys: Sequence[str], **settings: Any) -> dict[str, Any]:
  """An empty record: what ran, where, which code, the command, the fields that identify a row (`keys`:
  `compare` matches rows by them) and the run's settings; rows are appended to record['rows']."""
  return {"benchmark": benchmark, "machine": machine(), "commit": git_commit(), "command": command,
          "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "keys": list(keys), "settings": settings, "rows": []}


def header(record: dict[str, Any]) -> list[str]:
  """The markdown lines that open every benchmark's report: machine, code and command."""
  m = record["machine"]
  environment = " ".join(f"{name}={value}" for name, value in m.get("environment", {}).items())
  return [f"machine: {m['backend']} ({m['device']} x{m['devices']}), {m['cpu']}, {m['cpus']} cpus, "
          f"{m['platform']}, python {m['python']}, jax {m['jax']}"] + ([f"environment: {environment}"] if environment
                                                                     else []) + [
          f"commit: {record['commit']}", f"command: `{record['command']}`"]


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, digits: int = 3) -> str:
  """Rows as a markdown table (floats to `digits` significant digits; missing cells empty)."""
  columns = list(columns or dict.fromkeys(k for row in rows for k in row))

  def cell(value: Any) -> str:
    if isinstance(value, float):
      return f"{value:.{digits}g}"
    return "" if value is None else str(value)
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
  return "\n".join(lines)


def write_record(record: dict[str, Any], stem: str | os.PathLike, markdown: str) -> None:
  """Writes STEM.json (the record) and STEM.md (`header` then `markdown`), each whole or not at all."""
  stem = pathlib.Path(stem)
  stem.parent.mkdir(parents=True, exist_ok=True)
  for suffix, text in ((".json", json.dumps(record, indent=1, default=str) + "\n"),
                       (".md", "\n".join(header(record)) + "\n\n" + markdown.rstrip("\n") + "\n")):
    partial = stem.with_name(stem.name + suffix + ".partial")
    partial.write_text(text)
    partial.replace(stem.with_name(stem.name + suffix))


def log(message: str) -> None:
  """A progress line with the seconds since the process started (compiles take seconds each on a GPU)."""
  print(f"[{time.monotonic() - _START:7.1f} s] {message}", flush=True)


# --- timing ------------------------------------------------------------------------------------------------

def median_seconds(fn: Callable, *args, repeats: int) -> float:
  """Median wall-clock seconds of fn(*args) over `repeats` calls, after one warm-up call (compilation)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


# --- adapters: the models of revisions `--before` measures (`revision_tree`) predate today's protocol ------

def _logits_and_cache(scored: Any) -> tuple[jax.Array, Any]:
  """(logits, cache) of what `score` returned: a `Scored` record, or the tuple (logits, cache[, hidden]) of
  revisions before b1cd0ce."""
  return (scored[0], scored[1]) if isinstance(scored, tuple) else (scored.logits, scored.cache)


def _encoder_decoder(model: Any) -> bool:
  """Whether `model` reads its prompt as an encoder input: its declared `encoder_decoder`, or in revisions
  before 00b0d98 (which did not declare it) whether it has its own `prefill` (T5 alone had one)."""
  return model.encoder_decoder if hasattr(model, "encoder_decoder") else hasattr(model, "prefill")


# Only the logits: the cache is not donated here, so returning it would time a copy of the whole cache, which
# the decode loops (an in-place write of n entries) never make.
score_logits = jax.jit(lambda model, cache, tokens: _logits_and_cache(model.score(cache, tokens))[0])
_score_cache = jax.jit(lambda model, cache, tokens: _logits_and_cache(model.score(cache, tokens))[1])


@functools.cache
def _prefill():
  from specdec.models import base   # the library of the tree measured (`revision_tree`)
  return jax.jit(base.prefill)


def cache_after(model: Any, batch: int, prefix: int, room: int, *, encoder_input: int = 128, seed: int = 0) -> Any:
  """A cache of `batch` rows holding `prefix` positions of random tokens, with `room` positions free. An
  encoder-decoder model (T5) first encodes an `encoder_input`-token input (`prefill`), then its decoder holds
  the `prefix` positions."""
  rng = np.random.default_rng(seed)
  tokens = lambda n: jnp.asarray(rng.integers(2, model.vocab_size, (batch, n)), jnp.int32)  # noqa: E731
  cache = model.init_cache(batch, prefix + room)
  if _encoder_decoder(model):
    _, cache = _prefill()(model, cache, tokens(encoder_input), jnp.full((batch,), encoder_input, jnp.int32))
  return _score_cache(model, cache, tokens(prefix)) if prefix else cache


def score_seconds(model: Any, widths: Sequence[int], *, batch: int = 1, prefix: int = 64, repeats: int = 20,
                  encoder_input: int = 128) -> dict[int, float]:
  """Median seconds of one `score` of n tokens [batch, n] after `prefix` cached positions, per n in `widths`:
  t(1) is a decode step, t(γ + 1) / t(1) the c_γ of a verification and t_drafter(1) / t_verifier(1) the c of
  the wall-time formulas."""
  cache = cache_after(model, batch, prefix, max(widths), encoder_input=encoder_input)
  return {n: median_seconds(score_logits, model, cache, jnp.ones((batch, n), jnp.int32), repeats=repeats)
          for n in widths}


def draft_seconds(drafter: Any, verifier: Any, *, gamma: int, batch: int = 1, prefix: int = 64, repeats: int = 20,
                  seed: int = 0) -> float:
  """Median seconds of one block of γ = `gamma` greedy drafts (`drafter.propose`, jitted) after `prefix` committed
  positions of random tokens, the drafter's state read from the verifier's prefill as the loops read it. Divided
  by γ and by `score_seconds`' t(1): the c per draft of the wall-time formulas."""
  from specdec import sampling as sampling_lib
  from specdec.decoding.drafters import Verified
  from specdec.models import base
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(2, verifier.vocab_size, (batch, prefix)), jnp.int32)
  lengths = jnp.full((batch,), prefix, jnp.int32)
  state, last = drafter.start(prompts, lengths, prefix + gamma + 2)
  verifier = drafter.decoding_verifier(verifier)
  if drafter.reads_verifier:
    _, _, hidden = jax.jit(functools.partial(base.prefill, return_hidden=True))(
        verifier, verifier.init_cache(batch, prefix + gamma + 2), prompts, lengths)
    state = drafter.verified(state, Verified(tokens=prompts, count=lengths - 1, next_token=last,
                                             lengths=lengths - 1, hidden=hidden))
  sampling = sampling_lib.Sampling(0.0, 1.0).checked()
  propose = jax.jit(lambda state, last: drafter.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma,
                                                        sampling=sampling).tokens)
  return median_seconds(propose, state, last, repeats=repeats)


def interleaved(runs: Sequence[Callable[[Any, int], Any]], items: Sequence[Any], *, trials: int = 1,
                warmup: Sequence[Any] | None = None,
                on_output: Callable[[int, int, Any], None] | None = None) -> np.ndarray:
  """Seconds of each run on each item, summed over `trials` passes: [len(runs), len(items)].

  Each pass takes the items in turn and times every run on the item before the next item, so the runs'
  timings of an item are seconds apart and share the machine's load; `run(item, trial)` returns what it
  computed, awaited before the clock stops (`on_output(run_index, item_index, output)` then sees it, outside
  the timing). First, every run is called once on each item of `warmup` (default: all items; compilation),
  untimed.
  """
  for item in (items if warmup is None else warmup):
    for run in runs:
      jax.block_until_ready(run(item, 0))
  seconds = np.zeros((len(runs), len(items)))
  for trial in range(trials):
    for j, item in enumerate(items):
      for i, run in enumerate(runs):
        start = time.perf_counter()
        out = jax.block_until_ready(run(item, trial))
        seconds[i, j] += time.perf_counter() - start
        if on_output is not None:
          on_output(i, j, out)
  return seconds


# --- before / after ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def revision_tree(revision: str) -> Iterator[pathlib.Path]:
  """A temporary worktree of `revision` with this checkout's `HARNESS_FILES` copied over it (packages
  missing at that revision made), removed on exit: its `specdec` is the revision's library measured by
  today's benchmark code."""
  tree = pathlib.Path(tempfile.mkdtemp(prefix="specdec_before_"))
  subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(tree), revision], check=True,
                 capture_output=True, text=True)
  try:
    for name in HARNESS_FILES:
      source, target = REPO_ROOT / name, tree / name
      for package in target.relative_to(tree).parents:
        if str(package) not in (".", "") and not (tree / package / "__init__.py").exists():
          (tree / package).mkdir(parents=True, exist_ok=True)
          (tree / package / "__init__.py").touch()
      if source.is_dir():
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
      else:
        shutil.copy2(source, target)
    yield tree
  finally:
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                   capture_output=True)
    shutil.rmtree(tree, ignore_errors=True)


def run_in_tree(tree: str | os.PathLike, argv: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
  """The record of `specdec-bench ARGV` run by a fresh process on the `specdec` of `tree`."""
  with tempfile.TemporaryDirectory() as out:
    stem = os.path.join(out, "record")
    code = "import sys; from specdec.cli.bench import main; main(sys.argv[1:])"
    try:
      subprocess.run([sys.executable, "-c", code, *argv, "--out", stem], cwd=tree, check=True,
                     env={**os.environ, **(env or {}), "PYTHONPATH": str(tree)})
    except subprocess.CalledProcessError:
      raise ValueError(f"specdec-bench {' '.join(argv)} failed on the library of {tree} (its error is above): a "
                       "revision older than the library API the subcommand calls cannot be measured by it") from None
    with open(stem + ".json") as f:
      return json.load(f)


def compare(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Rows of before/after: each numeric figure of the rows (matched by the records' `keys`), its median over
  the rounds on each side and before / after. Rows or figures one side lacks are left out."""
  keys = after[0]["keys"]

  def medians(records: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, float]]:
    values: dict[tuple, dict[str, list[float]]] = {}
    for record in records:
      for row in record["rows"]:
        figures = values.setdefault(tuple(row.get(k) for k in keys), {})
        for name, value in row.items():
          if name not in keys and isinstance(value, (int, float)) and not isinstance(value, bool):
            figures.setdefault(name, []).append(float(value))
    return {key: {name: statistics.median(v) for name, v in figures.items()} for key, figures in values.items()}

  old, new = medians(before), medians(after)
  rows = []
  for key, figures in new.items():
    for name, value in figures.items():
      if name in old.get(key, {}):
        previous = old[key][name]
        rows.append({**dict(zip(keys, key)), "figure": name, "before": previous, "after": value,
                     "before / after": previous / value if value else None})
  return rows
