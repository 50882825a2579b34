"""`make device-check`: the accelerator tests, then `specdec-bench backend --quick`, in one short run.

  python scripts/device_check.py [--tests-only | --bench-only]

Built for short GPU windows: it refuses to start without an accelerator (one line, exit 1), runs `make
test-device`'s tests (tests/core, the decoding laws, the models) on it, then the quick benchmark, which
writes experiments/backend_<backend>/results.{json,md}. Both steps share the persistent compilation cache in
.cache/jax, so a second run compiles almost nothing. Each step prints its elapsed time; the exit status is
the first failing step's.

Compilation is most of a fresh machine's time (XLA:GPU takes 1–4.5 s per program): on one H100 with an
empty cache the tests in one process had passed 349 of about 400 after 330 s. Where pytest-xdist is
installed (the GPU machines' image has it) the tests run in `--workers` processes (default: a quarter of
the CPUs, at most 4), which compile in parallel and allocate GPU memory as they need it instead of
preallocating 75 % of it each.

Runs from the checkout (PYTHONPATH=.), with whatever Python has JAX for the accelerator: machines lent for
a few minutes may have no package registry to install into a fresh virtual environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_TESTS = ("tests/core", "tests/decoding/test_decoding_laws.py", "tests/models")
CACHE = os.path.join(ROOT, ".cache", "jax")


def backend(env: dict) -> str:
  """JAX's default backend in a fresh process with `env` ("" if JAX cannot start)."""
  found = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True)
  return found.stdout.strip() if found.returncode == 0 else ""


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  step = parser.add_mutually_exclusive_group()
  step.add_argument("--tests-only", action="store_true")
  step.add_argument("--bench-only", action="store_true")
  parser.add_argument("--workers", type=int, default=min(4, max(1, (os.cpu_count() or 1) // 4)),
                      help="test processes where pytest-xdist is installed (1: one process)")
  args = parser.parse_args()
  env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
  env.update(PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])), SPECDEC_TEST_DEVICE="1",
             SPECDEC_TEST_CACHE=CACHE)
  found = backend(env)
  if found in ("", "cpu"):
    print(f"device-check: no accelerator: JAX's backend here is {found or 'unavailable (jax did not import)'}; "
          "run it on a GPU or TPU machine", file=sys.stderr)
    return 1
  start = time.monotonic()
  steps = []
  if not args.bench_only:
    parallel, test_env = [], env
    if args.workers > 1 and importlib.util.find_spec("xdist") is not None:
      parallel, test_env = ["-n", str(args.workers)], {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    steps.append(("tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *parallel,
                            *DEVICE_TESTS], test_env))
  if not args.tests_only:
    steps.append(("bench", [sys.executable, "-m", "specdec.cli.bench", "backend", "--quick", "--cache_dir", CACHE],
                  env))
  status = 0
  for name, command, step_env in steps:
    began = time.monotonic()
    print(f"device-check [{began - start:6.1f} s] {name} on {found}: {' '.join(command[1:])}", flush=True)
    code = subprocess.run(command, cwd=ROOT, env=step_env).returncode
    print(f"device-check [{time.monotonic() - start:6.1f} s] {name} ended with status {code} "
          f"({time.monotonic() - began:.0f} s)", flush=True)
    status = status or code
  return status


if __name__ == "__main__":
  sys.exit(main())
