"""Argument checks shared by every layer.

Checks run on concrete values (Python scalars, NumPy or committed JAX arrays). Under `jax.jit` the
values are tracers and cannot be inspected without a host round-trip, so the checks are skipped there;
the public entry points (`decoding.generate`, sweeps) call them before tracing. Inside jit the math
functions report bad probabilities with a documented flag instead (see `verify.verify_block`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def is_concrete(x: Any) -> bool:
  """True when `x` holds values we can read on the host (not a tracer inside jit)."""
  return not isinstance(x, jax.core.Tracer)


def _values(x: Any) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


def check_range(name: str, x: Any, lo: float, hi: float, *, lo_closed: bool = True,
                hi_closed: bool = True) -> None:
  """Raises ValueError unless every value of `x` lies in the interval [lo|(lo, hi]|)."""
  if not is_concrete(x):
    return
  v = _values(x)
  lo_ok = v >= lo if lo_closed else v > lo
  hi_ok = v <= hi if hi_closed else v < hi
  if not (np.all(lo_ok & hi_ok) and not np.any(np.isnan(v))):
    interval = f"{'[' if lo_closed else '('}{lo}, {hi if math.isfinite(hi) else 'inf'}{']' if hi_closed else ')'}"
    bad = v[~(lo_ok & hi_ok) | np.isnan(v)].ravel()[:3]
    raise ValueError(f"{name} must lie in {interval}; got {bad.tolist()}")


def check_temperature(temperature: Any) -> None:
  check_range("temperature", temperature, 0.0, math.inf, hi_closed=False)


def check_top_p(top_p: Any) -> None:
  check_range("top_p", top_p, 0.0, 1.0, lo_closed=False)


def check_top_k(top_k: int) -> None:
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k must be a non-negative Python int (0 disables it); got {top_k!r}")


def check_gamma(gamma: Any) -> None:
  if not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f"gamma (the number of draft tokens per block) must be an int >= 1; got {gamma!r}")


def check_probs(name: str, x: Any) -> None:
  """Raises on NaN, infinite or negative entries of a probability array (concrete values only)."""
  if not is_concrete(x):
    return
  v = np.asarray(x)
  if np.any(np.isnan(v)):
    raise ValueError(f"{name} contains NaN")
  if np.any(~np.isfinite(v)) or np.any(v < 0):
    raise ValueError(f"{name} must be finite and non-negative")


def check_logits(name: str, x: Any) -> None:
  """Raises on NaN logits (concrete values only); -inf is allowed (a masked token)."""
  if is_concrete(x) and np.any(np.isnan(np.asarray(x))):
    raise ValueError(f"{name} contains NaN")


def check_shape(name: str, x: Any, shape: tuple[int | None, ...], spelled: str) -> None:
  """Raises ValueError unless `x` has `shape` (None matches any size); `spelled` names the axes."""
  got = tuple(np.shape(x))
  if len(got) != len(shape) or any(want is not None and n != want for n, want in zip(got, shape)):
    expected = ", ".join("·" if want is None else str(want) for want in shape)
    raise ValueError(f"{name} must have shape {spelled} = ({expected}); got {got}")


def check_count(name: str, k: Any, lo: int, hi: float = math.inf) -> None:
  """Raises unless `k` (concrete) holds integers in [lo, hi]; traced values pass."""
  if not is_concrete(k):
    return
  if not np.issubdtype(np.asarray(k).dtype, np.integer):
    raise ValueError(f"{name} must be an integer (array); got {k!r}")
  check_range(name, k, lo, hi)


def check_registered(kind: str, name: str, registry: dict[str, Any]) -> Any:
  """registry[name]; ValueError naming the registered names (a `kind`: rule, method) otherwise."""
  if name not in registry:
    raise ValueError(f"unknown {kind} {name!r}; choose one of {', '.join(registry)}")
  return registry[name]
