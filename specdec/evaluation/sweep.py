"""Runs a quality-vs-latency sweep (§6, Figures 3–4, Table 2, App. F): every point of a grid
(`specdec.evaluation.grid`) decoded and measured, one record per point in a results file
(`specdec.evaluation.results`).

Each grid point is decoded on the task's examples in large batches and scored with the task's metric,
then timed by the paper's protocol (App. F.1): batch size 1, the compiling warm-up call excluded, the mean
over `n_latency_examples` × `latency_trials` decodes, relative to the verifier decoding alone
(autoregressive, same temperature and top-P) on the same examples, timed interleaved with the point
(example by example), so the ratio holds on a shared machine. That baseline point is part of every grid
(its own quality and latency). Records are appended as each point finishes; a rerun skips the points
already stored, so a killed sweep resumes without losing or duplicating anything.

One function per concern:
  grid.expand_grid(experiment) -> [Point]   the grid in canonical form, validated before any compute
  load_workload(experiment) -> Workload     models and examples, checked against the grid (`check_fits`)
  run_point(point, workload) -> dict        quality (batched) and latency (batch 1) of one point
  context(experiment, workload) -> dict     what besides the point determines a result (its hash)
  run(experiment) -> [record]               all of it, with a progress bar
  grid.parse_gin(files, bindings)           t5x-style configuration (configs/)

Sweep parameters (α, temperature, top-P, BiLD's α_f) are traced in `decoding.generate`, so points that
share (method, rule, γ, model) reuse one compiled loop per batch shape; every point decodes with the
same keys (common random numbers across α).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from specdec import decoding, models
from specdec.data import few_shot, seqio_tasks, tasks
from specdec.data.vocab import Vocabulary, load_vocabulary
from specdec.decoding import common
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.evaluation import metrics
from specdec.evaluation.grid import Experiment, ModelSource, Point, baseline_point, expand_grid, find_task
from specdec.evaluation.bench import device, git_commit, interleaved
from specdec.evaluation.results import (append_result, code_digest, digest, drop_partial_line, files_digest, host_shard,
                                        point_hash, read_results)
from specdec.models import partitioning
from specdec.models.base import Model
from specdec.training import exports
from specdec.training.loading import load_model


# --- models and examples -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
  """What every point decodes: prompts [N, W] right-padded to one width W (one compile per shape),
  prompt_lengths [N], references (target texts), latency_rows [n_latency] (a seeded sample)."""
  drafter: Model | decoding.Drafter    # a model, or a feature drafter over `verifier` (a head's export)
  verifier: Model
  task: tasks.Task
  vocab: Vocabulary
  prompts: np.ndarray
  prompt_lengths: np.ndarray
  references: list[str]
  latency_rows: np.ndarray
  max_new_tokens: int
  stop_id: int                  # generation ends at this token: the vocabulary's eos, or <end_of_turn>
  batch_size: int
  latency_trials: int
  seed: int
  drafter_parts: dict[str, Any] = dataclasses.field(default_factory=dict)   # of its export (`exports.PARTS`)
  mesh: Any = None              # Experiment.mesh_shape's: the models are sharded on it, the rows split
  truncation: bool | None = None   # True where some top_p < 1: every point's program holds the top-p search


def _parts_directory(source: ModelSource) -> str | None:
  """Where the drafter's export parts are (`exports.PARTS`: SpecDec++'s acceptance head): `source.head`,
  which must hold one, else the model's own export directory."""
  if source.head is not None and not exports.present(source.head):
    raise ValueError(f"drafter head {source.head!r} holds none of {', '.join(exports.PARTS)} "
                     f"({', '.join(part.what for part in exports.PARTS.values())})")
  return source.head or source.directory()


def _load_model(source: ModelSource, vocab: Vocabulary, *, host: bool = False) -> Model:
  """The model in `source.dtype`; `host`: a checkpoint's parameters kept in host memory (to be sharded)."""
  if source.path is not None:
    model = load_model(source.directory(), host=host)
  else:
    model = models.build(source.preset, vocab_size=source.vocab_size or vocab.vocab_size, seed=source.seed,
                         max_length=source.max_length)
  return model if source.dtype is None else models.with_dtype(model, source.dtype)


