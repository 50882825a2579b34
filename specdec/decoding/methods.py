"""The registry of decoding methods: the one place that knows what a method is.

A `Method` names its parameters (each with a default, its allowed range as a check, whether it is traced
— a sweep over it reuses one compiled loop — or static), what it needs as a drafter (and, for a drafter
built from parts of a model export, how to build it), the cache positions it may write beyond prompt +
max_new_tokens, and the function that decodes. `decoding.generate`, the command line, the sweeps and the
Pareto tables all read `METHODS`; each method is one `register(Method(...))` next to its decode function
(`speculative.py`, `cascades.py`, …; docs/extending.md).

  decode(key, drafter, verifier, prompts, prompt_lengths, *, sampling, max_new_tokens, eos_id,
         cache_length, program, **params) -> Output     # program: `common.Program` (platform, caches' layout)
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specdec import checks, targets


def _always(params: Mapping[str, Any]) -> bool:
  return True


def _python_scalar(value: Any) -> Any:
  """NumPy scalars as Python ones (static parameters must hash like the Python values they equal)."""
  return value.item() if isinstance(value, np.generic) else value


@dataclasses.dataclass(frozen=True)
class Bounds:
  """A parameter's allowed values as data: the interval from `lo` to `hi` (closed ends unless
  `lo_closed` / `hi_closed` is False; `hi` may name another parameter, whose value bounds it), integers
  only where `integer`. `label`: the name errors give the parameter. The command line reads them (as
  `as_dict`, in specdec/cli/registry.json) to check values before JAX is imported."""
  lo: float
  hi: float | str = math.inf
  lo_closed: bool = True
  hi_closed: bool = True
  integer: bool = False
  label: str = ""

  def check(self, name: str, value: Any, params: Mapping[str, Any]) -> None:
    """Raises ValueError naming the parameter and the interval unless `value` lies in it."""
    hi = params[self.hi] if isinstance(self.hi, str) else self.hi
    label = self.label or name
    if self.integer:
      checks.check_count(label, value, int(self.lo), hi)
    else:
      checks.check_range(label, value, self.lo, hi, lo_closed=self.lo_closed, hi_closed=self.hi_closed)

  def as_dict(self) -> dict[str, Any]:
    hi = self.hi if isinstance(self.hi, str) or math.isfinite(self.hi) else "inf"
    return {"lo": self.lo, "hi": hi, "lo_closed": self.lo_closed, "hi_closed": self.hi_closed,
            "integer": self.integer, "label": self.label}


@dataclasses.dataclass(frozen=True)
class Param:
  """A method parameter. `validate(value, params)` raises ValueError naming the parameter and its allowed
  range (`params`: every parameter of the call, e.g. α's range depends on the rule): it calls `check` where
  one is given, else it checks `bounds`, the allowed values as data — `Bounds`, or {value of the parameter `bounds_by`: Bounds}, as α's
  bounds depend on the rule — and `choices`, the allowed values of a string parameter. `used(params)` says
  whether the value changes the run (a sweep stores None where it does not, so equal runs hash equally).
  `help`: its meaning and allowed range (command-line help, docs/methods.md); `type`: its values' type
  where the default is None (a None value then means the default and is not checked)."""
  name: str
  default: Any
  traced: bool
  check: Callable[[Any, Mapping[str, Any]], None] | None = None
  used: Callable[[Mapping[str, Any]], bool] = _always
  help: str = ""
  type: type | None = None
  bounds: Bounds | Mapping[str, Bounds] | None = None
  bounds_by: str | None = None
  choices: tuple[str, ...] | None = None

  def bounds_for(self, params: Mapping[str, Any]) -> Bounds | None:
    """The bounds that apply given the other parameters' values."""
    if self.bounds_by is None:
      return self.bounds
    if params[self.bounds_by] not in self.bounds:
      raise ValueError(f"{self.name} has no range for {self.bounds_by}={params[self.bounds_by]!r} (one of "
                       f"{', '.join(map(str, self.bounds))})")
    return self.bounds[params[self.bounds_by]]

  def validate(self, value: Any, params: Mapping[str, Any]) -> None:
    """`check(value, params)` if the parameter has one, else its `choices` and `bounds`."""
    (self.check or self._check)(value, params)

  def _check(self, value: Any, params: Mapping[str, Any]) -> None:
    if value is None and self.default is None:
      return
    if self.choices is not None and value not in self.choices:
      raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
    bounds = self.bounds_for(params)
    if bounds is not None:
      bounds.check(self.name, value, params)

  @property
  def value_type(self) -> type:
    return self.type or type(self.default)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding method (module docstring). `summary`: one line for the method tables (docs/methods.md).

  `drafter`: 'none' (one model decodes alone), 'model' (a `models.base.Model`: the method needs its
  distribution at every step) or 'any' (a model or any `drafters.Drafter`). `cache_overhang(params)`: cache
  positions one step may write beyond prompt + max_new_tokens (a block's γ + 1). A method whose drafter is
  a model plus parts of its export directory names those parts in `export_parts` (e.g. 'acceptance_head')
  and builds the drafter with `make_drafter(model, **parts)`; `training.exports` loads the parts."""
  name: str
  decode: Callable[..., Any]
  summary: str = ""
  params: tuple[Param, ...] = ()
  drafter: str = "any"
  cache_overhang: Callable[[Mapping[str, Any]], int] = lambda params: 1
  export_parts: tuple[str, ...] = ()
  make_drafter: Callable[..., Any] | None = None

  def __post_init__(self):
    if self.drafter not in ("none", "model", "any"):
      raise ValueError(f"Method.drafter must be 'none', 'model' or 'any'; got {self.drafter!r}")
    if bool(self.export_parts) != (self.make_drafter is not None):
      raise ValueError(f"method {self.name!r}: give export_parts and make_drafter together")

  def resolve(self, given: Mapping[str, Any]) -> dict[str, Any]:
    """This method's parameters from `given` (defaults for the missing ones), checked. Values of other
    methods' parameters are ignored; a name no registered method knows raises."""
    unknown = sorted(set(given) - set(all_param_names()))
    if unknown:
      raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; method {self.name!r} takes "
                       f"{', '.join(p.name for p in self.params) or 'none'}")
    values = {p.name: _python_scalar(given.get(p.name, p.default)) for p in self.params}
    for p in self.params:
      p.validate(values[p.name], values)
    return values

  def static(self, params: Mapping[str, Any]) -> dict[str, Any]:
    return {p.name: params[p.name] for p in self.params if not p.traced}

  def traced(self, params: Mapping[str, Any]) -> dict[str, Any]:
    return {p.name: params[p.name] for p in self.params if p.traced}


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
  """Adds (or replaces) a method in the registry; returns it."""
  METHODS[method.name] = method
  return method


def get(name: str) -> Method:
  """The registered method `name` (ValueError naming the registered ones otherwise)."""
  return checks.check_registered("method", name, METHODS)


def describe(indent: int = 0, width: int = 112) -> str:
  """One entry per registered method: its name, its parameters with their defaults, its summary (the
  method list of `generate`'s docstring)."""
  lines = []
  for method in METHODS.values():
    params = ", ".join(f"{p.name} [{p.default!r}]" for p in method.params)
    text = f"{params}: {method.summary}" if params else method.summary
    lines += textwrap.wrap(text, width, initial_indent=" " * indent + f"{method.name:<15} ",
                           subsequent_indent=" " * (indent + 16))
  return "\n".join(lines)


def markdown() -> str:
  """The methods and their parameters as Markdown tables (docs/methods.md)."""
  lines = ["| method | drafter | what it does |", "|---|---|---|"]
  lines += [f"| `{m.name}` | {m.drafter} | {m.summary} |" for m in METHODS.values()]
  lines += ["", "| method | parameter | default | traced | meaning and range |", "|---|---|---|---|---|"]
  lines += [f"| `{m.name}` | `{p.name}` | `{p.default!r}` | {'yes' if p.traced else 'no'} | {p.help} |"
            for m in METHODS.values() for p in m.params]
  return "\n".join(lines) + "\n"


def all_param_names() -> list[str]:
  """Every parameter name of every registered method, in registration order."""
  names: dict[str, None] = {}
  for method in METHODS.values():
    names.update(dict.fromkeys(p.name for p in method.params))
  return list(names)


# --- parameters several built-in methods share ----------------------------------------------------------------

def alpha_bounds(rule: str) -> Bounds:
  """α's bounds under `rule` (`targets.alpha_range`)."""
  lo, hi, label = targets.alpha_range(rule)
  return Bounds(lo, hi, hi_closed=False, label=label)


def count_bounds(lo: int, hi: float | str = math.inf, label: str = "") -> Bounds:
  """An integer parameter in [lo, hi]."""
  return Bounds(lo, hi, integer=True, label=label)


# `check`s read `targets.RULES` when called, so a rule registered later runs too; `choices` and `bounds` are the
# registry as the command line reads it (specdec/cli/registry.json).
RULE = Param("rule", "spec", traced=False, check=lambda rule, params: targets.check_rule(rule),
             choices=tuple(targets.RULES), help=f"the target rule T(q, p): one of {', '.join(targets.RULES)}")
ALPHA = Param("alpha", 0.0, traced=True, check=lambda alpha, params: targets.check_alpha(params["rule"], alpha),
              bounds={rule: alpha_bounds(rule) for rule in targets.RULES}, bounds_by="rule",
              help="the deferral trade-off α: [0, 1) for probability-scale rules, [0, inf) nats for the *_log "
                   "rules and bild")
GAMMA = Param("gamma", 5, traced=False, check=lambda gamma, params: checks.check_gamma(gamma),
              bounds=count_bounds(1, label="gamma (the number of draft tokens per block)"),
              help="draft tokens per block γ, an int >= 1")

