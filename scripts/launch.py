"""Launches the speculative-cascades paper's T5 and Gemma experiments on a Cloud TPU VM slice with plain `gcloud`.

  python scripts/launch.py --config=configs/experiments/paper_t5_wmt.gin --tpu=v4-32 \
      --bucket=gs://my-bucket [--zone=us-central2-b] [--project=P] [--name=N] [--verifier=large]
      [--stage=all] [--dry_run]
  python scripts/launch.py --config=configs/experiments/paper_gemma_2b_27b_gsm8k.gin --tpu=v5p-8 \
      --bucket=gs://my-bucket [--batch_size=64] [--dry_run]

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

Gemma configs (configs/experiments/paper_gemma_2b_<9b|27b>_<task>.gin) have no finetune stage: `install`
copies the Hugging Face checkpoints from `<bucket>/checkpoints/` and the sweep reads tfds data (and MBPP's
mbpp.jsonl) from `<bucket>/tfds`. Every host sweeps its block of the grid on a mesh of its own chips holding
both models, so the launch sizes that mesh (`size_mesh`): bf16 weights split over the 'model' axis, KV caches
over both axes, per chip against 75 % of the chip's HBM; the widest 'data' axis that fits wins, and a slice
whose hosts cannot hold the pair at `--batch_size` is refused before anything is created.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
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
# configs/experiments/paper_gemma_2b_<verifier>_<task>[_pt].gin
GEMMA_PATTERN = re.compile(r"paper_gemma_2b_(9b|27b)_(\w+?)(_pt)?\.gin$")
# Per chip: high-bandwidth memory (GiB) and chips per host (v5e and v6e hosts of single-host slices hold 8).
HBM_GIB = {"v4": 32, "v5litepod": 16, "v5p": 95, "v6e": 32}
CORES_PER_CHIP = {"v4": 2, "v5litepod": 1, "v5p": 2, "v6e": 1}
HBM_USABLE = 0.75        # left for XLA's temporaries, the logits and fragmentation
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
  if not (TASK_PATTERN.search(value) or GEMMA_PATTERN.search(value)):
    raise argparse.ArgumentTypeError(f"--config must be a configs/experiments/paper_t5_<task>.gin or "
                                     f"paper_gemma_2b_<9b|27b>_<task>.gin; got {value!r}")
  return value


def chips_per_host(tpu: str) -> tuple[int, int]:
  """(chips in the slice, chips per host) of a TPU type such as v4-32 (32 TensorCores: 16 chips)."""
  generation, count = tpu.split("-")
  chips = int(count) // CORES_PER_CHIP[generation]
  per_host = 8 if generation in ("v5litepod", "v6e") and chips <= 8 else 4
  return chips, min(chips, per_host)


@dataclasses.dataclass(frozen=True)
class Sizing:
  """A host's mesh (data, model) for a Gemma pair at `batch_size`, and the bytes per chip it needs."""
  mesh: tuple[int, int]
  batch_size: int
  weight_bytes: int        # both models, whole
  cache_bytes: int         # both models' KV caches for the batch, whole
  per_chip_bytes: int
  usable_bytes: int
  compiled: bool = False   # per_chip_bytes from the compiled program (XLA's total), not the estimate

  def describe(self) -> str:
    gib = 1 << 30
    if self.compiled:
      return (f"mesh {self.mesh} per host at batch {self.batch_size}: the compiled program needs "
              f"{self.per_chip_bytes / gib:.2f} GiB per chip (weights, KV caches, temporaries, code) of "
              f"{self.usable_bytes / gib:.0f} GiB")
    return (f"mesh {self.mesh} per host at batch {self.batch_size}: weights {self.weight_bytes / gib:.1f} GiB / "
            f"{self.mesh[1]} + KV caches {self.cache_bytes / gib:.1f} GiB / {self.mesh[0] * self.mesh[1]} = "
            f"{self.per_chip_bytes / gib:.1f} GiB per chip of {self.usable_bytes / gib:.1f} GiB usable (estimate)")


