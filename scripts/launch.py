"""Launches the speculative-cascades paper's T5 experiments on a Cloud TPU VM slice with plain `gcloud`.

  python scripts/launch.py --config=configs/experiments/paper_t5_wmt.gin --tpu=v4-32 \
      --bucket=gs://my-bucket [--zone=us-central2-b] [--project=P] [--name=N] [--verifier=large]
      [--stage=all] [--dry_run]

Plain `gcloud compute tpus tpu-vm` commands rather than XManager: no extra dependency, and they are what a
researcher would type by hand; `--dry_run` prints every command (shell-quoted, one per line) and runs
nothing. Stages, in order (`--stage` runs one, `all` every one; each command stops the launch on failure):
  create    the TPU VM slice (software version by TPU generation, `RUNTIMES`)
  install   on every worker: this repository from the bucket's copy, `pip install -c constraints.txt
            -e '.[seqio]'`, T5's vocabulary and the public T5X checkpoints copied locally
  finetune  on every worker: the drafter (T5 v1.1 small) and the verifier (large or XL) on the config's task
            (configs/train/paper_t5_<size>.gin + paper_task_<task>.gin), checkpoints and exports in the bucket
  sweep     on every worker: the exports copied locally, `scripts/sweep.py --multihost` (each host its block
            of the grid, its own results shard), shards copied to the bucket
  plot      here: the shards copied back, `scripts/plot.py` (Pareto plots, Table 2)
  delete    the TPU VM
The repository travels as `git archive HEAD` uploaded to the bucket (`upload`, part of `install`), so the
slice runs the committed code.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import shlex
import subprocess
import sys

from specdec import cli

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGES = ("create", "install", "finetune", "sweep", "plot", "delete")
# TPU generation -> a TPU VM software version that carries JAX's TPU runtime.
RUNTIMES = {"v4": "tpu-ubuntu2204-base", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
            "v6e": "v2-alpha-tpuv6e"}
DEFAULT_ZONES = {"v4": "us-central2-b", "v5litepod": "us-west4-a", "v5p": "us-east5-a", "v6e": "us-east5-b"}
# The experiment config's task (configs/experiments/paper_t5_<task>.gin) -> configs/train/paper_task_<task>.gin.
TASK_PATTERN = re.compile(r"paper_t5_(\w+)\.gin$")
T5X_CHECKPOINTS = "gs://t5-data/pretrained_models/t5x/t5_1_1_{size}/checkpoint_1000000"
T5_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"


@dataclasses.dataclass(frozen=True)
class Command:
  """One step: `argv` runs here (`gcloud …`, `gsutil …`, `python …`)."""
  stage: str
  argv: tuple[str, ...]

  def shell(self) -> str:
    return shlex.join(self.argv)


def _tpu_type(value: str) -> str:
  generation = value.split("-")[0]
  if generation not in RUNTIMES or not re.fullmatch(r"[a-z0-9]+-\d+", value):
    raise argparse.ArgumentTypeError(f"unknown TPU type {value!r}: give <generation>-<cores>, generation one of "
                                     f"{', '.join(RUNTIMES)} (e.g. v4-32)")
  return value


def _bucket(value: str) -> str:
  if not re.fullmatch(r"gs://[a-z0-9][a-z0-9._-]*[a-z0-9](/[^\s]*)?", value):
    raise argparse.ArgumentTypeError(f"--bucket must be a gs:// path (gs://BUCKET[/PREFIX]); got {value!r}")
  return value.rstrip("/")


def _config(value: str) -> str:
  if not (REPO_ROOT / value).is_file():
    raise argparse.ArgumentTypeError(f"--config {value!r} does not exist (relative to the repository root)")
  if not TASK_PATTERN.search(value):
    raise argparse.ArgumentTypeError(f"--config must be a configs/experiments/paper_t5_<task>.gin; got {value!r}")
  return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", type=_config, required=True, help="configs/experiments/paper_t5_<task>.gin")
  parser.add_argument("--tpu", type=_tpu_type, required=True, help="accelerator type, e.g. v4-32")
  parser.add_argument("--bucket", type=_bucket, required=True, help="gs://BUCKET[/PREFIX] for code, models, results")
  parser.add_argument("--zone", default=None, help="default: a zone of the TPU generation")
  parser.add_argument("--project", default=None, help="default: gcloud's configured project")
  parser.add_argument("--name", default=None, help="TPU VM name (default: specdec-<task>)")
  parser.add_argument("--verifier", choices=("large", "xl"), default="large", help="the verifier's T5 size")
  parser.add_argument("--stage", choices=("all",) + STAGES, default="all")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> list[Command]:
  """Every command of the launch, in order (only `args.stage`'s unless 'all')."""
  task = TASK_PATTERN.search(args.config).group(1)
  generation = args.tpu.split("-")[0]
  name = args.name or f"specdec-{task}"
  location = ["--zone", args.zone or DEFAULT_ZONES[generation]] + (["--project", args.project] if args.project else [])
  runs, exports, results = (f"{args.bucket}/{part}/{task}" for part in ("runs", "exports", "results"))
  code = f"{args.bucket}/code/specdec.tar.gz"

  def on_workers(script: str) -> tuple[str, ...]:
    return ("gcloud", "compute", "tpus", "tpu-vm", "ssh", name, *location, "--worker=all", "--command", script)

  def train(size: str) -> str:
    # Checkpoints and the export in the bucket: every host of the slice writes its shards to one directory.
    return (f"python scripts/train.py --multihost --gin_file=configs/train/paper_t5_{size}.gin "
            f"--gin_file=configs/train/paper_task_{task}.gin "
            f"--gin_bindings=\"train.model_dir = '{runs}/{size}'\" "
            f"--gin_bindings=\"export.path = '{exports}/{size}'\" "
            f"--gin_bindings=\"seqio_batches.t5_vocab_path = 'checkpoints/t5_vocab/sentencepiece.model'\"")

  setup = " && ".join([
      f"gsutil cp {code} . && mkdir -p specdec && tar -xzf specdec.tar.gz -C specdec && cd specdec",
      "python3 -m venv .venv && . .venv/bin/activate",
      "pip install -c constraints.txt -e '.[seqio]' 'jax[tpu]'",
      f"mkdir -p checkpoints/t5_vocab && gsutil cp {T5_VOCABULARY} checkpoints/t5_vocab/",
      *(f"gsutil -m cp -r {T5X_CHECKPOINTS.format(size=size)} checkpoints/t5_1_1_{size}/"
        for size in ("small", args.verifier))])
  enter = "cd specdec && . .venv/bin/activate && "
  sweep = (f"gsutil -m rsync -r {exports} outputs/paper_t5/export && "
           f"python scripts/sweep.py --multihost --gin_file={args.config} "
           f"--gin_bindings=\"verifier/ModelSource.path = 'outputs/paper_t5/export/{args.verifier}'\" "
           f"&& gsutil -m cp outputs/paper_t5/{task}/results*.jsonl {results}/")
  local_results = f"outputs/paper_t5/{task}"
  stages = {
      "create": [("gcloud", "compute", "tpus", "tpu-vm", "create", name, *location,
                  f"--accelerator-type={args.tpu}", f"--version={RUNTIMES[generation]}")],
      "install": [("git", "archive", "--format=tar.gz", "-o", "/tmp/specdec.tar.gz", "HEAD"),
                  ("gsutil", "cp", "/tmp/specdec.tar.gz", code),
                  on_workers(setup)],
      "finetune": [on_workers(enter + train("small")), on_workers(enter + train(args.verifier))],
      "sweep": [on_workers(enter + sweep)],
      "plot": [("mkdir", "-p", local_results),
               ("gsutil", "-m", "cp", f"{results}/results*.jsonl", f"{local_results}/"),
               ("python", "scripts/plot.py", f"--results={local_results}/results.jsonl")],
      "delete": [("gcloud", "compute", "tpus", "tpu-vm", "delete", name, *location, "--quiet")],
  }
  chosen = STAGES if args.stage == "all" else (args.stage,)
  return [Command(stage, tuple(argv)) for stage in chosen for argv in stages[stage]]


def main(argv: list[str] | None = None) -> list[Command]:
  """Prints each stage's name (as a comment) and its commands; runs them unless --dry_run (from the
  repository root, stopping at the first failure)."""
  args = parse_args(argv)
  commands = plan(args)
  for i, command in enumerate(commands):
    if i == 0 or commands[i - 1].stage != command.stage:
      print(f"# {command.stage}", flush=True)
    print(command.shell(), flush=True)
    if not args.dry_run:
      subprocess.run(command.argv, check=True, cwd=REPO_ROOT)
  return commands


if __name__ == "__main__":
  sys.exit(cli.run(main, sys.argv[1:], "scripts/launch.py"))
