r"""Trains a model from gin files and bindings (t5x style).

  specdec-train --gin_file=configs/train/tiny_synthetic.gin \
      --gin_bindings="train.num_steps = 100" --gin_bindings="train.model_dir = '/tmp/tiny'"

`train` is `specdec.training.train_and_evaluate`; `make_optimizer`, the data sources `markov_batches`
(synthetic), `prefix_lm_batches` and `seq2seq_batches` (the local Debian tasks for decoder-only and T5
models, `specdec.data.tasks`), `seqio_batches` (a seqio task such as the paper's WMT / XSum / CNN-DM:
`specdec.data.seqio_tasks`) and `export` (the trained parameters as a model directory for
`training.load_model`, e.g. in bfloat16) are configurable too. It resumes from the latest checkpoint in
`train.model_dir` and writes the gin config it ran with there (config.gin); Ctrl-C keeps the checkpoints
saved so far, and the same command resumes from the latest.

A gin file may pick another recipe with `specdec_train.recipe`: 'feature_head' trains a feature drafter's
head (EAGLE) for an exported verifier (`train_feature_head`, i.e. `training.feature_head.train_and_save`;
configs/train/debian_feature_head.gin); it is written once, at the end. Gin files and their includes are looked up
from the working directory, then from the repository root (or the installed copy of configs/).
"""

from __future__ import annotations

import functools
import re
import shlex
import sys
from collections.abc import Callable

import gin

from specdec import cli
from specdec.data import shipped

PROG = "specdec-train"
_configured: dict[str, Callable] = {}


@functools.cache
def _register_configurables() -> Callable:
  """Registers `train` and the functions its gin files configure (imports JAX, so only once the arguments
  parse); returns `train`."""
  from specdec import training
  from specdec.data import seqio_tasks, tasks
  from specdec.training import feature_head
  train = gin.configurable("train")(training.train_and_evaluate)
  gin.external_configurable(training.make_optimizer, "make_optimizer")
  gin.external_configurable(training.markov_batches, "markov_batches")
  gin.external_configurable(tasks.prefix_lm_batches, "prefix_lm_batches")
  gin.external_configurable(tasks.seq2seq_batches, "seq2seq_batches")
  gin.external_configurable(seqio_tasks.seqio_batches, "seqio_batches")
  _configured["train_feature_head"] = gin.external_configurable(feature_head.train_and_save,
                                                                "train_feature_head")
  return train


RECIPES = ("model", "feature_head")


@gin.configurable("specdec_train")
def recipe(recipe: str = "model") -> str:
  """What `specdec-train` trains: 'model' (`train`, then `export`) or 'feature_head' (`train_feature_head`)."""
  if recipe not in RECIPES:
    raise ValueError(f"specdec_train.recipe must be one of {', '.join(RECIPES)}; got {recipe!r}")
  return recipe


def _train_model():
  model_dir = gin.query_parameter("train.model_dir")
  cli.on_interrupt(lambda: _kept(model_dir))
  import jax
  from etils import epath
  if model_dir and jax.process_index() == 0:   # local or gs:// (etils.epath)
    epath.Path(model_dir).mkdir(parents=True, exist_ok=True)
    epath.Path(model_dir, "config.gin").write_text(gin.config_str())
  state, metrics = _register_configurables()()
  if model_dir:
    print(f"checkpoints and config.gin in {model_dir}", flush=True)
  export(state)
  return state, metrics


def _train_feature_head(command: str):
  verifier = gin.query_parameter("train_feature_head.verifier")
  out = gin.query_parameter("train_feature_head.out")
  try:
    self_distilled = gin.query_parameter("train_feature_head.data") == "self_distilled"
  except ValueError:   # not bound: the default, the Debian text
    self_distilled = False
  cli.on_interrupt(lambda: "the prompts, answers, feature shards and head checkpoints written so far are kept; the "
                           "same command resumes" if self_distilled else
                           f"nothing was saved (the head is written to {out} at the end); the same command starts over")
  # Explicit arguments win over the bindings: the verifier as a path or a shipped model's name.
  return _configured["train_feature_head"](verifier=shipped.find(verifier, "data/models"),
                                           command=command)


@gin.configurable
def export(state, *, path: str | None = None, dtype: str = "bfloat16") -> None:
  """Writes the trained parameters (a `training.TrainState`'s), cast to `dtype`, as a model directory
  (`checkpoint.save_params`)."""
  if path is None:
    print("not exported: export.path is not set (a model directory would need it)", flush=True)
    return
  import jax.numpy as jnp
  from specdec import models, training
  preset = gin.query_parameter("train.preset")
  model = models.build(preset, vocab_size=gin.query_parameter("train.vocab_size"),
                       max_length=gin.query_parameter("train.max_length"))
  model = model.replace(params=training.cast_params(state.params, getattr(jnp, dtype)))
  training.save_params(path, model, preset=preset)
  print(f"exported {preset} ({models.count_params(model):,} parameters, {dtype}) to {path}", flush=True)


def parse_gin(gin_files: list[str], gin_bindings: list[str]) -> None:
  """Parses gin files, then bindings (which override them); files and includes are looked up from the working
  directory, then from the shipped root (`shipped.root()`: the checkout, or the installed configs)."""
  _register_configurables()
  gin.add_config_file_search_path(str(shipped.root()))
  with cli.quiet_gin_lookups():
    gin.parse_config_files_and_bindings(gin_files, gin_bindings)


def saved_steps(model_dir: str) -> list[int]:
  """The steps of the finished checkpoints in `model_dir` (orbax writes each to a <step>/ folder, renamed
  from a temporary name once complete)."""
  from etils import epath
  directory = epath.Path(model_dir)
  if not directory.exists():
    return []
  return sorted(int(path.name) for path in directory.iterdir() if re.fullmatch(r"\d+", path.name))


def _kept(model_dir: str | None) -> str:
  """What an interrupted run keeps (`cli.on_interrupt`)."""
  if not model_dir:
    return "nothing was saved (train.model_dir is not set)"
  steps = saved_steps(model_dir)
  if not steps:
    return f"no checkpoint was saved yet in {model_dir} (train.save_every); the same command starts over"
  return f"checkpoints in {model_dir} are kept (latest: step {steps[-1]}); the same command resumes from it"


def main(argv: list[str] | None = None):
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--gin_file", action="append", default=[], help="a gin file; repeatable, later ones win")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding such as \"train.num_steps = 100\"; repeatable, applied after the files")
  parser.add_argument("--multihost", action="store_true",
                      help="jax.distributed.initialize() first (every host of a TPU slice runs this command; "
                           "train.mesh_shape spans all their chips, every host reads the same global batches)")
  args = parser.parse_args(argv)
  cli.check_gin_files(args.gin_file)
  import jax
  if args.multihost:
    jax.distributed.initialize()
  parse_gin(args.gin_file, args.gin_bindings)
  if recipe() == "feature_head":
    return _train_feature_head(shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)]))
  return _train_model()


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
