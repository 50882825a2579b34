"""Pareto plots and Table 2 from a sweep's results (JSON lines written by specdec-sweep).

  specdec-plot --results=outputs/table2_synopsis/results.jsonl [--out_dir=DIR]

Writes pareto.png (quality vs latency relative to the large model, Figure 4 style), rejection.png
(quality vs rejection rate, Figure 3 style) and table.md (Table 2) to DIR, by default the results' folder;
with multi-draft runs (spectr, specinfer) also multi_draft.md, SpecTr's Table 2 layout. They are drawn in
a temporary folder in DIR and then renamed into place, so a run that fails or is interrupted leaves the
previous ones whole.
"""

from __future__ import annotations

import os
import shutil
import uuid

from specdec import cli

PROG = "specdec-plot"


def check_results_file(results: str) -> None:
  """A results file (and its host shards) that exists and is UTF-8 text, or a one-line error naming the
  file and the line."""
  if os.path.isdir(results):
    raise ValueError(f"--results {results} is a directory; give the results .jsonl file of a sweep")
  if not os.path.exists(results):
    raise FileNotFoundError(f"--results {results}: no such file")
  from specdec.evaluation.results import result_files
  for path in result_files(results):
    data = path.read_bytes()
    try:
      data.decode("utf-8")
    except UnicodeDecodeError as e:
      line = data.count(b"\n", 0, e.start) + 1
      raise ValueError(f"{path}:{line} is not UTF-8 text (byte {data[e.start]:#04x}): not a results file of "
                       "specdec-sweep") from None


def write_report(results: str, out_dir: str) -> dict[str, str]:
  """`pareto.report(results, out_dir)`, written to a temporary folder in `out_dir` and then renamed into
  place: an error or Ctrl-C part way leaves no half-written figure. Returns the paths written."""
  from specdec.evaluation import pareto
  os.makedirs(out_dir, exist_ok=True)
  staging: list[str] = []
  moved: list[str] = []

  def kept() -> str:   # registered before the staging folder exists: Ctrl-C may come at any point
    for folder in staging:
      shutil.rmtree(folder, ignore_errors=True)
    if moved:
      return (f"{', '.join(moved)} were written to {out_dir}, the others are as they were; the same command "
              "writes them all")
    return f"no figure or table was written (those in {out_dir} are as they were); the same command writes them"
  cli.on_interrupt(kept)
  # Named (and known to `kept`) before it exists: Ctrl-C right after a mkdtemp, before its name was kept, left it.
  staging.append(os.path.join(out_dir, f".plot-{uuid.uuid4().hex[:8]}"))
  os.mkdir(staging[0])
  try:
    staged = pareto.report(results, staging[0])
    paths = {name: os.path.join(out_dir, name) for name in staged}
    for name, path in staged.items():
      os.replace(path, paths[name])
      moved.append(name)
  finally:
    shutil.rmtree(staging[0], ignore_errors=True)
  return paths


def main(argv: list[str] | None = None) -> dict[str, str]:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--results", required=True, help="a results .jsonl file")
  parser.add_argument("--out_dir", default=None, help="where to write the figures and table.md")
  args = parser.parse_args(argv)
  check_results_file(args.results)
  paths = write_report(args.results, args.out_dir or os.path.dirname(os.path.abspath(args.results)))
  for table in ("table.md", "multi_draft.md"):
    if table in paths:
      with open(paths[table]) as f:
        print(f.read())
  print("wrote " + ", ".join(paths.values()))
  return paths


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
