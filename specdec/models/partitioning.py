"""SPMD partitioning (layer 2): a ('data', 'model') device mesh and t5x-style logical axis rules.

Every parameter gets logical axis names from its path (each architecture's `LOGICAL_AXES`: T5X's parameter names
for `t5.T5`, the decoder-only `TransformerLM`'s, the gemma library's for `decoder.Decoder`), and `DEFAULT_RULES`
map logical names to mesh axes as t5x's
`standard_logical_axis_rules` do: the vocabulary, MLP and attention-head dimensions are split over
'model', the embedding dimension is replicated, batches are split over 'data'.

  mesh = make_mesh(data=4, model=2)            # 8 devices; data=-1: all devices not used by 'model'
  verifier = shard_model(verifier, mesh)       # parameters placed by the rules
  prompts = shard_batch(prompts, mesh)         # rows split over 'data'
  decoding.generate(key, drafter, verifier, prompts, …)   # the loops run unchanged under jit: XLA's SPMD
                                                          # partitioner propagates the shardings

A dimension that the mesh axis does not divide (a vocabulary of 12 over 8 devices, 4 heads over 8) is
replicated instead, so any model runs on any mesh; `param_shardings` reports the layout.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)

# (logical axis name, mesh axis or None), t5x's standard rules for the names our parameters use.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA), ("vocab", MODEL), ("mlp", MODEL), ("heads", MODEL), ("joined_kv", MODEL),
    ("embed", None), ("kv", None), ("relpos_buckets", None), ("stack", None))

def make_mesh(data: int = -1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over `devices` (default: all), the model axis over neighbouring devices.

  data = -1 takes every device the model axis leaves. Raises ValueError unless data · model equals the
  number of devices."""
  devices = list(jax.devices() if devices is None else devices)
  if not isinstance(model, (int, np.integer)) or model < 1:
    raise ValueError(f"mesh model axis must be an integer ≥ 1; got {model!r}")
  if data == -1:
    if len(devices) % model:
      raise ValueError(f"mesh model axis {model} does not divide the {len(devices)} devices")
    data = len(devices) // model
  if not isinstance(data, (int, np.integer)) or data < 1 or data * model != len(devices):
    raise ValueError(f"mesh shape (data={data}, model={model}) must multiply to the {len(devices)} devices "
                     "(data=-1: all devices not used by the model axis)")
  return Mesh(np.asarray(devices).reshape(data, model), AXES)


def logical_axes(params: Any) -> Any:
  """The logical axis names of every parameter, a pytree like `params` of tuples (one name per dimension), by
  the rules of every registered architecture (`families.logical_axis_rules`: each module's `LOGICAL_AXES`, a
  regular expression on the "/"-joined parameter path and the logical axes of its dimensions; first match
  wins). Raises ValueError naming a parameter that no rule covers or whose rank does not match its rule."""
  from specdec.models import families   # the registry imports the architectures, which import this module
  rules = families.logical_axis_rules()
  def axes(path: tuple[str, ...], leaf: Any) -> tuple[str, ...]:
    name = "/".join(path)
    for pattern, names in rules:
      if re.search(pattern, name):
        if len(names) != np.ndim(leaf):
          raise ValueError(f"parameter {name} has shape {np.shape(leaf)}; its rule names {len(names)} axes {names}")
        return names
    raise ValueError(f"no logical axis rule covers parameter {name} (shape {np.shape(leaf)}); "
                     "add one to the LOGICAL_AXES of its architecture's module")

  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({path: axes(path, leaf) for path, leaf in flat.items()})


