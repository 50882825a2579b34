"""The grid of a quality-vs-latency sweep (§6, Figures 3–4, Table 2, App. F), before anything runs.

An `Experiment` names a drafter/verifier pair (`ModelSource`), a task split and a grid: method families
(`Family`: a legend entry such as SpecCascade [OPT] and the α values it sweeps) × temperatures × top-P
values × block sizes γ. `expand_grid` turns it into canonical, distinct `Point`s, each checked by its
method, plus the verifier-alone baseline of every (temperature, top-P), which every grid holds (the
latency reference); a bad value raises ValueError naming its family and parameter before any compute.
`parse_gin` builds the `Experiment` from t5x-style gin files (configs/experiments/), where the
configurables are `Experiment`, `Family` and `ModelSource`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from specdec import checks, decoding, models
from specdec.data import SPLITS, few_shot, pretrained, seqio_tasks, shipped, tasks

# Keys every stored point has, None where the method does not read them: results written before the method
# registry (when these four were a point's only parameters) keep their hashes.
_RECORD_KEYS = ("rule", "alpha", "gamma", "fallback_alpha")


@dataclasses.dataclass(frozen=True)
class ModelSource:
  """A model: an exported directory (`checkpoint.save_params`), or a random-init `models.build` preset."""
  path: str | None = None
  preset: str | None = None
  seed: int = 0                    # preset only
  vocab_size: int | None = None    # preset only; None: the vocabulary's size
  max_length: int = 512            # preset only
  dtype: str | None = None         # 'bfloat16': weights and KV caches in it (`models.with_dtype`); None: float32
  # A directory holding the parts of the drafter's export that methods read (`training.exports.PARTS`:
  # SpecDec++'s acceptance_head/); None: the model's own export directory.
  head: str | None = None

  def directory(self) -> str | None:
    """The model `path` names (`data.pretrained.resolve`: from the working directory, a pretrained checkpoint's
    name such as "smollm2", a shipped model from the shipped root — data/models/… of an installed package); a
    directory or a file (GGUF). The record keeps `path` as written."""
    if self.path is None or "://" in self.path:   # gs://… as it is
      return self.path
    return os.path.abspath(pretrained.resolve(self.path))


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
  # (data, model): the pair decodes on a mesh of this host's devices (rows over 'data', parameters by the
  # logical axis rules over 'model'; loaded through host memory, so a model larger than one device fits);
  # latency then times one example per data shard. None: one device.
  mesh_shape: tuple[int, int] | None = None
  # The paper's tfds tasks (`task` = 'wmt_t2t_ende', 'xsum', 'cnn_dailymail', …: specdec.data.seqio_tasks):
  # where tfds keeps them, and the SentencePiece model the pair was trained with (T5's). None: tfds's own
  # data_dir; the shipped vocabulary.
  tfds_data_dir: str | None = None
  vocab_path: str | None = None
  # Few-shot benchmarks (`few_shot.BENCHMARKS`): prompts in Gemma's chat turn format for instruction-tuned
  # models, generation stopping at <end_of_turn>.
  chat_template: bool = False


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


def find_task(name: str, chat_template: bool = False) -> tasks.Task:
  """A local task (`tasks.TASKS`), the text format of a tfds one (`seqio_tasks.SEQIO_TASKS`) or a few-shot
  benchmark (`few_shot.BENCHMARKS`; `chat_template` as `Experiment`'s) by its `Experiment.task` name;
  ValueError listing them for any other."""
  if name in tasks.TASKS:
    return tasks.TASKS[name]
  if name in few_shot.BENCHMARKS:
    return few_shot.BENCHMARKS[name].task(chat_template)
  tfds_task = seqio_tasks.SEQIO_TASKS.get("specdec_" + name)
  if tfds_task is None or tfds_task.is_local:
    tfds_names = [t.text.name for t in seqio_tasks.SEQIO_TASKS.values() if not t.is_local]
    raise ValueError(f"unknown task {name!r}; local tasks: {', '.join(tasks.TASKS)}; tfds tasks: "
                     f"{', '.join(tfds_names)}; few-shot benchmarks: {', '.join(few_shot.BENCHMARKS)}")
  return tfds_task.text


def _check_experiment(experiment: Experiment) -> None:
  find_task(experiment.task)
  if experiment.chat_template and experiment.task not in few_shot.BENCHMARKS:
    raise ValueError(f"chat_template applies to the few-shot benchmarks ({', '.join(few_shot.BENCHMARKS)}); "
                     f"task is {experiment.task!r}")
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
    if source.dtype is not None and source.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"{role}: dtype must be float32, bfloat16 or float16 (None: float32); got {source.dtype!r}")
    if source.preset is not None:
      try:
        models.families.for_preset(source.preset)
      except ValueError as e:
        raise ValueError(f"{role}: {e}") from None
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
