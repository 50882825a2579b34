"""Model families as records (layer 2): the one place that says, per family, its presets, its config, how a model
is built, which checkpoint formats name it, and which of its parameters shard how. Every consumer reads this
registry: `models.build`, exports (`training.checkpoint`), Hugging Face and GGUF imports, partitioning, sweeps,
`specdec-plan` and launch sizing. Adding a family is one record here plus its module and its tests
(docs/extending.md walks through Llama).

  family = families.for_preset("smollm2_135m")          # the family a preset belongs to
  model = family.build("smollm2_135m", vocab_size=49152)
  families.for_model(model).name                          # "llama": the family whose switches the config has
  families.for_hf_model_type("gemma2"), families.for_gguf_architecture("llama")
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import jax

from specdec.models import decoder, feature_head, gemma2, llama, t5, transformer

Rules = tuple[tuple[str, tuple[str, ...]], ...]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """A family of models: one module's network with one set of switches.

  `module` holds the family's `PRESETS` (preset name -> config fields) and `config(vocab_size, **fields)`;
  `architecture` is the module with the network: its model class `MODEL`, `init(config, key)` and
  `LOGICAL_AXES` (partitioning rules on its parameter names). `switches`: the config values that tell this
  family's models from the other families of the same architecture (Gemma 2's and Llama's decoders).
  `hf_model_type`: the model_type of the Hugging Face config.json it reads; `gguf_architecture`: the
  general.architecture of the GGUF files it reads."""
  name: str
  module: types.ModuleType
  architecture: types.ModuleType
  switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  hf_model_type: str | None = None
  gguf_architecture: str | None = None

  @property
  def presets(self) -> Mapping[str, Mapping[str, Any]]:
    return self.module.PRESETS

  def config(self, vocab_size: int, **fields: Any) -> Any:
    """The family's config: its switches, then `fields`."""
    return self.module.config(vocab_size, **fields)

  def build(self, preset: str, *, vocab_size: int, seed: int = 0, max_length: int = 512) -> Any:
    """A randomly initialised model of a preset (`max_length`: the largest cache length it accepts)."""
    config = self.config(vocab_size, max_len=max_length, **self.presets[preset])
    return self.architecture.init(config, jax.random.PRNGKey(seed))

  def owns(self, model: Any) -> bool:
    """Whether `model` is of this family: its architecture's, with this family's switches."""
    return (isinstance(model, self.architecture.MODEL)
            and all(getattr(model.config, name) == value for name, value in self.switches.items()))


FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (
    # flax examples/lm1b's decoder-only transformer (SpecTr's LM1B models, the shipped Debian pair)
    ModelFamily("transformer", module=transformer, architecture=transformer),
    # T5 v1.1, encoder-decoder (the speculative-cascades paper's T5 pairs)
    ModelFamily("t5", module=t5, architecture=t5, hf_model_type="t5"),
    # Gemma 2 (the paper's §6 pairs) and the Llama family (SmolLM2) share one decoder
    ModelFamily("gemma2", module=gemma2, architecture=decoder, switches=gemma2.SWITCHES, hf_model_type="gemma2"),
    ModelFamily("llama", module=llama, architecture=decoder, switches=llama.SWITCHES, hf_model_type="llama",
                gguf_architecture="llama"),
)}
# Parameters that are not a family's network: the feature drafter's head.
_OTHER_RULES: Rules = feature_head.LOGICAL_AXES


def get(name: str) -> ModelFamily:
  if name not in FAMILIES:
    raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
  return FAMILIES[name]


def presets() -> dict[str, ModelFamily]:
  """Every preset's family, in the registry's order."""
  return {preset: family for family in FAMILIES.values() for preset in family.presets}


def for_preset(preset: str) -> ModelFamily:
  known = presets()
  if preset not in known:
    raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(known)}")
  return known[preset]


def for_model(model: Any) -> ModelFamily:
  """The family that owns `model` (TypeError for a model of no registered family)."""
  found = next((family for family in FAMILIES.values() if family.owns(model)), None)
  if found is None:
    raise TypeError(f"{type(model).__name__} with config {getattr(model, 'config', None)} is of no registered model "
                    f"family ({', '.join(FAMILIES)})")
  return found


def _by(field: str, value: str | None, what: str) -> ModelFamily:
  found = next((family for family in FAMILIES.values() if getattr(family, field) == value), None)
  if found is None or value is None:
    known = [getattr(family, field) for family in FAMILIES.values() if getattr(family, field)]
    raise ValueError(f"{what} {value!r} is of no registered model family; known: {', '.join(known)}")
  return found


def for_hf_model_type(model_type: str | None) -> ModelFamily:
  """The family whose Hugging Face checkpoints say model_type `model_type` (ValueError naming the known ones)."""
  return _by("hf_model_type", model_type, "model_type")


def for_gguf_architecture(architecture: str | None) -> ModelFamily:
  """The family whose GGUF files say general.architecture `architecture` (ValueError naming the known ones)."""
  return _by("gguf_architecture", architecture, "architecture")


def logical_axis_rules() -> Rules:
  """Every architecture's partitioning rules (regular expression on a parameter path, its logical axes)."""
  architectures = dict.fromkeys(family.architecture for family in FAMILIES.values())
  return tuple(rule for module in architectures for rule in module.LOGICAL_AXES) + _OTHER_RULES
