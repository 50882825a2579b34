"""Trains a model from gin files: `specdec-train` (specdec/cli/train.py; `--help` for its options), here as the
script the recorded commands run."""

from specdec.cli.train import console, export, main, parse_gin  # noqa: F401

if __name__ == "__main__":
  console()
