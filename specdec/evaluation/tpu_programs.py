"""The decode programs a plan compiles (`evaluation.plan`), lowered from shapes alone and read once compiled.

A `Setting` names one decode program (a pair of model presets, the method, shapes and dtype). Its models,
built under `jax.eval_shape` and laid out by `partitioning.abstract_model` on a mesh of a topology's chips
(`evaluation.tpu_topology`), lower through `decoding.lower` without weights or data (`decode_program`); each
model call lowers alone too (`call_program`, `feature_step_program`). `facts` compiles one and reads what a
plan needs (memory, flops, the optimized HLO), or that libtpu refused it for HBM; `ProgramCache` keeps them by
key (setting, topology, mesh, the code that builds them, jax and libtpu versions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specdec import decoding, models
from specdec.decoding import feature_drafter
from specdec.evaluation import results
from specdec.evaluation.tpu_topology import GIB, Topology, libtpu_version
from specdec.models import base, feature_head, partitioning


# --- what is planned --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setting:
  """One decode program: a pair of model presets (`models.build`; drafter None for a method without one,
  `FEATURE` for a feature drafter over the verifier), the method and its parameters, shapes and dtype. Sampling
  at `temperature` (> 0 compiles the sampling path; its value and top_p are traced, and the top-p search is
  compiled in whatever top_p is, so one program serves a sweep over them)."""
  verifier: str
  drafter: str | None
  vocab_size: int
  method: str = "speculative"
  params: tuple[tuple[str, Any], ...] = (("gamma", 5),)
  batch_size: int = 8
  prompt_width: int = 64
  max_new_tokens: int = 64
  dtype: str = "bfloat16"
  temperature: float = 1.0
  top_p: float = 1.0
  eos_id: int | None = None
  draft_vocabulary: int = 0   # a feature drafter's draft vocabulary (FR-Spec: k token ids); 0: the whole vocabulary

  @property
  def gamma(self) -> int:
    return int(dict(self.params).get("gamma", 1))

  def config(self) -> dict[str, Any]:
    config = dataclasses.asdict(self) | {"params": dict(self.params)}
    if not self.draft_vocabulary:   # the settings before the field keep their cached programs
      del config["draft_vocabulary"]
    return config


# Setting.drafter for EAGLE's feature drafter (`decoding.feature_drafter`): a one-layer head as wide as the
# verifier (its hidden size, heads and MLP width, as EAGLE's head is one decoder layer of the target's), reading
# the verifier's hidden states, embeddings and output layer.
FEATURE = "feature"


def check_mesh(mesh_shape: tuple[int, int], topo: Topology, batch_size: int) -> None:
  """One line naming the constraint a (data, model) mesh breaks on a topology, or nothing."""
  data, model = mesh_shape
  if data < 1 or model < 1 or data * model != topo.chips:
    raise ValueError(f"mesh (data={data}, model={model}) must multiply to the {topo.chips} chips of {topo.name}")
  if batch_size % data:
    raise ValueError(f"batch size {batch_size} is not a multiple of the mesh's data axis ({data})")


def target_of(devices: Sequence[Any], mesh_shape: tuple[int, int]) -> Mesh | Any:
  """What a program is laid out on: the one device, else a (data, model) mesh of the devices."""
  if len(devices) == 1:
    return devices[0]
  return partitioning.make_mesh(*mesh_shape, devices=devices)


def abstract_pair(setting: Setting, target: Mesh | Any) -> tuple[Any, Any]:
  """(drafter or None, verifier) of `setting` as abstract models on `target` (no weights allocated)."""
  max_length = decoding_cache_length(setting)

  def build(preset: str) -> Any:
    model = jax.eval_shape(lambda: models.build(preset, vocab_size=setting.vocab_size, max_length=max_length,
                                                dtype=jnp.dtype(setting.dtype)))
    return partitioning.abstract_model(model, target)
  verifier = build(setting.verifier)
  if setting.drafter == FEATURE:
    return abstract_feature_drafter(verifier, target, jnp.dtype(setting.dtype), setting.draft_vocabulary), verifier
  if setting.draft_vocabulary:
    raise ValueError(f"a draft vocabulary ({setting.draft_vocabulary} ids) is a feature drafter's: the drafter is "
                     f"{setting.drafter!r}, not {FEATURE!r}")
  return (None if setting.drafter is None else build(setting.drafter)), verifier


def abstract_feature_drafter(verifier: Any, target: Mesh | Any, dtype: Any, draft_vocabulary: int = 0
                             ) -> feature_drafter.FeatureDrafter:
  """A feature drafter over an abstract verifier, its head (`FEATURE`) abstract on `target` too, drafting among
  `draft_vocabulary` token ids (0: all of them)."""
  feature_drafter.check_features(verifier)
  if not 0 <= draft_vocabulary <= verifier.vocab_size:
    raise ValueError(f"draft_vocabulary must lie in [0, {verifier.vocab_size}] (0: the whole vocabulary); got "
                     f"{draft_vocabulary}")
  cfg = verifier.config
  config = feature_head.FeatureHeadConfig(embed_dim=verifier.hidden_size, vocab_size=verifier.vocab_size,
                                          num_heads=cfg.num_heads, hidden_dim=cfg.hidden_dim,
                                          max_len=verifier.max_length, dtype=dtype)
  head = jax.eval_shape(lambda: feature_head.init_from_config(config, jax.random.PRNGKey(0)))
  head = partitioning.abstract_model(head, target)
  if draft_vocabulary:   # which ids they are does not change the program: only how many
    head = head.replace(draft_ids=jax.ShapeDtypeStruct((draft_vocabulary,), jnp.int32, sharding=_whole(target)))
  return feature_drafter.FeatureDrafter(head, verifier)


def _whole(target: Mesh | Any) -> jax.sharding.Sharding:
  """A whole array on `target`: replicated over a mesh, on the one device otherwise."""
  return (jax.sharding.NamedSharding(target, jax.sharding.PartitionSpec()) if isinstance(target, Mesh)
          else jax.sharding.SingleDeviceSharding(target))


def network_of(drafter: Any) -> Any:
  """What holds a drafter's own weights and cache: a feature drafter's head, else the model."""
  return drafter.head if isinstance(drafter, feature_drafter.FeatureDrafter) else drafter


def decoding_cache_length(setting: Setting) -> int:
  """A max_length that holds the method's cache at these shapes (prompt, new tokens, a block's overhang, and a
  token tree's beyond it: K·γ + 1 positions for K drafts), with room to spare."""
  method = decoding.methods.get(setting.method)
  tree = max(0, method.cache_overhang(method.resolve(dict(setting.params))) - (setting.gamma + 1))
  return setting.prompt_width + setting.max_new_tokens + 2 * setting.gamma + 8 + tree


