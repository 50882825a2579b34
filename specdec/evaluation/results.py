"""The results file of a sweep (JSON lines, one record per grid point) and the hashes that key it.

A record's `hash` is the digest of its point's canonical config and the run context (`point_hash`: the
pair, the examples and the run settings; not the label, commit or machine), so a rerun of the same grid
finds the points already done. Records are appended one line at a time, flushed and fsynced
(`append_result`); a kill can only cut the last line short, which a rerun drops (`drop_partial_line`) and
readers leave out (`read_results`). Several hosts write shards beside the file (`host_shard`), read
together with it. `code_digest` (and the harness's `bench.git_commit` and `bench.device`) say which code on
which machine measured a record.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Collection
from typing import Any

from specdec.data import pretrained
from specdec.evaluation.grid import Point

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Keys every record has (`read_results` checks them).
RECORD_KEYS = ("hash", "context_hash", "family", "point", "context", "metric", "quality", "relative_latency")


def digest(value: Any) -> str:
  """16 hex digits of the SHA-256 of `value` as canonical JSON (sorted keys)."""
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def files_digest(root: pathlib.Path, skip: Collection[str] = (), pattern: str = "*") -> str:
  """Names and contents of the files under `root` matching `pattern` (none inside a folder named in `skip`); a
  file's contents where `root` is one (a GGUF checkpoint: its identity whatever its name)."""
  if root.is_file():
    return pretrained.file_sha256(root)[:16]
  sha = hashlib.sha256()
  for file in sorted(p for p in root.rglob(pattern)
                     if p.is_file() and not set(skip) & set(p.relative_to(root).parts)):
    sha.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
  return sha.hexdigest()[:16]


@functools.cache
def code_digest() -> str:
  """The `specdec` package's source, its .py files: the code a measurement ran (edits to configs, docs or
  tests do not change it)."""
  return files_digest(pathlib.Path(__file__).resolve().parents[1], pattern="*.py")


def point_hash(point: Point, run_context: dict[str, Any]) -> str:
  """A stable 16-hex-digit hash of the point's config and the context (not the label, commit or device)."""
  return digest({"point": point.config(), "context": run_context})


def host_shard(path: str | os.PathLike, index: int, count: int) -> pathlib.Path:
  """Where host `index` of `count` writes its points of the run whose results file is `path`:
  results.jsonl -> results.host-003-of-016.jsonl beside it."""
  path = pathlib.Path(path)
  return path.with_name(f"{path.stem}.host-{index:03d}-of-{count:03d}{path.suffix}")


def result_files(path: str | os.PathLike) -> list[pathlib.Path]:
  """A results file and the host shards written beside it (`host_shard`), those that exist."""
  path = pathlib.Path(path)
  shards = sorted(path.parent.glob(f"{path.stem}.host-*-of-*{path.suffix}"))
  return [p for p in [path, *shards] if p.exists()]


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a results file and of its host shards, without duplicates ([] when none exists; a
  point recorded twice keeps its last record). A last line without its newline (a write cut short by a
  kill) is left out, with a note on stderr; any other line that is not a sweep record (bad JSON, or a JSON
  value without the `RECORD_KEYS`) raises ValueError naming the file and line."""
  records = {}
  for file in result_files(path):
    records.update((record["hash"], record) for record in _read_file(file))
  return list(records.values())


def _read_file(path: pathlib.Path) -> list[dict[str, Any]]:
  lines = path.read_text().split("\n")
  if lines[-1]:
    print(f"note: {path}:{len(lines)} left out: a last line without its newline (a write cut short; the "
          "sweep redoes that point when resumed)", file=sys.stderr)
  records = []
  for number, line in enumerate(lines[:-1], 1):  # the last piece follows the last newline
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number} is not a JSON record ({e}); only the last line may be cut short") from e
    missing = [key for key in RECORD_KEYS if key not in record] if isinstance(record, dict) else list(RECORD_KEYS)
    if missing:
      raise ValueError(f"{path}:{number} is not a sweep record (no {', '.join(missing)}): a line from another "
                       "file or program?")
    records.append(record)
  return records


def drop_partial_line(path: str | os.PathLike) -> None:
  """Truncates the file after its last newline, removing a half-written record."""
  path = pathlib.Path(path)
  if path.exists():
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
      with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def append_result(path: str | os.PathLike, record: dict[str, Any]) -> None:
  """Appends one record as one line, flushed and fsynced before returning."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())
