"""The sweep tests' shared pieces: the smoke experiment (configs/experiments/smoke.gin: random `tiny` models
over the shipped vocabulary and sample), a script of scripts/ loaded as a module, and what a rerun must
reproduce."""

import importlib.util
import pathlib

import gin

from specdec.evaluation import grid

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = "configs/experiments/smoke.gin"


def load_script(name):
  """scripts/<name>.py as a module."""
  spec = importlib.util.spec_from_file_location(f"{name}_script", REPO_ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def smoke(output, *bindings):
  """The smoke experiment writing to `output`, with more gin bindings."""
  gin.clear_config()
  try:
    return grid.parse_gin([SMOKE], [f"Experiment.output = '{output}'", *bindings])
  finally:
    gin.clear_config()


def outcomes(records):
  """What a rerun must reproduce exactly: quality and counters per hash (latency is wall-clock)."""
  return {r["hash"]: (r["quality"], r["counters"]) for r in records}
