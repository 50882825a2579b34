"""Running model-written Python against its tests (MBPP's pass@1), contained (layer 5).

  result = run_program(code, ["assert add(1, 2) == 3"], timeout_s=10)
  result.passed, result.status        # True, "passed" ("failed", "timeout", "blocked", "error")
  result.isolation                    # "namespaces" (or "audit-hook" where namespaces are unavailable)

Each program runs in a fresh `python -I` subprocess, in its own session, in a throw-away directory that is
also its HOME and TMPDIR, with an empty environment, behind two walls:

- the operating system's ("namespaces", where the machine allows unprivileged user namespaces and util-linux's
  `unshare` is installed: `default_isolation()`): its own user, mount, network and PID namespaces. Every mount is
  read-only but the throw-away directory and a private /tmp (a tmpfs); /proc is the PID namespace's own, /dev
  holds null, zero, full, random and urandom only, /home and /root are empty (Python's own directories bound
  back read-only); the network has an unconfigured loopback and nothing else; the program is the namespace's
  init, so whatever it starts dies with it; it may run at most `MAX_PROCESSES` processes and threads
  (RLIMIT_NPROC, which Linux does not apply to root's processes); and every capability is dropped before its
  first line;
- a Python audit hook (PEP 578, installed before the program's first line and not removable from Python)
  that refuses: creating processes (fork, exec, spawn, system, subprocess), signalling others, network
  sockets, loading native code (ctypes, dlopen), importing the modules that bypass those checks or open files
  from C (sqlite3, dbm, readline, curses, tkinter, POSIX shared memory, syslog, CPython's test modules), FIFOs
  and device nodes (os.mkfifo, os.mknod), and any write, rename, removal, link, permission or extended-
  attribute change outside the throw-away directory, through paths, file descriptors or `dir_fd`.

and resource limits, set by the child before the program runs: address space (`memory_bytes`), CPU seconds,
file size, open files; and a wall-clock `timeout_s` after which the whole process group (and with it the
PID namespace) is killed. A refused operation raises PermissionError in the program (status "blocked" if it
ends the run); under namespaces an outside write fails with OSError (read-only file system) even where the
hook would let it through. Where namespaces are unavailable, the first run warns once, naming what is
missing, and programs run behind the audit hook alone: a list of what it knows to refuse, which code written
to defeat it (patching the standard library it calls, racing it from a thread) can get past. Neither wall
stands against a kernel exploit: run code written to attack the machine in a VM or gVisor as well.

`Result.detail` holds the end of the program's stderr (at most `DETAIL_LINES` lines, `DETAIL_CHARS`
characters), which is all a run reports of what the program read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from typing import BinaryIO

ISOLATIONS = ("namespaces", "audit-hook")
MAX_PROGRAM_CHARS = 1 << 20          # setup, program and tests together: MBPP's are a few kB
MAX_PROCESSES = 64                   # per program under namespaces, threads included (RLIMIT_NPROC)
DETAIL_LINES, DETAIL_CHARS = 20, 2000
_ISOLATION_FAILED = 125              # the guard's exit status when the namespaces could not be set up

# The program runs as: (under namespaces) the isolation, then the limits, the audit hook, the code, the tests.
_GUARD = r'''
import os, sys


def _isolate():
    """Inside fresh user, mount and network namespaces (`unshare`), as their root: every mount read-only, /dev
    reduced to its harmless nodes, /home and /root emptied but for Python's own directories, a private /tmp,
    the working directory read-write; then forks the init of the new PID namespace, which mounts its /proc,
    drops every capability and goes on to run the program."""
    import codecs, ctypes, errno, signal
    libc = ctypes.CDLL(None, use_errno=True)
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    NOATIME, NODIRATIME, RELATIME, STRICTATIME = 1024, 2048, 1 << 21, 1 << 24

    def mount(source, target, fstype, flags, data=None):
        names = [None if name is None else os.fsencode(name) for name in (source, target, fstype, data)]
        if libc.mount(names[0], names[1], names[2], ctypes.c_ulong(flags), names[3]) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"mount {os.fsdecode(target)}: {os.strerror(number)}")

    def prctl(option, value):
        return libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))

    def remount(target, flags):
        # A user namespace may not change a mount's nosuid, nodev, noexec or atime flags: keep them as they are.
        now = os.statvfs(target).f_flag
        flags |= now & (NOSUID | NODEV | NOEXEC | NOATIME | NODIRATIME)
        flags |= RELATIME if now & os.ST_RELATIME else 0 if now & NOATIME else STRICTATIME
        mount(None, target, None, REMOUNT | BIND | flags)

    def cover(target, keep):
        """An empty read-only tmpfs over `target`, with the paths in `keep` (inside it) bound back as they were."""
        opened = [(path, os.path.isdir(path), os.open(path, os.O_PATH)) for path in keep]
        mount("tmpfs", target, "tmpfs", NOSUID | NODEV, "mode=755,size=64k")
        for path, is_directory, fd in opened:
            os.makedirs(path if is_directory else os.path.dirname(path), exist_ok=True)
            if not is_directory:
                open(path, "x").close()
            mount(f"/proc/self/fd/{fd}", path, None, BIND | REC)
            os.close(fd)
        remount(target, RDONLY)

    def within(path, directory):
        return path == directory or path.startswith(directory.rstrip("/") + "/")

    directory = os.getcwd()
    python = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                   sys.base_exec_prefix, *sys.path) if os.path.exists(p)})
    python = [p for i, p in enumerate(python) if not any(within(p, q) for q in python[:i])]
    mount(None, "/", None, REC | PRIVATE)
    with open("/proc/self/mountinfo", "rb") as mounts:
        targets = [codecs.escape_decode(line.split()[4])[0] for line in mounts]
    for target in targets:
        try:
            remount(target, RDONLY)
        except OSError as e:     # a mount out of reach (under a directory it may not enter): the program's too
            if e.errno not in (errno.EACCES, errno.ENOENT):
                raise
    cover("/dev", [f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom")
                   if os.path.exists(f"/dev/{name}")])
    for home in ("/home", "/root"):
        if os.path.isdir(home) and not within(directory, home) and not any(within(home, p) for p in python):
            cover(home, [p for p in python if within(p, home)])
    mount("tmpfs", "/tmp", "tmpfs", NOSUID | NODEV, "mode=1777,size=64m")
    os.makedirs(directory, exist_ok=True)     # under the new /tmp, or already there
    mount(".", directory, None, BIND)         # "." is still the directory the parent made
    remount(directory, 0)
    os.chdir(directory)
    program = os.fork()                       # the first process of the new PID namespace: its init
    if program:                               # this one, outside it, ends as the program does
        status = os.waitstatus_to_exitcode(os.waitpid(program, 0)[1])
        if status < 0:                        # killed: by the same signal
            if -status != signal.SIGKILL:
                signal.signal(-status, signal.SIG_DFL)
            os.kill(os.getpid(), -status)
        os._exit(status)
    prctl(1, signal.SIGKILL)                  # PR_SET_PDEATHSIG: killed with the process outside
    mount("proc", "/proc", "proc", RDONLY | NOSUID | NODEV | NOEXEC)
    prctl(38, 1)                              # PR_SET_NO_NEW_PRIVS
    capability = 0
    while prctl(24, capability) == 0:         # PR_CAPBSET_DROP, up to the kernel's last capability (EINVAL)
        capability += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)    # _LINUX_CAPABILITY_VERSION_3, this process
    if ctypes.get_errno() != errno.EINVAL or libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), f"dropping capabilities: {os.strerror(ctypes.get_errno())}")
    for name in [name for name in sys.modules if name.split(".")[0] in ("ctypes", "_ctypes", "signal")]:
        del sys.modules[name]                 # a cached module would skip the hook's import check


def _limit(memory, cpu, processes):
    import resource
    limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 16 << 20),
              (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]
    for limit, value in limits + ([(resource.RLIMIT_NPROC, processes)] if processes else []):
        resource.setrlimit(limit, (value, value))
    del sys.modules["resource"]      # a cached module would skip the hook's import check


def _install_audit_hook():
    """The second wall (module docstring); what it checks against (the directory, the lists, the functions it
    resolves paths with) lives in this closure, out of reach of a program that rebinds names."""
    import posix
    root = os.path.realpath(os.getcwd())
    realpath, join, dirname, isdir = os.path.realpath, os.path.join, os.path.dirname, os.path.isdir
    readlink, fsdecode, write_flags = os.readlink, os.fsdecode, os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
    blocked_events = {
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
        "os.kill", "os.killpg", "os.setuid", "os.setgid", "os.chroot", "socket.__new__", "socket.connect",
        "socket.bind", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
        "ctypes.call_function", "sys.setprofile", "sys.settrace", "sys.addaudithook", "sqlite3.connect",
    }
    blocked_modules = {
        "_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "multiprocessing", "_multiprocessing",
        "subprocess", "pty", "resource", "signal", "mmap", "_xxsubinterpreters", "sqlite3", "_sqlite3", "dbm",
        "_dbm", "_gdbm", "readline", "_curses", "_curses_panel", "curses", "_tkinter", "tkinter", "_posixshmem",
        "syslog", "ossaudiodev", "_testcapi", "_testinternalcapi", "_testbuffer", "_testclinic",
        "_testmultiphase", "_testimportmultiple", "_xxtestfuzz", "_ctypes_test",
    }
    # event: its (path, dir_fd) argument positions (dir_fd -1 or None: relative to the working directory)
    path_events = {
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
        "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.mkdir": ((0, 2),),
        "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),), "os.chdir": ((0, None),),
    }

    def resolve(path, dir_fd=None):
        if isinstance(path, int):                          # a file descriptor: the file it is open on
            return readlink(f"/proc/self/fd/{path}")
        path = fsdecode(path)
        if dir_fd is not None and dir_fd >= 0:
            path = join(readlink(f"/proc/self/fd/{dir_fd}"), path)
        return realpath(path)

    def inside(path, dir_fd=None):
        try:
            path = resolve(path, dir_fd)
        except (OSError, TypeError, ValueError):           # nothing to resolve it with: refused
            return False
        return path == root or path.startswith(root + "/")

    def refuse(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def guard(event, args):
        if event in blocked_events:
            refuse(event)
        if event == "import" and args[0].split(".")[0] in blocked_modules:
            refuse(f"import {args[0]}")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and flags is not None and flags & write_flags)
            # an open directory outside would serve as a dir_fd, which the "open" event does not show
            directory = not writing and path is not None and not isinstance(path, int) and isdir(path)
            if (writing or directory) and path is not None and not inside(path):
                refuse(f"{'writing' if writing else 'opening the directory'} {path!r} outside the working directory")
        if event in path_events:
            for i, fd in path_events[event]:
                dir_fd = args[fd] if fd is not None and fd < len(args) else None
                if i < len(args) and args[i] is not None and not inside(args[i], dir_fd):
                    refuse(f"{event} on {args[i]!r} outside the working directory")
            if event == "os.symlink":                      # where the link will point, seen from where it is
                link = resolve(args[1], args[2])
                if not inside(join(dirname(link), fsdecode(args[0]))):
                    refuse(f"a symbolic link to {args[0]!r} outside the working directory")

    def refused(name):
        def function(*args, **kwargs):
            refuse(name)
        return function

    for name in ("mkfifo", "mknod"):                       # no audit event: taken away
        setattr(os, name, refused(f"os.{name}"))
        setattr(posix, name, refused(f"os.{name}"))
    sys.addaudithook(guard)


_memory, _cpu, _isolation = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if _isolation == "namespaces":
    try:
        _isolate()
    except Exception as e:
        print(f"sandbox: isolation failed: {type(e).__name__}: {e}", file=sys.stderr)
        os._exit(125)                         # _ISOLATION_FAILED
_limit(_memory, _cpu, int(sys.argv[4]) if _isolation == "namespaces" else 0)
_install_audit_hook()
del _isolate, _limit, _install_audit_hook, _memory, _cpu, _isolation
__builtins__.__dict__.pop("breakpoint", None)
with open("program.py", encoding="utf-8") as _file:
    _source = _file.read()
del _file
exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
'''


@dataclasses.dataclass(frozen=True)
class Result:
  """How a program ended: `status` is "passed" (exit 0), "failed" (an assertion or any other exception),
  "blocked" (the sandbox refused an operation), "timeout" (killed after timeout_s) or "error" (killed by a
  resource limit, not run: bad input, or its isolation could not be set up); `detail` is the end of its
  stderr or the reason; `isolation` the walls it ran behind ("namespaces" or "audit-hook"; "" when it did not
  run)."""
  status: str
  detail: str = ""
  isolation: str = ""

  @property
  def passed(self) -> bool:
    return self.status == "passed"


@functools.cache
def _namespaces_missing() -> str:
  """Why programs cannot run in namespaces here ("" when they can): tried once per process on an empty
  program; warns (once) where they cannot."""
  if not sys.platform.startswith("linux"):
    missing = f"Linux namespaces (this is {sys.platform})"
  elif shutil.which("unshare") is None:
    missing = "the unshare command (util-linux)"
  else:
    probe = _execute("pass", "namespaces", timeout_s=30.0, memory_bytes=1 << 30, cpu_s=10)
    missing = "" if probe.passed else f"namespaces through unshare ({probe.detail.strip() or probe.status})"
  if missing:
    warnings.warn(f"sandbox: model-written programs run behind the Python audit hook alone; missing: {missing}",
                  RuntimeWarning, stacklevel=3)
  return missing


def default_isolation() -> str:
  """The walls `run_program` puts programs behind by default here: "namespaces" where the machine allows
  them (tried once per process), else "audit-hook"."""
  return "audit-hook" if _namespaces_missing() else "namespaces"


def run_program(code: str, tests: Sequence[str] = (), *, setup: str = "", timeout_s: float = 10.0,
                memory_bytes: int = 1 << 30, cpu_s: int = 10, isolation: str | None = None) -> Result:
  """Runs `setup`, then `code`, then each of `tests` (statements, e.g. MBPP's asserts) as one program in
  the sandbox (module docstring), behind `isolation` (one of `ISOLATIONS`; default `default_isolation()`). Code
  that is not text, empty, or longer than `MAX_PROGRAM_CHARS` with its setup and tests is an "error" result.
  Raises ValueError on a non-positive limit, an unknown isolation, or namespaces where they are missing."""
  for name, value in (("timeout_s", timeout_s), ("memory_bytes", memory_bytes), ("cpu_s", cpu_s)):
    if not value > 0:
      raise ValueError(f"{name} must be > 0; got {value!r}")
  if isolation is None:
    isolation = default_isolation()
  elif isolation not in ISOLATIONS:
    raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}; got {isolation!r}")
  elif isolation == "namespaces" and _namespaces_missing():
    raise ValueError(f"isolation 'namespaces' is unavailable here; missing: {_namespaces_missing()}")
  if not isinstance(code, str):
    return Result("error", f"the program is not text but {type(code).__name__}")
  if not code.strip():
    return Result("error", "the program is empty")
  program = "\n".join([setup, code, *tests, ""])
  if len(program) > MAX_PROGRAM_CHARS:
    return Result("error", f"the program is {len(program):,} characters long with its setup and tests; "
                           f"at most {MAX_PROGRAM_CHARS:,} run")
  return _execute(program, isolation, timeout_s=timeout_s, memory_bytes=memory_bytes, cpu_s=cpu_s)


def _execute(program: str, isolation: str, *, timeout_s: float, memory_bytes: int, cpu_s: int) -> Result:
  try:
    source = program.encode("utf-8")
  except UnicodeEncodeError as e:
    return Result("error", f"the program is not valid text: {e.reason} at character {e.start}")
  with tempfile.TemporaryDirectory(prefix="specdec_sandbox_") as directory, tempfile.TemporaryFile() as stderr:
    directory = os.path.realpath(directory)
    with open(os.path.join(directory, "program.py"), "wb") as f:
      f.write(source)
    env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "PYTHONHASHSEED": "0",
           "LANG": "C.UTF-8"}
    command = [sys.executable, "-I", "-c", _GUARD, str(math.ceil(memory_bytes)), str(math.ceil(cpu_s)), isolation,
               str(MAX_PROCESSES)]
    if isolation == "namespaces":
      command = [shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--net", "--pid",
                 *command]
    process = subprocess.Popen(command, cwd=directory, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    try:
      _wait(process, timeout_s)
    except subprocess.TimeoutExpired:
      return Result("timeout", f"killed after {timeout_s:g} s", isolation)
    finally:
      _kill_group(process)   # anything the program left behind in its session (and its PID namespace)
    detail = _tail(stderr)
  if process.returncode == 0:
    return Result("passed", "", isolation)
  if process.returncode < 0:
    return Result("error", f"killed by signal {-process.returncode} (a resource limit)", isolation)
  if isolation == "namespaces" and (process.returncode == _ISOLATION_FAILED or detail.startswith("unshare: ")):
    return Result("error", detail, isolation)
  return Result("blocked" if "PermissionError: sandbox:" in detail else "failed", detail, isolation)


def _tail(stderr: BinaryIO) -> str:
  """The end of what the program wrote to stderr: its last `DETAIL_LINES` lines, at most `DETAIL_CHARS`
  characters, "…" first where cut."""
  size = stderr.seek(0, os.SEEK_END)
  stderr.seek(max(0, size - 4 * DETAIL_CHARS))
  text = stderr.read().decode("utf-8", "replace").rstrip("\n")
  lines = text.split("\n")
  last = "\n".join(lines[-DETAIL_LINES:])
  tail = last[-(DETAIL_CHARS - 1):]
  cut = size > 4 * DETAIL_CHARS or len(lines) > DETAIL_LINES or len(tail) < len(last)
  return "…" + tail if cut else tail


def _wait(process: subprocess.Popen, timeout_s: float) -> None:
  """`process.wait(timeout_s)`, woken by the exit itself where Linux gives a pidfd (Popen.wait polls, and
  notices an exit up to 50 ms late)."""
  try:
    pidfd = os.pidfd_open(process.pid)
  except (AttributeError, OSError):       # not Linux 5.3+
    pidfd = None
  if pidfd is not None:
    try:
      ended = select.select([pidfd], [], [], timeout_s)[0]
    finally:
      os.close(pidfd)
    if not ended:
      raise subprocess.TimeoutExpired(process.args, timeout_s)
  process.wait(timeout=timeout_s)


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

