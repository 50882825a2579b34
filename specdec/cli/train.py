"""Trains a model from gin files and bindings (t5x style).

  specdec-train --gin_file=configs/train/tiny_synthetic.gin \
      --gin_bindings="train.num_steps = 100" --gin_bindings="train.model_dir = '/tmp/tiny'"

`train` is `specdec.training.train_and_evaluate`; `make_optimizer`, the data sources `markov_batches`
(synthetic), `prefix_lm_batches` and `seq2seq_batches` (the local Debian tasks for decoder-only and T5
models, `specdec.data.tasks`), `seqio_batches` (a seqio task such as the paper's WMT / XSum / CNN-DM:
`specdec.data.seqio_tasks`) and `export` (the trained parameters as a model directory for
`checkpoint.load_model`, e.g. in bfloat16) are configurable too. It resumes from the latest checkpoint in
`train.model_dir` and writes the gin config it ran with there (config.gin). Gin files and their includes are
looked up from the working directory, then from the repository root (or the installed copy of configs/).
"""

from __future__ import annotations

import gin
import jax
import jax.numpy as jnp
from etils import epath

from specdec import cli, models, training
from specdec.data import seqio_tasks, shipped, tasks

train = gin.configurable("train")(training.train_and_evaluate)
gin.external_configurable(training.make_optimizer, "make_optimizer")
gin.external_configurable(training.markov_batches, "markov_batches")
gin.external_configurable(tasks.prefix_lm_batches, "prefix_lm_batches")
gin.external_configurable(tasks.seq2seq_batches, "seq2seq_batches")
gin.external_configurable(seqio_tasks.seqio_batches, "seqio_batches")

PROG = "specdec-train"


@gin.configurable
def export(state: training.TrainState, *, path: str | None = None, dtype: str = "bfloat16") -> None:
  """Writes the trained parameters, cast to `dtype`, as a model directory (`checkpoint.save_params`)."""
  if path is None:
    return
  preset = gin.query_parameter("train.preset")
  model = models.build(preset, vocab_size=gin.query_parameter("train.vocab_size"),
                       max_length=gin.query_parameter("train.max_length"))
  model = model.replace(params=training.cast_params(state.params, getattr(jnp, dtype)))
  training.save_params(path, model, preset=preset)
  print(f"exported {preset} ({models.count_params(model):,} parameters, {dtype}) to {path}", flush=True)


def parse_gin(gin_files: list[str], gin_bindings: list[str]) -> None:
  """Parses gin files, then bindings (which override them); files and includes are looked up from the working
  directory, then from the shipped root (`shipped.root()`: the checkout, or the installed configs)."""
  gin.add_config_file_search_path(str(shipped.root()))
  gin.parse_config_files_and_bindings(gin_files, gin_bindings)


def main(argv: list[str] | None = None):
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--gin_file", action="append", default=[], help="a gin file; repeatable, later ones win")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding such as \"train.num_steps = 100\"; repeatable, applied after the files")
  parser.add_argument("--multihost", action="store_true",
                      help="jax.distributed.initialize() first (every host of a TPU slice runs this command; "
                           "train.mesh_shape spans all their chips, every host reads the same global batches)")
  args = parser.parse_args(argv)
  if args.multihost:
    jax.distributed.initialize()
  parse_gin(args.gin_file, args.gin_bindings)
  model_dir = gin.query_parameter("train.model_dir")
  if model_dir and jax.process_index() == 0:   # local or gs:// (etils.epath)
    epath.Path(model_dir).mkdir(parents=True, exist_ok=True)
    epath.Path(model_dir, "config.gin").write_text(gin.config_str())
  state, metrics = train()
  export(state)
  return state, metrics


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
