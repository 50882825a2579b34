"""The registry of decoding methods: the one place that knows what a method is.

A `Method` names its parameters (each with a default, its allowed range as a check, whether it is traced
— a sweep over it reuses one compiled loop — or static), what it needs as a drafter, the cache positions
it may write beyond prompt + max_new_tokens, where it sits in plots and tables, and the function that
decodes. `decoding.generate`, the sweeps and the Pareto tables all read `METHODS`; adding a method is one
`register(Method(...))` next to its decode function.

  decode(key, drafter, verifier, prompts, prompt_lengths, *, sampling, max_new_tokens, eos_id,
         cache_length, **params) -> Output
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from specdec import checks, targets
from specdec.decoding import cascades, cs_drafting, drafters, multi_draft, speculative
from specdec.decoding.autoregressive import autoregressive


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
  `symbol` labels series that differ in this parameter within one legend entry (γ, α_f). `help`: its
  meaning and allowed range (command-line help); `type`: its values' type where the default is None."""
  name: str
  default: Any
  traced: bool
  check: Callable[[Any, Mapping[str, Any]], None]
  used: Callable[[Mapping[str, Any]], bool] = _always
  symbol: str | None = None
  help: str = ""
  type: type | None = None

  @property
  def value_type(self) -> type:
    return self.type or type(self.default)


@dataclasses.dataclass(frozen=True)
class Method:
  """A decoding method (module docstring). `drafter`: 'none' (one model decodes alone), 'model' (a
  `models.base.Model`: the method needs its distribution at every step) or 'any' (a model or any
  `drafters.Drafter`). `slack(params)`: cache positions beyond prompt + max_new_tokens. `rank(params)`:
  the series' place in plots and tables (Table 2's row order)."""
  name: str
  decode: Callable[..., Any]
  params: tuple[Param, ...] = ()
  drafter: str = "any"
  slack: Callable[[Mapping[str, Any]], int] = lambda params: 1
  rank: Callable[[Mapping[str, Any]], float] = lambda params: math.inf

  def __post_init__(self):
    if self.drafter not in ("none", "model", "any"):
      raise ValueError(f"Method.drafter must be 'none', 'model' or 'any'; got {self.drafter!r}")

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


def all_param_names() -> list[str]:
  """Every parameter name of every registered method, in registration order."""
  names: dict[str, None] = {}
  for method in METHODS.values():
    names.update(dict.fromkeys(p.name for p in method.params))
  return list(names)


# --- the parameters of the built-in methods ----------------------------------------------------------------

def _check_rule(rule, params) -> None:
  targets.check_rule(rule)


def _check_alpha(alpha, params) -> None:
  targets.check_alpha(params["rule"], alpha)


RULE = Param("rule", "spec", traced=False, check=_check_rule,
             help=f"the target rule T(q, p): one of {', '.join(targets.RULES)}")
ALPHA = Param("alpha", 0.0, traced=True, check=_check_alpha,
              help="the deferral trade-off α: [0, 1) for probability-scale rules, [0, inf) nats for the *_log "
                   "rules and bild")
GAMMA = Param("gamma", 5, traced=False, check=lambda gamma, params: checks.check_gamma(gamma), symbol="γ",
              help="draft tokens per block γ, an int >= 1")


def _check_chow_rule(rule, params) -> None:
  if rule not in ("chow", "chow_log"):
    raise ValueError(f"rule must be chow or chow_log for token_cascade (it defers on q alone, before the "
                     f"verifier runs); got {rule!r}")


# SpecDecode / SpecCascade rows of Table 2 first, the cascade and token rules after the BiLD variants.
_SPECULATIVE_RANK = {rule: i for i, rule in enumerate(("spec", "lossy", "lossy_tuned", "bild"))}

register(Method("autoregressive", decode=lambda key, drafter, verifier, prompts, prompt_lengths, **kw:
                autoregressive(key, verifier, prompts, prompt_lengths, **kw), drafter="none", rank=lambda p: -1))
register(Method("seq_cascade", decode=cascades.seq_cascade, drafter="model", rank=lambda p: 0, params=(
    Param("alpha", 0.0, traced=True, help=ALPHA.help,
          check=lambda alpha, params: checks.check_range("alpha (seq_cascade)", alpha, 0.0, 1.0, hi_closed=False)),)))
register(Method("token_cascade", decode=cascades.token_cascade, drafter="model",
                slack=lambda p: cascades.MAX_DRAFTER_RUN + 2,
                rank=lambda p: 1 + 0.1 * (p["rule"] == "chow_log"),
                params=(dataclasses.replace(RULE, default="chow", check=_check_chow_rule,
                                            help="chow or chow_log (defers on q alone)"), ALPHA)))
