"""Quality-vs-latency sweeps of the speculative-cascades comparison (§6, Figures 3–4, Table 2, App. F).

An `Experiment` names a drafter/verifier pair, a task split and a grid: method families (`Family`: a
legend entry such as SpecCascade [OPT] and the α values it sweeps) × temperatures × top-P values × block
sizes γ. Each grid point is decoded on the task's examples in large batches and scored with the task's
metric, then timed by the paper's protocol (App. F.1): batch size 1, the compiling warm-up call excluded,
the mean over `n_latency_examples` × `latency_trials` decodes, relative to the verifier decoding alone
(autoregressive, same temperature and top-P) on the same examples, timed interleaved with the point
(example by example), so the ratio holds on a shared machine. That baseline point is part of every grid
(its own quality and latency). Results are JSON lines, one per point, appended and fsynced as each point
finishes; a rerun skips the points whose hash is already stored and drops a half-written last line, so a
killed sweep resumes without losing or duplicating anything.

One function per concern:
  expand_grid(experiment) -> [Point]        the grid in canonical form, validated before any compute
  load_workload(experiment) -> Workload     models and examples, checked against the grid (`check_fits`)
  run_point(point, workload) -> dict        quality (batched) and latency (batch 1) of one point
  read_results / drop_partial_line / append_result    the JSONL store
  run(experiment) -> [record]               all of it, with a progress bar
  parse_gin(files, bindings) -> Experiment  t5x-style configuration (configs/)

Sweep parameters (α, temperature, top-P, BiLD's α_f) are traced in `decoding.generate`, so points that
share (method, rule, γ, model) reuse one compiled loop per batch shape; every point decodes with the
same keys (common random numbers across α).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from specdec import checks, decoding, models
from specdec.data import SPLITS, seqio_tasks, shipped, tasks
from specdec.data.vocab import Vocabulary, load_vocabulary
from specdec.decoding import common
from specdec.evaluation import metrics
from specdec.models import base, partitioning
from specdec.models.base import Model
from specdec.training import acceptance, checkpoint

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

# Keys every stored point has, None where the method does not read them: results written before the method
# registry (when these four were a point's only parameters) keep their hashes.
_RECORD_KEYS = ("rule", "alpha", "gamma", "fallback_alpha")
MODELS = ("pair", "drafter", "verifier")   # both models, or one of them decoding alone (autoregressive)


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A model: an exported directory (`checkpoint.save_params`), or a random-init `models.build` preset."""
  path: str | None = None
  preset: str | None = None
  seed: int = 0                    # preset only
  vocab_size: int | None = None    # preset only; None: the vocabulary's size
  max_length: int = 512            # preset only
  # SpecDec++ (method specdec_pp): a directory holding an acceptance head (`acceptance_head/`); None: the
  # model's own export directory, if it holds one.
  head: str | None = None

  def directory(self) -> str | None:
    """`path` from the working directory, else from the shipped root (`shipped.find`: data/models/… of an
    installed package). The record keeps `path` as written."""
    if self.path is None or "://" in self.path:   # gs://… as it is
      return self.path
    return os.path.abspath(shipped.find(self.path, ""))


