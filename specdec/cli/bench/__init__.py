"""specdec-bench: every benchmark of specdec, one subcommand each, on the harness of `specdec.evaluation.bench`.

  specdec-bench score     ms of a model's `score` of n tokens after a prefix; c_γ and the drafter/verifier c
  specdec-bench decoding  speculative against autoregressive decoding, interleaved: trained pairs on a task, or
                          random presets; acceptance, tokens per call, speed-ups, EWIF (CS Drafting)
  specdec-bench backend   what decoding costs on this machine's JAX backend (CPU, GPU, TPU), in one command
  specdec-bench program   the compiled decode program: verify call, one-token step, ms per token, temp memory,
                          and the collectives of its loop on a (data=4, model=2) mesh of 8 fake CPU devices
  specdec-bench verify    the block's sampling side (top-P, targets, verify_block) in softmaxes
  specdec-bench peer      head to head with Hugging Face transformers on the same T5 weights

Every run writes one record (`--out STEM`: STEM.json and STEM.md; machine, commit, command, rows) or prints
its table. Before/after of two revisions, sides alternating round by round, each in a fresh process on its
revision's library with this checkout's benchmark code:

  specdec-bench --before REV [--after TREE] [--rounds 3] program --mesh --out experiments/decode_program/results

`python -m specdec.cli.bench …` is the same command. `specdec-bench SUBCOMMAND --help` lists each one's options.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

PROG = "specdec-bench"
# name -> one line; only the subcommand run is imported (JAX, and torch for `peer`, load after the parsing).
SUBCOMMANDS = {"score": "ms of a model's `score` of n tokens after a prefix; c_γ and the drafter/verifier c",
               "decoding": "speculative against autoregressive decoding, interleaved, and the theory's prediction",
               "backend": "what decoding costs on this machine's JAX backend, in one command",
               "program": "the compiled decode program's costs, memory and collectives",
               "verify": "the block's sampling side (top-P, targets, verify_block) in softmaxes",
               "peer": "head to head with Hugging Face transformers on the same T5 weights"}


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
  """The top-level options and every subcommand, with the options of the one `argv` names."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--before", metavar="REVISION", help="also measure this git revision, interleaved")
  parser.add_argument("--after", metavar="TREE", default=None, help="the tree measured as 'after' (default: this "
                      "checkout)")
  parser.add_argument("--rounds", type=int, default=3, help="rounds of before/after, sides alternating")
  commands = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND",
                                   help="one of those above")
  chosen = next((a for a in argv if a in SUBCOMMANDS), None)
  for name in SUBCOMMANDS:
    if name != chosen:
      commands.add_parser(name)   # listed once, in the description
      continue
    module = importlib.import_module(f"specdec.cli.bench.{name}")
    sub = commands.add_parser(name, description=module.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(sub)
    sub.add_argument("--out", metavar="STEM", default=None, help="write STEM.json and STEM.md (default: print "
                     "the table" + (", and write experiments/backend_<backend>/results" if name == "backend" else "")
                     + ")")
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs one subcommand (or its before/after) and returns its record."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _parser(argv).parse_args(argv)
  from specdec.evaluation import bench
  if args.before:
    return _before_after(args, argv[argv.index(args.subcommand):])
  module = importlib.import_module(f"specdec.cli.bench.{args.subcommand}")
  record, table = module.run(args, bench.command_line(argv, PROG))
  if args.out:
    bench.write_record(record, args.out, table)
    bench.log(f"wrote {args.out}.json and {args.out}.md")
  print("\n".join(bench.header(record)) + "\n\n" + table)
  return record


def _before_after(args: argparse.Namespace, sub_argv: list[str]) -> dict[str, Any]:
  """Both sides' records, `args.rounds` of each alternating, and their comparison (`bench.compare`)."""
  from specdec.evaluation import bench
  sub_argv = [a for i, a in enumerate(sub_argv) if a != "--out" and (i == 0 or sub_argv[i - 1] != "--out")]
  records: dict[str, list] = {"before": [], "after": []}
  with bench.revision_tree(args.before) as before_tree:
    trees = {"before": before_tree, "after": args.after or bench.REPO_ROOT}
    for round_ in range(args.rounds):
      for side, tree in trees.items():
        bench.log(f"round {round_ + 1}/{args.rounds}: {side} ({tree})")
        records[side].append(bench.run_in_tree(tree, sub_argv))
  rows = bench.compare(records["before"], records["after"])
  after_commit = records["after"][0]["commit"]
  record = bench.new_record(f"{args.subcommand} before/after", bench.command_line(None, PROG),
                            keys=[*records["after"][0]["keys"], "figure"], before=args.before,
                            after=after_commit, rounds=args.rounds)
  record.update(rows=rows, runs=records)
  table = (f"before: {args.before} ({records['before'][0]['commit']}), after: {after_commit}; medians over "
           f"{args.rounds} interleaved rounds, each a fresh process\n\n" + bench.markdown_table(rows))
  for side, runs in records.items():   # what is not a figure (program --mesh: the sharded loop's collectives)
    if "mesh" in runs[0]:
      table += f"\n\n- {side}: " + "; ".join(f"{name} {value}" for name, value in runs[0]["mesh"].items())
  if args.out:
    bench.write_record(record, args.out, table)
  print("\n".join(bench.header(record)) + "\n\n" + table)
  return record


def console() -> None:
  """The installed `specdec-bench`: a user error prints one line and exits with status 2."""
  from specdec import cli
  sys.exit(cli.run(main, sys.argv[1:], PROG))


if __name__ == "__main__":
  console()
