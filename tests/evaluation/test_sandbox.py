"""The sandbox that runs model-written code (MBPP pass@1): right and wrong programs are told apart behind
either isolation, and every escape — writes outside the throw-away directory (open, os.open, symlinks,
renames, sqlite3, mkfifo, mknod, xattrs), a network connection, processes that multiply or outlive the
program, memory, time — is contained behind the namespaces with the audit hook, behind the audit hook alone,
and behind the namespaces alone ("kernel": the hook taken out, so that the operating system's walls are
shown to hold by themselves)."""

import os
import socket
import tempfile
import time
import uuid
import warnings

import pytest

from specdec.evaluation import sandbox

ADD = "def add(a, b):\n  return a + b\n"
NAMESPACES = sandbox.default_isolation() == "namespaces"
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="this machine runs no Linux namespaces")
WALLS = [pytest.param("namespaces", marks=needs_namespaces), "audit-hook",
         pytest.param("kernel", marks=needs_namespaces)]


@pytest.fixture(params=WALLS)
def walls(request, monkeypatch):
  """(name, run): `run(code, **limits)` runs a program behind the walls named."""
  name = request.param
  if name == "kernel":
    without_hook = sandbox._GUARD.replace("\n_install_audit_hook()\n", "\n")
    assert without_hook != sandbox._GUARD
    monkeypatch.setattr(sandbox, "_GUARD", without_hook)
  isolation = "audit-hook" if name == "audit-hook" else "namespaces"

  def run(code, **limits):
    result = sandbox.run_program(code, isolation=isolation, **limits)
    assert result.isolation == isolation
    return result
  return name, run


@pytest.fixture
def outside():
  """A directory outside the sandbox's, off /tmp (which namespaces replace), holding keep.txt; checked
  untouched (the same names, contents, modes and no extended attributes) after the test."""
  base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
  directory = tempfile.mkdtemp(prefix="specdec_outside_", dir=base)
  keep = os.path.join(directory, "keep.txt")
  with open(keep, "w") as f:
    f.write("kept")
  mode = os.stat(keep).st_mode
  yield directory
  assert sorted(os.listdir(directory)) == ["keep.txt"]
  with open(keep) as f:
    assert f.read() == "kept"
  assert os.stat(keep).st_mode == mode and os.listxattr(keep) == []
  os.remove(keep)
  os.rmdir(directory)


