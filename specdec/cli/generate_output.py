"""specdec-generate's output: the --output FILE.jsonl stream, each prompt's printed record and the summary."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from specdec import cli


class StreamedOutput:
  """--output FILE: the records of finished prompts appended to FILE.partial, one batch at a time (whole
  lines), renamed to FILE when every prompt is done; until then FILE is left as it was. Paths are checked
  when it is made, before anything is decoded."""

  def __init__(self, path: str):
    self.path = path
    self.partial = path + ".partial"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
      raise ValueError(f"--output {path} is a directory; give a file name, e.g. {os.path.join(path, 'out.jsonl')}")
    if not os.path.isdir(folder):
      raise FileNotFoundError(f"--output {path}: no such directory {folder}")
    for file in (path, self.partial):
      if os.path.exists(file) and not os.access(file, os.W_OK):
        raise PermissionError(f"--output {path}: {file} is not writable")
    if not os.access(folder, os.W_OK):
      raise PermissionError(f"--output {path}: cannot create files in {folder}")

  def resume(self, texts: Sequence[str], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The records FILE.partial holds from an interrupted run of this command (the same run settings, its
    prompts the first of `texts`); [] when there is none. A line cut short (a killed write) is dropped."""
    if not os.path.exists(self.partial):
      return []
    with open(self.partial, "rb") as f:
      data = f.read()
    lines = data[:data.rfind(b"\n") + 1].decode("utf-8", "replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        record = None
      if (not isinstance(record, dict) or record.get("run") != run or number > len(texts)
          or record.get("prompt") != texts[number - 1]):
        raise ValueError(f"--output {self.path}: {self.partial} holds the start of another run (line {number}: other "
                         "settings or prompts); rerun that command to finish it, or delete the file")
      records.append(record)
    if not data.endswith(b"\n"):
      with open(self.partial, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
    return records

  def kept(self) -> int:
    """How many records FILE.partial holds: its whole lines (read from the file, which Ctrl-C may have
    reached between a write and anything counted after it)."""
    if not os.path.exists(self.partial):
      return 0
    with open(self.partial, "rb") as f:
      return f.read().count(b"\n")

  def append(self, records: Sequence[dict[str, Any]]) -> None:
    """Appends the records as whole lines in one write(2), unbuffered (Ctrl-C ends the process with
    `os._exit`, which flushes nothing), synced to the disk."""
    data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
    descriptor = os.open(self.partial, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      while data:
        data = data[os.write(descriptor, data):]
      os.fsync(descriptor)
    finally:
      os.close(descriptor)

  def finish(self) -> None:
    """Renames FILE.partial (an empty one if no record was written) to FILE."""
    if not os.path.exists(self.partial):
      open(self.partial, "w").close()
    os.replace(self.partial, self.path)


def kept_message(output: StreamedOutput | None, n_records: int, n_texts: int) -> str:
  """What an interrupted run keeps: the prompts printed so far, or those in FILE.partial."""
  if output is None:
    return (f"{n_records} of {n_texts} prompts were decoded (printed above); with --output FILE an "
            "interrupted run keeps them and the same command resumes it")
  done = output.kept()
  if done == 0:
    return f"no prompt was finished; {output.path} is as it was"
  return (f"{done} of {n_texts} prompts kept in {output.partial} ({output.path} is written once all are "
          f"done); rerun the same command to decode the other {n_texts - done}")


def print_record(record: dict[str, Any]) -> None:
  """A prompt, its decoded text and its counters (acceptance where it drafted)."""
  from specdec import targets   # JAX: after the arguments are checked
  counters = record["counters"]
  # `deferred` counts a deferral rule's decisions (cascades); under a lossless rule it would only count p ≠ q.
  defers = record["run"]["params"].get("rule") in targets.deferral_rules()
  shown = " ".join(f"{name}={count}" for name, count in counters.items() if name != "deferred" or defers)
  if counters["drafted"]:
    shown += f" acceptance={counters['accepted'] / counters['drafted']:.2f}"
  print(f"> {record['prompt']}\n{record['text']}\n  [{shown}]", flush=True)


@dataclasses.dataclass
class Tally:
  """New tokens, decode seconds (compilation excluded) and compile seconds, summed over batches."""
  tokens: int = 0
  decode_seconds: float = 0.0
  compile_seconds: float = 0.0

  def add(self, tokens: int, decode_seconds: float, compile_seconds: float) -> None:
    self.tokens += tokens
    self.decode_seconds += decode_seconds
    self.compile_seconds += compile_seconds


def print_summary(method: str, n_texts: int, resumed: int, tally: Tally, cache: str, alone: Tally | None) -> None:
  """The run's line (compile and decode seconds, tokens/s); with `alone` (--compare) the verifier's and the
  speed-up."""
  n_tokens, decode_seconds = tally.tokens, tally.decode_seconds
  print(f"{method}: {n_texts} prompt{'s' * (n_texts > 1)}{f' ({resumed} resumed)' if resumed else ''}, "
        f"{n_tokens} new tokens; compile {tally.compile_seconds:.1f} s{cache}, decode {decode_seconds:.2f} s: "
        f"{n_tokens / max(decode_seconds, 1e-9):.1f} tokens/s, {1000 * decode_seconds / max(n_tokens, 1):.1f} ms/token",
        flush=True)
  if alone is not None:
    print(f"verifier alone: {alone.tokens} new tokens; compile {alone.compile_seconds:.1f} s, decode "
          f"{alone.decode_seconds:.2f} s: {alone.tokens / max(alone.decode_seconds, 1e-9):.1f} tokens/s; speed-up of "
          f"{method} (ms/token, decode only): "
          f"{(alone.decode_seconds / max(alone.tokens, 1)) / max(decode_seconds / max(n_tokens, 1), 1e-9):.2f}x",
          flush=True)


def batch_records(out, rows: np.ndarray, texts: Sequence[str], vocab, seconds: float, unknown: Sequence[int],
                  run: dict[str, Any]) -> list[dict[str, Any]]:
  """The records of a decoded batch's prompts (what --output writes); the padding rows, which repeat the last
  prompt, are left out."""
  from specdec.decoding import common
  return [{"prompt": texts[row], "text": vocab.decode(out.tokens[i, :out.lengths[i]].tolist()),
           "tokens": out.tokens[i, :out.lengths[i]].tolist(), "new_tokens": int(out.lengths[i]),
           "seconds": seconds, "batch": int(rows[0]),
           "counters": {name: int(getattr(out.stats, name)[i]) for name in common.STAT_NAMES},
           "unknown_characters": unknown[row], "run": run}
          for i, row in enumerate(rows[:len(texts) - rows[0]])]


def finish_output(output: StreamedOutput, n_texts: int) -> None:
  """Renames FILE.partial to FILE, saying where the prompts are if Ctrl-C comes meanwhile."""
  done = f"all {n_texts} prompts are in {output.path}"
  cli.on_interrupt(lambda: f"{done} (or, if the rename was cut short, in {output.partial}; rerun to finish)")
  output.finish()
  cli.on_interrupt(lambda: done)
