"""Runs a quality/latency sweep configured by gin files (t5x style) and appends one JSON line per point.

  specdec-sweep --gin_file=configs/experiments/table2_synopsis.gin \
      [--gin_bindings="Experiment.n_examples = 100"] [--gin_bindings="opt/Family.alphas = [0.2, 0.4]"]

An experiment file includes a pair (configs/pairs/), a task (configs/tasks/) and a method list
(configs/methods/), then overrides sizes and grids. The whole grid is validated before anything runs.
Rerun the same command after an interruption: points already in `Experiment.output` are skipped. Then
`specdec-plot --results=<output>` draws the frontiers and writes Table 2.

On a multi-host TPU slice every host runs the same command with --multihost (`jax.distributed`): the
hosts split the grid, each appends to its own shard beside the output (results.host-IIII-of-NNN.jsonl),
and the plots read the shards together.
"""

from __future__ import annotations


import jax

from specdec import cli
from specdec.evaluation import grid, sweep

PROG = "specdec-sweep"


def main(argv: list[str] | None = None) -> list[dict]:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--gin_file", action="append", default=[], required=True,
                      help="a gin file; repeatable, later ones win")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding such as \"Experiment.n_examples = 50\"; repeatable, applied last")
  parser.add_argument("--multihost", action="store_true",
                      help="jax.distributed.initialize() first (every host of a TPU slice runs this command)")
  args = parser.parse_args(argv)
  if args.multihost:
    jax.distributed.initialize()
  experiment = grid.parse_gin(args.gin_file, args.gin_bindings)
  records = sweep.run(experiment)
  print(f"{len(records)} points in {experiment.output}")
  return records


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
