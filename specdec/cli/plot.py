"""Pareto plots and Table 2 from a sweep's results (JSON lines written by specdec-sweep).

  specdec-plot --results=outputs/table2_synopsis/results.jsonl [--out_dir=DIR]

Writes pareto.png (quality vs latency relative to the large model, Figure 4 style), rejection.png
(quality vs rejection rate, Figure 3 style) and table.md (Table 2) to DIR, by default the results' folder;
with multi-draft runs (spectr, specinfer) also multi_draft.md, SpecTr's Table 2 layout.
"""

from __future__ import annotations

import os

from specdec import cli
from specdec.evaluation import pareto

PROG = "specdec-plot"


def main(argv: list[str] | None = None) -> dict[str, str]:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--results", required=True, help="a results .jsonl file")
  parser.add_argument("--out_dir", default=None, help="where to write the figures and table.md")
  args = parser.parse_args(argv)
  paths = pareto.report(args.results, args.out_dir or os.path.dirname(os.path.abspath(args.results)))
  for table in ("table.md", "multi_draft.md"):
    if table in paths:
      with open(paths[table]) as f:
        print(f.read())
  print("wrote " + ", ".join(paths.values()))
  return paths


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