def num_drafts(setting: Setting) -> int:
  """K, the drafts per block of a multi-draft method (its `num_drafts`, default included); 1 for the others."""
  return int(decoding.methods.get(setting.method).resolve(dict(setting.params)).get("num_drafts", 1))


# --- compiling and reading a program ----------------------------------------------------------------------

class DoesNotFit(Exception):
  """libtpu refused the program: it needs more HBM than a chip has (`required` bytes, when it says)."""

  def __init__(self, message: str, required: int | None):
    super().__init__(message)
    self.required = required


def _compile(lowered: Any) -> Any:
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    required = re.search(r"required for [^(]*\(([\d.]+)([GMK])\)", str(e))
    scale = {"G": GIB, "M": 2**20, "K": 2**10}
    raise DoesNotFit(" ".join(str(e).split())[:300],
                     int(float(required.group(1)) * scale[required.group(2)]) if required else None) from None


def _memory(compiled: Any) -> dict[str, int]:
  stats = compiled.memory_analysis()
  memory = dict(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                aliased=stats.alias_size_in_bytes, temporaries=stats.temp_size_in_bytes,
                code=stats.generated_code_size_in_bytes)
  memory["total"] = memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"] + memory["code"]
  return memory


def _flops(compiled: Any) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get("flops", 0.0))


def facts(lowered: Callable[[], Any]) -> dict[str, Any]:
  """What a plan reads of a compiled program: {"fits", "memory" (`_memory`), "flops", "hlo" (its optimized
  HLO text)}, or {"fits": False, "error", "required_bytes"} when libtpu refuses it for HBM."""
  try:
    compiled = _compile(lowered())
  except DoesNotFit as e:
    return dict(fits=False, error=str(e), required_bytes=e.required)
  return dict(fits=True, memory=_memory(compiled), flops=_flops(compiled), hlo=compiled.as_text())


