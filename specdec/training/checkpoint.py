"""Checkpoints (layer 4): orbax training checkpoints that resume exactly, and exported models.

A training checkpoint is one step directory of an orbax `CheckpointManager` with two items:
  state  the `TrainState` pytree (step, params, opt_state), orbax `StandardSave`;
  meta   JSON: the step, the data offset (batches consumed), the run's description (model spec, batch
         shape) and a manifest {path: [shape, dtype]} of the state's leaves.
`restore_latest` compares the JSON with what the run expects and the manifest with the state it restores
into before reading any array, and turns every read failure into a `CheckpointError`: a mismatched,
corrupt or incomplete checkpoint raises; it never yields random or partial weights.

An exported model (`save_params`) is a directory holding `params/` (orbax) and `model.json` (its spec: its
model family's name, `models.families`: 'transformer', 't5', 'gemma2' or 'llama'; its preset; its config's
fields). Exports written before the config fields were named alike ('emb_dim', 'mlp_dim') and Gemma 2's written
before the shared decoder (no switches in model.json, the gemma library's layouts) load as well.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from etils import epath

from specdec import models
from specdec.models import base, decoder, families, t5, transformer

_MODEL_JSON = "model.json"
Model = transformer.TransformerLM | t5.T5 | decoder.Decoder


class CheckpointError(Exception):
  """A checkpoint that cannot be restored: unreadable, incomplete, or made by a different run."""


def model_spec(model: Model, preset: str | None = None) -> dict[str, Any]:
  """A model's architecture as JSON: its family's name (`models.families`: 'transformer', 't5', 'gemma2',
  'llama'), the preset it was built from and its config's fields."""
  try:
    family = families.for_model(model)
  except TypeError as e:
    raise TypeError(f"no exportable architecture: {e}") from None
  config = dataclasses.asdict(model.config)
  config["dtype"] = jnp.dtype(config["dtype"]).name
  return {"architecture": family.name, "preset": preset, **config}


def _init_from_spec(spec: dict[str, Any]) -> Callable[[jax.Array], Model]:
  """init(key) of a spec's family and config (its config's constructor fills what an older export's fields lack:
  Gemma 2's exported before the shared decoder); specs from before T5 name no architecture."""
  family = families.get(spec.get("architecture", "transformer"))
  fields = base.current_fields({k: v for k, v in spec.items() if k not in ("architecture", "preset")})
  config = family.config(**{**fields, "dtype": getattr(jnp, fields["dtype"])})
  return functools.partial(family.architecture.init, config)


def _manifest(tree: Any, *, dtypes: bool = True) -> dict[str, list]:
  """{path: [shape, dtype]}, or [shape] without `dtypes`, of a pytree's leaves (arrays,
  `jax.ShapeDtypeStruct`s or orbax's stored array metadata)."""
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
              [list(leaf.shape), jnp.dtype(leaf.dtype).name] if dtypes else [list(leaf.shape)]
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _differences(stored: Any, expected: Any, prefix: str = "") -> list[str]:
  if isinstance(stored, dict) and isinstance(expected, dict):
    return [d for key in expected
            for d in _differences(stored.get(key), expected[key], f"{prefix}{key}.")]
  return [] if stored == expected else [f"{prefix[:-1]} is {stored!r} there, {expected!r} here"]


def _entry(entry: list) -> str:
  """A manifest entry as text: '(32, 64) float32'."""
  return " ".join([str(tuple(entry[0])), *entry[1:]])


def _tree_problems(stored: dict[str, list], expected: dict[str, list]) -> list[str]:
  missing = [p for p in expected if p not in stored]
  unexpected = [p for p in stored if p not in expected]
  changed = [f"{p}: {_entry(stored[p])} there, {_entry(e)} here"
             for p, e in expected.items() if p in stored and stored[p] != e]
  return [f"{name} ({len(items)}): {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
          for name, items in [("missing", missing), ("unexpected", unexpected), ("different", changed)] if items]


def _unreadable(where: str, error: BaseException) -> CheckpointError:
  """A read failure as one line, from the innermost cause that says something: orbax wraps tensorstore's
  status (which names the file and the problem) in messages ending in a multi-line pybind repr."""
  chain = [error]
  while chain[-1].__cause__ is not None:
    chain.append(chain[-1].__cause__)
  for cause in reversed(chain):
    # Up to the repr, if any: "… See full TensorStore details: <bound method … of TensorStore({ …".
    detail = (str(cause).strip().splitlines() or [""])[0].split("<")[0].strip()
    if detail:
      break
  return CheckpointError(f"{where} cannot be read, it is truncated, corrupt or incomplete "
                         f"({type(cause).__name__}: {detail[:300]})")


def _location(path: str | os.PathLike) -> str:
  """A local path made absolute, or a remote one (gs://…: orbax and etils.epath read and write them) as is,
  so that the hosts of a TPU slice share one checkpoint directory."""
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


