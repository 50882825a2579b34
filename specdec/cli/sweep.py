r"""Runs a quality/latency sweep configured by gin files (t5x style) and appends one JSON line per point.

  specdec-sweep --gin_file=configs/experiments/table2_synopsis.gin \
      [--gin_bindings="Experiment.n_examples = 100"] [--gin_bindings="opt/Family.alphas = [0.2, 0.4]"]

An experiment file includes a pair (configs/pairs/), a task (configs/tasks/) and a method list
(configs/methods/), then overrides sizes and grids. The whole grid is validated before anything runs.
Rerun the same command after an interruption (Ctrl-C, a kill): points already in `Experiment.output` are
skipped, the one under way is redone. Then `specdec-plot --results=<output>` draws the frontiers and
writes Table 2.

On a multi-host TPU slice every host runs the same command with --multihost (`jax.distributed`): the
hosts split the grid, each appends to its own shard beside the output (results.host-IIII-of-NNN.jsonl),
and the plots read the shards together.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from specdec import cli

PROG = "specdec-sweep"


def kept_points(output: str | os.PathLike, command: str = "the same command") -> str:
  """What an interrupted sweep keeps (`cli.on_interrupt`): the finished points, the whole lines of its
  results file and shards (a line cut short is dropped when the sweep resumes)."""
  from specdec.evaluation import results
  files = results.result_files(output)
  points = sum(file.read_bytes().count(b"\n") for file in files)
  shards = " and its host shards" if len(files) > 1 else ""
  finished = "1 finished point is" if points == 1 else f"{points} finished points are"
  return f"{finished} in {output}{shards}; {command} resumes (finished points are skipped)"


def parse_experiment(gin_files: Sequence[str], gin_bindings: Sequence[str]):
  """`grid.parse_gin`, without gin's lines about search paths it did not find a file in."""
  from specdec.evaluation import grid
  with cli.quiet_gin_lookups():
    return grid.parse_gin(gin_files, gin_bindings)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--gin_file", action="append", default=[], required=True,
                      help="a gin file; repeatable, later ones win")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding such as \"Experiment.n_examples = 50\"; repeatable, applied last")
  parser.add_argument("--multihost", action="store_true",
                      help="jax.distributed.initialize() first (every host of a TPU slice runs this command)")
  args = parser.parse_args(argv)
  cli.check_gin_files(args.gin_file)
  import jax
  from specdec.evaluation import sweep
  if args.multihost:
    jax.distributed.initialize()
  experiment = parse_experiment(args.gin_file, args.gin_bindings)
  cli.on_interrupt(lambda: kept_points(experiment.output))
  records = sweep.run(experiment)
  print(f"{len(records)} points in {experiment.output}")
  return records


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
