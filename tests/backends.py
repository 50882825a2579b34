"""What the tests allow per backend (imported by test modules; not a test module itself).

The suite runs on XLA:CPU by default (tests/conftest.py). `make test-device` runs the core, decoding-law
and model tests on the accelerator JAX finds (`SPECDEC_TEST_DEVICE=1`), with float32 matmuls at full
precision (`jax_default_matmul_precision = "highest"`: JAX's default on GPU is TF32 and on TPU bfloat16
passes, which move logits by ~1e-3). Exactness tests need no allowance: the sampling kernels give the
definition's result on every backend (specdec/core/_top_p.py). What does differ is the float32 rounding of
model arithmetic (reduction orders, fused multiply-adds): comparisons of logits against another
implementation or another call path use `tolerance`.
"""

from __future__ import annotations

import jax
import pytest

BACKEND = jax.default_backend()

# Logit tolerances on accelerators, as multiples of the CPU's: measured on XLA:CPU; GPU and TPU reduce in
# other orders and fuse multiply-adds, at full float32 precision.
ACCELERATOR_FACTOR = 10.0


def tolerance(cpu: float) -> float:
  """The absolute tolerance of a float32 logit comparison whose CPU tolerance is `cpu`, on this backend."""
  return cpu if BACKEND == "cpu" else cpu * ACCELERATOR_FACTOR


cpu_only = pytest.mark.skipif(BACKEND != "cpu", reason="asserts XLA:CPU-only behaviour")
