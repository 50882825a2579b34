"""Plans of decode programs for a TPU topology, compiled ahead of time on a host without a TPU (layer 5).

libtpu compiles for a topology's compile-only devices (`jax.experimental.topologies`) on any Linux x86
host: `topology("v4-8")` gives a v4-8's four chips. Models built under `jax.eval_shape` and laid out by
`partitioning.abstract_model`, and prompts as `jax.ShapeDtypeStruct`s, lower through `decoding.lower`
without weights or data, and the compiled TPU program reports what the plan needs:

  memory per chip     `memory_analysis()`: arguments (the weights), temporaries (the KV caches and the
                      rest), generated code; fits when libtpu compiles it (it refuses a program over the
                      chip's HBM) — and the smallest mesh of the topology's chips that fits;
  cost per call       each model call compiled alone (a verifier call of γ + 1 tokens, a drafter step,
                      an autoregressive step, a prefill): flops, minimum HBM bytes (arguments + outputs −
                      aliased: weights and cache read once, logits written once), the roofline time
                      max(flops / peak, bytes / bandwidth), collectives;
  waste in the loop   from the optimized HLO (`evaluation.hlo`), per loop: relayouts of KV-cache-sized
                      arrays, transfers of them between HBM and on-chip memory, moves of [B, γ + 1, V]
                      arrays, collectives; each also counted apart in the branches of conditionals, which
                      run only on the iterations that take them (a rare fallback);
  tokens/s            at the roofline of each call (the fastest the chips could run the loop; a bound, not
                      a prediction): autoregressive decoding of the verifier, speculative decoding at given
                      acceptance rates per drafted token, and their ratio.

Each compiled program's facts (memory, flops, optimized HLO) are cached by its key (setting, topology,
mesh, the code that builds it, jax and libtpu versions) and analysed afresh: a plan re-run costs seconds. A cost_analysis counts a while loop's body once, so the
whole program's flops are not a latency: tokens/s come from the per-call programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import importlib.metadata
import json
import math
import os
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specdec import decoding, models
from specdec.decoding import feature_drafter
from specdec.evaluation import hlo, results
from specdec.models import base, feature_head, partitioning

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
  "v4-1chip": one chip), one per chip. Needs libtpu (`pip install -c constraints.txt libtpu`); raises
  ValueError naming the known slices for an unknown name, ImportError saying how to install libtpu."""
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
    raise ImportError("compiling for TPU needs libtpu: pip install -c constraints.txt libtpu (Linux x86-64; "
                      "the test extra installs it)")


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

  @property
  def gamma(self) -> int:
    return int(dict(self.params).get("gamma", 1))

  def config(self) -> dict[str, Any]:
    return dataclasses.asdict(self) | {"params": dict(self.params)}


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


def _target(devices: Sequence[Any], mesh_shape: tuple[int, int]) -> Mesh | Any:
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
    return abstract_feature_drafter(verifier, target, jnp.dtype(setting.dtype)), verifier
  return (None if setting.drafter is None else build(setting.drafter)), verifier


def abstract_feature_drafter(verifier: Any, target: Mesh | Any, dtype: Any) -> feature_drafter.FeatureDrafter:
  """A feature drafter over an abstract verifier, its head (`FEATURE`) abstract on `target` too."""
  missing = [name for name in ("hidden_size",) + feature_drafter.VERIFIER_METHODS if not hasattr(verifier, name)]
  if missing:
    raise ValueError(f"a feature drafter reads the verifier's hidden states through {', '.join(missing)}, which "
                     f"{type(verifier).__name__} does not have")
  cfg = verifier.config
  config = feature_head.FeatureHeadConfig(embed_dim=verifier.hidden_size, vocab_size=verifier.vocab_size,
                                          num_heads=cfg.num_heads, hidden_dim=cfg.hidden_dim,
                                          max_len=verifier.max_length, dtype=dtype)
  head = jax.eval_shape(lambda: feature_head.init_from_config(config, jax.random.PRNGKey(0)))
  return feature_drafter.FeatureDrafter(partitioning.abstract_model(head, target), verifier)