class Checkpointer:
  """Saves training checkpoints to `directory` every `save_every` steps (or when forced), keeping the
  newest `keep`. `metadata` (JSON) describes the run; `restore_latest` checks it on resume."""

  def __init__(self, directory: str, *, metadata: dict[str, Any], save_every: int, keep: int):
    self._metadata = metadata
    self._save_every = save_every
    self._manager = ocp.CheckpointManager(
        _location(directory), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def save(self, step: int, state: Any, *, data_offset: int, force: bool = False) -> bool:
    """Saves `state` (after `step` steps, `data_offset` batches consumed) if due; returns whether it did.

    Asynchronous: arrays are copied to the host before this returns, so the caller may donate them.
    """
    if not (force or step % self._save_every == 0) or self._manager.latest_step() == step:
      return False
    meta = {**self._metadata, "step": step, "data_offset": data_offset, "tree": _manifest(state)}
    return self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                            meta=ocp.args.JsonSave(meta)), force=True)

  def close(self) -> None:
    """Waits for pending saves to finish."""
    self._manager.wait_until_finished()
    self._manager.close()


class Restored(NamedTuple):
  state: Any           # the restored TrainState
  data_offset: int     # batches the data source had produced: resume it at this index
  metadata: dict[str, Any]


def restore_latest(directory: str, abstract_state: Any, *, expected: dict[str, Any] | None = None
                   ) -> Restored | None:
  """The newest checkpoint in `directory` restored into the structure of `abstract_state` (a TrainState
  of arrays or of `jax.ShapeDtypeStruct`s), or None when there is none.

  Raises CheckpointError when an entry of `expected` (e.g. {'model': model_spec(...)}) differs from the
  checkpoint's, when its tree, shapes or dtypes differ from `abstract_state`'s, or when any file is
  missing or unreadable. Older checkpoints are not tried: delete a bad one to fall back.
  """
  directory = _location(directory)
  if not epath.Path(directory).is_dir():
    return None
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
  try:
    step = manager.latest_step()
    if step is None:
      return None
    where = f"checkpoint {directory}/{step}"
    try:
      meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax and tensorstore raise many types; all mean the same here
      raise _unreadable(where, e) from e
    if not isinstance(meta, dict) or not {"step", "data_offset", "tree"} <= meta.keys():
      raise CheckpointError(f"{where} has no valid metadata (step, data offset, tree manifest)")
    if isinstance(meta.get("model"), dict):   # a run's model spec written with config fields' older names
      meta["model"] = base.current_fields(meta["model"])
    differences = _differences(meta, expected or {})
    if differences:
      raise CheckpointError(f"{where} was written by a different run: " + "; ".join(differences))
    abstract_state = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    problems = _tree_problems(meta["tree"], _manifest(abstract_state))
    if problems:
      raise CheckpointError(f"{where} does not fit the state to restore: " + "; ".join(problems))
    try:
      state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state
    except Exception as e:
      raise _unreadable(where, e) from e
  finally:
    manager.close()
  return Restored(state=state, data_offset=int(meta["data_offset"]), metadata=meta)


def save_params(path: str, model: Model, *, preset: str | None = None) -> None:
  """Exports `model` (its parameters in their own dtype, e.g. after `cast_params(…, bfloat16)`, and its
  spec) to a new directory `path`, for `load_export` (and `loading.load_model`)."""
  path = _location(path)
  if epath.Path(path).exists():
    raise FileExistsError(f"{path} exists; save_params writes a new directory")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(f"{path}/params", model.params)
    checkpointer.wait_until_finished()
  # Written last (by one process of a slice): a directory with model.json holds complete parameters.
  if jax.process_index() == 0:
    epath.Path(path, _MODEL_JSON).write_text(json.dumps(model_spec(model, preset), indent=2))


def read_head(directory: str, subdirectory: str, record: str, hint: str) -> tuple[str, dict[str, Any]]:
  """(path, stored record) of a head saved under `directory`/`subdirectory` with its JSON `record` (written last: it
  marks a complete head); FileNotFoundError naming the expected path and `hint` (how to train one) if absent."""
  path = os.path.join(os.path.abspath(directory), subdirectory)
  if not os.path.isfile(os.path.join(path, record)):
    raise FileNotFoundError(f"no {subdirectory.replace('_', ' ')} in {directory} (expected {path}/{record}; {hint})")
  with open(os.path.join(path, record)) as f:
    return path, json.load(f)


def restore_head_params(path: str, init: Callable[[jax.Array], Any]) -> Any:
  """The parameters saved in `path`/params, restored into the structure `init(key).params` has, as device arrays."""
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  with ocp.StandardCheckpointer() as checkpointer:
    params = checkpointer.restore(os.path.join(path, "params"), abstract.params)
  return jax.tree.map(jnp.asarray, params)


