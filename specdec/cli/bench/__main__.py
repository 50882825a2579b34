"""`python -m specdec.cli.bench`: specdec-bench."""

from specdec.cli.bench import console

console()