def feature_head_directory(source: ModelSource) -> str | None:
  """The directory of a drafter source that is a feature drafter's head (`exports.is_feature_head`), else None."""
  directory = source.directory() if source.path is not None and "://" not in source.path else None
  return directory if directory is not None and exports.is_feature_head(directory) else None


def _load_drafter(source: ModelSource, verifier: Model, vocab: Vocabulary, *, host: bool) -> Model | FeatureDrafter:
  """The drafter model (`_load_model`), or a feature drafter over `verifier` where `source` is a head's
  export (ValueError naming both where it was trained for another verifier), its head in `source.dtype`."""
  directory = feature_head_directory(source)
  if directory is None:
    return _load_model(source, vocab, host=host)
  drafter = exports.load_drafter(directory, verifier)
  return drafter if source.dtype is None else drafter.replace(head=models.with_dtype(drafter.head, source.dtype))


def load_workload(experiment: Experiment) -> Workload:
  """Loads the pair and the first `n_examples` examples of the task split (tokenized as the task does: T5's
  encoder inputs for an encoder-decoder pair, decoder-only prompts otherwise). The drafter may be a feature
  drafter's head (EAGLE, `exports.load_drafter`): it reads the verifier's hidden states."""
  vocab = load_vocabulary(experiment.vocab_path)
  on_mesh = experiment.mesh_shape is not None
  # A feature head is checked against the verifier as exported (its fingerprint), then reads it in its dtype.
  verifier = _load_model(dataclasses.replace(experiment.verifier, dtype=None), vocab, host=on_mesh)
  drafter = _load_drafter(experiment.drafter, verifier, vocab, host=on_mesh)
  if experiment.verifier.dtype is not None:
    verifier = models.with_dtype(verifier, experiment.verifier.dtype)
    drafter = drafter.replace(verifier=verifier) if isinstance(drafter, FeatureDrafter) else drafter
  common.check_models(drafter, verifier)
  encoder_decoder = verifier.encoder_decoder
  task = find_task(experiment.task, experiment.chat_template)
  if experiment.task in few_shot.BENCHMARKS:
    # prompts within the (max_prompt_tokens) budget by dropping shots: `few_shot.prompt_ids`
    split = few_shot.tokenized(few_shot.BENCHMARKS[experiment.task], vocab, experiment.split,
                               experiment.n_examples, data_dir=experiment.tfds_data_dir, source=experiment.source,
                               seed=experiment.seed, chat_template=experiment.chat_template,
                               max_input_tokens=experiment.max_prompt_tokens)
  elif experiment.task in tasks.TASKS:
    split = tasks.tokenized(experiment.task, experiment.split, source=experiment.source,
                            vocab_path=experiment.vocab_path, encoder_decoder=encoder_decoder)
  else:
    records = seqio_tasks.tfds_records("specdec_" + experiment.task, experiment.split,
                                       data_dir=experiment.tfds_data_dir, limit=experiment.n_examples)
    # seqio's tasks end T5's encoder input with eos: prompt as the pair was fine-tuned (`seqio_batches`).
    split = tasks.tokenize(task, vocab, records, encoder_decoder=encoder_decoder, encoder_eos=encoder_decoder)
  if len(split) < experiment.n_examples:
    raise ValueError(f"n_examples={experiment.n_examples} but {experiment.task}/{experiment.split} has "
                     f"{len(split)} examples")
  rows = np.arange(experiment.n_examples)
  if experiment.max_prompt_tokens is not None and experiment.task not in few_shot.BENCHMARKS:
    if task.input_field is None:
      raise ValueError(f"max_prompt_tokens applies to tasks with inputs; {task.name} prompts with its "
                       f"first {task.lm_prompt_tokens} tokens")
    task = dataclasses.replace(task, max_input_tokens=experiment.max_prompt_tokens)
    split = tasks.tokenize(task, vocab, split.records[:experiment.n_examples], encoder_decoder=encoder_decoder,
                           encoder_eos=encoder_decoder and experiment.task not in tasks.TASKS)
  prompts, prompt_lengths = split.prompts(rows)
  latency_rows = np.sort(np.random.default_rng(experiment.seed).permutation(experiment.n_examples)[
      :experiment.n_latency_examples])
  batch_size, mesh = min(experiment.batch_size, experiment.n_examples), None
  if on_mesh:
    # This host's devices: on a multi-host slice each host sweeps its own block of the grid.
    mesh = partitioning.make_mesh(*experiment.mesh_shape, devices=jax.local_devices())
    if batch_size % mesh.shape[partitioning.DATA]:
      raise ValueError(f"batch_size {batch_size} must be a multiple of the mesh's data axis "
                       f"({mesh.shape[partitioning.DATA]}; Experiment.mesh_shape = {experiment.mesh_shape})")
    verifier = partitioning.shard_model(verifier, mesh)
    drafter = (FeatureDrafter(partitioning.shard_model(drafter.head, mesh), verifier)
               if isinstance(drafter, FeatureDrafter) else partitioning.shard_model(drafter, mesh))
  return Workload(
      drafter=drafter, verifier=verifier, mesh=mesh,
      task=task, vocab=vocab, prompts=prompts, prompt_lengths=prompt_lengths,
      references=[split.records[i][task.target_field] for i in rows], latency_rows=latency_rows,
      max_new_tokens=experiment.max_new_tokens or task.max_target_tokens, batch_size=batch_size,
      stop_id=few_shot.stop_id(vocab, experiment.chat_template),
      latency_trials=experiment.latency_trials, seed=experiment.seed,
      drafter_parts=exports.load_parts(_parts_directory(experiment.drafter)),
      truncation=True if any(top_p < 1.0 for top_p in experiment.top_ps) else None)


