"""`make device-check`: SmolLM2's speed table with its shipped head, the accelerator tests, then `specdec-bench
backend --quick`, in one short run.

  python scripts/device_check.py [--steps smollm2 tests bench] [--smollm2_out PREFIX]

Built for short GPU windows: it refuses to start without an accelerator (one line, exit 1), then runs
- smollm2: where SmolLM2's GGUF file is cached (`make smollm2`; $SPECDEC_CACHE), the speed table of
  experiments/smollm2_eagle on this backend — `specdec-bench decoding` over the held-out chat prompts with the
  shipped head `smollm2_eagle`: SmolLM2 alone, the chain at γ = 2…5 and EAGLE-2's dynamic tree (K = 4), greedy
  and T = 1 at batch 1, greedy at batch 8 — into PREFIX_b1.{json,md} and PREFIX_b8.{json,md} (default
  experiments/smollm2_eagle/speed_<backend>); skipped, saying so, where the file is not cached;
- tests: `make test-device`'s tests (tests/core, the decoding laws, the models);
- bench: the quick benchmark, which writes experiments/backend_<backend>/results.{json,md}.
All steps share the persistent compilation cache in .cache/jax, so a second run compiles almost nothing. Each
step prints its elapsed time; the exit status is the first failing step's.

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
STEPS = ("smollm2", "tests", "bench")
SMOLLM2_PROMPTS = os.path.join(ROOT, "experiments", "smollm2_eagle", "heldout_prompts.txt")
# (suffix, `specdec-bench decoding` arguments): the CPU's table of experiments/smollm2_eagle on this backend.
SMOLLM2_RUNS = (
    ("b1", ["--gamma", "2", "3", "4", "5", "--trees", "4", "--temperatures", "0", "1", "--batch", "1"]),
    ("b8", ["--gamma", "2", "3", "--temperatures", "0", "--batch", "8"]),
)


def backend(env: dict) -> str:
  """JAX's default backend in a fresh process with `env` ("" if JAX cannot start)."""
  found = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True)
  return found.stdout.strip() if found.returncode == 0 else ""


def smollm2_commands(env: dict, prefix: str) -> list[tuple[str, list[str]]]:
  """The smollm2 step's (name, command) pairs; none, saying why, where SmolLM2's file is not cached."""
  found = subprocess.run([sys.executable, "-c", "from specdec.data import pretrained; "
                          "print(pretrained.cached_path('smollm2').is_file())"], env=env, capture_output=True, text=True)
  if found.stdout.strip() != "True":
    print("device-check: smollm2 skipped: SmolLM2's GGUF file is not cached here (`make smollm2`, or $SPECDEC_CACHE)",
          flush=True)
    return []
  return [(f"smollm2 {suffix}", [sys.executable, "-m", "specdec.cli.bench", "decoding", "--verifier", "smollm2",
                                 "--prompts", SMOLLM2_PROMPTS, "--drafter", "feature:smollm2_eagle", "--tokens", "128",
                                 *arguments, "--out", f"{prefix}_{suffix}"])
          for suffix, arguments in SMOLLM2_RUNS]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="the steps to run, in this order")
  parser.add_argument("--smollm2_out", help="the smollm2 step's records: PREFIX_b1.{json,md}, PREFIX_b8.{json,md} "
                      "(default experiments/smollm2_eagle/speed_<backend>)")
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
  for step in args.steps:
    if step == "smollm2":
      prefix = args.smollm2_out or os.path.join(ROOT, "experiments", "smollm2_eagle", f"speed_{found}")
      steps += [(name, command, env) for name, command in smollm2_commands(env, prefix)]
    elif step == "tests":
      parallel, test_env = [], env
      if args.workers > 1 and importlib.util.find_spec("xdist") is not None:
        parallel, test_env = ["-n", str(args.workers)], {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
      steps.append(("tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *parallel,
                              *DEVICE_TESTS], test_env))
    else:
      steps.append(("bench", [sys.executable, "-m", "specdec.cli.bench", "backend", "--quick", "--cache_dir",
                              CACHE], env))
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