@dataclasses.dataclass(frozen=True)
class Family:
  """One method of the comparison (one legend entry) and the values its parameters take.

  method: a `decoding.METHODS` name. Grids of its parameters (`Method.params`): `rule` (one value),
  `alphas`, `gammas` (None takes the experiment's), `fallback_alphas` (the original BiLD's α_f), and
  `params` {name: values} for any other parameter; a parameter the method does not read is ignored.
  model: for autoregressive, 'verifier' (default: the large model alone) or 'drafter'.
  """
  name: str
  method: str
  rule: str = "spec"
  alphas: Sequence[float] = (0.0,)
  fallback_alphas: Sequence[float] = (0.5,)
  gammas: Sequence[int] | None = None
  model: str | None = None
  params: Mapping[str, Sequence] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A pair, a task split and a grid. `max_new_tokens` None: the task's target budget; `max_prompt_tokens`
  re-encodes the inputs with a smaller budget (the input is cut before the separator)."""
  drafter: ModelSource
  verifier: ModelSource
  task: str
  families: Sequence[Family]
  split: str = "validation"
  source: str = "auto"
  n_examples: int = 100
  batch_size: int = 32
  max_new_tokens: int | None = None
  max_prompt_tokens: int | None = None
  n_latency_examples: int = 20
  latency_trials: int = 3
  temperatures: Sequence[float] = (1.0,)
  top_ps: Sequence[float] = (1.0,)
  gammas: Sequence[int] = (5,)
  seed: int = 0
  output: str = "outputs/sweep/results.jsonl"
  allow_mixed_runs: bool = False   # resume a run recorded on another commit or machine
  # (data, model): quality batches decoded on a mesh of this host's devices (rows over 'data', parameters
  # by the logical axis rules over 'model'); latency stays at batch 1 on one device. None: one device.
  mesh_shape: tuple[int, int] | None = None
  # The paper's tfds tasks (`task` = 'wmt_t2t_ende', 'xsum', 'cnn_dailymail', …: specdec.data.seqio_tasks):
  # where tfds keeps them, and the SentencePiece model the pair was trained with (T5's). None: tfds's own
  # data_dir; the shipped vocabulary.
  tfds_data_dir: str | None = None
  vocab_path: str | None = None


@dataclasses.dataclass(frozen=True)
class Point:
  """One grid point in canonical form: `params` holds the method's parameters that change its run, as
  sorted (name, value) pairs; reading any other parameter name gives None (`point.alpha`). `family` is the
  legend label; it is stored but not hashed."""
  family: str
  method: str
  model: str
  temperature: float
  top_p: float
  params: tuple[tuple[str, Any], ...] = ()

  def __getattr__(self, name: str) -> Any:
    if name in decoding.methods.all_param_names() or name in _RECORD_KEYS:
      return dict(self.params).get(name)
    raise AttributeError(name)

  def config(self) -> dict[str, Any]:
    """What determines the run (everything but the label)."""
    return {"method": self.method, "model": self.model, **dict.fromkeys(_RECORD_KEYS), **dict(self.params),
            "temperature": self.temperature, "top_p": self.top_p}

  @property
  def is_baseline(self) -> bool:
    """The verifier decoding alone: the latency reference of its (temperature, top-P)."""
    return self.method == "autoregressive" and self.model == "verifier"


# --- grid expansion and validation -------------------------------------------------------------------

def _values(owner: str, name: str, values: Any) -> list:
  if not isinstance(values, (list, tuple)) or not values:
    raise ValueError(f"{owner}: {name} must be a non-empty list; got {values!r}")
  return list(values)


def _check_int(name: str, value: Any, lo: int) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
    raise ValueError(f"{name} must be an int >= {lo}; got {value!r}")


def _task(name: str) -> tasks.Task:
  """A local task (`tasks.TASKS`) or the text format of a tfds one (`seqio_tasks.SEQIO_TASKS`)."""
  if name in tasks.TASKS:
    return tasks.TASKS[name]
  tfds_task = seqio_tasks.SEQIO_TASKS.get("specdec_" + name)
  if tfds_task is None or tfds_task.is_local:
    tfds_names = [t.text.name for t in seqio_tasks.SEQIO_TASKS.values() if not t.is_local]
    raise ValueError(f"unknown task {name!r}; local tasks: {', '.join(tasks.TASKS)}; tfds tasks: "
                     f"{', '.join(tfds_names)}")
  return tfds_task.text


def _check_experiment(experiment: Experiment) -> None:
  _task(experiment.task)
  if experiment.split not in SPLITS:
    raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {experiment.split!r}")
  _check_int("n_examples", experiment.n_examples, 1)
  _check_int("batch_size", experiment.batch_size, 1)
  _check_int("n_latency_examples", experiment.n_latency_examples, 1)
  if experiment.n_latency_examples > experiment.n_examples:
    raise ValueError(f"n_latency_examples must lie in [1, n_examples={experiment.n_examples}]; got "
                     f"{experiment.n_latency_examples}")
  _check_int("latency_trials", experiment.latency_trials, 1)
  for name in ("max_new_tokens", "max_prompt_tokens"):
    if getattr(experiment, name) is not None:
      _check_int(name, getattr(experiment, name), 1)
  for role in ("drafter", "verifier"):
    source = getattr(experiment, role)
    if (source.path is None) == (source.preset is None):
      raise ValueError(f"{role}: give exactly one of path (an exported model) and preset; got {source}")
    known = [*models.PRESETS, *models.t5.PRESETS]
    if source.preset is not None and source.preset not in known:
      raise ValueError(f"{role}: unknown preset {source.preset!r}; known: {', '.join(known)}")
  for t in _values("experiment", "temperatures", experiment.temperatures):
    checks.check_temperature(t)
  for p in _values("experiment", "top_ps", experiment.top_ps):
    checks.check_top_p(p)
  _values("experiment", "families", experiment.families)


def _grids(family: Family, experiment: Experiment) -> dict[str, list]:
  """The values each parameter takes in a family (`Family` fields and `params`)."""
  gammas = experiment.gammas if family.gammas is None else family.gammas
  grids = {"rule": [family.rule], "alpha": _values(family.name, "alphas", family.alphas),
           "gamma": _values(family.name, "gammas", gammas),
           "fallback_alpha": _values(family.name, "fallback_alphas", family.fallback_alphas)}
  for name, values in dict(family.params).items():
    grids[name] = _values(family.name, name, values)
  return grids


def _family_points(family: Family, experiment: Experiment) -> list[Point]:
  """The family's points, each checked by its method (`Method.resolve`: the ranges `generate` enforces)."""
  try:
    method = decoding.methods.get(family.method)
    if method.drafter == "none":   # one model decodes alone: which one
      if family.model not in (None, "drafter", "verifier"):
        raise ValueError(f"model must be 'drafter' or 'verifier' for {family.method}; got {family.model!r}")
    elif family.model is not None:
      raise ValueError(f"model applies to one-model methods only; got {family.model!r} for {family.method!r}")
    model = "pair" if method.drafter != "none" else (family.model or "verifier")
    grids = _grids(family, experiment)
    points = []
    for combination in itertools.product(*(grids.get(p.name, [p.default]) for p in method.params)):
      params = method.resolve({p.name: value for p, value in zip(method.params, combination)})
      used = tuple(sorted((p.name, float(params[p.name]) if p.traced else params[p.name])
                          for p in method.params if p.used(params)))
      for temperature in experiment.temperatures:
        for top_p in experiment.top_ps:
          point = Point(family=family.name, method=family.method, model=model, temperature=float(temperature),
                        top_p=float(top_p), params=used)
          if point not in points:
            points.append(point)
  except ValueError as e:
    raise ValueError(f"family {family.name!r}: {e}") from None
  return points