def check_fits(points: Sequence[Point], workload: Workload) -> None:
  """The checks `generate` makes on prompts and models (vocabulary, lengths, cache room for the method
  that needs the most), once for the whole grid."""
  common.check_models(workload.drafter, workload.verifier)
  if isinstance(workload.drafter, FeatureDrafter):
    for point in points:
      if point.model == "drafter":
        raise ValueError(f"family {point.family!r} decodes the drafter alone (model='drafter'), but the drafter "
                         "is a feature drafter: its head decodes only over the verifier")
      exports.check_feature_drafter_method(decoding.methods.get(point.method),
                                           f"the drafter (family {point.family!r})")

  def required(point: Point) -> int:
    method = decoding.methods.get(point.method)
    # The drafter as `decode_rows` builds it (a method needing export parts the drafter lacks fails here).
    drafter = (exports.drafter_for(method, workload.drafter, workload.drafter_parts) if point.model == "pair"
               else None)
    verifier = workload.drafter if point.model == "drafter" else workload.verifier
    return decoding.required_cache_length(method, method.resolve(dict(point.params)), verifier, drafter,
                                          workload.prompts.shape[1], workload.max_new_tokens)

  try:
    common.check_prompts(workload.prompts, workload.prompt_lengths, max(required(p) for p in points),
                         [workload.drafter, workload.verifier])
  except ValueError as e:
    raise ValueError(f"{e} (Experiment.max_prompt_tokens, max_new_tokens)") from None


# --- running one point -----------------------------------------------------------------------------------

def decode_rows(point: Point, workload: Workload, key: jax.Array, rows: np.ndarray) -> decoding.Output:
  """Decodes `rows` at `point`, each row's randomness from (key, its row index); on the workload's mesh,
  if it has one, the rows split over its data axis."""
  small, large = workload.drafter, workload.verifier
  prompts = workload.prompts[rows]
  if workload.mesh is not None:
    prompts = partitioning.shard_batch(jnp.asarray(prompts), workload.mesh)
  drafter = None
  if point.model == "pair":
    drafter = exports.drafter_for(decoding.methods.get(point.method), small, workload.drafter_parts)
  verifier = small if point.model == "drafter" else large
  sampling = decoding.Sampling(point.temperature, point.top_p, truncation=workload.truncation)
  return decoding.generate(key, drafter, verifier, prompts, workload.prompt_lengths[rows],
                           method=point.method, sampling=sampling, max_new_tokens=workload.max_new_tokens,
                           eos_id=workload.stop_id, row_ids=rows, **dict(point.params))


