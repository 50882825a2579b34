"""The command-line tools (setup.py's console scripts): `specdec-generate`, `specdec-sweep`,
`specdec-plot` and `specdec-train`, also `python -m specdec.cli.<name>`.

Each module has `main(argv) -> result`, which raises (tests call it), and `console()`, the installed
command: a user error (a bad value, a missing or unreadable file or checkpoint) prints one line naming the
parameter or file and exits with status 2; `--debug` shows the traceback instead. Ctrl-C prints one line
saying what was kept and how to resume (`on_interrupt`) and exits with status 130. Importing this package
does not import JAX: the commands check their arguments first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import tokenize
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

# What a user's input can cause: ValueError (UnicodeDecodeError is one), OSError (missing or unreadable
# files), FloatingPointError (NaN logits of a model), a gin file's syntax errors, and
# specdec.training.checkpoint.CheckpointError (`_user_errors`: added once that module is loaded).
# A missing optional package (libtpu for specdec-plan, …) is the user's to install: one line saying how.
USER_ERRORS = (ValueError, OSError, FloatingPointError, SyntaxError, tokenize.TokenError, ModuleNotFoundError)

# Ctrl-C: the main thread runs its signal handler only when it returns from C code, and XLA compiling or
# running a loop holds it for many seconds. A watcher thread, woken by the signal itself, ends the process
# for it when the main thread has not begun to within this many seconds.
INTERRUPT_GRACE_SECONDS = 0.5
INTERRUPTED_STATUS = 130


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
  """The module docstring as written, wide enough for the options' help."""

  def __init__(self, prog: str):
    super().__init__(prog, max_help_position=32, width=110)


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser, whose errors are one line (no usage block), like the commands' other errors."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (--help for the options)\n")


def parser(prog: str, doc: str) -> ArgumentParser:
  """An argument parser with the tools' shared `--debug` flag."""
  result = ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
  result.add_argument("--debug", action="store_true", help="on an error, show its traceback")
  return result


def check_gin_files(gin_files: Sequence[str]) -> None:
  """Each gin file exists in the working directory or under the shipped root (the checkout, or the installed
  configs/), or a one-line error naming it, before JAX is imported."""
  from specdec.data import shipped
  for path in gin_files:
    if not (os.path.isfile(path) or (not os.path.isabs(path) and shipped.path(path).is_file())):
      raise FileNotFoundError(f"--gin_file {path}: no such file (looked in the working directory and in "
                              f"{shipped.root()})")


def _config_on_python_path(path: str) -> bool:
  """gin's `resource_reader.system_path_file_exists` (a gin file inside an importable package), without its
  `ERROR:root:Path not found: …` line for each miss, and a miss rather than a TypeError where the folder is
  a namespace package (`configs/` with the checkout on PYTHONPATH and another working directory)."""
  from gin import resource_reader
  try:
    return os.path.isfile(resource_reader._parse_config_path(path))
  except (ImportError, ValueError, TypeError):
    return False


@contextlib.contextmanager
def quiet_gin_lookups() -> Iterator[None]:
  """While gin parses: gin looks for each file and include in the working directory, then in each search
  path (the shipped configs), trying its Python-path reader at each place; that reader's misses are quiet
  (`_config_on_python_path`). A file that is nowhere is still an error ("Unable to open file")."""
  from gin import config, resource_reader
  readers = list(config._FILE_READERS)
  config._FILE_READERS[:] = [(read, _config_on_python_path if exists is resource_reader.system_path_file_exists
                              else exists) for read, exists in readers]
  try:
    yield
  finally:
    config._FILE_READERS[:] = readers


def _user_errors() -> tuple[type[BaseException], ...]:
  checkpoint = sys.modules.get("specdec.training.checkpoint")
  return USER_ERRORS + ((checkpoint.CheckpointError,) if checkpoint is not None else ())


# --- Ctrl-C ---------------------------------------------------------------------------------------------

def _nothing_written() -> str:
  return "nothing was written"


class _Interrupt:
  """The state of Ctrl-C handling: the running command's name, what it says it keeps, and who exits."""
  prog: str | None = None
  describe: Callable[[], str] = staticmethod(_nothing_written)
  main_thread_exiting = threading.Event()
  exit_lock = threading.Lock()
  watching = False


def on_interrupt(describe: Callable[[], str]) -> None:
  """From now on, Ctrl-C prints `describe()` after "<prog>: interrupted; ": what the run has kept and how
  to resume it, one sentence; it may also remove temporary files. It may run on another thread than the
  main one, while that one is inside compiled code, so it must not wait for the main thread."""
  _Interrupt.describe = staticmethod(describe)


