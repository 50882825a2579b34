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
mesh, the code that builds it, jax and libtpu versions) and analysed afresh: a plan re-run costs seconds. A
cost_analysis counts a while loop's body once, so the whole program's flops are not a latency: tokens/s come
from the per-call programs.

The parts: `tpu_topology` (the slices and their chips), `tpu_programs` (what is planned, `Setting`, and its
programs lowered, compiled and cached), `tpu_costs` (per-call costs, waste in the loops, tokens/s); this
module puts them together per setting, finds the smallest mesh that fits, and reads a sweep's settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specdec import decoding
from specdec.decoding import feature_drafter
from specdec.evaluation.tpu_costs import BLOCK_METHODS, analyse_call, analyse_loop, speeds
from specdec.evaluation.tpu_programs import (FEATURE, ProgramCache, Setting, abstract_cache, abstract_pair,
                                             cache_length_of, call_program, check_mesh, code_versions,
                                             decode_program, facts, feature_step_program, network_of, num_drafts,
                                             per_device_bytes, target_of)
from specdec.evaluation.tpu_topology import Topology
# Read through this module by its callers (`specdec-plan`, scripts/launch.py, the tests), beside the above.
from specdec.evaluation.tpu_programs import default_cache_dir
from specdec.evaluation.tpu_topology import CHIPS, Chip, libtpu_version, topology, topology_names


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
  target = target_of(topo.devices, mesh_shape)
  drafter, verifier = abstract_pair(setting, target)
  cache_length = cache_length_of(setting, drafter, verifier)
  out: dict[str, Any] = dict(setting=setting.config(), topology=topo.name, chip=topo.chip.name,
                             hbm_bytes=topo.chip.hbm_bytes, mesh=dict(data=mesh_shape[0], model=mesh_shape[1]),
                             cache_length=cache_length, versions=code_versions())
  program = decode_facts(setting, topo, mesh_shape, cache=cache, progress=progress)
  out["program"] = _program_report(program, setting, verifier.config, mesh_shape, cache_length)
  networks = [network_of(m) for m in (drafter, verifier) if m is not None]
  out["pytrees"] = dict(weights=per_device_bytes([m.params for m in networks]),
                        caches=sum(per_device_bytes(abstract_cache(m, target, setting.batch_size, cache_length))
                                   for m in networks))
  if not program["fits"] and search_mesh:
    out["smallest_fitting_mesh"] = smallest_fitting_mesh(setting, topo, cache=cache, progress=progress)
  calls = out["calls"] = {}
  for name, preset, model, n, prefill, batch_size in _calls(setting, drafter, verifier):
    def lowered(model=model, n=n, prefill=prefill, name=name, batch_size=batch_size) -> Any:
      progress(f"{name} (n={n}, batch {batch_size}) on {topo.name} mesh {mesh_shape}")
      if isinstance(model, feature_drafter.FeatureDrafter):
        return feature_step_program(model, target, batch_size=batch_size, cache_length=cache_length, n=n,
                                    logits=name == "drafter_step")
      return call_program(model, target, batch_size=batch_size, cache_length=cache_length, n=n, prefill=prefill)
    # A call's program depends on the model, the shapes and the mesh only: shared by every method.
    call_key = dict(kind="call", model=preset, vocab_size=setting.vocab_size, dtype=setting.dtype,
                    batch_size=batch_size, cache_length=cache_length, n=n, prefill=prefill,
                    topology=topo.name, chips=topo.chips, mesh=list(mesh_shape), versions=out["versions"])
    calls[name] = analyse_call(cache.get(call_key, lambda lowered=lowered: facts(lowered)), topo.chip)
  # The block cost model is speculative decoding's (γ drafter steps, one verifier call).
  reread = ("drafter_reread",) if setting.drafter == FEATURE else ()
  needed = ("verifier_step", "verifier_call", "drafter_step") + reread
  if setting.method in BLOCK_METHODS and all("roofline_us" in calls[n] for n in needed):
    out["speeds"] = speeds(calls, batch_size=setting.batch_size, gamma=setting.gamma, acceptances=acceptances,
                           feature=setting.drafter == FEATURE)
  return out