def partition_spec(names: Sequence[str], shape: Sequence[int], mesh: Mesh,
                   rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> PartitionSpec:
  """The PartitionSpec of an array with logical axes `names`: each name's mesh axis from `rules` (unknown
  names and those mapped to None are replicated), replicated where the mesh axis does not divide the
  dimension or is already used by an earlier dimension."""
  table, used, spec = dict(rules), set(), []
  for name, size in zip(names, shape):
    axis = table.get(name)
    if axis is None or axis in used or size % mesh.shape[axis]:
      spec.append(None)
    else:
      spec.append(axis)
      used.add(axis)
  return PartitionSpec(*spec)


def param_shardings(params: Any, mesh: Mesh, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
  """NamedShardings of a model's parameters (a pytree like `params`) by `rules`."""
  return jax.tree.map(lambda names, leaf: NamedSharding(mesh, partition_spec(names, np.shape(leaf), mesh, rules)),
                      logical_axes(params), params, is_leaf=lambda x: isinstance(x, tuple))


def shard_model(model: Any, mesh: Mesh, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
  """`model` with its parameters placed on `mesh` by `rules` (`param_shardings`)."""
  return model.replace(params=jax.tree.map(place, model.params, param_shardings(model.params, mesh, rules)))


def place(x: Any, sharding: NamedSharding) -> jax.Array:
  """`x` laid out by `sharding`. Built from each device's slice of the host copy, so on a multi-host mesh
  every process passes the same (global) value and keeps only its own devices' shards."""
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def mesh_of(tree: Any) -> Mesh | None:
  """The mesh that a pytree's arrays are laid out on (`shard_model`, `shard_batch`), or None when none is
  on a mesh of more than one device."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
      return sharding.mesh
  return None


def device_of(tree: Any) -> jax.Device | None:
  """The one device a pytree's arrays (or `jax.ShapeDtypeStruct`s with a sharding) are on, or None when
  they are on a mesh of several devices (`mesh_of`) or carry no placement (host arrays)."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and len(sharding.device_set) == 1:
      return next(iter(sharding.device_set))
  return None


def platform_of(tree: Any) -> str | None:
  """The platform ("cpu", "gpu", "tpu") of the devices a pytree's arrays are placed on — compile-only TPU
  devices included, so a program lowered on a CPU host for a TPU topology is built for "tpu" — or None
  when nothing in it is placed."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None:
      return next(iter(sharding.device_set)).platform
  return None


Target = Mesh | jax.Device


def abstract_model(model: Any, target: Target, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
  """`model` with every parameter a `jax.ShapeDtypeStruct` laid out for `target` (a mesh: by `rules`, as
  `shard_model` places them; a device: whole on it), for lowering and compiling a program without weights,
  e.g. for a TPU topology's compile-only devices on a CPU host. `model` may hold arrays or be
  `jax.eval_shape(lambda: models.build(...))` (no memory allocated)."""
  if isinstance(target, Mesh):
    shardings = param_shardings(model.params, target, rules)
  else:
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(target), model.params)
  return model.replace(params=jax.tree.map(
      lambda x, sharding: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), model.params, shardings))


def abstract_batch(tree: Any, target: Target, batch_size: int) -> Any:
  """Every leaf of `tree` (arrays, scalars or `jax.ShapeDtypeStruct`s) as a `jax.ShapeDtypeStruct` on
  `target`: leaves with a leading axis of `batch_size` split by rows over 'data' on a mesh (as
  `shard_batch` splits them), the others replicated; on a device, whole on it. Leaves that already carry
  a sharding keep it."""
  def put(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
      return x
    shape, dtype = np.shape(x), (x.dtype if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else np.asarray(x).dtype)
    if not isinstance(target, Mesh):
      sharding = jax.sharding.SingleDeviceSharding(target)
    elif shape and shape[0] == batch_size:
      if batch_size % target.shape[DATA]:
        raise ValueError(f"batch size {batch_size} is not a multiple of the mesh's data axis "
                         f"({target.shape[DATA]} devices); pad the batch")
      sharding = batch_sharding(target, len(shape))
    else:
      sharding = replicated(target)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  return jax.tree.map(put, tree)


def gather_vocab(logits: Any) -> Any:
  """Logits [..., V] whole along the vocabulary on every device, their other axes as the partitioner likes.

  Under a mesh (`jax.sharding.use_abstract_mesh`, as `decoding.generate` traces sharded models) the output
  projection leaves the logits split over 'model'; S(·), the targets, the acceptance test and sampling all
  reduce over V, and each such reduction would otherwise gather or all-reduce them again. Gathering them
  once per model call makes the sampling math local. Without a mesh (or a 'model' axis of 1): `logits`.

  Gathered as [n·B, V] rows, the batch innermost: the TPU compiler lays the output projection's [B, n, V] out
  with n outermost (the batch's rows fill a tile's sublanes), so these rows are that buffer as it is and the
  gather moves nothing else. Gathered as [B, n, V] (or as [B·n, V] rows) each device's share or the whole
  logits were relayouted around the gather: 2B → 9B at batch 8 on 4 devices moved [B, γ + 1, V] arrays 3 times
  per block (a relayout before the gather, one fused after it and a transfer), 1 time gathered this way
  (experiments/tpu_v4_plan)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or MODEL not in mesh.axis_names or mesh.shape[MODEL] == 1:
    return logits
  batch_inner = jnp.moveaxis(logits, 0, -2)    # [..., B, V]
  rows = batch_inner.reshape(-1, logits.shape[-1])
  gathered = jax.lax.with_sharding_constraint(rows, PartitionSpec(PartitionSpec.UNCONSTRAINED, None))
  return jnp.moveaxis(gathered.reshape(batch_inner.shape), -2, 0)


def replicated(mesh: Mesh) -> NamedSharding:
  """A whole copy on every device of `mesh`."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Rows over 'data', every other dimension replicated."""
  return NamedSharding(mesh, PartitionSpec(DATA, *([None] * (ndim - 1))))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
  """Every array of `batch` (an array or a pytree of arrays with a leading batch axis) split by rows over
  'data' (on several hosts, each passes the same global batch). Raises ValueError when the data axis does
  not divide the batch size."""
  def put(x: Any) -> jax.Array:
    if np.shape(x)[0] % mesh.shape[DATA]:
      raise ValueError(f"batch size {np.shape(x)[0]} is not a multiple of the mesh's data axis "
                       f"({mesh.shape[DATA]} devices); pad the batch")
    return place(x, batch_sharding(mesh, np.ndim(x)))
  return jax.tree.map(put, batch)


def shard_like(tree: Any, params: Any, mesh: Mesh, rules: Sequence[tuple[str, str | None]] = DEFAULT_RULES) -> Any:
  """Places a training state or an optimizer state (any pytree) on `mesh`: every subtree structured as
  `params` (the parameters, Adam's μ and ν, …) takes the parameters' shardings leaf by leaf where the
  shapes match (Adafactor's factored rows and columns do not: replicated); every other leaf (step
  counts, …) is replicated."""
  structure, shardings = jax.tree.structure(params), param_shardings(params, mesh, rules)

  def put(subtree: Any) -> Any:
    if jax.tree.structure(subtree) == structure:
      return jax.tree.map(
          lambda leaf, p, s: place(leaf, s if np.shape(leaf) == np.shape(p) else replicated(mesh)),
          subtree, params, shardings)
    return place(subtree, replicated(mesh))

  return jax.tree.map(put, tree, is_leaf=lambda x: jax.tree.structure(x) == structure)
