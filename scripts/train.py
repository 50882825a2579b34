"""Trains a model from gin files and bindings (t5x style).

  python scripts/train.py --gin_file=configs/train/tiny_synthetic.gin \
      --gin_bindings="train.num_steps = 100" --gin_bindings="train.model_dir = '/tmp/tiny'"

`train` is `specdec.training.train_and_evaluate`; `make_optimizer` and `markov_batches` (the synthetic
data source) are configurable too. It resumes from the latest checkpoint in `train.model_dir` and writes
the gin config it ran with there (config.gin). Gin files and their includes are looked up from the
working directory, then from the repository root.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import gin

from specdec import training

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

train = gin.configurable("train")(training.train_and_evaluate)
gin.external_configurable(training.make_optimizer, "make_optimizer")
gin.external_configurable(training.markov_batches, "markov_batches")


def parse_gin(gin_files: list[str], gin_bindings: list[str]) -> None:
  """Parses gin files, then bindings (which override them)."""
  gin.add_config_file_search_path(str(REPO_ROOT))
  gin.parse_config_files_and_bindings(gin_files, gin_bindings)


def main(argv: list[str] | None = None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="a gin file; repeatable, later ones win")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="a gin binding such as \"train.num_steps = 100\"; repeatable, applied after the files")
  args = parser.parse_args(argv)
  parse_gin(args.gin_file, args.gin_bindings)
  model_dir = gin.query_parameter("train.model_dir")
  if model_dir:
    os.makedirs(model_dir, exist_ok=True)
    pathlib.Path(model_dir, "config.gin").write_text(gin.config_str())
  return train()


if __name__ == "__main__":
  main()