def _program_report(program: dict[str, Any], setting: Setting, config: Any, mesh_shape: tuple[int, int],
                     cache_length: int) -> dict[str, Any]:
  """The plan's "program" entry from the decode program's `facts`: its memory and the waste in its loops
  (`analyse_loop`: arrays at least one layer's KV cache per device, [.., γ + 1, V] arrays), or why libtpu
  refused it. `config`: the verifier's."""
  if not program["fits"]:
    return dict(fits=False, error=program["error"], required_bytes=program["required_bytes"])
  heads = config.cache_heads
  data, model = mesh_shape
  cache_elements = (setting.batch_size // data) * (heads // model if heads % model == 0 else heads) \
      * cache_length * config.head_dim
  vocab = setting.vocab_size // model if setting.vocab_size % model == 0 else setting.vocab_size
  return dict(fits=True, memory=program["memory"],
              loops=analyse_loop(program["hlo"], cache_elements=cache_elements, cache_length=cache_length,
                                 width=setting.gamma + 1, vocabs=sorted({setting.vocab_size, vocab})))


def _calls(setting: Setting, drafter: Any, verifier: Any) -> list[tuple[str, str, Any, int, bool, int]]:
  """The model calls a plan compiles alone, each (name, model key, abstract model, tokens n, prefill, rows):
  the verifier's step, its call on a block and its prefill; the drafter's step and prefill, or a feature
  drafter's head step and its re-read of a verified block."""
  # K drafts per block: the drafter runs K copies of each row, the verifier scores their K·γ + 1-token tree.
  drafts = num_drafts(setting)
  batch, rows = setting.batch_size, setting.batch_size * drafts
  wanted = [("verifier_step", setting.verifier, verifier, 1, False, batch),
            ("verifier_call", setting.verifier, verifier, drafts * setting.gamma + 1, False, batch),
            ("verifier_prefill", setting.verifier, verifier, setting.prompt_width, True, batch)]
  if setting.drafter == FEATURE:   # a head step drafting, and the head's re-read of a verified block
    head = f"{FEATURE}:{setting.verifier}" + (f":k={setting.draft_vocabulary}" if setting.draft_vocabulary else "")
    wanted += [("drafter_step", head, drafter, 1, False, rows),
               ("drafter_reread", head, drafter, setting.gamma, False, rows)]
  elif drafter is not None:
    wanted += [("drafter_step", setting.drafter, drafter, 1, False, rows),
               ("drafter_prefill", setting.drafter, drafter, setting.prompt_width, True, rows)]
  return wanted


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
             versions=code_versions())

  def lowered() -> Any:
    progress(f"decode program ({setting.method}) on {chips} chip(s) of {topo.name}, mesh {mesh_shape}")
    drafter, verifier = abstract_pair(setting, target_of(topo.devices[:chips], mesh_shape))
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
                   vocab_size: int | None = None, dtype: str | None = None, draft_vocabulary: int = 0
                   ) -> list[tuple[Setting, int]]:
  """The distinct decode programs of a sweep (`grid.Experiment`), from its config alone — no data, no
  weights: one per (model decoding, method, static parameters), since temperature, top-P and α are traced,
  each with how many grid points run it. Shapes: the batch, the prompt at the task's input budget
  (`max_prompt_tokens`, else the task's; the sweep pads to its longest prompt, at most this), the task's
  target budget or `max_new_tokens`. Models: the presets given, else the sources' `ModelSource.preset`; a drafter
  that is a feature head drafts among its saved draft vocabulary (read from its record), else `draft_vocabulary`."""
  from specdec.evaluation import grid
  task = grid.find_task(experiment.task, experiment.chat_template)
  width = experiment.max_prompt_tokens or task.max_input_tokens
  new_tokens = experiment.max_new_tokens or task.max_target_tokens
  if not width or not new_tokens:
    raise ValueError(f"task {experiment.task!r} has no input or target budget: set Experiment.max_prompt_tokens "
                     "and max_new_tokens")
  from specdec.evaluation import sweep
  from specdec.training import feature_head as feature_head_training
  presets = {}
  for role, given in (("verifier", verifier), ("drafter", drafter)):
    source = getattr(experiment, role)
    # A drafter that is a feature drafter's head (EAGLE) is planned as one over the verifier.
    head = sweep.feature_head_directory(source) if role == "drafter" else None
    presets[role] = given or (FEATURE if head is not None else source.preset)
    if head is not None and not draft_vocabulary:
      draft_vocabulary = feature_head_training.saved_draft_vocabulary(head)
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
                      dtype=dtype or experiment.verifier.dtype or "float32",
                      draft_vocabulary=draft_vocabulary if presets["drafter"] == FEATURE and not alone else 0)
    counts[setting] = counts.get(setting, 0) + 1
  return list(counts.items())
