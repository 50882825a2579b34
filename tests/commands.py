"""Running a command as a user does, in its own process (the command-line tests): `command`, its environment
`ENV`, and `interrupt` / `interrupted_line` for Ctrl-C; and `load_script`, a script of scripts/ as a module."""

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from specdec.data import load_vocabulary

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = load_vocabulary().vocab_size   # the shipped vocabulary's size


def command(module: str, *args: str) -> list[str]:
  """`python -m specdec.cli.<module> args…`: what the console script runs."""
  return [sys.executable, "-m", f"specdec.cli.{module}", *args]


def load_script(name: str):
  """scripts/<name>.py imported as the module `<name>_script` (its `main` called in-process)."""
  spec = importlib.util.spec_from_file_location(f"{name}_script", REPO_ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO_ROOT)}


def interrupt(argv: list[str], ready: Callable[[str], bool], *, cwd=None, timeout: float = 300
              ) -> tuple[subprocess.CompletedProcess, float]:
  """Runs `argv`, presses Ctrl-C (SIGINT) once `ready(stderr so far)` holds, and waits for the end: the
  finished process and the seconds from the signal to its exit."""
  with tempfile.NamedTemporaryFile("w+") as stdout, tempfile.NamedTemporaryFile("w+") as stderr:
    def written() -> str:
      return pathlib.Path(stderr.name).read_text()
    # SIGINT as a terminal gives it, even where this test runs with it ignored (a shell's background job
    # ignores SIGINT, and its children inherit that: Python then installs no KeyboardInterrupt handler).
    process = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=ENV, cwd=cwd,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + timeout
    while not ready(written()):
      if process.poll() is not None or time.monotonic() > deadline:
        process.kill()
        raise AssertionError(f"never ready (exit {process.returncode}):\n{written()[-3000:]}")
      time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    exited = time.monotonic() - signalled
    result = subprocess.CompletedProcess(argv, process.returncode, pathlib.Path(stdout.name).read_text(), written())
  return result, exited


def interrupted_line(result: subprocess.CompletedProcess, prog: str) -> str:
  """The one line a Ctrl-C prints (exit status 130, no traceback): after any progress bar, the last line."""
  assert result.returncode == 130, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
  lines = result.stderr.rstrip("\n").split("\n")
  assert [line for line in lines if "interrupted" in line] == [lines[-1]], result.stderr[-3000:]
  assert lines[-1].startswith(f"{prog}: interrupted; "), lines[-1]
  return lines[-1]
