"""Runs a quality/latency sweep: `specdec-sweep` (specdec/cli/sweep.py; `--help` for its options), here as the
script the recorded commands run."""

from specdec.cli.sweep import console, main  # noqa: F401

if __name__ == "__main__":
  console()