def batches(workload: Workload) -> list[np.ndarray]:
  """Row indices per batch, the last padded with its final row (static shapes; padding is discarded)."""
  n, size = len(workload.prompts), workload.batch_size
  return [np.minimum(np.arange(start, start + size), n - 1) for start in range(0, n, size)]


def quality(point: Point, workload: Workload) -> tuple[np.ndarray, dict[str, int]]:
  """Per-example statistics of the task metric on all examples [N, k] (`metrics.example_statistics`;
  the metric itself is `metrics.from_statistics`), and the counters summed over examples."""
  key = jax.random.fold_in(jax.random.PRNGKey(workload.seed), 0)
  n = len(workload.prompts)
  scores, hypotheses = [], []
  totals = dict.fromkeys(common.STAT_NAMES, 0)
  for index, rows in enumerate(batches(workload)):
    out = decode_rows(point, workload, key, rows)
    real = min(len(rows), n - index * workload.batch_size)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for name, count in metrics.count_totals({name: np.asarray(getattr(out.stats, name))[:real]
                                             for name in common.STAT_NAMES}).items():
      totals[name] += count
    if workload.task.metric == "log_likelihood":
      scores.append(metrics.log_likelihood(workload.verifier, workload.prompts[rows],
                                           workload.prompt_lengths[rows], tokens, lengths)[:real])
    else:
      hypotheses += [_response(workload, row[:length]) for row, length in zip(tokens[:real], lengths[:real])]
  if point.model == "drafter":  # the drafter ran as `generate`'s verifier: its calls are drafter calls
    totals["drafter_calls"], totals["verifier_calls"], totals["verifier_positions"] = totals["verifier_calls"], 0, 0
  if workload.task.metric == "log_likelihood":
    return np.concatenate(scores)[:, None].astype(np.float64), totals
  return metrics.example_statistics(workload.task.metric, hypotheses, workload.references), totals


def _response(workload: Workload, tokens: np.ndarray) -> str:
  """An output's text as its metric reads it (`Task.response`), without the token that stopped it."""
  if len(tokens) and tokens[-1] == workload.stop_id:
    tokens = tokens[:-1]
  return workload.task.response(workload.vocab.decode(tokens))


def latency(point: Point, workload: Workload, baseline: Point | None = None) -> list[np.ndarray]:
  """Wall-clock seconds per latency example at batch size 1 (App. F.1), summed over `latency_trials`
  passes, after one warm-up call (compilation) excluded: [n_latency] for the point, then for the
  `baseline` if given, which is timed on each example right after the point (same key): on a shared
  machine the ratio of interleaved timings (`bench.interleaved`) is stable where timings taken minutes apart
  are not. On a mesh each data shard decodes the example (the batch is the example repeated over the data
  axis), the models split over 'model' as in the quality batches."""
  key = jax.random.fold_in(jax.random.PRNGKey(workload.seed), 1)
  rows = workload.latency_rows
  copies = 1 if workload.mesh is None else workload.mesh.shape[partitioning.DATA]
  timed = [point] if baseline is None else [point, baseline]
  runs = [lambda row, _, each=each: decode_rows(each, workload, key, np.repeat(row, copies)).tokens for each in timed]
  return list(interleaved(runs, rows, trials=workload.latency_trials, warmup=rows[:1]))


