"""Runs the test suite as `make test` does: one pytest process per folder of tests/, `--jobs` at a time.

The groups are found, not listed: every folder under tests/ holding test_*.py files is one group (test files
directly in tests/, if any, another), so a new test file runs by being put in its layer's folder. Fresh
processes per group keep XLA:CPU's compiled-program count low (tests/conftest.py); running two at once uses
both cores of a small machine, since compiling the tests' many small programs is mostly single-threaded. The
groups known to be long (`START_FIRST`: they compile the most decode loops) start first, then the others,
largest first by the size of their test files, so that the last to start are short. A group's output is
printed whole when it ends, so that groups never interleave; the exit status is 1 when any group failed.

The groups compile with XLA's backend optimisation level 0: the tests' programs are small and run once, so
LLVM's optimisations cost more compile time than they save. Both sides of every exactness check are compiled
alike, and the whole suite also passes at the default level (`XLA_FLAGS=--xla_backend_optimization_level=2`
overrides: the later flag wins). `tests/sharding/` runs on 8 fake CPU devices (the flag must be set before JAX
starts: a process of its own).

Usage: python scripts/run_tests.py [--jobs N] [GROUP_FOLDER ...]   (default: every group)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import subprocess
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
SHARDED = TESTS / "sharding"
_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
_SHARDED_FLAGS = "--xla_force_host_platform_device_count=8"
START_FIRST = ("decoding", "drafters", "sharding", "models")


def groups() -> list[list[pathlib.Path]]:
  """The test files of each folder under tests/ (and of tests/ itself), in the order they start."""
  by_folder: dict[pathlib.Path, list[pathlib.Path]] = {}
  for file in sorted(TESTS.rglob("test_*.py")):
    by_folder.setdefault(file.parent, []).append(file)

  def order(files: list[pathlib.Path]) -> tuple[int, int]:
    name = files[0].parent.name
    return (START_FIRST.index(name) if name in START_FIRST else len(START_FIRST),
            -sum(f.stat().st_size for f in files))
  return sorted(by_folder.values(), key=order)


def _run_group(files: list[pathlib.Path], env: dict[str, str]) -> tuple[str, int, str, float]:
  start = time.monotonic()
  names = [str(f.relative_to(TESTS.parent)) for f in files]
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--durations=8", *names], env=env,
                        cwd=TESTS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  return " ".join(names), proc.returncode, proc.stdout, time.monotonic() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folders", nargs="*", help="run only these groups (folders under tests/)")
  parser.add_argument("--jobs", type=int, default=2, help="groups run at once (default 2)")
  args = parser.parse_args()
  if args.jobs < 1:
    parser.error(f"--jobs must be >= 1, got {args.jobs}")
  work = groups()
  if args.folders:
    chosen = {pathlib.Path(folder).resolve() for folder in args.folders}
    unknown = chosen - {files[0].parent for files in work}
    if unknown:
      parser.error(f"not a folder of test files: {', '.join(sorted(map(str, unknown)))}")
    work = [files for files in work if files[0].parent in chosen]
  def env(folder: pathlib.Path) -> dict[str, str]:
    flags = [_COMPILE_FLAGS, os.environ.get("XLA_FLAGS", ""), _SHARDED_FLAGS if folder == SHARDED else ""]
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flag for flag in flags if flag))

  start = time.monotonic()
  failed = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    futures = [pool.submit(_run_group, files, env(files[0].parent)) for files in work]
    for future in concurrent.futures.as_completed(futures):
      names, returncode, output, seconds = future.result()
      print(f"== pytest {names} ({seconds:.0f} s)\n{output}", end="", flush=True)
      if returncode != 0:
        failed.append(names)
  print(f"== {len(work)} groups in {time.monotonic() - start:.0f} s, {args.jobs} at a time; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "all passed"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
