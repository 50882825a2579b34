"""Main job: a small sweep of the main methods on the shipped trained pair, then Figure 4 and Table 2.

  python scripts/quickstart.py [--gin_file=configs/experiments/quickstart.gin] [--gin_bindings=...]

Runs SpecDecode, SpecDecode [Lossy], TokenCascade [Chow] and SpecCascade [Chow / OPT / Token] at a few α,
greedy and T = 1, with the drafter and verifier alone, on Debian synopsis generation (ROUGE-2); writes
outputs/quickstart/results.jsonl, pareto.png, rejection.png and table.md. A rerun resumes (finished points
are skipped); Ctrl-C says what was kept. The pair's paths are gin bindings (`drafter/ModelSource.path`,
`verifier/ModelSource.path`).
"""

from __future__ import annotations

import os
import sys
import time

from specdec import cli
from specdec.cli import plot, sweep as sweep_cli

PROG = "scripts/quickstart.py"
DEFAULT_GIN = "configs/experiments/quickstart.gin"


def main(argv: list[str] | None = None) -> dict[str, str]:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--gin_file", action="append", default=None, help=f"gin files (default {DEFAULT_GIN})")
  parser.add_argument("--gin_bindings", action="append", default=[], help="gin bindings, applied last")
  args = parser.parse_args(argv)
  gin_files = args.gin_file or [DEFAULT_GIN]
  cli.check_gin_files(gin_files)
  from specdec.evaluation import sweep
  experiment = sweep_cli.parse_experiment(gin_files, args.gin_bindings)
  cli.on_interrupt(lambda: sweep_cli.kept_points(experiment.output, "the same command (`make quickstart`)"))
  start = time.perf_counter()
  records = sweep.run(experiment)
  paths = plot.write_report(experiment.output, os.path.dirname(experiment.output))
  with open(paths["table.md"]) as f:
    print(f.read())
  print(f"{len(records)} points in {time.perf_counter() - start:.0f} s; wrote {experiment.output}, "
        + ", ".join(paths.values()))
  return paths


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:], PROG))