def _exit_interrupted() -> NoReturn:
  """Prints the interrupt line and ends the process at once (exit status 130): no traceback, and no
  interpreter shutdown while XLA's threads run (which crashed with SIGSEGV)."""
  with _Interrupt.exit_lock:   # held until the process ends: the main thread or the watcher, never both
    try:
      kept = _Interrupt.describe()
    except Exception as e:  # noqa: BLE001 (the line must still be printed)
      kept = f"could not tell what was kept ({type(e).__name__}: {e})"
    progress = sys.modules.get("tqdm")
    after_bar = "\n" if progress is not None and getattr(progress.tqdm, "_instances", None) else ""
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001 (closed, or a write this handler interrupted: RuntimeError, reentrant)
        pass
    os.write(2, f"{after_bar}{_Interrupt.prog}: interrupted; {kept}\n".encode("utf-8", "replace"))
    os._exit(INTERRUPTED_STATUS)


def _on_interrupt(*_: Any) -> NoReturn:
  """Ctrl-C in the main thread: the interrupt line, and the end of the process."""
  _Interrupt.main_thread_exiting.set()
  signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not interrupt the message
  _exit_interrupted()


def _watch_for_interrupts() -> None:
  """Starts (once per process, from the main thread) the thread that exits on Ctrl-C when the main
  thread cannot: the signal wakes it through `signal.set_wakeup_fd`. A KeyboardInterrupt raised where
  Python cannot propagate it (in a garbage-collection callback of JAX's) is not printed ("Exception
  ignored …"): the watcher ends the process instead. Results files stay whole when it does so while the
  main thread runs: `specdec-generate` appends a batch's lines in one write(2), and a sweep's line is
  either written whole or, still in Python's buffer, lost (its point is then redone)."""
  if _Interrupt.watching or threading.current_thread() is not threading.main_thread():
    return
  read_end, write_end = os.pipe()
  os.set_blocking(write_end, False)
  signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
  _Interrupt.watching = True
  report_unraisable = sys.unraisablehook

  def unraisable(info: Any) -> None:
    if _Interrupt.prog is None or info.exc_type is None or not issubclass(info.exc_type, KeyboardInterrupt):
      report_unraisable(info)
  sys.unraisablehook = unraisable

  def watch() -> None:
    while True:
      signals = os.read(read_end, 64)
      if signal.SIGINT in signals and _Interrupt.prog is not None:
        if not _Interrupt.main_thread_exiting.wait(INTERRUPT_GRACE_SECONDS):
          _exit_interrupted()

  threading.Thread(target=watch, name="specdec-interrupt", daemon=True).start()


# --- running a command ------------------------------------------------------------------------------------

def run(main: Callable[[Sequence[str]], Any], argv: Sequence[str], prog: str) -> int:
  """Runs `main(argv)` (without `--debug`, also removed from sys.argv for mains that parse it): 0, or 2 after
  one line on stderr for a user error (unless --debug). Ctrl-C ends the process with status 130 after one
  line (`on_interrupt`)."""
  debug = "--debug" in argv
  if debug:
    argv = [a for a in argv if a != "--debug"]
    sys.argv = [a for a in sys.argv if a != "--debug"]
  _Interrupt.prog, _Interrupt.describe = prog, staticmethod(_nothing_written)
  _watch_for_interrupts()
  # A SIGINT the parent set to be ignored (a background job of a shell) stays ignored.
  in_main_thread = (threading.current_thread() is threading.main_thread()
                    and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
  # Ctrl-C ends the process from the handler itself rather than as a KeyboardInterrupt, which libraries
  # catch, log with a traceback and re-raise (orbax, waiting for a checkpoint to be written).
  previous = signal.signal(signal.SIGINT, _on_interrupt) if in_main_thread else None
  try:
    main(list(argv))
  except KeyboardInterrupt:
    _on_interrupt()
  except _user_errors() as e:
    if debug:
      raise
    message = " ".join(str(e).split()) or type(e).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
  finally:
    _Interrupt.prog = None
    if in_main_thread:
      signal.signal(signal.SIGINT, previous)
  return 0


def console_for(main: Callable[[Sequence[str]], Any], prog: str) -> Callable[[], None]:
  """The console-script function of `main`."""
  def console() -> None:
    sys.exit(run(main, sys.argv[1:], prog))
  return console
