"""The command-line tools (setup.py's console scripts): `specdec-generate`, `specdec-sweep`,
`specdec-plot` and `specdec-train`, also `python -m specdec.cli.<name>`.

Each module has `main(argv) -> result`, which raises (tests call it), and `console()`, the installed
command: a user error (a bad value, a missing or unreadable file or checkpoint) prints one line naming the
parameter or file and exits with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import tokenize
from collections.abc import Callable, Sequence
from typing import Any

from specdec.training.checkpoint import CheckpointError

# What a user's input can cause: ValueError (UnicodeDecodeError is one), OSError (missing or unreadable
# files), CheckpointError, FloatingPointError (NaN logits of a model) and a gin file's syntax errors.
USER_ERRORS = (ValueError, OSError, CheckpointError, FloatingPointError, SyntaxError, tokenize.TokenError)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """The module docstring as written, wide enough for the options' help."""

  def __init__(self, prog: str):
    super().__init__(prog, max_help_position=32, width=110)


def parser(prog: str, doc: str) -> argparse.ArgumentParser:
  """An argument parser with the tools' shared `--debug` flag."""
  result = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
  result.add_argument("--debug", action="store_true", help="on an error, show its traceback")
  return result


def run(main: Callable[[Sequence[str]], Any], argv: Sequence[str], prog: str) -> int:
  """Runs `main(argv)` (without `--debug`, also removed from sys.argv for mains that parse it): 0, or 2 after
  one line on stderr for a user error (unless --debug)."""
  debug = "--debug" in argv
  if debug:
    argv = [a for a in argv if a != "--debug"]
    sys.argv = [a for a in sys.argv if a != "--debug"]
  try:
    main(list(argv))
  except USER_ERRORS as e:
    if debug:
      raise
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
  return 0


def console_for(main: Callable[[Sequence[str]], Any], prog: str) -> Callable[[], None]:
  """The console-script function of `main`."""
  def console() -> None:
    sys.exit(run(main, sys.argv[1:], prog))
  return console
