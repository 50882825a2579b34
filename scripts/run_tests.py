"""Runs the test groups of `make test`, each in a pytest process of its own, `--jobs` at a time.

Fresh processes per group keep XLA:CPU's compiled-program count low (Makefile); running two at once uses
both cores of a small machine, since compiling the tests' many small programs is mostly single-threaded.
A group's output is printed whole when it ends, so that groups never interleave; the exit status is 1
when any group failed.

Usage: python scripts/run_tests.py [--jobs N] [--sharded "FILES"] "GROUP FILES" ...
(`--sharded` names one of the groups: it runs on 8 fake CPU devices.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

# The sharded tests fake 8 devices; the flag must be set before JAX starts, hence a process of its own.
_SHARDED_FLAGS = "--xla_force_host_platform_device_count=8"


def _run_group(files: str, env: dict[str, str]) -> tuple[str, int, str, float]:
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=8", *files.split()], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  return files, proc.returncode, proc.stdout, time.monotonic() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("groups", nargs="+", help="one quoted, space-separated list of test files per group")
  parser.add_argument("--sharded", default="", help="the group that runs on 8 fake CPU devices")
  parser.add_argument("--jobs", type=int, default=2, help="groups run at once (default 2)")
  args = parser.parse_args()
  if args.jobs < 1:
    parser.error(f"--jobs must be >= 1, got {args.jobs}")
  if args.sharded and args.sharded not in args.groups:
    parser.error(f"--sharded {args.sharded!r} is not one of the groups")
  base_env = dict(os.environ, JAX_PLATFORMS="cpu")
  work = [(group, dict(base_env, XLA_FLAGS=_SHARDED_FLAGS) if group == args.sharded else base_env)
          for group in args.groups]
  start = time.monotonic()
  failed = []
  # Groups start in the order given: list the longest first so that the last to start are short.
  with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    futures = [pool.submit(_run_group, files, env) for files, env in work]
    for future in concurrent.futures.as_completed(futures):
      files, returncode, output, seconds = future.result()
      print(f"== pytest {files} ({seconds:.0f} s)\n{output}", end="", flush=True)
      if returncode != 0:
        failed.append(files)
  print(f"== {len(work)} groups in {time.monotonic() - start:.0f} s, {args.jobs} at a time; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "all passed"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