register(Method("speculative", decode=speculative.speculative, slack=lambda p: p["gamma"] + 1,
                rank=lambda p: 2 + 0.1 * _SPECULATIVE_RANK[p["rule"]] if p["rule"] in _SPECULATIVE_RANK
                else 4 + 0.1 * targets.RULES.index(p["rule"]),
                params=(RULE, dataclasses.replace(ALPHA, used=lambda p: p["rule"] != "spec"), GAMMA)))
register(Method("bild", decode=speculative.bild, slack=lambda p: p["gamma"] + 1, rank=lambda p: 3, params=(
    Param("alpha", 0.0, traced=True, check=lambda alpha, params: targets.check_alpha("bild", alpha), help=ALPHA.help),
    Param("fallback_alpha", 0.5, traced=True, symbol="α_f",
          check=lambda value, params: checks.check_range("fallback_alpha", value, 0.0, 1.0),
          help="BiLD's fallback: the drafter hands over while max q < 1 − fallback_alpha, in [0, 1]"),
    GAMMA)))
register(Method("oracle_cascade", decode=cascades.oracle_cascade, drafter="model", rank=lambda p: 6,
                params=(RULE, ALPHA)))


def _check_model_drafts(value, params) -> None:
  if value is not None:
    checks.check_count("model_drafts (positions of a block the model drafts; None: all gamma)", value, 0,
                       params["gamma"])


def _uses_max_gram(params) -> bool:
  model_drafts = params["gamma"] if params["model_drafts"] is None else params["model_drafts"]
  return model_drafts < params["gamma"] or params["lower_gamma"] > 0


register(Method("cs_drafting", decode=cs_drafting.cs_drafting, drafter="model", rank=lambda p: 2.05,
                slack=lambda p: p["gamma"] + p["lower_gamma"] + 2, params=(
    GAMMA,
    Param("model_drafts", None, traced=False, check=_check_model_drafts, symbol="k_m", type=int,
          help="positions of a block the model drafts, in [0, gamma] (default: all gamma; 0: Max-Gram alone)"),
    Param("lower_gamma", 4, traced=False, symbol="k_l", used=lambda p: p["model_drafts"] != 0,
          check=lambda value, params: checks.check_count("lower_gamma (Max-Gram drafts per model call; 0: "
                                                         "the model drafts alone)", value, 0),
          help="Max-Gram drafts per model call, an int >= 0 (0: the model drafts alone)"),
    Param("lenience", 1.0, traced=True, used=lambda p: p["model_drafts"] != 0 and p["lower_gamma"] > 0,
          check=lambda value, params: checks.check_range("lenience", value, 1.0, math.inf, hi_closed=False),
          help="the model's lenience reviewing Max-Gram's drafts, >= 1 (1: exact)"),
    Param("gate", 0, traced=False, symbol="g", used=lambda p: p["gate"] != 0 and _uses_max_gram(p),
          check=lambda value, params: checks.check_count("gate (shortest suffix match Max-Gram drafts on)", value,
                                                         0, drafters.MaxGram.max_match),
          help=f"Max-Gram drafts only where the text's longest suffix match is >= gate tokens, in "
               f"[0, {drafters.MaxGram.max_match}] (0: always)"))))
register(Method("specdec_pp", decode=speculative.specdec_pp, rank=lambda p: 2.07,
                slack=lambda p: p["max_gamma"] + 1, params=(
    Param("stop_threshold", 0.5, traced=True,
          check=lambda value, params: checks.check_range("stop_threshold", value, 0.0, 1.0),
          help="the head stops a block once P(some draft rejected) > stop_threshold, in [0, 1]"),
    Param("max_gamma", 8, traced=False, symbol="Γ",
          check=lambda value, params: checks.check_count("max_gamma", value, 1),
          help="the most drafts per block, an int >= 1"))))

NUM_DRAFTS = Param("num_drafts", 4, traced=False, symbol="K",
                   check=lambda value, params: checks.check_count("num_drafts (K drafts per block)", value, 1),
                   help="K i.i.d. drafts per block, an int >= 1")


def _tree_slack(params) -> int:   # the verifier writes the whole tree, 1 + K·γ slots, before keeping one path
  return params["num_drafts"] * params["gamma"] + 1


register(Method("spectr", decode=multi_draft.spectr, drafter="model", rank=lambda p: 2.08, slack=_tree_slack,
                params=(NUM_DRAFTS, GAMMA)))
register(Method("specinfer", decode=multi_draft.specinfer, drafter="model", rank=lambda p: 2.09, slack=_tree_slack,
                params=(NUM_DRAFTS, GAMMA)))
