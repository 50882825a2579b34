"""Writes the bytecode of what the tests and commands import, by importing it once: `make`'s install step.

pip compiles every file it installs to bytecode by default, TensorFlow's and torch's tens of thousands
included, and that was half of a fresh install's time (121 s of 121 without `--no-compile`, 62 s with it, on
the 2-core machine of 2026-11-27). `make` installs with `--no-compile` and runs this instead (20 s): Python
writes the bytecode of each module it imports, also where the environment sets PYTHONDONTWRITEBYTECODE (this
script lifts it for itself), and later processes read it. A module missing here (a platform without one of
the test extra's packages) is skipped: the tests that need it say so.

  python scripts/compile_imports.py
"""

from __future__ import annotations

import importlib
import os
import sys

# The third-party packages the tests, the quickstart and the commands import, heaviest first, then specdec's
# layers (its commands import them inside their functions).
MODULES = ("tensorflow", "tensorflow_datasets", "seqio", "torch", "transformers", "jax", "flax", "optax",
           "orbax.checkpoint", "tensorstore", "scipy.stats", "matplotlib.pyplot", "sacrebleu", "rouge_score.rouge_scorer",
           "sentencepiece", "safetensors", "gin", "pytest", "specdec.decoding", "specdec.models", "specdec.training",
           "specdec.data.tasks", "specdec.evaluation.sweep", "specdec.evaluation.plan")


def main() -> int:
  sys.dont_write_bytecode = False
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # TensorFlow's start-up notices
  skipped = []
  for name in MODULES:
    try:
      importlib.import_module(name)
    except Exception:   # noqa: BLE001 — warming a cache: whatever fails here fails again, with its message, where used
      skipped.append(name)
  if skipped:
    print(f"compile_imports: not importable here, skipped: {', '.join(skipped)}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
