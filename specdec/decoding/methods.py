"""The registry of decoding methods: the one place that knows what a method is.

A `Method` names its parameters (each with a default, its allowed range as a check, whether it is traced
— a sweep over it reuses one compiled loop — or static), what it needs as a drafter (and, for a drafter
built from parts of a model export, how to build it), the cache positions it may write beyond prompt +
max_new_tokens, and the function that decodes. `decoding.generate`, the command line, the sweeps and the
Pareto tables all read `METHODS`; each method is one `register(Method(...))` next to its decode function
(`speculative.py`, `cascades.py`, …; docs/extending.md).

  decode(key, drafter, verifier, prompts, prompt_lengths, *, sampling, max_new_tokens, eos_id,
         cache_length, **params) -> Output
"""

from __future__ import annotations

import dataclasses
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
class Param:
  """A method parameter. `check(value, params)` raises ValueError naming the parameter and its allowed
  range (`params`: every parameter of the call, e.g. α's range depends on the rule). `used(params)` says
  whether the value changes the run (a sweep stores None where it does not, so equal runs hash equally).
  `help`: its meaning and allowed range (command-line help, docs/methods.md); `type`: its values' type
  where the default is None."""
  name: str
  default: Any
  traced: bool
  check: Callable[[Any, Mapping[str, Any]], None]
  used: Callable[[Mapping[str, Any]], bool] = _always
  help: str = ""
  type: type | None = None

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
      p.check(values[p.name], values)
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
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
  return METHODS[name]


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

def _check_rule(rule, params) -> None:
  targets.check_rule(rule)


def _check_alpha(alpha, params) -> None:
  targets.check_alpha(params["rule"], alpha)


RULE = Param("rule", "spec", traced=False, check=_check_rule,
             help=f"the target rule T(q, p): one of {', '.join(targets.RULES)}")
ALPHA = Param("alpha", 0.0, traced=True, check=_check_alpha,
              help="the deferral trade-off α: [0, 1) for probability-scale rules, [0, inf) nats for the *_log "
                   "rules and bild")
GAMMA = Param("gamma", 5, traced=False, check=lambda gamma, params: checks.check_gamma(gamma),
              help="draft tokens per block γ, an int >= 1")

