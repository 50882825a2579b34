"""Running model-written Python against its tests (MBPP's pass@1), contained (layer 5).

  result = run_program(code, ["assert add(1, 2) == 3"], timeout_s=10)
  result.passed, result.status        # True, "passed" ("failed", "timeout", "blocked", "error")

Each program runs in a fresh `python -I` subprocess, in its own session, in a throw-away directory that is
also its HOME and TMPDIR, with an empty environment, and under
- resource limits, set by the child before the program runs: address space (`memory_bytes`), CPU seconds,
  file size, open files; and a wall-clock `timeout_s` after which the whole process group is killed;
- a Python audit hook (PEP 578, installed before the program's first line and not removable from Python)
  that refuses: creating processes (fork, exec, spawn, system, subprocess), signalling others, network
  sockets, loading native code (ctypes, dlopen), importing the modules that bypass those checks, and any
  write, rename, removal, link or permission change outside the throw-away directory.
A refused operation raises PermissionError in the program (status "blocked" if it ends the run).

This contains the accidents of model-written code and the usual escape attempts (an infinite loop, a fork
bomb, a write to the home directory, a download); it is not a security boundary against code written to
break out of CPython. For adversarial code, run the evaluation in a VM or a container (gVisor) as well.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

# The program runs as: the guard (limits already set by the parent), then the code, then the tests.
_GUARD = r'''
import os, sys
import resource
_memory, _cpu = int(sys.argv[1]), int(sys.argv[2])
for _limit, _value in ((resource.RLIMIT_AS, _memory), (resource.RLIMIT_CPU, _cpu), (resource.RLIMIT_FSIZE, 16 << 20),
                       (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(_limit, (_value, _value))
del resource, sys.modules["resource"]      # a cached module would skip the import check below
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "os.kill", "os.killpg", "os.setuid", "os.setgid", "os.chroot", "socket.__new__", "socket.connect",
    "socket.bind", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
    "ctypes.call_function", "sys.setprofile", "sys.settrace", "sys.addaudithook",
}
_BLOCKED_MODULES = {"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "multiprocessing",
                    "_multiprocessing", "subprocess", "pty", "resource", "signal", "mmap", "_xxsubinterpreters"}
_PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
                "os.symlink": (0, 1), "os.chmod": (0,), "os.chown": (0,), "os.mkdir": (0,), "os.truncate": (0,),
                "os.utime": (0,), "shutil.rmtree": (0,), "os.chdir": (0,)}

def _inside(path):
    if isinstance(path, int):        # a file descriptor this program opened
        return True
    path = os.fsdecode(path)
    return os.path.realpath(path) == _ROOT or os.path.realpath(path).startswith(_ROOT + os.sep)

def _guard(event, args):
    if event in _BLOCKED_EVENTS:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0].split(".")[0] in _BLOCKED_MODULES:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            mode is None and flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    if event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory is not allowed")

sys.addaudithook(_guard)
del _guard
__builtins__.__dict__.pop("breakpoint", None)
_source = open("program.py").read()
exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
'''


@dataclasses.dataclass(frozen=True)
class Result:
  """How a program ended: `status` is "passed" (exit 0), "failed" (an assertion or any other exception),
  "blocked" (the sandbox refused an operation), "timeout" (killed after timeout_s) or "error" (killed by a
  resource limit); `detail` is the end of its stderr."""
  status: str
  detail: str = ""

  @property
  def passed(self) -> bool:
    return self.status == "passed"


def run_program(code: str, tests: Sequence[str] = (), *, setup: str = "", timeout_s: float = 10.0,
                memory_bytes: int = 1 << 30, cpu_s: int = 10) -> Result:
  """Runs `setup`, then `code`, then each of `tests` (statements, e.g. MBPP's asserts) as one program in
  the sandbox (module docstring). Raises ValueError on non-positive limits."""
  if timeout_s <= 0 or memory_bytes <= 0 or cpu_s <= 0:
    raise ValueError(f"timeout_s, memory_bytes and cpu_s must be > 0; got {timeout_s}, {memory_bytes}, {cpu_s}")
  program = "\n".join([setup, code, *tests, ""])
  with tempfile.TemporaryDirectory(prefix="specdec_sandbox_") as directory:
    with open(os.path.join(directory, "program.py"), "w", encoding="utf-8") as f:
      f.write(program)
    env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "PYTHONHASHSEED": "0",
           "LANG": "C.UTF-8"}
    process = subprocess.Popen([sys.executable, "-I", "-c", _GUARD, str(memory_bytes), str(cpu_s)], cwd=directory,
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
      _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      _kill_group(process)
      return Result("timeout", f"killed after {timeout_s:g} s")
    finally:
      _kill_group(process)   # anything the program left behind in its session
  detail = stderr.decode("utf-8", "replace")[-2000:]
  if process.returncode == 0:
    return Result("passed")
  if process.returncode < 0:
    return Result("error", f"killed by signal {-process.returncode} (a resource limit)")
  return Result("blocked" if "PermissionError: sandbox:" in detail else "failed", detail)


def _kill_group(process: subprocess.Popen) -> None:
  try:
    os.killpg(process.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  process.wait()


def extract_code(response: str) -> str:
  """The program in a model's response: what lies between MBPP's "[BEGIN]" and "[DONE]" markers (or the
  whole response), and within that the first fenced block (```python … ```: instruction-tuned models write
  one, inside the markers too) without its language tag."""
  if "[BEGIN]" in response:
    response = response.split("[BEGIN]", 1)[1]
  response = response.split("[DONE]", 1)[0]
  if "```" in response:
    response = response.split("```", 2)[1]
    tag, _, rest = response.partition("\n")
    if re.fullmatch(r"[\w.+#-]*", tag.strip()):
      response = rest
  return response.strip("\n")


def pass_at_1(results: Sequence[Result]) -> float:
  """The fraction of programs that passed their tests (one sample per problem: pass@1), in percent."""
  return 100.0 * sum(r.passed for r in results) / max(len(results), 1)