def baseline_point(temperature: float, top_p: float) -> Point:
  """The verifier alone at (temperature, top-P): every grid holds it (the latency reference)."""
  return Point(family="Large (verifier)", method="autoregressive", model="verifier",
               temperature=float(temperature), top_p=float(top_p))


def _grid_order(point: Point) -> tuple:
  """Baselines first, then grouped by compiled signature (model, method, static parameters)."""
  method = decoding.methods.METHODS.get(point.method)
  traced = {p.name for p in method.params if p.traced} if method else set()
  static = [(name, str(value)) for name, value in point.params if name not in traced]
  swept = [(name, value) for name, value in point.params if name in traced]
  return (not point.is_baseline, point.model, point.method, static, point.temperature, point.top_p, swept)


def expand_grid(experiment: Experiment) -> list[Point]:
  """Every point of the grid, validated, canonical and distinct, plus the verifier baselines; baselines
  first, then grouped by compiled signature (model, method, static parameters). Raises ValueError naming
  the family and parameter (with its allowed range) on the first bad value, before anything runs."""
  _check_experiment(experiment)
  owner: dict[tuple, str] = {}
  points = []
  for family in experiment.families:
    for point in _family_points(family, experiment):
      config = tuple(point.config().items())
      if config in owner:
        raise ValueError(f"families {owner[config]!r} and {family.name!r} both contain the point "
                         f"{point.config()}; give each run one family")
      owner[config] = family.name
      points.append(point)
  for temperature in experiment.temperatures:
    for top_p in experiment.top_ps:
      baseline = baseline_point(temperature, top_p)
      if tuple(baseline.config().items()) not in owner:
        points.append(baseline)
  return sorted(points, key=_grid_order)