def gemma_pair_bytes(verifier: str, cache_length: int, batch_size: int, bytes_per_value: int = 2
                     ) -> tuple[int, int, int]:
  """`pair_bytes` of Gemma 2 2B → `verifier` ('9b' | '27b') at Gemma's 256k vocabulary."""
  return pair_bytes("gemma2_2b", f"gemma2_{verifier}", 256_000, cache_length, batch_size, bytes_per_value)


def pair_bytes(drafter: str, verifier: str, vocab_size: int, cache_length: int, batch_size: int,
               bytes_per_value: int = 2) -> tuple[int, int, int]:
  """(weight bytes, KV-cache bytes, the largest 'model' axis both models' KV heads divide) of two presets (any
  family: `models.families`), weights and caches of `cache_length` positions for `batch_size` rows held in
  `bytes_per_value` (2: bfloat16, as the pairs' gin files load them). From the models' own shapes (nothing
  allocated)."""
  weights = cache = 0
  kv_heads = []
  import jax
  for preset in (drafter, verifier):
    model = _abstract(preset, vocab_size)
    cache_values = jax.eval_shape(lambda: model.init_cache(batch_size, cache_length)).kv
    weights += _count(model.params) * bytes_per_value
    cache += _count(cache_values) * bytes_per_value
    kv_heads.append(model.config.cache_heads)
  return weights, cache, math.gcd(*kv_heads)


def _count(tree) -> int:
  import jax
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


@functools.lru_cache(maxsize=None)
def _abstract(preset: str, vocab_size: int):
  """A preset's model as shapes (tracing a 27B init takes seconds: once per preset), caches of any length."""
  import jax
  from specdec import models
  return jax.eval_shape(lambda: models.build(preset, vocab_size=vocab_size, max_length=1 << 20))


