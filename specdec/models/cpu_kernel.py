"""The verifier's projections at memory speed on a CPU: a few rows times a weight matrix (layer 2).

  y = einsum(equation, x, w)   # as jnp.einsum; on the CPU, float32, ≤ MAX_ROWS rows: cpu_kernel.cc

A decode step scores 1 to ~16 positions. XLA:CPU runs one row as a matrix-vector loop near memory speed and
several as a GEMM at about half of it (experiments/smollm2_eagle: SmolLM2's score(5) cost 1.45× score(1)), which
taxes every speculative block. `cpu_kernel.cc` (an XLA FFI custom call) reads each weight once for all rows.
Each row's sums are formed in one order whatever the number of rows, so scoring n positions gives the
bits of scoring them one at a time; they differ from XLA's own products in the last bits (another order).

Used when all hold, else `jnp.einsum` (same maths): the equation contracts x's trailing axes with w's leading
ones (w [in…, out…]) or, w 2-D, with its trailing one (an output table [V, E]); x and w are float32; x has at
most MAX_ROWS rows (the product of its other axes; a prefill is a GEMM's job); the program is lowered for the
CPU (`jax.lax.platform_dependent`: GPU and TPU programs never contain it); one CPU device (the call cannot be
partitioned); the kernel is enabled and built. Enabled: by default on x86 CPUs with AVX-512, or AVX2 and FMA
(`suited`), where it was measured to pay (experiments/smollm2_eagle: an Intel Xeon with AVX-512, an AMD EPYC
znver2 with AVX2, whose register tiles are sized for its 16 ymm registers); elsewhere (ARM) it is off unless asked for.
`SPECDEC_CPU_KERNEL=1` or `enabled(True)` turn it on anywhere, `SPECDEC_CPU_KERNEL=0` or `enabled(False)` off (read
when a function is traced). The C++ source is compiled on first use with the machine's C++ compiler
($CXX, else g++, else c++; -O3 -march=native) into $SPECDEC_CACHE/kernels (else ~/.cache/specdec/kernels),
keyed by the source, jaxlib and the CPU; without a compiler the plain path runs, with one warning.
Gradients are the plain einsum's (a `custom_vjp`), so training code may call it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import jaxlib

Array = jax.Array

MAX_ROWS = 16
TARGET = "specdec_rows_matmul"
SOURCE = Path(__file__).with_suffix(".cc")
ENV = "SPECDEC_CPU_KERNEL"
_log = logging.getLogger(__name__)
# None: where `suited`.
_enabled: list[bool | None] = [None if os.environ.get(ENV, "") == "" else os.environ[ENV] != "0"]


@functools.cache
def suited() -> bool:
  """Whether this CPU is one the kernel was measured to pay on: x86 with AVX-512, or with AVX2 and FMA."""
  flags = set()
  with contextlib.suppress(OSError):
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        flags |= set(line.split(":", 1)[1].split())
  return platform.machine().lower() in ("x86_64", "amd64") and ("avx512f" in flags or {"avx2", "fma"} <= flags)


@contextlib.contextmanager
def enabled(flag: bool | None) -> Iterator[None]:
  """Turn the kernel on or off (None: where `suited`) for what is traced inside (jit caches keep what was traced
  before)."""
  previous = _enabled[0]
  _enabled[0] = flag
  try:
    yield
  finally:
    _enabled[0] = previous


def _cpu_signature() -> str:
  flags = ""
  with contextlib.suppress(OSError):
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features", "model name")):
        flags += line
  return platform.machine() + platform.processor() + flags


def _compile(library: Path) -> None:
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler ($CXX, g++ or c++) on PATH")
  library.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
    built = Path(scratch) / library.name
    base = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE),
            "-o", str(built)]
    result = subprocess.run(base[:1] + ["-march=native"] + base[1:], capture_output=True, text=True)
    if result.returncode != 0:   # compilers that do not know -march=native (Apple's clang on arm64)
      result = subprocess.run(base, capture_output=True, text=True)
    if result.returncode != 0:
      raise RuntimeError(f"{compiler} failed on {SOURCE.name}:\n{result.stderr[-2000:]}")
    os.replace(built, library)   # atomic: a concurrent build finds a whole file or none


@functools.cache
def available() -> bool:
  """Build (once per machine and source) and register the kernel; False, with a warning, if it cannot be."""
  key = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode() + _cpu_signature().encode())
  cache = Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")
  library = cache / "kernels" / f"cpu_kernel-{key.hexdigest()[:16]}.so"
  try:
    if not library.exists():
      _compile(library)
    handler = ctypes.cdll.LoadLibrary(str(library)).specdec_rows_matmul
  except (OSError, RuntimeError) as error:
    _log.warning("specdec's CPU kernel is not available, the plain XLA path runs instead: %s", error)
    return False
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
  return True


def rows_matmul(x: Array, w: Array, transposed: bool = False) -> Array:
  """x [..., K] · w [K, N] (or w [N, K]ᵀ with transposed) -> [..., N], float32, by the kernel (CPU only)."""
  n = w.shape[0] if transposed else w.shape[1]
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32),
                          vmap_method="expand_dims")
  return call(x, w, transposed=transposed)


def _split(equation: str, x_ndim: int, w_ndim: int) -> tuple[int, bool, list[int]] | None:
  """(contracted axes, transposed, the permutation from the kernel's product to the equation's output) where the
  kernel computes the equation, else None."""
  inputs, out = equation.replace(" ", "").split("->")
  lhs, rhs = inputs.split(",")
  if len(lhs) != x_ndim or len(rhs) != w_ndim or len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
    return None
  shared = "".join(c for c in lhs if c in rhs)
  n = len(shared)
  if n == 0 or sorted(out) != sorted(set(lhs) ^ set(rhs)) or not lhs.endswith(shared):
    return None
  if rhs.startswith(shared):
    transposed, product = False, lhs[:-n] + rhs[n:]
  elif w_ndim == 2 and rhs[1] == shared:
    transposed, product = True, lhs[:-1] + rhs[0]
  else:
    return None
  return n, transposed, [product.index(c) for c in out]


def einsum(equation: str, x: Array, w: Array) -> Array:
  """`jnp.einsum(equation, x, w)`, by the CPU kernel where it applies (module docstring)."""
  split = _split(equation, x.ndim, w.ndim)
  on = suited() if _enabled[0] is None else _enabled[0]
  if split is None or not on or x.dtype != jnp.float32 or w.dtype != jnp.float32:
    return jnp.einsum(equation, x, w)
  n, transposed, permutation = split
  if (math.prod(x.shape[:x.ndim - n]) > MAX_ROWS or jax.device_count() != 1 or jax.default_backend() != "cpu"
      or not available()):
    return jnp.einsum(equation, x, w)
  return _contract(x, w, n, transposed).transpose(permutation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _contract(x: Array, w: Array, n: int, transposed: bool) -> Array:
  """x's trailing n axes with w's leading n (or, transposed, w's last): the kernel on the CPU."""
  out_shape = x.shape[:x.ndim - n] + (w.shape[:1] if transposed else w.shape[n:])

  def kernel(x: Array, w: Array) -> Array:
    k = math.prod(x.shape[x.ndim - n:])     # explicit shapes: -1 is undefined where k is 0
    w2 = w if transposed else w.reshape(k, math.prod(w.shape[n:]))
    return rows_matmul(x.reshape(math.prod(x.shape[:x.ndim - n]), k), w2, transposed).reshape(out_shape)

  return jax.lax.platform_dependent(x, w, cpu=kernel, default=lambda x, w: _plain(x, w, n, transposed))


def _plain(x: Array, w: Array, n: int, transposed: bool) -> Array:
  axes = (tuple(range(x.ndim - n, x.ndim)), (1,) if transposed else tuple(range(n)))
  return jax.lax.dot_general(x, w, (axes, ((), ())))


def _contract_fwd(x: Array, w: Array, n: int, transposed: bool) -> tuple[Array, tuple[Array, Array]]:
  return _contract(x, w, n, transposed), (x, w)


def _contract_bwd(n: int, transposed: bool, residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
  x, w = residuals
  _, vjp = jax.vjp(lambda x, w: _plain(x, w, n, transposed), x, w)
  return vjp(g)


_contract.defvjp(_contract_fwd, _contract_bwd)
