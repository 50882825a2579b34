"""T5X checkpoints (layer 4): T5X's parameter tree is ours (`models.t5.T5`), so a T5X checkpoint maps one to
one; its architecture lives in gin, not in the checkpoint, so the loader takes a `t5.T5Config`.

  model = load_t5x(path, config)            # a T5X checkpoint_<step> directory, or the directory holding them
  save_t5x(directory, params, step=0)       # T5X's native layout (tests, export)

Two layouts are read. T5X's native one (t5x/checkpoints.py, VERSION 3): `checkpoint_<step>/checkpoint` is a
msgpack {'version', 'optimizer': {'target': params, 'state': …}} whose leaves are arrays or tensorstore specs
of zarr arrays stored next to it, named `target.<path with dots>`. T5X's Orbax layout keeps the same tree in
`checkpoint_<step>/state/`. Optimizer states are not read. The loader checks the presence and shape of each
parameter before building a model and raises CheckpointError naming it; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization, traverse_util

from specdec.models import t5
from specdec.training.checkpoint import CheckpointError, checked_model

_T5X_VERSION = 3


def _step_directory(path: str) -> str:
  """`path` itself if it is one checkpoint, else its newest checkpoint_<step> subdirectory."""
  if os.path.exists(os.path.join(path, "checkpoint")) or os.path.isdir(os.path.join(path, "state")):
    return path
  steps = [int(m.group(1)) for name in (os.listdir(path) if os.path.isdir(path) else [])
           if (m := re.fullmatch(r"checkpoint_(\d+)", name))]
  if not steps:
    raise CheckpointError(f"{path} is not a T5X checkpoint (no checkpoint file, no state/ directory, "
                          "no checkpoint_<step> subdirectory)")
  return os.path.join(path, f"checkpoint_{max(steps)}")


def _is_tensorstore_spec(node: Any) -> bool:
  return isinstance(node, dict) and {"driver", "kvstore"} <= node.keys()


def _read_tensorstore(directory: str, name: str, spec: dict[str, Any]) -> np.ndarray:
  """Reads one parameter's zarr array; its spec's path is relative to the checkpoint directory."""
  kvstore = spec["kvstore"]
  # tensorstore ≥ 0.1.14 puts the path in the kvstore, older versions (and T5X's GCS specs) beside it.
  relative = kvstore.get("path", spec.get("path"))
  # A checkpoint copied from GCS is read from the local disk; the stored metadata is read from .zarray.
  local = {"driver": spec["driver"], "kvstore": {"driver": "file", "path": os.path.join(directory, relative)}}
  try:
    return np.asarray(ts.open(local, open=True, read=True).result().read().result())
  except Exception as e:  # tensorstore raises ValueError/OSError subclasses with long messages
    raise CheckpointError(f"T5X checkpoint {directory}: parameter {name} cannot be read from {relative} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e


def _read_native(directory: str) -> Any:
  """The msgpack tree of T5X's native layout (`checkpoint`): arrays, or tensorstore specs of zarr arrays."""
  with open(os.path.join(directory, "checkpoint"), "rb") as f:
    return serialization.msgpack_restore(f.read())


def _read_orbax(directory: str) -> Any:
  """The tree of T5X's Orbax layout (`state/`), as host numpy arrays: a checkpoint's sharding need not fit
  this machine."""
  checkpointer, state = ocp.PyTreeCheckpointer(), os.path.join(directory, "state")
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                          checkpointer.metadata(state).item_metadata.tree)
  return checkpointer.restore(state, restore_args=as_numpy)


def load_t5x(path: str, config: t5.T5Config) -> t5.T5:
  """The T5X checkpoint at `path` (a checkpoint_<step> directory, or a model directory: its newest step)
  as a float32 `t5.T5` of architecture `config` (T5X keeps the architecture in gin, not in the
  checkpoint). Reads the native layout and the Orbax one; optimizer states are not read.

  Raises CheckpointError naming a missing, unexpected, mis-shaped or unreadable parameter.
  """
  directory = _step_directory(os.path.abspath(path))
  where = f"T5X checkpoint {directory}"
  try:
    contents = _read_orbax(directory) if os.path.isdir(os.path.join(directory, "state")) else _read_native(directory)
  except Exception as e:  # msgpack and orbax raise many types; all mean the same here
    raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
  contents = contents.get("optimizer", contents) if isinstance(contents, dict) else None
  if not isinstance(contents, dict) or not isinstance(contents.get("target"), dict):
    raise CheckpointError(f"{where} holds no 'target' (parameter) tree")

  def read(node: Any, prefix: str) -> Any:
    if _is_tensorstore_spec(node):
      return _read_tensorstore(directory, prefix, node)
    if isinstance(node, dict):
      return {key: read(child, f"{prefix}/{key}" if prefix else key) for key, child in node.items()}
    return np.asarray(node)

  return checked_model(where, t5.init, config, read(contents["target"], ""))


def save_t5x(directory: str, params: Any, *, step: int = 0) -> str:
  """Writes `params` (our/T5X tree) as T5X's native checkpoint directory/checkpoint_<step>; returns it.

  One gzip-compressed zarr array per parameter, named target.<path with dots>, and the msgpack
  `checkpoint` file {'version': 3, 'optimizer': {'target': specs, 'state': {'step': step}}} with
  relative paths, written last (a directory with that file is complete). No optimizer state is written.
  """
  step_directory = os.path.join(os.path.abspath(directory), f"checkpoint_{step}")
  if os.path.exists(step_directory):
    raise FileExistsError(f"{step_directory} exists; save_t5x writes a new checkpoint")
  os.makedirs(step_directory)
  specs = {}
  for path, leaf in traverse_util.flatten_dict(jax.tree.map(np.asarray, params)).items():
    name = ".".join(("target",) + path)
    spec = {"driver": "zarr", "dtype": np.dtype(leaf.dtype).name, "kvstore": {"driver": "file", "path": name},
            "metadata": {"compressor": {"id": "gzip"}, "shape": list(leaf.shape), "chunks": list(leaf.shape)}}
    absolute = {**spec, "kvstore": {"driver": "file", "path": os.path.join(step_directory, name)}}
    ts.open(absolute, create=True).result().write(leaf).result()
    specs[path] = spec
  contents = {"version": _T5X_VERSION, "optimizer": {"target": traverse_util.unflatten_dict(specs),
                                                     "state": {"step": np.int32(step)}}}
  with open(os.path.join(step_directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(contents))
  return step_directory
