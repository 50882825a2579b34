"""Decode loops (layer 3) and their public entry point `generate`.

Every method is one entry of `methods.METHODS` (its parameters and ranges, its drafter, its cache
overhang, its decode function), registered next to its decode function; every loop runs on
`common.decode_loop`, batched with ragged per-row progress, and sees models only through
`specdec.models.base` and drafters through `drafters.Drafter`. `generate` checks
its arguments on the host, then runs a jitted loop whose sweep parameters (α, temperature, top_p, …: the
traced ones) are arguments: a sweep compiles once per (method, static parameters, shapes).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec import checks, rng, sampling as sampling_lib
# Importing a method's module registers it (`methods.register`); this order is the order of `METHODS`.
from specdec.decoding import autoregressive, speculative, cascades, cs_drafting, multi_draft  # noqa: F401
from specdec.decoding import common, methods
from specdec.decoding.common import Output, Stats
from specdec.decoding.cs_drafting import HorizontalCascade, VerticalCascade, cs_drafter
from specdec.decoding.drafters import Draft, Drafter, MaxGram, ModelDrafter, as_drafter, bigram_table
from specdec.decoding.methods import METHODS, Bounds, Method, Param, count_bounds, register
from specdec.models import partitioning
from specdec.models.base import Model

Array = jax.Array
Sampling = sampling_lib.Sampling   # `decoding.Sampling`: how tokens are drawn (`specdec.sampling`)

# End-of-sequence id of T5's vocabularies and of the shipped SentencePiece vocabulary (pad 0, eos 1, unk 2):
# generation stops there unless `generate` is told otherwise (eos_id=None decodes max_new_tokens always).
DEFAULT_EOS_ID = 1

__all__ = ["DEFAULT_EOS_ID", "Bounds", "Draft", "Drafter", "HorizontalCascade", "METHODS", "MaxGram", "Method",
           "ModelDrafter", "Output", "Param", "Sampling", "Stats", "VerticalCascade", "bigram_table", "count_bounds",
           "cs_drafter", "generate", "lower", "register", "required_cache_length"]


def _int(name: str, value: Any, lo: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}; got {value!r}")
  return int(value)


def _prompt_arrays(prompts: Any, prompt_lengths: Any) -> tuple[Any, Any]:
  """prompts [B, L] and prompt_lengths [B] as int32 arrays, or a ValueError saying what is wrong. Shapes
  alone (`jax.ShapeDtypeStruct`, for `lower`) are kept as they are: prompt_lengths then defaults to
  shapes too."""
  if not isinstance(prompts, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)):
    raise ValueError(f"prompts must be an integer array [B, L] (np.asarray a list of token lists, or use "
                     f"specdec.data.tasks.prompt_batch for texts); got {type(prompts).__name__}")
  if np.ndim(prompts) != 2:
    raise ValueError(f"prompts must be [B, L] (one row per prompt; a single prompt is prompts[None]); got "
                     f"shape {tuple(np.shape(prompts))}")
  if not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(f"prompts must hold integer token ids; got dtype {prompts.dtype}")
  if prompt_lengths is None:
    prompt_lengths = (jax.ShapeDtypeStruct(prompts.shape[:1], np.int32) if _abstract(prompts)
                      else np.full((prompts.shape[0],), prompts.shape[1], np.int32))
  if not _abstract(prompt_lengths):
    prompt_lengths = np.asarray(prompt_lengths)
  checks.check_shape("prompt_lengths", prompt_lengths, (prompts.shape[0],), "[B]")
  return prompts, prompt_lengths


def _abstract(x: Any) -> bool:
  return isinstance(x, jax.ShapeDtypeStruct)


def _row_ids(row_ids: Any, batch: int) -> Array:
  """row_ids [B] as uint32 (default 0 … B−1), or a ValueError naming the problem."""
  if row_ids is None:
    return jnp.arange(batch, dtype=jnp.uint32)
  if _abstract(row_ids):
    checks.check_shape("row_ids", row_ids, (batch,), "[B]")
    return row_ids
  row_ids = np.asarray(row_ids)
  checks.check_shape("row_ids", row_ids, (batch,), "[B]")
  if not np.issubdtype(row_ids.dtype, np.integer) or np.any(row_ids < 0) or np.any(row_ids >= 2**32):
    raise ValueError(f"row_ids must be integers in [0, 2**32); got {row_ids!r}")
  return jnp.asarray(row_ids.astype(np.uint32))


def _sampling(sampling: Sampling | None, temperature, top_p, top_k, platform: str) -> Sampling:
  loose = {name: value for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k))
           if value is not None}
  if sampling is not None and loose:
    raise ValueError(f"give either sampling= or {', '.join(loose)}, not both")
  if sampling is None:
    sampling = Sampling(**loose)
  return sampling.checked(platform)


def required_cache_length(method: Method, params: dict[str, Any], verifier: Model, drafter: Model | Drafter | None,
                          prompt_width: int, max_new_tokens: int) -> int:
  """Cache positions a run needs: the padded prompt's (`prompt_cache_positions` of the verifier and the
  drafter: the width, 1 for an encoder-decoder and a drafter built on one), the new tokens, the method's
  overhang (`Method.cache_overhang`: one step's writes beyond them) and the drafter's
  (`Drafter.cache_overhang`: a cascade's review call). `params`: resolved; `drafter`: as the method's decode
  function gets it (None, a model or a `Drafter`)."""
  # A drafter that reads the verifier (a feature drafter) holds the verifier's positions.
  reads_verifier = isinstance(drafter, Drafter) and drafter.reads_verifier
  networks = [verifier] + ([] if drafter is None or reads_verifier else [drafter])
  overhang = method.cache_overhang(params) + (drafter.cache_overhang if isinstance(drafter, Drafter) else 0)
  return max(m.prompt_cache_positions(prompt_width) for m in networks) + max_new_tokens + overhang


def generate(key: Array, drafter: Model | Drafter | None, verifier: Model, prompts: Array,
             prompt_lengths: Array | None = None, *, method: str, max_new_tokens: int,
             sampling: Sampling | None = None, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, eos_id: int | None = DEFAULT_EOS_ID, row_ids: Array | None = None,
             cache_layout: str | None = None, **params: Any) -> Output:
  """Decodes a batch of prompts [B, L] (row b's prompt is prompts[b, :prompt_lengths[b]]; None: all of L).

  method (`methods.METHODS`, docs/methods.md; its parameters as keyword arguments, defaults in brackets):
{methods}
  Sampling: `sampling=Sampling(temperature, top_p, top_k)` or the three as keyword arguments (default
  temperature 1, no truncation). `drafter`: a model or any `drafters.Drafter` (speculative, bild, spectr,
  specinfer, dynamic_tree: the methods whose drafter is 'any'). Rows
  stop at `eos_id` (default: T5's and the shipped vocabulary's, 1; None: always max_new_tokens).
  Randomness is per row: row b draws from fold_in(key, row_ids[b]) alone (`specdec.rng`; default ids
  0 … B−1), so a prompt's sample depends on (key, its id), not on its batch position or the batch size.
  `cache_layout`: the KV caches' (`models.base.CACHE_LAYOUTS`; None: the platform's, `base.cache_layout`).
  Returns tokens [B, max_new_tokens] (0 after each row's end), lengths [B] and per-row stats. NaN in a
  model's logits stops the affected rows (inside the jitted loop, without a host round-trip) and then
  raises FloatingPointError naming them. Bad arguments raise ValueError before any compute.
  """
  args, static = _prepare(drafter, verifier, prompts, prompt_lengths, method=method, max_new_tokens=max_new_tokens,
                          sampling=sampling, temperature=temperature, top_p=top_p, top_k=top_k, eos_id=eos_id,
                          row_ids=row_ids, cache_layout=cache_layout, params=params)
  out = _program(static["program"])(key, *args, **static)
  failed = np.asarray(out.failed)
  if failed.any():
    raise FloatingPointError(f"NaN logits reached rows {np.flatnonzero(failed).tolist()} of the batch; "
                             "those rows stopped (Output.failed). Check the model's parameters and dtype.")
  return out


def lower(key: Array, drafter: Model | Drafter | None, verifier: Model, prompts: Array,
          prompt_lengths: Array | None = None, *, method: str, max_new_tokens: int,
          sampling: Sampling | None = None, temperature: float | None = None, top_p: float | None = None,
          top_k: int | None = None, eos_id: int | None = DEFAULT_EOS_ID, row_ids: Array | None = None,
          cache_layout: str | None = None, **params: Any) -> jax.stages.Lowered:
  """The program `generate` runs for these arguments, lowered, not run: `.compile().as_text()` is its
  optimized HLO, `.compile().memory_analysis()` its memory (tests and benchmarks read both).

  From shapes alone, for any platform: models from `partitioning.abstract_model` (parameters as
  `jax.ShapeDtypeStruct`s laid out on a mesh or a device, e.g. a TPU topology's compile-only devices,
  `jax.experimental.topologies`) and prompts [B, L] as a `jax.ShapeDtypeStruct` lower without weights or
  data; every other argument (the key included) is made abstract on the models' mesh or device. Every
  backend-dependent choice (the top-p search, call narrowing, the KV caches' layout: `common.Program`) follows
  the models' platform, not this process's backend."""
  args, static = _prepare(drafter, verifier, prompts, prompt_lengths, method=method, max_new_tokens=max_new_tokens,
                          sampling=sampling, temperature=temperature, top_p=top_p, top_k=top_k, eos_id=eos_id,
                          row_ids=row_ids, cache_layout=cache_layout, params=params)
  if _abstract(args[2]):
    key = partitioning.abstract_batch(key, static["mesh"] or partitioning.device_of(verifier), -1)
  return _program(static["program"]).lower(key, *args, **static)


def _prepare(drafter, verifier, prompts, prompt_lengths, *, method, max_new_tokens, sampling, temperature, top_p,
             top_k, eos_id, row_ids, cache_layout, params) -> tuple[tuple, dict[str, Any]]:
  """`generate`'s checks on the host: the jitted loop's arguments after the key, and its static arguments."""
  spec = methods.get(method)
  params = spec.resolve(params)
  # The platform the program is built for: where the models are (a TPU topology's compile-only devices
  # for a plan made on a CPU host), else this process's backend.
  program = common.Program.of(partitioning.platform_of((verifier, prompts)), cache_layout)
  sampling = _sampling(sampling, temperature, top_p, top_k, program.platform)
  max_new_tokens = _int("max_new_tokens", max_new_tokens, 1)
  if eos_id is not None:
    eos_id = _int("eos_id", eos_id, 0)
  prompts, prompt_lengths = _prompt_arrays(prompts, prompt_lengths)
  abstract = _abstract(prompts)
  row_ids = _row_ids(row_ids, prompts.shape[0])
  # The drafter, resolved once: None, a model (the method reads its distribution) or a `Drafter`.
  if spec.drafter == "none":
    drafter = None
  elif drafter is None:
    raise ValueError(f"method {method!r} needs a drafter")
  elif spec.drafter == "model":
    drafter = drafter.model if isinstance(drafter, ModelDrafter) else drafter
    if isinstance(drafter, Drafter):
      raise ValueError(f"method {method!r} needs the drafter's distribution at every step: pass a model, "
                       f"not a {type(drafter).__name__}")
  else:
    drafter = as_drafter(drafter)
    verifier = drafter.decoding_verifier(verifier)
  common.check_models(drafter, verifier)
  positions = required_cache_length(spec, params, verifier, drafter, prompts.shape[1], max_new_tokens)
  common.check_prompts(prompts, prompt_lengths, positions, [verifier] if drafter is None else [drafter, verifier])
  traced = {name: jnp.float32(value) for name, value in spec.traced(params).items()}
  mesh = partitioning.mesh_of((verifier, prompts))
  loose = (prompts if abstract else jnp.asarray(prompts, jnp.int32),
           prompt_lengths if _abstract(prompt_lengths) else jnp.asarray(prompt_lengths, jnp.int32),
           row_ids, sampling, traced)
  if abstract:
    target = mesh or partitioning.device_of(verifier)
    if target is None:
      raise ValueError("abstract prompts need abstract models placed on a mesh or a device "
                       "(partitioning.abstract_model)")
    loose = partitioning.abstract_batch(loose, target, prompts.shape[0])
  args = (drafter, verifier) + loose
  return args, dict(method=method, static=tuple(sorted(spec.static(params).items())),
                    max_new_tokens=max_new_tokens, eos_id=eos_id, cache_length=positions, mesh=mesh,
                    program=program)


def _decode(key, drafter, verifier, prompts, prompt_lengths, row_ids, sampling, traced, *, method, static,
            max_new_tokens, eos_id, cache_length, mesh, program) -> Output:
  # Traced under the models' mesh, if any: the models then gather their logits over 'model' once per call
  # (`partitioning.gather_vocab`).
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None else contextlib.nullcontext():
    return METHODS[method].decode(rng.per_row(key, row_ids), drafter, verifier, prompts, prompt_lengths,
                                  sampling=sampling, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                  cache_length=cache_length, program=program, **traced, **dict(static))


# XLA options of the decode programs built for TPU. No memory-space assignment into a v4 chip's CMEM: it moved
# KV caches small enough to fit there (T5 large's at batch 1, Gemma 2 9B's at batch 8) into CMEM and back to HBM
# whole on every iteration of the decode loop, around a write of a few slots — traffic a loop that reads
# each weight and cache entry once per call does not win back (experiments/tpu_v4_plan). Chips without
# CMEM (v5e) ignore it.
TPU_COMPILER_OPTIONS = {"xla_tpu_cmem_memory_space_assignment": False}
# XLA options of the decode programs built for CPU (a GPU compiler ignores them): copy insertion that reads the
# loop's regions, which sees that a decode step's caches are read before they are written (`base.attend_and_write`)
# and updates them in place; without it XLA:CPU still copied every layer's keys and values at every step (2.4 ms
# of SmolLM2's 32.5 ms token, of the 4.1 ms it copied before `attend_and_write`).
CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
_STATIC = ("method", "static", "max_new_tokens", "eos_id", "cache_length", "mesh", "program")
_generate = jax.jit(_decode, static_argnames=_STATIC, compiler_options=CPU_COMPILER_OPTIONS)
_generate_tpu = jax.jit(_decode, static_argnames=_STATIC, compiler_options=TPU_COMPILER_OPTIONS)


def _program(program: common.Program) -> Any:
  """The jitted decode loop for programs built for `program`'s platform."""
  return _generate_tpu if program.platform == "tpu" else _generate


# The method list of `generate`'s docstring, from the registry (no docstrings under python -OO).
if generate.__doc__:
  generate.__doc__ = generate.__doc__.replace("{methods}", methods.describe(indent=4))