def size_mesh(tpu: str, verifier: str, cache_length: int, batch_size: int, bytes_per_value: int = 2) -> Sizing:
  """The host mesh with the widest 'data' axis whose per-chip share (weights / model + caches / chips)
  fits `HBM_USABLE` of a chip; ValueError naming the need and the batch size if none does. The sweep loads
  the checkpoints through host memory and shards them (`Experiment.mesh_shape`), and times latency on the
  same mesh, so no chip holds a whole model."""
  generation = tpu.split("-")[0]
  _, per_host = chips_per_host(tpu)
  weights, cache, max_model = gemma_pair_bytes(verifier, cache_length, batch_size, bytes_per_value)
  usable = int(HBM_USABLE * HBM_GIB[generation] * (1 << 30))
  candidates = []
  for model in (m for m in range(1, per_host + 1) if per_host % m == 0 and max_model % m == 0):
    data = per_host // model
    if batch_size % data == 0:
      candidates.append(Sizing((data, model), batch_size, weights, cache, weights // model + cache // per_host, usable))
  if not candidates:
    raise ValueError(f"--batch_size {batch_size} splits over no data axis of a {tpu} host ({per_host} chips; the "
                     f"'model' axis divides {max_model} KV heads): give a multiple of {per_host // math.gcd(per_host, max_model)}")
  fitting = [c for c in candidates if c.per_chip_bytes <= usable]
  if not fitting:
    best = min(candidates, key=lambda c: c.per_chip_bytes)
    raise ValueError(f"Gemma 2 2B → {verifier.upper()} does not fit a {tpu} host ({per_host} chips of "
                     f"{HBM_GIB[generation]} GiB): {best.describe()}; lower --batch_size or take a larger chip")
  return max(fitting, key=lambda c: c.mesh[0])


# A host of a generation (chips per host) as a slice `specdec.evaluation.plan.topology` compiles for.
HOST_TOPOLOGIES = {("v4", 4): "v4-8", ("v5p", 4): "v5p-8", ("v5litepod", 4): "v5e-4", ("v5litepod", 8): "v5e-8"}


def host_meshes(per_host: int, max_model: int, batch_size: int) -> list[tuple[int, int]]:
  """(data, model) meshes of a host's chips whose 'model' axis divides the KV heads and whose 'data' axis
  divides the batch, the widest 'data' axis first."""
  return [(per_host // model, model) for model in range(1, per_host + 1)
          if per_host % model == 0 and max_model % model == 0 and batch_size % (per_host // model) == 0]


def compiled_sizing(tpu: str, experiment, verifier: str, batch_size: int,
                    progress=lambda what: print(f"# compiling {what}", file=sys.stderr, flush=True)) -> Sizing | None:
  """The host mesh with the widest 'data' axis on which libtpu compiles the sweep's largest decode program
  within a chip's HBM (`specdec.evaluation.plan`, cached); None without libtpu or for a host it cannot
  compile for; ValueError naming the fix when no mesh holds it."""
  import dataclasses as dc
  from specdec.evaluation import plan as planning
  generation = tpu.split("-")[0]
  _, per_host = chips_per_host(tpu)
  name = HOST_TOPOLOGIES.get((generation, per_host))
  if planning.libtpu_version() is None or name is None:
    return None
  settings = [s for s, _ in planning.sweep_settings(experiment, verifier=f"gemma2_{verifier}", drafter="gemma2_2b",
                                                    vocab_size=256_000)]
  setting = dc.replace(max((s for s in settings if s.drafter is not None), key=lambda s: s.gamma),
                       batch_size=batch_size)
  weights, cache, max_model = gemma_pair_bytes(verifier, 1, 1)
  topology = planning.topology(name)
  meshes = host_meshes(per_host, max_model, batch_size)
  if not meshes:
    raise ValueError(f"--batch_size {batch_size} splits over no data axis of a {tpu} host ({per_host} chips; the "
                     f"'model' axis divides {max_model} KV heads): give a multiple of {per_host // math.gcd(per_host, max_model)}")
  needs = []
  for mesh in meshes:
    if weights // mesh[1] > topology.chip.hbm_bytes:   # the weights alone: no compile needed to refuse it
      needs.append(f"{mesh}: weights alone {weights / mesh[1] / (1 << 30):.1f} GiB")
      continue
    found = planning.decode_facts(setting, topology, mesh, cache=planning.ProgramCache(planning.default_cache_dir()),
                                   progress=progress)
    if found["fits"]:
      return Sizing(mesh, batch_size, weights, 0, found["memory"]["total"], topology.chip.hbm_bytes, compiled=True)
    needs.append(f"{mesh}: " + (f"{found['required_bytes'] / (1 << 30):.1f} GiB" if found["required_bytes"]
                                else "refused"))
  raise ValueError(f"Gemma 2 2B → {verifier.upper()} at batch {batch_size} does not fit a {tpu} host ({per_host} chips "
                   f"of {topology.chip.hbm_bytes / (1 << 30):.0f} GiB; libtpu per chip: {'; '.join(needs)}): lower "
                   f"--batch_size (e.g. {max(batch_size // 2, 1)}) or take a chip with more HBM (v5p)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", type=_config, required=True, help="configs/experiments/paper_t5_<task>.gin")
  parser.add_argument("--tpu", type=_tpu_type, required=True, help="accelerator type, e.g. v4-32")
  parser.add_argument("--bucket", type=_bucket, required=True, help="gs://BUCKET[/PREFIX] for code, models, results")
  parser.add_argument("--zone", default=None, help="default: a zone of the TPU generation")
  parser.add_argument("--project", default=None, help="default: gcloud's configured project")
  parser.add_argument("--name", default=None, help="TPU VM name (default: specdec-<task>)")
  parser.add_argument("--verifier", choices=("large", "xl"), default="large", help="the verifier's T5 size")
  parser.add_argument("--batch_size", type=int, default=None,
                      help="Gemma: rows per quality batch on each host (default: the config's)")
  parser.add_argument("--compile_sizing", action=argparse.BooleanOptionalAction, default=True,
                      help="Gemma: size the host mesh from the program libtpu compiles (default; minutes per mesh, "
                           "cached); --no-compile_sizing: from the estimate")
  parser.add_argument("--stage", choices=("all",) + STAGES, default="all")
  parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
  return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Run:
  """What differs between launches: the VM's name, what `install` fetches, the fine-tuning and sweep
  scripts (run on every worker inside the repository's venv) and where the results go."""
  name: str
  fetch: tuple[str, ...]        # shell commands after the install, in the repository
  finetune: tuple[str, ...]
  sweep: str                    # writes <local_results>/results*.jsonl
  local_results: str
  results: str                  # in the bucket


def t5_run(args: argparse.Namespace) -> Run:
  """The T5 experiments: T5X checkpoints fetched, drafter and verifier fine-tuned into the bucket, swept."""
  task = TASK_PATTERN.search(args.config).group(1)
  runs, exports, results = (f"{args.bucket}/{part}/{task}" for part in ("runs", "exports", "results"))

  def train(size: str) -> str:
    # Checkpoints and the export in the bucket: every host of the slice writes its shards to one directory.
    return (f"python scripts/train.py --multihost --gin_file=configs/train/paper_t5_{size}.gin "
            f"--gin_file=configs/train/paper_task_{task}.gin "
            f"--gin_bindings=\"train.model_dir = '{runs}/{size}'\" "
            f"--gin_bindings=\"export.path = '{exports}/{size}'\" "
            f"--gin_bindings=\"seqio_batches.t5_vocab_path = 'checkpoints/t5_vocab/sentencepiece.model'\"")

  fetch = (f"mkdir -p checkpoints/t5_vocab && gsutil cp {T5_VOCABULARY} checkpoints/t5_vocab/",
           *(f"gsutil -m cp -r {T5X_CHECKPOINTS.format(size=size)} checkpoints/t5_1_1_{size}/"
             for size in ("small", args.verifier)))
  sweep = (f"gsutil -m rsync -r {exports} outputs/paper_t5/export && "
           f"python scripts/sweep.py --multihost --gin_file={args.config} "
           f"--gin_bindings=\"verifier/ModelSource.path = 'outputs/paper_t5/export/{args.verifier}'\"")
  return Run(args.name or f"specdec-{task}", fetch, (train("small"), train(args.verifier)), sweep,
             f"outputs/paper_t5/{task}", results)


def gemma_run(args: argparse.Namespace) -> Run:
  """The Gemma experiments: no fine-tuning; checkpoints and tfds data from the bucket; the sweep on the mesh
  `gemma_sizing` chose, each host its block of the grid."""
  verifier, task, pretrained = GEMMA_PATTERN.search(args.config).groups()
  sizing = gemma_sizing(args)
  run = f"2b_{verifier}{pretrained or ''}"
  suffix = "" if pretrained else "-it"
  fetch = tuple(f"gsutil -m cp -r {args.bucket}/checkpoints/{checkpoint} checkpoints/"
                for checkpoint in (f"gemma-2-2b{suffix}", f"gemma-2-{verifier}{suffix}"))
  sweep = (f"python scripts/sweep.py --multihost --gin_file={args.config} "
           f"--gin_bindings=\"Experiment.mesh_shape = {sizing.mesh}\" "
           f"--gin_bindings=\"Experiment.batch_size = {sizing.batch_size}\" "
           f"--gin_bindings=\"Experiment.tfds_data_dir = '{args.bucket}/tfds'\"")
  return Run(args.name or f"specdec-gemma-{run}-{task}".replace("_", "-"), fetch, (), sweep,
             f"outputs/paper_gemma/{run}/{task}", f"{args.bucket}/results/paper_gemma/{run}/{task}")


def plan(args: argparse.Namespace) -> list[Command]:
  """Every command of the launch, in order (only `args.stage`'s unless 'all')."""
  run = gemma_run(args) if GEMMA_PATTERN.search(args.config) else t5_run(args)
  generation = args.tpu.split("-")[0]
  location = ["--zone", args.zone or DEFAULT_ZONES[generation]] + (["--project", args.project] if args.project else [])
  code = f"{args.bucket}/code/specdec.tar.gz"

  def on_workers(script: str) -> tuple[str, ...]:
    return ("gcloud", "compute", "tpus", "tpu-vm", "ssh", run.name, *location, "--worker=all", "--command", script)

  setup = " && ".join([
      f"gsutil cp {code} . && mkdir -p specdec && tar -xzf specdec.tar.gz -C specdec && cd specdec",
      "python3 -m venv .venv && . .venv/bin/activate",
      "pip install -c constraints.txt -e '.[seqio]' 'jax[tpu]'", *run.fetch])
  enter = "cd specdec && . .venv/bin/activate && "
  stages = {
      "create": [("gcloud", "compute", "tpus", "tpu-vm", "create", run.name, *location,
                  f"--accelerator-type={args.tpu}", f"--version={RUNTIMES[generation]}")],
      "install": [("git", "archive", "--format=tar.gz", "-o", "/tmp/specdec.tar.gz", "HEAD"),
                  ("gsutil", "cp", "/tmp/specdec.tar.gz", code),
                  on_workers(setup)],
      "finetune": [on_workers(enter + script) for script in run.finetune],
      "sweep": [on_workers(f"{enter}{run.sweep} && gsutil -m cp {run.local_results}/results*.jsonl {run.results}/")],
      "plot": [("mkdir", "-p", run.local_results),
               ("gsutil", "-m", "cp", f"{run.results}/results*.jsonl", f"{run.local_results}/"),
               ("python", "scripts/plot.py", f"--results={run.local_results}/results.jsonl")],
      "delete": [("gcloud", "compute", "tpus", "tpu-vm", "delete", run.name, *location, "--quiet")],
  }
  chosen = STAGES if args.stage == "all" else (args.stage,)
  return [Command(stage, tuple(argv)) for stage in chosen for argv in stages[stage]]


def gemma_sizing(args: argparse.Namespace) -> Sizing:
  """The config's experiment (batch size, prompt and output budgets, γ) sized for a host of `args.tpu`."""
  import gin
  import jax.numpy as jnp
  from specdec.evaluation import grid
  gin.clear_config()
  try:
    experiment = grid.parse_gin([str(REPO_ROOT / args.config)])
  finally:
    gin.clear_config()
  task = grid.find_task(experiment.task)
  # prompt budget + output + the speculative loop's overhang (γ + 1 positions past the output)
  cache_length = task.max_input_tokens + task.max_target_tokens + max(experiment.gammas) + 1
  dtypes = {source.dtype or "float32" for source in (experiment.drafter, experiment.verifier)}
  if len(dtypes) != 1:
    raise ValueError(f"the sizing assumes one dtype for both models; the config loads {sorted(dtypes)}")
  verifier, batch_size = GEMMA_PATTERN.search(args.config).group(1), args.batch_size or experiment.batch_size
  compiled = compiled_sizing(args.tpu, experiment, verifier, batch_size) if args.compile_sizing else None
  return compiled or size_mesh(args.tpu, verifier, cache_length, batch_size, jnp.dtype(dtypes.pop()).itemsize)


def main(argv: list[str] | None = None) -> list[Command]:
  """Prints each stage's name (as a comment) and its commands; runs them unless --dry_run (from the
  repository root, stopping at the first failure)."""
  args = parse_args(argv)
  if GEMMA_PATTERN.search(args.config):
    print(f"# sizing: {gemma_sizing(args).describe()}", flush=True)
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
