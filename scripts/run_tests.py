"""Runs the test suite as `make test` does: one pytest process per group of test files, `--jobs` at a time.

The groups are found, not listed: every folder under tests/ holding test_*.py files is one group (test files
directly in tests/, if any, another), so a new test file runs by being put in its layer's folder. The folders
in `SPLIT`, which compile the most decode loops (over half of the suite's time between them), run one
process per file instead: as two whole folders they kept both jobs for most of the run and ended it with
one job idle; as files they fill the gaps. Fresh processes keep XLA:CPU's compiled-program count low
(tests/conftest.py); running two at once uses both cores of a small machine, since compiling the tests' many
small programs is mostly single-threaded. The groups known to be long (`START_FIRST`, in that order) start
first, then the others, largest first by the size of their test files, so that the last to start are
short. A group's output is printed whole when it ends, so that groups never interleave; the exit status is 1
when any group failed.

How the groups compile: XLA's backend optimisation level 0 (the tests' programs are small and run once, so
LLVM's optimisations cost more compile time than they save) and XLA:CPU's elemental fusion emitters instead
of its newer MLIR ones (`--xla_cpu_use_fusion_emitters=false`: the decode loops compile 2-4× faster). Both
sides of every exactness check are compiled alike, and the suite also passes at XLA's defaults
(`XLA_FLAGS="--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true"`: the later flag wins).
The emitters change the optimized HLO (which instructions are fused, which become loops), so the files that
read it (`HLO_READERS`) run in processes of their own with XLA:CPU's default emitters: they check the HLO
users' programs get. `tests/sharding/` runs on 8 fake CPU devices (the flag must be set before JAX starts: a
process of its own). All the groups of one run share JAX's persistent compilation cache (tests/conftest.py):
a temporary directory removed at the end, or the one `$SPECDEC_TEST_CACHE` names (kept).

`--slow` runs the tests marked slow instead (`make test-slow`), in the same groups; `--durations 0` lists every
test phase of at least 0.5 s per group (a profile of the run; default: the 8 slowest).

Usage: python scripts/run_tests.py [--jobs N] [--slow] [--durations N] [GROUP_FOLDER ...]   (default: every group)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
SHARDED = TESTS / "sharding"
_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
_EMITTER_FLAGS = "--xla_cpu_use_fusion_emitters=false"
_SHARDED_FLAGS = "--xla_force_host_platform_device_count=8"
SPLIT = ("decoding", "drafters")
HLO_READERS = ("decoding/test_compiled.py", "evaluation/test_hlo.py")
START_FIRST = ("decoding/test_decoding.py", "drafters/test_multi_draft.py", "drafters/test_feature_drafter.py",
               "sharding", "models", "decoding/test_compiled.py")
CACHE_ENV = "SPECDEC_TEST_CACHE"   # read by tests/conftest.py
_SLOW_ONLY = ("-m", "slow", "--run-slow")
_NO_TESTS_COLLECTED = 5            # pytest's exit status when every test was deselected


def _key(file: pathlib.Path) -> str:
  """A test file's group: its folder, or folder/file for a file that runs in a process of its own."""
  folder = file.parent.relative_to(TESTS).as_posix()
  alone = f"{folder}/{file.name}"
  return alone if folder in SPLIT or alone in HLO_READERS else folder


def groups() -> list[list[pathlib.Path]]:
  """The test files of each group, in the order they start."""
  by_key: dict[str, list[pathlib.Path]] = {}
  for file in sorted(TESTS.rglob("test_*.py")):
    by_key.setdefault(_key(file), []).append(file)

  def order(files: list[pathlib.Path]) -> tuple[int, int]:
    key = _key(files[0])
    return (START_FIRST.index(key) if key in START_FIRST else len(START_FIRST),
            -sum(f.stat().st_size for f in files))
  return sorted(by_key.values(), key=order)


def _env(files: list[pathlib.Path], cache: str) -> dict[str, str]:
  flags = [_COMPILE_FLAGS, "" if _key(files[0]) in HLO_READERS else _EMITTER_FLAGS, os.environ.get("XLA_FLAGS", ""),
           _SHARDED_FLAGS if files[0].parent == SHARDED else ""]
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flag for flag in flags if flag),
              **{CACHE_ENV: cache})


def _run_group(files: list[pathlib.Path], env: dict[str, str], slow: bool, durations: int
               ) -> tuple[str, int, str, float]:
  start = time.monotonic()
  names = [str(f.relative_to(TESTS.parent)) for f in files]
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", f"--durations={durations}", "--durations-min=0.5",
                         *(_SLOW_ONLY if slow else ()), *names], env=env, cwd=TESTS.parent, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
  # --slow: a group without slow tests selects none, and nothing failed.
  returncode = 0 if slow and proc.returncode == _NO_TESTS_COLLECTED else proc.returncode
  return " ".join(names), returncode, proc.stdout, time.monotonic() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folders", nargs="*", help="run only these groups (folders under tests/)")
  parser.add_argument("--jobs", type=int, default=2, help="groups run at once (default 2)")
  parser.add_argument("--slow", action="store_true", help="run only the tests marked slow")
  parser.add_argument("--durations", type=int, default=8,
                      help="list each group's N slowest tests and phases of at least 0.5 s (0: all; default 8)")
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

  start = time.monotonic()
  failed = []
  cache = os.environ.get(CACHE_ENV) or tempfile.mkdtemp(prefix="specdec-tests-jax-cache-")
  try:
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
      futures = [pool.submit(_run_group, files, _env(files, cache), args.slow, args.durations) for files in work]
      for future in concurrent.futures.as_completed(futures):
        names, returncode, output, seconds = future.result()
        print(f"== pytest {names} ({seconds:.0f} s)\n{output}", end="", flush=True)
        if returncode != 0:
          failed.append(names)
  finally:
    if cache != os.environ.get(CACHE_ENV):
      shutil.rmtree(cache, ignore_errors=True)
  print(f"== {len(work)} groups in {time.monotonic() - start:.0f} s, {args.jobs} at a time; "
        + (f"FAILED: {'; '.join(failed)}" if failed else "all passed"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
