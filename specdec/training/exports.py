"""A method's drafter from a model export (layer 4): the model, and the parts of its export directory the
method declares (`decoding.Method.export_parts`), read here and put together by `Method.make_drafter`.

  parts = load_parts("data/models/debian_drafter_distilled", decoding.METHODS["specdec_pp"].export_parts)
  drafter = drafter_for(decoding.METHODS["specdec_pp"], model, parts)

The command line and the sweeps build every method's drafter this way, so neither names a method.

A drafter's directory is a model export (or a save_pretrained directory), or a feature drafter's: a
feature_head/ alone (`training.feature_head.save_head`), a head that drafts from the verifier's own hidden
states (`load_drafter`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from specdec.data import pretrained
from specdec.decoding import METHODS, Drafter, Method
from specdec.models.base import Model
from specdec.decoding.feature_drafter import FeatureDrafter, check_pair
from specdec.training import acceptance, feature_head
from specdec.training.loading import load_model


@dataclasses.dataclass(frozen=True)
class Part:
  """A part of a model's export directory (a subdirectory `name`/): what it is, how to read it from the
  export directory, how to make one, and the key of its digest in a sweep's run context."""
  name: str
  what: str
  load: Callable[[str], Any]
  how: str
  context_key: str


PARTS = {part.name: part for part in (
    Part(acceptance.HEAD_DIRECTORY, "acceptance head", acceptance.load_head, "scripts/train_acceptance_head.py",
         context_key="drafter_head"),)}


def present(directory: str | None) -> list[str]:
  """The parts `directory` holds."""
  return [name for name in PARTS if directory is not None and os.path.isdir(os.path.join(directory, name))]


def load_parts(directory: str | None, names: Iterable[str] | None = None, *, user: str = "the method",
               option: str = "the drafter's export directory") -> dict[str, Any]:
  """The parts `names` read from `directory`; None: every part it holds. A missing one is a
  FileNotFoundError naming it, `user` (who needs it) and `option` (what the caller calls the directory)."""
  names = present(directory) if names is None else list(names)
  for name in names:
    if name not in present(directory):
      raise FileNotFoundError(f"{user} needs the drafter's {PARTS[name].what}: {directory or 'the drafter'} holds "
                              f"no {name}/ (give {option}, or make one with {PARTS[name].how})")
  return {name: PARTS[name].load(directory) for name in names}


def drafter_for(method: Method, model: Model | None, parts: Mapping[str, Any]) -> Model | Drafter | None:
  """The drafter `method` decodes with: None where it needs none, `model` where it needs nothing else, else
  `method.make_drafter(model, **parts)` (ValueError naming a part it needs that `parts` lacks)."""
  if method.drafter == "none":
    return None
  if not method.export_parts:
    return model
  missing = [name for name in method.export_parts if name not in parts]
  if missing:
    raise ValueError(f"method {method.name!r} needs the drafter's {PARTS[missing[0]].what} ({missing[0]}/ in "
                     f"its export directory; make one with {PARTS[missing[0]].how})")
  return method.make_drafter(model, **{name: parts[name] for name in method.export_parts})


def is_feature_head(directory: str) -> bool:
  """Whether `directory` is a feature drafter's: a feature_head/ and no model of its own."""
  return (os.path.isfile(os.path.join(directory, feature_head.HEAD_DIRECTORY, feature_head.HEAD_JSON))
          and not any(os.path.exists(os.path.join(directory, name)) for name in ("model.json", "config.json")))


def check_feature_drafter_method(method: Method, drafter: str) -> None:
  """ValueError, naming the methods that take it, where `method` cannot decode with the feature drafter
  `drafter` (a name for the message): one whose drafter must be a model, or that reads export parts (a
  method without a drafter just does not use it)."""
  if method.drafter == "model" or method.export_parts:
    takers = [m.name for m in METHODS.values() if m.drafter == "any" and not m.export_parts]
    raise ValueError(f"{drafter} is a feature drafter (a head over the verifier's hidden states); method "
                     f"{method.name} needs a drafter model: use it with {' or '.join(takers)}")


def load_drafter(directory: str, verifier: Model) -> Model | Drafter:
  """The drafter exported in `directory` (or shipped under that name: smollm2_eagle, debian_drafter, …): a feature
  drafter over `verifier` (`is_feature_head`; ValueError naming both where the head was trained for another
  verifier), else the model (`loading.load_model`)."""
  directory = pretrained.resolve(directory)
  if is_feature_head(directory):
    head = feature_head.load_head(directory)
    try:
      check_pair(head, verifier)
    except ValueError as e:
      raise ValueError(f"{directory}: {e}") from None
    return FeatureDrafter(head, verifier)
  return load_model(directory)
