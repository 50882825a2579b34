"""Pareto plots and tables of a sweep's results: `specdec-plot` (specdec/cli/plot.py; `--help` for its options), here as the
script the recorded commands run."""

from specdec.cli.plot import console, main  # noqa: F401

if __name__ == "__main__":
  console()
