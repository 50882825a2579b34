"""Cloud TPU slices as libtpu's compile-only devices, for compiling TPU programs on a host without a TPU.

libtpu compiles for a topology's compile-only devices (`jax.experimental.topologies`) on any Linux x86
host: `topology("v4-8")` gives a v4-8's four chips, each a `Chip` (HBM, peak flops, HBM bandwidth) that
`evaluation.plan` plans decode programs for.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from typing import Any

GIB = 2**30

# Without a TPU, libtpu looks for the TPU VM's metadata (and logs an error per field) unless these are set.
_LIBTPU_ENV = {"TPU_ACCELERATOR_TYPE": "v4-8", "TPU_WORKER_HOSTNAMES": "localhost",
               # one libtpu per machine unless told otherwise: the tests compile in parallel processes
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@dataclasses.dataclass(frozen=True)
class Chip:
  """A TPU generation's chip: HBM, peak bf16 matmul rate, HBM bandwidth (Cloud TPU's published figures),
  and whether a chip is one device of two TensorCores (megacore) as JAX shows it on a TPU VM."""
  name: str
  hbm_bytes: int
  peak_flops: float
  hbm_bandwidth: float
  megacore: bool


CHIPS: dict[str, Chip] = {
    "v4": Chip("TPU v4", 32 * GIB, 275e12, 1.2e12, megacore=True),
    "v5e": Chip("TPU v5 lite", 16 * GIB, 197e12, 0.819e12, megacore=False),
    "v5p": Chip("TPU v5p", 95 * GIB, 459e12, 2.765e12, megacore=True),
}

# Chips of a slice -> libtpu's topology shape: v4 and v5p are 3-D tori (a "-N" accelerator type counts
# TensorCores, two per chip), v5e a 2-D one ("-N" counts chips).
_SHAPES_3D = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice: its accelerator type (e.g. "v4-8"), chip, and one compile-only device per chip."""
  name: str
  chip: Chip
  devices: tuple[Any, ...]

  @property
  def chips(self) -> int:
    return len(self.devices)


def _slices() -> dict[str, tuple[str, int]]:
  """Accelerator type -> (generation, chips): "v4-8" is 4 chips, "v5e-8" 8; "<generation>-1chip" one chip."""
  slices = {}
  for generation in ("v4", "v5p"):
    slices[f"{generation}-1chip"] = (generation, 1)
    slices |= {f"{generation}-{2 * chips}": (generation, chips) for chips in _SHAPES_3D if chips > 1}
  return slices | {"v5e-1chip": ("v5e", 1)} | {f"v5e-{chips}": ("v5e", chips) for chips in _SHAPES_2D if chips > 1}


def topology_names() -> list[str]:
  """The accelerator types `topology` knows."""
  return list(_slices())


def topology(name: str) -> Topology:
  """The compile-only devices of a Cloud TPU slice named by its accelerator type ("v4-8": 4 v4 chips;
  "v4-1chip": one chip), one per chip. Needs libtpu (the `tpu-plan` extra); raises
  ValueError naming the known slices for an unknown name, ModuleNotFoundError saying how to install libtpu."""
  if name not in _slices():
    raise ValueError(f"unknown TPU topology {name!r}; known: {', '.join(topology_names())}")
  generation, chips = _slices()[name]
  _check_libtpu()
  for variable, value in _LIBTPU_ENV.items():
    os.environ.setdefault(variable, value)
  from jax.experimental import topologies
  chip = CHIPS[generation]
  shape = (_SHAPES_2D if generation == "v5e" else _SHAPES_3D)[chips]
  kwargs: dict[str, Any] = dict(chip_config_name="megacore") if chip.megacore else {}
  if chips == 1:   # one chip alone: libtpu's default host (2x2x1 chips) does not divide it
    kwargs["chips_per_host_bounds"] = [1, 1, 1]
  devices = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{shape}", **kwargs).devices
  return Topology(name, chip, tuple(devices))


def libtpu_version() -> str | None:
  """The installed libtpu's version, or None."""
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def _check_libtpu() -> None:
  if libtpu_version() is None:
    raise ModuleNotFoundError("compiling for TPU needs libtpu: pip install -c constraints.txt '.[tpu-plan]' (Linux "
                              "x86-64; the test extra installs it too)", name="libtpu")