def run_point(point: Point, workload: Workload) -> dict[str, Any]:
  """Quality, absolute latency, cost rates and counters of one point, the verifier-alone baseline's
  latency timed interleaved with it (`latency`; for a baseline point, its own), bootstrap 95 % intervals
  of quality and relative latency over examples, and the per-example data they come from."""
  statistics, totals = quality(point, workload)
  metric = workload.task.metric
  baseline = None if point.is_baseline else baseline_point(point.temperature, point.top_p)
  timed = latency(point, workload, baseline)
  seconds, baseline_seconds = timed[0], timed[-1]     # a baseline point is its own reference
  trials = workload.latency_trials
  return {"quality": metrics.from_statistics(metric, statistics),
          "quality_interval": list(metrics.bootstrap_interval(
              len(statistics), lambda rows: metrics.from_statistics(metric, statistics[rows]))),
          "seconds_per_example": float(seconds.mean() / trials),
          "baseline_seconds_per_example": float(baseline_seconds.mean() / trials),
          "relative_latency_interval": list(metrics.bootstrap_interval(
              len(seconds), lambda rows: float(seconds[rows].sum() / baseline_seconds[rows].sum()))),
          "examples": {"quality_statistics": statistics.tolist(), "seconds": seconds.tolist(),
                       "baseline_seconds": baseline_seconds.tolist()},
          "costs": metrics.cost_metrics(totals), "counters": totals}


# --- the run's identity -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _directory_digest(path: str) -> str:
  """The model's files; the export parts kept in the directory (an acceptance head) have their own entries
  in the context."""
  return files_digest(pathlib.Path(path), skip=tuple(exports.PARTS))


def _model_identity(source: ModelSource, model: Model) -> dict[str, Any]:
  # the dtype only when set: records of float32 runs keep their hashes
  dtype = {} if source.dtype is None else {"dtype": source.dtype}
  if source.path is not None:
    return {"path": source.path, "content": _directory_digest(source.directory()), **dtype}
  return {"preset": source.preset, "seed": source.seed, "vocab_size": model.vocab_size,
          "max_length": model.max_length, **dtype}


def context(experiment: Experiment, workload: Workload) -> dict[str, Any]:
  """Everything besides the point that determines a result: the pair (directory contents or preset and
  seed), the examples (a digest of prompts and references) and the run settings."""
  data = hashlib.sha256(workload.prompts.tobytes() + workload.prompt_lengths.tobytes()
                        + json.dumps(workload.references).encode()).hexdigest()[:16]
  directory = _parts_directory(experiment.drafter)
  # Only the parts present, so that results recorded before a kind of part existed keep their hashes.
  parts = {exports.PARTS[name].context_key: files_digest(pathlib.Path(directory, name))
           for name in exports.present(directory)}
  return {**parts, "drafter": _model_identity(experiment.drafter, workload.drafter),
          "verifier": _model_identity(experiment.verifier, workload.verifier),
          "task": experiment.task, "split": experiment.split, "data": data,
          "n_examples": experiment.n_examples, "batch_size": workload.batch_size,
          "max_new_tokens": workload.max_new_tokens, "max_prompt_tokens": experiment.max_prompt_tokens,
          "n_latency_examples": experiment.n_latency_examples, "latency_trials": experiment.latency_trials,
          "seed": experiment.seed}


# --- the sweep ----------------------------------------------------------------------------------------------