def _network(drafter: Any) -> Any:
  """What holds a drafter's own weights and cache: a feature drafter's head, else the model."""
  return drafter.head if isinstance(drafter, feature_drafter.FeatureDrafter) else drafter


def decoding_cache_length(setting: Setting) -> int:
  """A max_length that holds the method's cache at these shapes (prompt, new tokens, a block's overhang, and a
  token tree's beyond it: K·γ + 1 positions for K drafts), with room to spare."""
  method = decoding.methods.get(setting.method)
  tree = max(0, method.cache_overhang(method.resolve(dict(setting.params))) - (setting.gamma + 1))
  return setting.prompt_width + setting.max_new_tokens + 2 * setting.gamma + 8 + tree


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


def _cache_sharding(leaf: Any, target: Mesh | Any, batch_size: int) -> Any:
  """A KV-cache array's layout for a call compiled alone: rows over 'data', heads over 'model' where the
  axes divide them (as the decode loop's partitioner lays them out): [B, H, C, D] (head-major), [C, B, H·D]
  (slot-major, `base.empty_cache` on TPU), or another per-row array [B, …]."""
  if not isinstance(target, Mesh):
    return jax.sharding.SingleDeviceSharding(target)
  spec = [None] * leaf.ndim
  rows, heads = (1, 2) if leaf.ndim == 3 else (0, 1)
  if leaf.ndim > rows and leaf.shape[rows] == batch_size and batch_size % target.shape[partitioning.DATA] == 0:
    spec[rows] = partitioning.DATA
  if leaf.ndim in (3, 4) and leaf.shape[heads] % target.shape[partitioning.MODEL] == 0:
    spec[heads] = partitioning.MODEL
  return NamedSharding(target, PartitionSpec(*spec))


def _abstract_cache(model: Any, target: Mesh | Any, batch_size: int, cache_length: int) -> Any:
  with base.target_platform(_platform(target)):   # the target's cache layout (`base.cache_layout`)
    cache = jax.eval_shape(lambda: model.init_cache(batch_size, cache_length))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_cache_sharding(x, target, batch_size)),
                      cache)


def _platform(target: Mesh | Any) -> str:
  """The platform of a mesh's or a device's chips ("tpu" for a topology's compile-only devices)."""
  return (target.devices.flat[0] if isinstance(target, Mesh) else target).platform


@contextlib.contextmanager
def _under(target: Mesh | Any):
  """Within: programs traced for `target`'s platform, on its mesh if it is one."""
  with (jax.sharding.use_abstract_mesh(target.abstract_mesh) if isinstance(target, Mesh) else contextlib.nullcontext(),
        base.target_platform(_platform(target))):
    yield


def call_program(model: Any, target: Mesh | Any, *, batch_size: int, cache_length: int, n: int,
                 prefill: bool = False) -> Any:
  """One model call lowered alone for `target`: `score` of n tokens into a cache of `cache_length`
  slots (donated, as the loop updates it in place), or the prefill of an n-token prompt."""
  cache = _abstract_cache(model, target, batch_size, cache_length)
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
  """A feature drafter's head call lowered alone: n positions into its cache (donated), from features and
  the verifier's embeddings of the tokens, and with `logits` its prediction read through the verifier's
  output layer (a drafting step); without, the re-read of a verified block."""
  cache = _abstract_cache(drafter.head, target, batch_size, cache_length)
  features = partitioning.abstract_batch(jax.ShapeDtypeStruct((batch_size, n, drafter.head.config.embed_dim),
                                                              jnp.float32), target, batch_size)
  tokens = partitioning.abstract_batch(jax.ShapeDtypeStruct((batch_size, n), jnp.int32), target, batch_size)

  def call(drafter, cache, features, tokens):
    predicted, cache = drafter.head.score(cache, features, drafter.verifier.token_embeddings(tokens))
    return (drafter.verifier.output_logits(predicted) if logits else predicted), cache
  with _under(target):
    return jax.jit(call, donate_argnums=1).lower(drafter, cache, features, tokens)


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


# --- the analyses -----------------------------------------------------------------------------------------