def export_name(path: str) -> str:
  """A model directory's name for tables and logs: the training run's (its parent) for a `scripts/train.py`
  `…/export` directory, else its own."""
  path = os.path.normpath(path)
  name = os.path.basename(path)
  return os.path.basename(os.path.dirname(path)) if name == "export" else name


def load_export(path: str, *, dtype: Any = None) -> Model:
  """The model `save_params` exported to `path`, parameters checked by `models.with_params` and held in
  the config's float32 (bfloat16 exports load exactly), or computing in `dtype` (`models.with_dtype`:
  e.g. bfloat16 weights and caches). Raises CheckpointError on any problem, in one line: the missing,
  unexpected or mis-shaped parameters by path, or that the directory is truncated or corrupt."""
  path = _location(path)
  try:
    spec = json.loads(epath.Path(path, _MODEL_JSON).read_text())
    init = _init_from_spec(spec)
  except (OSError, ValueError, TypeError, KeyError) as e:
    raise CheckpointError(f"{path} is not an exported model: its {_MODEL_JSON} is missing or invalid ({e})") from e
  # Shapes only: the structure to check against, without initialising random weights.
  abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
  # Restored onto this process's first device whatever device saved it (a GPU-trained export loads on a
  # CPU); shapes and dtypes are the stored ones, checked by `with_params` below.
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=device), abstract.params)
  where = f"exported model {path}"
  # The handler's metadata, not the checkpointer's: that one logs a read failure and returns None.
  handler = ocp.PyTreeCheckpointHandler()
  try:
    stored = handler.metadata(epath.Path(path, "params")).tree
  except Exception as e:  # orbax and tensorstore raise many types; all mean the same here
    raise _unreadable(where, e) from e
  finally:
    handler.close()
  # A Gemma 2 export written before the shared decoder (its model.json names no switch) holds the gemma library's
  # layouts: their shapes are the ones to find, transposed into ours once read.
  legacy = spec.get("architecture") == "gemma2" and "norm_offset" not in spec
  expected = _manifest(abstract.params, dtypes=False)
  if legacy:
    expected = {name: [_legacy_shape(name, entry[0])] for name, entry in expected.items()}
  # Compared before restoring: orbax reports a tree that differs from `restore_args` as a pytree structure
  # error naming no tensor. Shapes only: a bfloat16 export loads into a float32 model.
  problems = _tree_problems(_manifest(stored, dtypes=False), expected)
  if problems:
    raise CheckpointError(f"{where} does not match its {_MODEL_JSON}: " + "; ".join(problems))
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      params = checkpointer.restore(f"{path}/params",
                                    args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except Exception as e:
    raise _unreadable(where, e) from e
  if legacy:
    params = jax.tree_util.tree_map_with_path(
        lambda key, leaf: decoder.from_gemma_library_layout(jax.tree_util.keystr(key, simple=True, separator="/"),
                                                            leaf), params)
  try:
    model = models.with_params(abstract, params)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from e
  return model if dtype is None else models.with_dtype(model, dtype)


def _legacy_shape(name: str, shape: list[int]) -> list[int]:
  """The shape parameter `name` had in the gemma library's layout, given ours."""
  axes = next((axes for suffix, axes in decoder.GEMMA_LIBRARY_AXES.items() if name.endswith(suffix)), None)
  return shape if axes is None else [shape[i] for i in np.argsort(axes)]


def safetensors_files(directory: str) -> dict[str, str]:
  """{tensor name: file} of a single-file or sharded safetensors checkpoint."""
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      return {name: os.path.join(directory, file) for name, file in json.load(f)["weight_map"].items()}
  single = os.path.join(directory, "model.safetensors")
  if not os.path.exists(single):
    raise CheckpointError(f"{directory} holds neither model.safetensors nor model.safetensors.index.json "
                          "(save the model with save_pretrained(..., safe_serialization=True))")
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def abstract_model(init: Callable[[Any, jax.Array], Model], config: Any) -> Model:
  """The model `init(config, key)` builds, with `jax.ShapeDtypeStruct` leaves (no random weights drawn)."""
  return jax.eval_shape(functools.partial(init, config), jax.random.PRNGKey(0))


def checked_model(where: str, init: Callable[[Any, jax.Array], Model], config: Any, params: Any, *,
                  host: bool = False) -> Model:
  """The model of `config` holding `params` (`models.with_params`; `host` as there): CheckpointError naming `where`
  and the missing, unexpected or mis-shaped parameters."""
  try:
    return models.with_params(abstract_model(init, config), params, host=host)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from e


def hf_config(directory: str) -> dict[str, Any]:
  """A Hugging Face save_pretrained directory's config.json (CheckpointError if it has none readable)."""
  try:
    with open(os.path.join(directory, "config.json")) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{directory}: no readable config.json ({e}); a Hugging Face save_pretrained "
                          "directory holds one") from e