# --- models and examples -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
  """What every point decodes: prompts [N, W] right-padded to one width W (one compile per shape),
  prompt_lengths [N], references (target texts), latency_rows [n_latency] (a seeded sample)."""
  drafter: Model
  verifier: Model
  task: tasks.Task
  vocab: Vocabulary
  prompts: np.ndarray
  prompt_lengths: np.ndarray
  references: list[str]
  latency_rows: np.ndarray
  max_new_tokens: int
  batch_size: int
  latency_trials: int
  seed: int
  drafter_head: Any = None      # the drafter's acceptance head (specdec_pp), if it has one
  mesh: Any = None              # quality batches run on it (Experiment.mesh_shape) with `sharded` models
  sharded: tuple[Model, Model] | None = None


def _head_directory(source: ModelSource) -> str | None:
  directory = source.head or source.directory()
  if directory and os.path.exists(os.path.join(directory, acceptance.HEAD_DIRECTORY)):
    return directory
  if source.head is not None:
    raise ValueError(f"drafter head {source.head!r} holds no {acceptance.HEAD_DIRECTORY}/ (SpecDec++'s "
                     "acceptance head; scripts/train_acceptance_head.py)")
  return None


def _load_model(source: ModelSource, vocab: Vocabulary) -> Model:
  if source.path is not None:
    return checkpoint.load_model(source.directory())
  return models.build(source.preset, vocab_size=source.vocab_size or vocab.vocab_size, seed=source.seed,
                      max_length=source.max_length)


def load_workload(experiment: Experiment) -> Workload:
  """Loads the pair and the first `n_examples` examples of the task split (tokenized as the task does: T5's
  encoder inputs for an encoder-decoder pair, decoder-only prompts otherwise)."""
  vocab = load_vocabulary(experiment.vocab_path)
  drafter, verifier = _load_model(experiment.drafter, vocab), _load_model(experiment.verifier, vocab)
  encoder_decoder = isinstance(verifier, models.T5)
  if isinstance(drafter, models.T5) != encoder_decoder:
    raise ValueError(f"drafter and verifier must both be encoder-decoder (T5) or both decoder-only; got "
                     f"{type(drafter).__name__} and {type(verifier).__name__}")
  task = _task(experiment.task)
  if experiment.task in tasks.TASKS:
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
  if experiment.max_prompt_tokens is not None:
    if task.input_field is None:
      raise ValueError(f"max_prompt_tokens applies to tasks with inputs; {task.name} prompts with its "
                       f"first {task.lm_prompt_tokens} tokens")
    task = dataclasses.replace(task, max_input_tokens=experiment.max_prompt_tokens)
    split = tasks.tokenize(task, vocab, split.records[:experiment.n_examples], encoder_decoder=encoder_decoder,
                           encoder_eos=encoder_decoder and experiment.task not in tasks.TASKS)
  prompts, prompt_lengths = split.prompts(rows)
  latency_rows = np.sort(np.random.default_rng(experiment.seed).permutation(experiment.n_examples)[
      :experiment.n_latency_examples])
  batch_size, mesh, sharded = min(experiment.batch_size, experiment.n_examples), None, None
  if experiment.mesh_shape is not None:
    # This host's devices: on a multi-host slice each host sweeps its own block of the grid.
    mesh = partitioning.make_mesh(*experiment.mesh_shape, devices=jax.local_devices())
    if batch_size % mesh.shape[partitioning.DATA]:
      raise ValueError(f"batch_size {batch_size} must be a multiple of the mesh's data axis "
                       f"({mesh.shape[partitioning.DATA]}; Experiment.mesh_shape = {experiment.mesh_shape})")
    sharded = (partitioning.shard_model(drafter, mesh), partitioning.shard_model(verifier, mesh))
  return Workload(
      drafter=drafter, verifier=verifier, mesh=mesh, sharded=sharded,
      task=task, vocab=vocab, prompts=prompts, prompt_lengths=prompt_lengths,
      references=[split.records[i][task.target_field] for i in rows], latency_rows=latency_rows,
      max_new_tokens=experiment.max_new_tokens or task.max_target_tokens, batch_size=batch_size,
      latency_trials=experiment.latency_trials, seed=experiment.seed,
      drafter_head=acceptance.load_head(head) if (head := _head_directory(experiment.drafter)) else None)


