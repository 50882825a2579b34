"""The method and task registries as the commands read them before importing JAX: registry.json, written from
`decoding.METHODS`, `training.exports.PARTS` and `data.tasks.TASKS` by

  python -m specdec.cli.registry

(tests/cli/test_cli.py keeps it equal to them). With it, `specdec-generate` builds its options and
`--help`, checks which method takes which parameter and checks each value against its bounds and choices
(`check_params`, as `Param.validate` does), in a fraction of a second.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

PATH = pathlib.Path(__file__).with_name("registry.json")


@functools.cache
def load() -> dict[str, Any]:
  """registry.json: {"methods": {name: {drafter, export_parts, params: [{name, default, type, traced, help,
  bounds, bounds_by, choices}]}},
  "parts": {name: what}, "tasks": {name: {inputs, max_input_tokens, max_target_tokens}}}."""
  return json.loads(PATH.read_text())


def current() -> dict[str, Any]:
  """The same, from the registries themselves (imports JAX)."""
  from specdec import decoding
  from specdec.data import tasks
  from specdec.training import exports
  return {
      "methods": {method.name: {
          "drafter": method.drafter, "export_parts": list(method.export_parts),
          "params": [{"name": p.name, "default": p.default, "type": p.value_type.__name__, "traced": p.traced,
                      "help": p.help, "bounds": _bounds(p), "bounds_by": p.bounds_by,
                      "choices": list(p.choices) if p.choices is not None else None}
                     for p in method.params]} for method in decoding.METHODS.values()},
      "parts": {name: part.what for name, part in exports.PARTS.items()},
      "tasks": {name: {"inputs": task.input_field is not None, "max_input_tokens": task.max_input_tokens,
                       "max_target_tokens": task.max_target_tokens} for name, task in tasks.TASKS.items()},
  }


def _bounds(param) -> Any:
  if param.bounds is None:
    return None
  if param.bounds_by is not None:
    return {value: bounds.as_dict() for value, bounds in param.bounds.items()}
  return param.bounds.as_dict()


def _interval(bounds: dict[str, Any], hi: Any) -> str:
  return f"{'[' if bounds['lo_closed'] else '('}{bounds['lo']}, {hi}{']' if bounds['hi_closed'] else ')'}"


def check_params(method: str, params: dict[str, Any]) -> None:
  """Raises ValueError, naming the option and its allowed values, for a value of `params` (the method's
  parameters given on the command line; the others take their defaults) outside its choices or bounds:
  the checks of `decoding.Param.validate`, from registry.json, without JAX."""
  entries = load()["methods"][method]["params"]
  values = {entry["name"]: params.get(entry["name"], entry["default"]) for entry in entries}
  for entry in entries:
    name, value = entry["name"], values[entry["name"]]
    if name not in params:
      continue
    if entry["choices"] is not None and value not in entry["choices"]:
      raise ValueError(f"--{name} must be one of {', '.join(entry['choices'])}; got {value!r}")
    bounds = entry["bounds"]
    if bounds is None:
      continue
    if entry["bounds_by"] is not None:
      if values[entry["bounds_by"]] not in bounds:
        continue   # the choices' check of that parameter names it
      bounds = bounds[values[entry["bounds_by"]]]
    hi = values[bounds["hi"]] if isinstance(bounds["hi"], str) and bounds["hi"] != "inf" else bounds["hi"]
    top = float("inf") if hi == "inf" else hi
    inside = ((value >= bounds["lo"]) if bounds["lo_closed"] else (value > bounds["lo"])) and (
        (value <= top) if bounds["hi_closed"] else (value < top))
    if not inside or value != value:
      raise ValueError(f"--{name}: {bounds['label'] or name} must lie in {_interval(bounds, hi)}; got {value}")


def text(registry: dict[str, Any]) -> str:
  return json.dumps(registry, indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
  PATH.write_text(text(current()))
  print(f"wrote {PATH}")
