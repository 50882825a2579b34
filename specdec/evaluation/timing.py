"""Wall-clock timing of jitted calls: warm-up excluded, median of repeats, device work awaited."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, repeats: int) -> float:
  """Median wall-clock seconds of fn(*args) over `repeats` calls, after one warm-up call (compilation)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