def check_fits(points: Sequence[Point], workload: Workload) -> None:
  """The checks `generate` makes on prompts and models (vocabulary, lengths, cache room for the largest
  method slack), once for the whole grid."""
  common.check_models(workload.drafter, workload.verifier)
  def slack(point: Point) -> int:
    method = decoding.methods.get(point.method)
    return method.slack(method.resolve(dict(point.params)))

  slack = max(slack(p) for p in points)
  pair = [workload.drafter, workload.verifier]
  prompt_positions = max(base.prompt_cache_positions(m, workload.prompts.shape[1]) for m in pair)
  cache_length = decoding.cache_length_for(prompt_positions, workload.max_new_tokens, slack)
  try:
    common.check_prompts(workload.prompts, workload.prompt_lengths, cache_length, pair)
  except ValueError as e:
    raise ValueError(f"{e} (Experiment.max_prompt_tokens, max_new_tokens)") from None


# --- running one point -----------------------------------------------------------------------------------

def _decode(point: Point, workload: Workload, key: jax.Array, rows: np.ndarray, *, on_mesh: bool = False
            ) -> decoding.Output:
  """Decodes `rows` at `point`, each row's randomness from (key, its row index); `on_mesh`: on the
  workload's mesh, if it has one (quality batches)."""
  on_mesh = on_mesh and workload.mesh is not None
  small, large = workload.sharded if on_mesh else (workload.drafter, workload.verifier)
  prompts = workload.prompts[rows]
  if on_mesh:
    prompts = partitioning.shard_batch(jnp.asarray(prompts), workload.mesh)
  drafter = small if point.model == "pair" else None
  if point.method == "specdec_pp":   # generate says so if the drafter has no head
    drafter = decoding.ModelDrafter(small, head=workload.drafter_head)
  verifier = small if point.model == "drafter" else large
  return decoding.generate(key, drafter, verifier, prompts, workload.prompt_lengths[rows],
                           method=point.method, temperature=point.temperature, top_p=point.top_p,
                           max_new_tokens=workload.max_new_tokens, eos_id=workload.vocab.eos_id, row_ids=rows,
                           **dict(point.params))


def _batches(workload: Workload) -> list[np.ndarray]:
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
  for index, rows in enumerate(_batches(workload)):
    out = _decode(point, workload, key, rows, on_mesh=True)
    real = min(len(rows), n - index * workload.batch_size)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for name, count in metrics.count_totals({name: np.asarray(getattr(out.stats, name))[:real]
                                             for name in common.STAT_NAMES}).items():
      totals[name] += count
    if workload.task.metric == "log_likelihood":
      scores.append(metrics.log_likelihood(workload.verifier, workload.prompts[rows],
                                           workload.prompt_lengths[rows], tokens, lengths)[:real])
    else:
      hypotheses += [workload.vocab.decode(row[:length]) for row, length in zip(tokens[:real], lengths[:real])]
  if point.model == "drafter":  # the drafter ran as `generate`'s verifier: its calls are drafter calls
    totals["drafter_calls"], totals["verifier_calls"], totals["verifier_positions"] = totals["verifier_calls"], 0, 0
  if workload.task.metric == "log_likelihood":
    return np.concatenate(scores)[:, None].astype(np.float64), totals
  return metrics.example_statistics(workload.task.metric, hypotheses, workload.references), totals


def latency(point: Point, workload: Workload, baseline: Point | None = None) -> list[np.ndarray]:
  """Wall-clock seconds per latency example at batch size 1 (App. F.1), summed over `latency_trials`
  passes, after one warm-up call (compilation) excluded: [n_latency] for the point, then for the
  `baseline` if given, which is timed on each example right after the point (same key): on a shared
  machine the ratio of interleaved timings is stable where timings taken minutes apart are not."""
  key = jax.random.fold_in(jax.random.PRNGKey(workload.seed), 1)
  rows = workload.latency_rows
  timed = [point] if baseline is None else [point, baseline]
  for each in timed:
    jax.block_until_ready(_decode(each, workload, key, rows[:1]).tokens)
  seconds = np.zeros((len(timed), len(rows)))
  for _ in range(workload.latency_trials):
    for j, row in enumerate(rows):
      for i, each in enumerate(timed):
        start = time.perf_counter()
        jax.block_until_ready(_decode(each, workload, key, np.array([row])).tokens)
        seconds[i, j] += time.perf_counter() - start
  return list(seconds)


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


