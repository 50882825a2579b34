"""`make device-check`: the accelerator tests, then `bench_backend.py --quick`, in one short run.

  python scripts/device_check.py [--tests-only | --bench-only]

Built for short GPU windows (≤ 5 minutes on one GPU, compilation included): it refuses to start without an
accelerator (one line, exit 1), runs `make test-device`'s tests (tests/core, the decoding laws, the models)
on it, then the quick benchmark, which writes experiments/backend_<backend>/results.{json,md}. Both steps
share the persistent compilation cache in .cache/jax, so a second run compiles almost nothing. Each step
prints its elapsed time; the exit status is the first failing step's.

Runs from the checkout (PYTHONPATH=.), with whatever Python has JAX for the accelerator: machines lent for
a few minutes may have no package registry to install into a fresh virtual environment.
"""

from __future__ import annotations

import argparse
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
    steps.append(("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DEVICE_TESTS]))
  if not args.tests_only:
    steps.append(("bench", [sys.executable, "scripts/bench_backend.py", "--quick", "--cache_dir", CACHE]))
  status = 0
  for name, command in steps:
    began = time.monotonic()
    print(f"device-check [{began - start:6.1f} s] {name} on {found}: {' '.join(command[1:])}", flush=True)
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    print(f"device-check [{time.monotonic() - start:6.1f} s] {name} ended with status {code} "
          f"({time.monotonic() - began:.0f} s)", flush=True)
    status = status or code
  return status


if __name__ == "__main__":
  sys.exit(main())