def run(experiment: Experiment, *, progress: bool = True, host: tuple[int, int] | None = None
        ) -> list[dict[str, Any]]:
  """Runs every point of the grid not yet in `experiment.output`, appending one record per point:

    hash, context_hash, family, point (the canonical config), context, metric, quality,
    seconds_per_example, relative_latency (to the verifier alone at the same temperature and top-P, timed
    interleaved with the point), baseline {hash, seconds_per_example (of that interleaved timing)}, costs
    (metrics.cost_metrics), counters (summed over examples), code (`code_digest`), git_commit, device, seeds,
    finished_at; for pass@1, sandbox (`metrics.scoring`: the isolation the programs ran behind).

  Everything is validated before the first decode; nothing is written for a bad grid. Returns the
  grid's records (stored and new) in grid order.

  Several hosts (`host` = (index, count); default `jax.process_index()`, `jax.process_count()`) split
  the grid into contiguous blocks (points that share a compiled loop stay together); each host writes its
  block to its own shard (`host_shard`) and skips points any shard already holds, so a killed host's
  rerun redoes only its unfinished points; `read_results` (and the plots) read the shards together.
  Returns the records of the grid that exist so far (all of them once every host has finished).
  """
  index, count = (jax.process_index(), jax.process_count()) if host is None else host
  output = experiment.output if count == 1 else host_shard(experiment.output, index, count)
  points = expand_grid(experiment)
  workload = load_workload(experiment)
  check_fits(points, workload)
  run_context = context(experiment, workload)
  hashes = {point: point_hash(point, run_context) for point in points}
  drop_partial_line(output)
  stored = {record["hash"]: record for record in read_results(experiment.output)}
  block = np.array_split(np.arange(len(points)), count)[index]
  mine = [points[i] for i in block]
  pending = [point for point in mine if hashes[point] not in stored]
  shared = {"context_hash": digest(run_context), "context": run_context, "metric": workload.task.metric,
            **metrics.scoring(workload.task.metric),
            "code": code_digest(), "git_commit": git_commit(), "device": device(),
            "seeds": {"sweep": experiment.seed,
                      "drafter": experiment.drafter.seed if experiment.drafter.preset else None,
                      "verifier": experiment.verifier.seed if experiment.verifier.preset else None}}
  if 0 < len(pending) < len(mine):
    _check_one_run([stored[hashes[point]] for point in points if hashes[point] in stored], shared, experiment)
    if progress:
      print(f"resuming: {len(mine) - len(pending)} of {len(mine)} points already done in {output}", file=sys.stderr)
  elif mine and not pending and progress:
    print(f"nothing to run: all {len(mine)} points are already done in {output}", file=sys.stderr)
  bar = tqdm.tqdm(pending, desc="sweep", unit="point", file=sys.stderr, disable=not progress or not pending)
  for point in bar:
    settings = " ".join(f"{name}={value}" for name, value in point.params)
    bar.set_postfix_str(f"{point.family} {settings} T={point.temperature} top_p={point.top_p}")
    result = run_point(point, workload)
    baseline_hash = point_hash(baseline_point(point.temperature, point.top_p), run_context)
    baseline_seconds = result.pop("baseline_seconds_per_example")
    record = {"hash": hashes[point], "family": point.family, "point": point.config(), **shared, **result,
              "relative_latency": result["seconds_per_example"] / baseline_seconds,
              "baseline": {"hash": baseline_hash, "seconds_per_example": baseline_seconds},
              "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    append_result(output, record)
    stored[hashes[point]] = record
    _release_compiled_programs()
  return [stored[hashes[point]] for point in points if hashes[point] in stored]


def _release_compiled_programs(fraction: float = 0.5) -> None:
  """Frees JAX's compiled programs once the process holds more than `fraction` of Linux's limit on memory
  maps: XLA:CPU keeps ~3 maps per compiled object (~840 for a decode loop) while a program is cached, and a
  process that reaches vm.max_map_count segfaults in its next compilation. A long sweep over many methods
  and γ would; the next points recompile what they need."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps") as f:
      mapped = sum(1 for _ in f)
  except OSError:   # not Linux
    return
  if mapped > fraction * limit:
    jax.clear_caches()


def _check_one_run(done: list[dict[str, Any]], shared: dict[str, Any], experiment: Experiment) -> None:
  """A run's points come from one version of the `specdec` code (`code_digest`; records from before it
  existed: one commit) and one machine, since their latencies are compared with each other, unless
  `Experiment.allow_mixed_runs`."""
  def code(record: dict[str, Any]) -> str:
    return f"code {record['code']}" if "code" in record else f"commit {record.get('git_commit')}"

  others = sorted({(code(r), r.get("device")) for r in done} - {(code(shared), shared["device"])}, key=str)
  if others and not experiment.allow_mixed_runs:
    raise ValueError(
        f"{experiment.output} holds {len(done)} finished points of this run recorded with "
        + "; ".join(f"{version} / {machine}" for version, machine in others)
        + f", and this process runs {code(shared)} (commit {shared['git_commit']}) / {shared['device']}: "
        "latencies from different code or machines are not comparable. Finish the run where it started (on its "
        "machine, from `git worktree add DIR COMMIT` with PYTHONPATH=DIR and an absolute Experiment.output), "
        "write to a new Experiment.output, or set Experiment.allow_mixed_runs = True")