# --- hashing and the results file --------------------------------------------------------------------------

def _digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _files_digest(root: pathlib.Path, skip: str | None = None, pattern: str = "*") -> str:
  """Names and contents of the files under `root` matching `pattern` (none inside a folder named `skip`)."""
  digest = hashlib.sha256()
  for file in sorted(p for p in root.rglob(pattern) if p.is_file() and skip not in p.relative_to(root).parts):
    digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
  return digest.hexdigest()[:16]


@functools.cache
def code_digest() -> str:
  """The `specdec` package's source, its .py files: the code a measurement ran (edits to configs, docs or
  tests do not change it)."""
  return _files_digest(pathlib.Path(__file__).resolve().parents[1], pattern="*.py")


@functools.lru_cache(maxsize=8)
def _directory_digest(path: str) -> str:
  """The model's files; an acceptance head kept in the directory has its own entry in the context."""
  return _files_digest(pathlib.Path(path), skip=acceptance.HEAD_DIRECTORY)


def _model_identity(source: ModelSource, model: Model) -> dict[str, Any]:
  if source.path is not None:
    return {"path": source.path, "content": _directory_digest(source.directory())}
  return {"preset": source.preset, "seed": source.seed, "vocab_size": model.vocab_size,
          "max_length": model.max_length}


def context(experiment: Experiment, workload: Workload) -> dict[str, Any]:
  """Everything besides the point that determines a result: the pair (directory contents or preset and
  seed), the examples (a digest of prompts and references) and the run settings."""
  data = hashlib.sha256(workload.prompts.tobytes() + workload.prompt_lengths.tobytes()
                        + json.dumps(workload.references).encode()).hexdigest()[:16]
  head = _head_directory(experiment.drafter)
  # Only present with a head, so that results recorded before heads existed keep their hashes.
  with_head = {} if head is None else {"drafter_head": _files_digest(pathlib.Path(head, acceptance.HEAD_DIRECTORY))}
  return {**with_head, "drafter": _model_identity(experiment.drafter, workload.drafter),
          "verifier": _model_identity(experiment.verifier, workload.verifier),
          "task": experiment.task, "split": experiment.split, "data": data,
          "n_examples": experiment.n_examples, "batch_size": workload.batch_size,
          "max_new_tokens": workload.max_new_tokens, "max_prompt_tokens": experiment.max_prompt_tokens,
          "n_latency_examples": experiment.n_latency_examples, "latency_trials": experiment.latency_trials,
          "seed": experiment.seed}


def point_hash(point: Point, run_context: dict[str, Any]) -> str:
  """A stable 16-hex-digit hash of the point's config and the context (not the label, commit or device)."""
  return _digest({"point": point.config(), "context": run_context})


RECORD_KEYS = ("hash", "context_hash", "family", "point", "context", "metric", "quality", "relative_latency")


def host_shard(path: str | os.PathLike, index: int, count: int) -> pathlib.Path:
  """Where host `index` of `count` writes its points of the run whose results file is `path`:
  results.jsonl -> results.host-003-of-016.jsonl beside it."""
  path = pathlib.Path(path)
  return path.with_name(f"{path.stem}.host-{index:03d}-of-{count:03d}{path.suffix}")


