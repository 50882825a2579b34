"""The sandbox that runs model-written code (MBPP pass@1): right and wrong programs are told apart, and an
infinite loop, a fork bomb, writes outside the throw-away directory, a network connection and a memory hog
are contained."""

import time

import pytest

from specdec.evaluation import sandbox

ADD = "def add(a, b):\n  return a + b\n"


def test_a_right_program_passes_and_a_wrong_one_fails():
  assert sandbox.run_program(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]).passed
  wrong = sandbox.run_program(ADD.replace("a + b", "a - b"), ["assert add(1, 2) == 3"])
  assert wrong.status == "failed" and "AssertionError" in wrong.detail
  assert sandbox.run_program("def f(:\n  pass", []).status == "failed"          # a syntax error
  assert sandbox.pass_at_1([sandbox.Result("passed"), sandbox.Result("failed")]) == 50.0
  # What model-written solutions use still works: the standard library's pure modules, a scratch file.
  scratch = ("import collections, heapq, math, re, itertools\n"
             "open('notes.txt', 'w').write('x')\nassert open('notes.txt').read() == 'x'\n")
  assert sandbox.run_program(scratch).passed


def test_an_infinite_loop_is_killed_at_the_timeout():
  start = time.monotonic()
  result = sandbox.run_program("while True:\n  pass", timeout_s=2.0, cpu_s=30)
  assert result.status == "timeout" and time.monotonic() - start < 10


def test_a_fork_bomb_creates_no_process():
  """Each attempt is refused before the operation (the audit hook raises ahead of fork, exec or import)."""
  # Bounded (16 processes at most) so that a broken sandbox fails the test without harming the machine.
  for attempt, refused in (("import os\nfor _ in range(4):\n  os.fork()", "os.fork"),
                           ("import subprocess\nsubprocess.run(['sleep', '100'])", "import subprocess"),
                           ("import os\nos.system('sleep 100 &')", "os.system"),
                           ("import os\nos.execv('/bin/sh', ['sh'])", "os.exec"),
                           ("import multiprocessing\nmultiprocessing.Process(target=print).start()",
                            "import multiprocessing"),
                           ("import _posixsubprocess", "import _posixsubprocess")):
    result = sandbox.run_program(attempt, timeout_s=10.0)
    assert result.status == "blocked" and f"sandbox: {refused} is not allowed" in result.detail, (attempt, result)


def test_writes_outside_the_directory_are_refused(tmp_path):
  target = tmp_path / "outside.txt"
  (tmp_path / "keep.txt").write_text("kept")
  for attempt in (f"open({str(target)!r}, 'w').write('x')",
                  f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                  f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                  f"import os\nos.mkdir({str(tmp_path / 'dir')!r})",
                  f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})",
                  f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
    result = sandbox.run_program(attempt)
    assert result.status == "blocked", (attempt, result)
  assert not target.exists() and not (tmp_path / "dir").exists() and (tmp_path / "keep.txt").read_text() == "kept"


def test_no_network_and_memory_is_bounded():
  network = sandbox.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))")
  assert network.status == "blocked"
  hog = sandbox.run_program("x = bytearray(4 << 30)", memory_bytes=512 << 20)
  assert not hog.passed and "MemoryError" in hog.detail


def test_limits_are_checked():
  with pytest.raises(ValueError, match="timeout_s"):
    sandbox.run_program(ADD, timeout_s=0)



def test_code_is_extracted_from_mbpp_markers_fences_or_taken_whole():
  code = "def f(x):\n    return x"
  assert sandbox.extract_code(f"[BEGIN]\n{code}\n[DONE]\n\nYou are") == code
  assert sandbox.extract_code(f"Here it is:\n```python\n{code}\n```\nDone.") == code
  assert sandbox.extract_code(f"```\n{code}\n```") == code
  assert sandbox.extract_code(f"[BEGIN]\n```python3.10\n{code}\n```\n[DONE]") == code   # a chat model copying shots
  assert sandbox.extract_code(code) == code