def roofline_seconds(flops: float, hbm_bytes: float, chip: Chip) -> float:
  """The least time a call can take on one chip: compute- or HBM-bound, whichever is slower."""
  return max(flops / chip.peak_flops, hbm_bytes / chip.hbm_bandwidth)


def analyse_call(program_facts: dict[str, Any], chip: Chip) -> dict[str, Any]:
  """flops, minimum HBM bytes, roofline time and collectives of one call's program, per chip.

  Minimum HBM bytes: every argument the program reads, once, as the chip's tiles store it (padding
  included), plus its outputs, less what is updated in place (the donated cache): a call's weights and
  cache read once and its logits written once. Arguments it never reads (a T5 decoder step does not read
  the encoder's weights) are left out. `padding` is that read's size over its logical size;
  `over_arguments`, the minimum HBM bytes over the logical size of what it reads (its weights, cache and
  inputs): what tiles and outputs add to reading the weights and cache once."""
  if not program_facts["fits"]:
    return dict(fits=False, error=program_facts["error"])
  memory, flops = program_facts["memory"], program_facts["flops"]
  program = hlo.parse(program_facts["hlo"])
  read = [shape for parameter in hlo.entry_parameters(program, used_only=True) for shape in parameter.shapes]
  read_bytes = sum(shape.padded_bytes for shape in read)
  hbm_bytes = read_bytes + memory["outputs"] - memory["aliased"]
  logical = max(1, sum(shape.bytes for shape in read))
  return dict(flops=flops, hbm_bytes=hbm_bytes, read_bytes=read_bytes, padding=read_bytes / logical,
              over_arguments=hbm_bytes / logical,
              roofline_us=1e6 * roofline_seconds(flops, hbm_bytes, chip),
              bound="compute" if flops / chip.peak_flops > hbm_bytes / chip.hbm_bandwidth else "memory",
              collectives={op: tally._asdict() for op, tally in hlo.collectives(program, program.entry).items()},
              memory=memory)