def result_files(path: str | os.PathLike) -> list[pathlib.Path]:
  """A results file and the host shards written beside it (`host_shard`), those that exist."""
  path = pathlib.Path(path)
  shards = sorted(path.parent.glob(f"{path.stem}.host-*-of-*{path.suffix}"))
  return [p for p in [path, *shards] if p.exists()]


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The records of a results file and of its host shards, without duplicates ([] when none exists; a
  point recorded twice keeps its last record). A last line without its newline (a write cut short by a
  kill) is left out, with a note on stderr; any other line that is not a sweep record (bad JSON, or a JSON
  value without the `RECORD_KEYS`) raises ValueError naming the file and line."""
  records = {}
  for file in result_files(path):
    records.update((record["hash"], record) for record in _read_file(file))
  return list(records.values())


def _read_file(path: pathlib.Path) -> list[dict[str, Any]]:
  lines = path.read_text().split("\n")
  if lines[-1]:
    print(f"note: {path}:{len(lines)} left out: a last line without its newline (a write cut short; the "
          "sweep redoes that point when resumed)", file=sys.stderr)
  records = []
  for number, line in enumerate(lines[:-1], 1):  # the last piece follows the last newline
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{number} is not a JSON record ({e}); only the last line may be cut short") from e
    missing = [key for key in RECORD_KEYS if key not in record] if isinstance(record, dict) else list(RECORD_KEYS)
    if missing:
      raise ValueError(f"{path}:{number} is not a sweep record (no {', '.join(missing)}): a line from another "
                       "file or program?")
    records.append(record)
  return records


def drop_partial_line(path: str | os.PathLike) -> None:
  """Truncates the file after its last newline, removing a half-written record."""
  path = pathlib.Path(path)
  if path.exists():
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
      with open(path, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
        f.flush()
        os.fsync(f.fileno())


def append_result(path: str | os.PathLike, record: dict[str, Any]) -> None:
  """Appends one record as one line, flushed and fsynced before returning."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record, sort_keys=True) + "\n")
    f.flush()
    os.fsync(f.fileno())


def git_commit() -> str | None:
  """HEAD of the repository, with '-dirty' when tracked files differ from it; None outside git."""
  try:
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("-dirty" if dirty else "")


def device() -> str:
  first = jax.devices()[0]
  return (f"{first.platform}:{first.device_kind} x{jax.device_count()} | {platform.machine()} "
          f"{os.cpu_count()} cpus | jax {jax.__version__}")


# --- the sweep ----------------------------------------------------------------------------------------------

def run(experiment: Experiment, *, progress: bool = True, host: tuple[int, int] | None = None
        ) -> list[dict[str, Any]]:
  """Runs every point of the grid not yet in `experiment.output`, appending one record per point:

    hash, context_hash, family, point (the canonical config), context, metric, quality,
    seconds_per_example, relative_latency (to the verifier alone at the same temperature and top-P, timed
    interleaved with the point), baseline {hash, seconds_per_example (of that interleaved timing)}, costs
    (metrics.cost_metrics), counters (summed over examples), code (`code_digest`), git_commit, device, seeds,
    finished_at.

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
  shared = {"context_hash": _digest(run_context), "context": run_context, "metric": workload.task.metric,
            "code": code_digest(), "git_commit": git_commit(), "device": device(),
            "seeds": {"sweep": experiment.seed,
                      "drafter": experiment.drafter.seed if experiment.drafter.preset else None,
                      "verifier": experiment.verifier.seed if experiment.verifier.preset else None}}
  if 0 < len(pending) < len(mine):
    _check_one_run([stored[hashes[point]] for point in points if hashes[point] in stored], shared, experiment)
    if progress:
      print(f"resuming: {len(mine) - len(pending)} of {len(mine)} points already done in {output}", file=sys.stderr)
  bar = tqdm.tqdm(pending, desc="sweep", unit="point", file=sys.stderr, disable=not progress)
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


# --- gin ----------------------------------------------------------------------------------------------------

@functools.cache
def _gin_experiment():
  """Registers the configurable classes once; returns the gin-configured `Experiment`."""
  for cls in (ModelSource, Family):
    gin.external_configurable(cls, cls.__name__)
  return gin.external_configurable(Experiment, "Experiment")


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str] = ()) -> Experiment:
  """The `Experiment` configured by gin files (looked up from the working directory, then the shipped root:
  the checkout, or the installed copy of configs/; later files and then bindings override), e.g.
  configs/experiments/quickstart.gin."""
  configured = _gin_experiment()
  gin.add_config_file_search_path(str(shipped.root()))
  gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings))
  return configured()