def per_device_bytes(tree: Any) -> int:
  """Bytes of one device's share of a pytree of laid-out arrays or `jax.ShapeDtypeStruct`s."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
  return total


def _cache_sharding(leaf: Any, rows: int, target: Mesh | Any, batch_size: int) -> Any:
  """A KV-cache array's layout for a call compiled alone: rows (axis `rows`, `base.row_axes`) over 'data', the
  heads after them over 'model' where the axes divide them (as the decode loop's partitioner lays them out):
  [B, H, C, D] ("heads"), [C, B, H·D] ("slots", `base.cache_layout` on TPU), or another per-row array [B, …]."""
  if not isinstance(target, Mesh):
    return jax.sharding.SingleDeviceSharding(target)
  spec = [None] * leaf.ndim
  if leaf.ndim > rows and leaf.shape[rows] == batch_size and batch_size % target.shape[partitioning.DATA] == 0:
    spec[rows] = partitioning.DATA
  if leaf.ndim in (3, 4) and leaf.shape[rows + 1] % target.shape[partitioning.MODEL] == 0:
    spec[rows + 1] = partitioning.MODEL
  return NamedSharding(target, PartitionSpec(*spec))


def abstract_cache(model: Any, target: Mesh | Any, batch_size: int, cache_length: int) -> Any:
  """`model`'s KV cache of `batch_size` rows and `cache_length` slots as `jax.ShapeDtypeStruct`s laid out on
  `target` (`_cache_sharding`), in the target platform's cache layout (`base.cache_layout`)."""
  cache = jax.eval_shape(lambda: model.init_cache(batch_size, cache_length, base.cache_layout(_platform(target))))
  return jax.tree.map(lambda x, rows: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=_cache_sharding(x, rows, target, batch_size)),
                      cache, base.row_axes(cache))


def _platform(target: Mesh | Any) -> str:
  """The platform of a mesh's or a device's chips ("tpu" for a topology's compile-only devices)."""
  return (target.devices.flat[0] if isinstance(target, Mesh) else target).platform


def _under(target: Mesh | Any) -> contextlib.AbstractContextManager:
  """Within: programs traced on `target`'s mesh if it is one (the platform is the cache's: `abstract_cache`)."""
  return jax.sharding.use_abstract_mesh(target.abstract_mesh) if isinstance(target, Mesh) else contextlib.nullcontext()


def call_program(model: Any, target: Mesh | Any, *, batch_size: int, cache_length: int, n: int,
                 prefill: bool = False) -> Any:
  """One model call lowered alone for `target`: `score` of n tokens into a cache of `cache_length`
  slots (donated, as the loop updates it in place), or the prefill of an n-token prompt."""
  cache = abstract_cache(model, target, batch_size, cache_length)
  tokens = partitioning.abstract_batch(jax.ShapeDtypeStruct((batch_size, n), jnp.int32), target, batch_size)
  with _under(target):
    if prefill:
      lengths = partitioning.abstract_batch(jax.ShapeDtypeStruct((batch_size,), jnp.int32), target, batch_size)
      lowered = jax.jit(lambda m, c, t, l: base.prefill(m, c, t, l)[:2], donate_argnums=1).lower(
          model, cache, tokens, lengths)
    else:
      def call(m, c, t):   # logits and cache: the hidden states are no output of a decode call
        scored = m.score(c, t)
        return scored.logits, scored.cache
      lowered = jax.jit(call, donate_argnums=1).lower(model, cache, tokens)
  return lowered