def _processes_with(marker: str) -> list[int]:
  """Host processes whose command line holds `marker`, killed (a failing test leaves nothing running)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if marker.encode() in f.read():
          found.append(int(pid))
          os.kill(int(pid), 9)
    except OSError:
      pass
  return found


def test_a_right_program_passes_and_a_wrong_one_fails(walls):
  _, run = walls
  assert run(ADD + "assert add(1, 2) == 3\nassert add(-1, 1) == 0").passed
  wrong = run(ADD.replace("a + b", "a - b") + "assert add(1, 2) == 3")
  assert wrong.status == "failed" and "AssertionError" in wrong.detail
  assert run("def f(:\n  pass").status == "failed"          # a syntax error
  # What model-written solutions use still works: the standard library's pure modules, a scratch file, threads.
  scratch = ("import collections, heapq, math, re, itertools, json, decimal, fractions, datetime, random\n"
             "import tempfile, threading\n"
             "open('notes.txt', 'w').write('x')\nassert open('notes.txt').read() == 'x'\n"
             "with tempfile.NamedTemporaryFile('w') as f:\n  f.write('x')\n"
             "t = threading.Thread(target=print)\nt.start()\nt.join()\nrandom.random()\n")
  assert run(scratch).passed


def test_setup_then_code_then_tests_and_pass_at_1():
  assert sandbox.run_program("Y = X + 1", ["assert Y == 2"], setup="X = 1").passed
  assert sandbox.pass_at_1([sandbox.Result("passed"), sandbox.Result("failed")]) == 50.0


def test_results_name_their_isolation():
  assert sandbox.default_isolation() in sandbox.ISOLATIONS
  assert sandbox.run_program(ADD).isolation == sandbox.default_isolation()
  assert sandbox.run_program(ADD, isolation="audit-hook").isolation == "audit-hook"
  with pytest.raises(ValueError, match="isolation must be one of"):
    sandbox.run_program(ADD, isolation="docker")


def test_without_namespaces_it_warns_once_and_falls_back(monkeypatch):
  monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
  sandbox._namespaces_missing.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match=r"audit hook alone; missing: the unshare command \(util-linux\)"):
      assert sandbox.default_isolation() == "audit-hook"
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      result = sandbox.run_program(ADD + "assert add(1, 2) == 3")
    assert result.passed and result.isolation == "audit-hook"
    with pytest.raises(ValueError, match="'namespaces' is unavailable here; missing: the unshare command"):
      sandbox.run_program(ADD, isolation="namespaces")
  finally:
    sandbox._namespaces_missing.cache_clear()


def test_where_unshare_fails_it_warns_with_its_error_and_falls_back(monkeypatch, tmp_path):
  """As where unprivileged user namespaces are disabled (a sysctl, AppArmor): `unshare` exits with its error."""
  unshare = tmp_path / "unshare"
  unshare.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
  unshare.chmod(0o755)
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
  sandbox._namespaces_missing.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match="missing: namespaces through unshare .unshare: unshare failed"):
      assert sandbox.run_program(ADD + "assert add(1, 2) == 3").isolation == "audit-hook"
  finally:
    sandbox._namespaces_missing.cache_clear()


ESCAPES = {   # name: program, with OUT (the outside directory) and KEEP (its keep.txt)
    "open": "open(OUT + '/new.txt', 'w').write('x')",
    "os.open": "import os\nos.open(OUT + '/new.txt', os.O_WRONLY | os.O_CREAT)",
    "pathlib": "import pathlib\npathlib.Path(OUT, 'new.txt').write_text('x')",
    "os.open with dir_fd": "import os\nos.open('new.txt', os.O_WRONLY | os.O_CREAT, dir_fd=os.open(OUT, os.O_RDONLY))",
    "mkdir": "import os\nos.mkdir(OUT + '/dir')",
    "remove": "import os\nos.remove(KEEP)",
    "rmtree": "import shutil\nshutil.rmtree(OUT)",
    "symlink to the directory": "import os\nos.symlink(OUT, 'link')\nopen('link/new.txt', 'w').write('x')",
    "relative symlink": ("import os\nos.makedirs('a/b')\nos.symlink('../' * 20 + OUT[1:], 'a/b/link')\n"
                         "open('a/b/link/new.txt', 'w').write('x')"),
    "rename out": "import os\nopen('x', 'w').write('x')\nos.rename('x', OUT + '/new.txt')",
    "rename in": "import os\nos.rename(KEEP, 'stolen.txt')",
    "hard link": "import os\nos.link(KEEP, 'linked.txt')\nopen('linked.txt', 'w').write('changed')",
    "chmod through a descriptor": "import os\nos.chmod(os.open(KEEP, os.O_RDONLY), 0o777)",
    "sqlite3.connect": "import sqlite3\nsqlite3.connect(OUT + '/new.db').execute('CREATE TABLE t (x)')",
    "sqlite3 ATTACH DATABASE": ("import sqlite3\nc = sqlite3.connect(':memory:')\n"
                                "c.execute(f\"ATTACH DATABASE '{OUT}/new.db' AS a\")\n"
                                "c.execute('CREATE TABLE a.t (x)')"),
    "sqlite3 file: URI": ("import sqlite3\n"
                          "sqlite3.connect(f'file:{OUT}/new.db?mode=rwc', uri=True).execute('CREATE TABLE t (x)')"),
    "os.mkfifo": "import os\nos.mkfifo(OUT + '/fifo')",
    "os.mknod": "import os, stat\nos.mknod(OUT + '/node', stat.S_IFREG | 0o600)",
    "posix.mkfifo": "import posix\nposix.mkfifo(OUT + '/fifo')",
    "os.setxattr": "import os\nos.setxattr(KEEP, 'user.sandbox', b'x')",
    "os.setxattr through a descriptor": "import os\nos.setxattr(os.open(KEEP, os.O_RDONLY), 'user.sandbox', b'x')",
    "rebinding what the hook resolves with": ("import os, os.path\nos.path.realpath = lambda path: os.getcwd()\n"
                                              "os.O_WRONLY = os.O_CREAT = 0\nos.open(OUT + '/new.txt', 1 | 64)"),
}


@pytest.mark.parametrize("escape", ESCAPES)
def test_nothing_outside_the_directory_is_written(walls, outside, escape):
  """Refused by the hook where it runs ("blocked"), by the read-only file system where only the kernel does;
  `outside` checks the directory untouched either way."""
  name, run = walls
  code = f"OUT, KEEP = {outside!r}, {os.path.join(outside, 'keep.txt')!r}\n" + ESCAPES[escape]
  result = run(code)
  assert not result.passed, result
  if name != "kernel":
    assert result.status == "blocked" and "PermissionError: sandbox:" in result.detail, result


@needs_namespaces
def test_under_namespaces_tmp_is_private_and_homes_are_hidden(walls):
  name, run = walls
  if name == "audit-hook":
    pytest.skip("the audit hook alone shares /tmp and the home directories")
  path = f"/tmp/specdec_sandbox_test_{uuid.uuid4().hex}"
  wrote = run(f"open({path!r}, 'w').write('x')\nassert open({path!r}).read() == 'x'")
  assert not os.path.exists(path)
  assert wrote.passed if name == "kernel" else wrote.status == "blocked"
  # /home and /root hold only the way to Python's own directories; /proc only the program; /dev 5 nodes.
  seen = run("import os, sys\n"
             "python = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, *sys.path) if os.path.exists(p)]\n"
             "for home in ('/home', '/root'):\n"
             "  for entry in (os.listdir(home) if os.path.isdir(home) else []):\n"
             "    path = os.path.join(home, entry)\n"
             "    assert any(p == path or p.startswith(path + '/') for p in python), path\n"
             "assert [p for p in os.listdir('/proc') if p.isdigit()] == ['1'], os.listdir('/proc')\n"
             "assert sorted(os.listdir('/dev')) == ['full', 'null', 'random', 'urandom', 'zero']\n")
  assert seen.passed, seen


def test_a_network_connection_to_a_listening_port_is_refused(walls):
  name, run = walls
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0)
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')")
    with pytest.raises(BlockingIOError):
      listener.accept()
  assert not result.passed
  assert result.status == "blocked" if name != "kernel" else "Network is unreachable" in result.detail, result


def test_a_fork_bomb_is_refused_or_bounded(walls):
  """The hook refuses each attempt before the operation (fork, exec, import); the kernel alone lets at most
  MAX_PROCESSES run (RLIMIT_NPROC in the user namespace, which Linux does not apply to root) and kills them
  with the program."""
  name, run = walls
  marker = f"{time.time() % 1000 + 2000:.6f}"     # a unique `sleep` duration, to find the children by
  # Bounded (200 processes at most) so that a broken sandbox fails the test without harming the machine.
  bomb = ("import os\nchildren = 0\nfor _ in range(200):\n  try:\n    pid = os.fork()\n"
          "  except BlockingIOError:\n    break\n"
          f"  if pid == 0:\n    os.execv('/bin/sleep', ['sleep', '{marker}'])\n  children += 1\n"
          "raise SystemExit(f'forked {children}')")
  result = run(bomb, timeout_s=20.0)
  assert _processes_with(marker) == []
  if name == "kernel":
    forked = int(result.detail.rsplit(" ", 1)[-1])
    assert forked < sandbox.MAX_PROCESSES or (os.getuid() == 0 and forked == 200), result
    return
  assert result.status == "blocked" and "sandbox: os.fork is not allowed" in result.detail, result
  for attempt, refused in (("import subprocess\nsubprocess.run(['sleep', '100'])", "import subprocess"),
                           ("import os\nos.system('sleep 100 &')", "os.system"),
                           ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
                           ("import multiprocessing\nmultiprocessing.Process(target=print).start()",
                            "import multiprocessing"),
                           ("import _posixsubprocess", "import _posixsubprocess")):
    result = run(attempt)
    assert result.status == "blocked" and f"sandbox: {refused} is not allowed" in result.detail, (attempt, result)


def test_a_detached_child_does_not_outlive_the_program(walls):
  name, run = walls
  marker = f"{time.time() % 1000 + 3000:.6f}"
  daemon = ("import os\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n"
            f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n  os._exit(0)\nos.wait()\n")
  result = run(daemon)
  assert _processes_with(marker) == []
  assert result.passed if name == "kernel" else result.status == "blocked", result


def test_a_thread_bomb_ends_within_its_limits(walls):
  _, run = walls
  start = time.monotonic()
  result = run("import threading, time\nwhile True:\n"
               "  threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", timeout_s=20.0)
  assert result.status == "failed" and "can't start new thread" in result.detail, result
  assert time.monotonic() - start < 15


def test_memory_is_bounded(walls):
  _, run = walls
  for hog in ("x = bytearray(4 << 30)", "chunks = []\nwhile True:\n  chunks.append(bytearray(16 << 20))"):
    result = run(hog, memory_bytes=512 << 20)
    assert not result.passed and "MemoryError" in result.detail, (hog, result)


def test_an_infinite_loop_or_a_sleep_is_killed_at_the_timeout_or_the_cpu_limit(walls):
  _, run = walls
  for forever in ("while True:\n  pass", "import time\ntime.sleep(60)"):
    start = time.monotonic()
    result = run(forever, timeout_s=1.0, cpu_s=30)
    assert result.status == "timeout" and time.monotonic() - start < 10, (forever, result)
  spinning = run("while True:\n  pass", timeout_s=30.0, cpu_s=1)
  assert spinning.status == "error" and spinning.detail == "killed by signal 9 (a resource limit)", spinning


def test_detail_is_the_end_of_stderr_truncated():
  result = sandbox.run_program("import sys\nfor i in range(100):\n"
                               "  print(f'line {i:03d} ' + 'x' * 90, file=sys.stderr)\nsys.exit(1)")
  assert result.status == "failed" and len(result.detail) <= sandbox.DETAIL_CHARS
  lines = result.detail.split("\n")
  assert result.detail.startswith("…") and len(lines) <= sandbox.DETAIL_LINES and lines[-1].startswith("line 099")
  flood = sandbox.run_program("import sys\nwhile True:\n  sys.stderr.write('y' * (1 << 20))")   # ends at 16 MiB
  assert not flood.passed and len(flood.detail) <= sandbox.DETAIL_CHARS
  assert sandbox.run_program("raise ValueError('short')").detail.endswith("ValueError: short")


@pytest.mark.parametrize("code, reason", [(b"x = 1", "not text but bytes"), (None, "not text but NoneType"),
                                          ("", "empty"), ("  \n\t\n", "empty"),
                                          ("x = 1\n" * 300_000, "characters long"),
                                          ("s = '\udc80'", "not valid text")])
def test_bad_programs_are_errors(code, reason):
  result = sandbox.run_program(code, ["assert True"])
  assert result.status == "error" and reason in result.detail and result.isolation == ""


@pytest.mark.parametrize("limit", ["timeout_s", "memory_bytes", "cpu_s"])
@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_non_positive_limits_are_value_errors(limit, value):
  with pytest.raises(ValueError, match=f"{limit} must be > 0"):
    sandbox.run_program(ADD, **{limit: value})


def test_code_is_extracted_from_mbpp_markers_fences_or_taken_whole():
  code = "def f(x):\n    return x"
  assert sandbox.extract_code(f"[BEGIN]\n{code}\n[DONE]\n\nYou are") == code
  assert sandbox.extract_code(f"Here it is:\n```python\n{code}\n```\nDone.") == code
  assert sandbox.extract_code(f"```\n{code}\n```") == code
  assert sandbox.extract_code(f"[BEGIN]\n```python3.10\n{code}\n```\n[DONE]") == code   # a chat model copying shots
  assert sandbox.extract_code(code) == code