def analyse_loop(hlo_text: str, *, cache_elements: int, cache_length: int, width: int, vocabs: Sequence[int]
                 ) -> list[dict[str, Any]]:
  """Per scope of the decode program (outside loops, each loop): relayouts and HBM↔on-chip round trips
  of arrays of at least one layer's KV cache per device with a cache_length dimension, copies of
  [.., γ + 1, V] arrays (`width` = γ + 1; `vocabs`: V whole, as the sampling math holds it after the
  logits' gather, and V per device), and collectives."""
  program = hlo.parse(hlo_text)

  def cache_sized(dims: Sequence[int]) -> bool:
    return cache_length in dims and math.prod(dims) >= cache_elements

  def block_sized(dims: Sequence[int]) -> bool:   # [.., γ+1, V] and its [.., γ+1, V/128, 128] tiling
    return width in dims and any(v in dims or (v % 128 == 0 and v // 128 in dims and 128 in dims) for v in vocabs)

  return hlo.summary(program, min_elements=1, selectors=dict(cache=cache_sized, block=block_sized))


def _versions() -> dict[str, Any]:
  """What a compiled program depends on besides its setting: jax, libtpu, and the code that builds it
  (core, models, decoding: not this module, whose analyses are recomputed from the cached programs)."""
  package = pathlib.Path(__file__).resolve().parents[1]
  code = results.digest([results.files_digest(package / part, pattern="*.py") for part in ("core", "models", "decoding")])
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
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specdec", "plan")


def expected_tokens_per_block(acceptance: float, gamma: int) -> float:
  """E[tokens per block] = (1 − a^{γ+1}) / (1 − a) for an acceptance rate a per drafted token, i.i.d.
  across a block's positions (Leviathan et al., eq. 1)."""
  if acceptance >= 1.0:
    return float(gamma + 1)
  return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


# The methods whose block is γ drafter steps and one verifier call (`speeds`): speculative decoding, and the
# multi-draft methods, whose drafter steps K copies of each row and whose verifier call scores their token tree.
BLOCK_METHODS = ("speculative", "spectr", "specinfer", "dynamic_tree")


def num_drafts(setting: Setting) -> int:
  """K, the drafts per block of a multi-draft method (its `num_drafts`, default included); 1 for the others."""
  return int(decoding.methods.get(setting.method).resolve(dict(setting.params)).get("num_drafts", 1))


def speeds(calls: dict[str, dict[str, Any]], *, batch_size: int, gamma: int, acceptances: Iterable[float],
           feature: bool = False) -> dict[str, Any]:
  """Roofline tokens/s (an upper bound: every call at its roofline time; sampling math and collective
  latency not counted) of the verifier alone and of speculative decoding per acceptance rate a.

  A block costs γ drafter steps, one verifier call of γ + 1 tokens and, when every draft is accepted
  (probability a^γ), the drafter's step scoring its last draft (`ModelDrafter(bonus_q=False)`); a feature
  drafter's block, the head's re-read of the verified block instead (`FeatureDrafter.verified`). For K drafts
  per block (SpecTr, SpecInfer, a dynamic tree) `calls` holds the drafter's calls on K·B rows and the verifier's
  call on the K·γ + 1 tokens of their tree (its widest: shared prefixes can make it narrower), and a is the
  rate at which the block's selection keeps a position."""
  step, verify, draft = (calls[name]["roofline_us"] for name in ("verifier_step", "verifier_call", "drafter_step"))
  autoregressive = batch_size / (step * 1e-6)
  rows = []
  for a in acceptances:
    catch_up = calls["drafter_reread"]["roofline_us"] if feature else a ** gamma * draft
    block_us = gamma * draft + verify + catch_up
    tokens = expected_tokens_per_block(a, gamma)
    speculative = batch_size * tokens / (block_us * 1e-6)
    rows.append(dict(acceptance=a, tokens_per_block=tokens, block_us=block_us, tokens_per_s=speculative,
                     speedup=speculative / autoregressive))
  fixed = gamma * draft + verify + (calls["drafter_reread"]["roofline_us"] if feature else 0.0)
  return dict(autoregressive_tokens_per_s=autoregressive, break_even_tokens_per_block=fixed / step, speculative=rows)


def plan(setting: Setting, topo: Topology, mesh_shape: tuple[int, int], *, acceptances: Sequence[float] = (0.6, 0.8),
         cache: ProgramCache | None = None, progress: Callable[[str], None] = lambda _: None,
         search_mesh: bool = True) -> dict[str, Any]:
  """The plan of one setting on a topology's mesh: memory per chip (and the smallest mesh that fits when
  this one does not), per-call costs, waste in the loops and roofline tokens/s (module docstring)."""
  if setting.batch_size < 1 or setting.prompt_width < 1 or setting.max_new_tokens < 1:
    raise ValueError("batch_size, prompt_width and max_new_tokens must be ≥ 1")
  decoding.methods.get(setting.method)
  check_mesh(mesh_shape, topo, setting.batch_size)
  cache = cache or ProgramCache(None)
  target = _target(topo.devices, mesh_shape)
  drafter, verifier = abstract_pair(setting, target)
  cache_length = cache_length_of(setting, drafter, verifier)
  versions = _versions()
  out: dict[str, Any] = dict(setting=setting.config(), topology=topo.name, chip=topo.chip.name,
                             hbm_bytes=topo.chip.hbm_bytes, mesh=dict(data=mesh_shape[0], model=mesh_shape[1]),
                             cache_length=cache_length, versions=versions)
  program = decode_facts(setting, topo, mesh_shape, cache=cache, progress=progress)
  if program["fits"]:
    cfg = verifier.config
    heads = cfg.cache_heads
    data, model = mesh_shape
    cache_elements = (setting.batch_size // data) * (heads // model if heads % model == 0 else heads) \
        * cache_length * cfg.head_dim
    vocab = setting.vocab_size // model if setting.vocab_size % model == 0 else setting.vocab_size
    out["program"] = dict(fits=True, memory=program["memory"],
                          loops=analyse_loop(program["hlo"], cache_elements=cache_elements, cache_length=cache_length,
                                             width=setting.gamma + 1, vocabs=sorted({setting.vocab_size, vocab})))
  else:
    out["program"] = dict(fits=False, error=program["error"], required_bytes=program["required_bytes"])
  networks = [_network(m) for m in (drafter, verifier) if m is not None]
  out["pytrees"] = dict(weights=per_device_bytes([m.params for m in networks]),
                        caches=sum(per_device_bytes(_abstract_cache(m, target, setting.batch_size, cache_length))
                                   for m in networks))
  if not program["fits"] and search_mesh:
    out["smallest_fitting_mesh"] = smallest_fitting_mesh(setting, topo, cache=cache, progress=progress)

  calls = {}
  # K drafts per block: the drafter runs K copies of each row, the verifier scores their K·γ + 1-token tree.
  drafts = num_drafts(setting)
  batch, rows = setting.batch_size, setting.batch_size * drafts
  wanted = [("verifier_step", setting.verifier, verifier, 1, False, batch),
            ("verifier_call", setting.verifier, verifier, drafts * setting.gamma + 1, False, batch),
            ("verifier_prefill", setting.verifier, verifier, setting.prompt_width, True, batch)]
  if setting.drafter == FEATURE:   # a head step drafting, and the head's re-read of a verified block
    wanted += [("drafter_step", f"{FEATURE}:{setting.verifier}", drafter, 1, False, rows),
               ("drafter_reread", f"{FEATURE}:{setting.verifier}", drafter, setting.gamma, False, rows)]
  elif drafter is not None:
    wanted += [("drafter_step", setting.drafter, drafter, 1, False, rows),
               ("drafter_prefill", setting.drafter, drafter, setting.prompt_width, True, rows)]
  for name, preset, model, n, is_prefill, batch_size in wanted:
    def lowered(model=model, n=n, is_prefill=is_prefill, name=name, batch_size=batch_size) -> Any:
      progress(f"{name} (n={n}, batch {batch_size}) on {topo.name} mesh {mesh_shape}")
      if isinstance(model, feature_drafter.FeatureDrafter):
        return feature_step_program(model, target, batch_size=batch_size, cache_length=cache_length, n=n,
                                    logits=name == "drafter_step")
      return call_program(model, target, batch_size=batch_size, cache_length=cache_length, n=n,
                          prefill=is_prefill)
    # A call's program depends on the model, the shapes and the mesh only: shared by every method.
    call_key = dict(kind="call", model=preset, vocab_size=setting.vocab_size, dtype=setting.dtype,
                    batch_size=batch_size, cache_length=cache_length, n=n, prefill=is_prefill,
                    topology=topo.name, chips=topo.chips, mesh=list(mesh_shape), versions=versions)
    calls[name] = analyse_call(cache.get(call_key, lambda lowered=lowered: facts(lowered)), topo.chip)
  out["calls"] = calls
  # The block cost model is speculative decoding's (γ drafter steps, one verifier call).
  needed = ("verifier_step", "verifier_call", "drafter_step") + (("drafter_reread",) if setting.drafter == FEATURE else ())
  if setting.method in BLOCK_METHODS and all("roofline_us" in calls[n] for n in needed):
    out["speeds"] = speeds(calls, batch_size=setting.batch_size, gamma=setting.gamma, acceptances=acceptances,
                           feature=setting.drafter == FEATURE)
  return out


def candidate_meshes(chips: int, batch_size: int) -> list[tuple[int, int]]:
  """(data, model) meshes of `chips` chips whose data axis divides the batch, most 'model' first (the
  weights split most ways)."""
  return [(chips // model, model) for model in sorted({m for m in range(1, chips + 1) if chips % m == 0},
                                                      reverse=True) if batch_size % (chips // model) == 0]


def decode_facts(setting: Setting, topo: Topology, mesh_shape: tuple[int, int], *, chips: int | None = None,
                 cache: ProgramCache | None = None, progress: Callable[[str], None] = lambda _: None
                 ) -> dict[str, Any]:
  """The decode program's `facts` on the topology's first `chips` chips (default all) on a (data, model)
  mesh, from the cache or compiled. `fits`: libtpu compiled it within a chip's HBM."""
  chips = chips or topo.chips
  check_mesh(mesh_shape, Topology(topo.name, topo.chip, topo.devices[:chips]), setting.batch_size)
  key = dict(kind="decode", setting=setting.config(), topology=topo.name, chips=chips, mesh=list(mesh_shape),
             versions=_versions())

  def lowered() -> Any:
    progress(f"decode program ({setting.method}) on {chips} chip(s) of {topo.name}, mesh {mesh_shape}")
    drafter, verifier = abstract_pair(setting, _target(topo.devices[:chips], mesh_shape))
    return decode_program(setting, drafter, verifier)
  return (cache or ProgramCache(None)).get(key, lambda: facts(lowered))


def smallest_fitting_mesh(setting: Setting, topo: Topology, *, cache: ProgramCache | None = None,
                          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any] | None:
  """The fewest of the topology's chips (1, 2, 4, …) on which the decode program compiles within HBM, and
  the mesh (most 'model' first); None when even all of them do not hold it."""
  chips = 1
  while chips <= topo.chips:
    for mesh_shape in candidate_meshes(chips, setting.batch_size):
      found = decode_facts(setting, topo, mesh_shape, chips=chips, cache=cache, progress=progress)
      if found["fits"]:
        return dict(chips=chips, data=mesh_shape[0], model=mesh_shape[1], total_bytes=found["memory"]["total"])
    chips *= 2
  return None


def sweep_settings(experiment: Any, *, verifier: str | None = None, drafter: str | None = None,
                   vocab_size: int | None = None, dtype: str | None = None) -> list[tuple[Setting, int]]:
  """The distinct decode programs of a sweep (`grid.Experiment`), from its config alone — no data, no
  weights: one per (model decoding, method, static parameters), since temperature, top-P and α are traced,
  each with how many grid points run it. Shapes: the batch, the prompt at the task's input budget
  (`max_prompt_tokens`, else the task's; the sweep pads to its longest prompt, at most this), the task's
  target budget or `max_new_tokens`. Models: the presets given, else the sources' `ModelSource.preset`."""
  from specdec.evaluation import grid
  task = grid.find_task(experiment.task, experiment.chat_template)
  width = experiment.max_prompt_tokens or task.max_input_tokens
  new_tokens = experiment.max_new_tokens or task.max_target_tokens
  if not width or not new_tokens:
    raise ValueError(f"task {experiment.task!r} has no input or target budget: set Experiment.max_prompt_tokens "
                     "and max_new_tokens")
  from specdec.evaluation import sweep
  presets = {}
  for role, given in (("verifier", verifier), ("drafter", drafter)):
    source = getattr(experiment, role)
    # A drafter that is a feature drafter's head (EAGLE) is planned as one over the verifier.
    feature = role == "drafter" and sweep.feature_head_directory(source) is not None
    presets[role] = given or (FEATURE if feature else source.preset)
    if presets[role] is None:
      raise ValueError(f"the sweep's {role} is {source.path!r}, not a preset: name its architecture with "
                       f"--{role} (a models.build preset, e.g. t5_large, gemma2_9b)")
  vocab_size = vocab_size or experiment.verifier.vocab_size
  if vocab_size is None:
    raise ValueError("the sweep does not say its vocabulary size: give --vocab_size")
  counts: dict[Setting, int] = {}
  for point in grid.expand_grid(experiment):
    method = decoding.methods.get(point.method)
    static = tuple(sorted(method.static(method.resolve(dict(point.params))).items()))
    alone = point.model != "pair"
    if alone and point.model == "drafter" and presets["drafter"] == FEATURE:
      raise ValueError(f"family {point.family!r} decodes the drafter alone, but the drafter is a feature drafter")
    setting = Setting(verifier=presets["drafter" if point.model == "drafter" else "verifier"],
                      drafter=None if alone else presets["drafter"], vocab_size=vocab_size, method=point.method,
                      params=static, batch_size=min(experiment.batch_size, experiment.n_examples),
                      prompt_width=width, max_new_tokens=new_tokens,
                      dtype=dtype or experiment.verifier.dtype or "float32")
    counts[setting] = counts.get(setting, 0) + 1
  return list(counts.items())