def feature_step_program(drafter: feature_drafter.FeatureDrafter, target: Mesh | Any, *, batch_size: int,
                         cache_length: int, n: int, logits: bool) -> Any:
  """A feature drafter's head call lowered alone: n positions into its cache (donated), from features and the
  verifier's embeddings of the tokens (gathered before the call: n rows, whatever the table's size), and with
  `logits` its prediction read through the output layer's rows it drafts among (`FeatureDrafter.draft_logits`: all
  V, or its draft vocabulary's k rows, gathered once per decode) — a drafting step; without, the re-read of a
  verified block. Arguments count whole in the plan's bytes: these are the ones the call reads whole."""
  width = drafter.head.config.embed_dim
  cache = abstract_cache(drafter.head, target, batch_size, cache_length)
  features, embeddings = (partitioning.abstract_batch(jax.ShapeDtypeStruct((batch_size, n, width), jnp.float32),
                                                      target, batch_size) for _ in range(2))
  ids = drafter.head.draft_ids
  table = None if ids is None or not logits else jax.ShapeDtypeStruct(
      (ids.shape[0], width), drafter.verifier.output_table().dtype, sharding=_whole(target))

  def call(drafter, cache, features, embeddings, table):
    predicted, cache = drafter.head.score(cache, features, embeddings)
    return (drafter.draft_logits(predicted, table) if logits else predicted), cache
  with _under(target):
    return jax.jit(call, donate_argnums=1).lower(drafter, cache, features, embeddings, table)


def decode_program(setting: Setting, drafter: Any, verifier: Any) -> Any:
  """`generate`'s whole program for `setting`, lowered for the models' devices (`decoding.lower`)."""
  target = partitioning.mesh_of(verifier) or partitioning.device_of(verifier)
  prompts = partitioning.abstract_batch(jax.ShapeDtypeStruct((setting.batch_size, setting.prompt_width), jnp.int32),
                                        target, setting.batch_size)
  # With the top-p search whatever top_p is: the program a sweep over top-P runs at every point.
  sampling = decoding.Sampling(setting.temperature, setting.top_p, truncation=True)
  return decoding.lower(jax.random.PRNGKey(0), drafter, verifier, prompts, method=setting.method,
                        max_new_tokens=setting.max_new_tokens, sampling=sampling, eos_id=setting.eos_id,
                        **dict(setting.params))


def cache_length_of(setting: Setting, drafter: Any, verifier: Any) -> int:
  """The cache positions `generate` allocates for `setting` (`decoding.required_cache_length`)."""
  method = decoding.METHODS[setting.method]
  params = method.resolve(dict(setting.params))
  drafter_arg = None if method.drafter == "none" else (drafter if method.drafter == "model"
                                                       else decoding.as_drafter(drafter))
  return decoding.required_cache_length(method, params, verifier, drafter_arg, setting.prompt_width,
                                        setting.max_new_tokens)


# --- the cache of compiled programs ---------------------------------------------------------------------

def code_versions() -> dict[str, Any]:
  """What a compiled program depends on besides its setting: jax, libtpu, and the code that builds it
  (core, models, decoding: not evaluation's modules, whose analyses are recomputed from the cached programs)."""
  package = pathlib.Path(__file__).resolve().parents[1]
  code = results.digest([results.files_digest(package / part, pattern="*.py")
                         for part in ("core", "models", "decoding")])
  return dict(jax=jax.__version__, libtpu=libtpu_version(), code=code)


class ProgramCache:
  """Compiled programs' `facts`, one JSON file per key in `directory` (their HLO text gzipped beside it);
  None: no cache."""

  def __init__(self, directory: str | None):
    self.directory = None if directory is None else pathlib.Path(directory)

  def get(self, key: dict[str, Any], make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if self.directory is None:
      return make()
    path = self.directory / f"{results.digest(key)}.json"
    text = path.with_suffix(".hlo.gz")
    if path.is_file():
      value = json.loads(path.read_text())
      if value.get("fits"):
        value["hlo"] = gzip.decompress(text.read_bytes()).decode()
      return value
    value = make()
    self.directory.mkdir(parents=True, exist_ok=True)
    if value.get("fits"):
      _write_whole(text, gzip.compress(value["hlo"].encode()))
    _write_whole(path, json.dumps({k: v for k, v in value.items() if k != "hlo"}).encode())
    return value


def _write_whole(path: pathlib.Path, data: bytes) -> None:
  staged = path.with_name(path.name + ".partial")
  staged.write_bytes(data)
  os.replace(staged, path)


def default_cache_dir() -> str:
  """Where `specdec-plan` caches compiled programs unless told: $XDG_CACHE_HOME/specdec/plan."""
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec", "plan")

