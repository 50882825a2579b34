"""SpecDec++'s acceptance-prediction head (layer 2): P̂(draft token accepted | prefix) from the drafter's
last hidden state at the draft token's position (SpecDec++ §4.2).

A `depth`-layer ResNet with SiLU on the hidden state [.., E] (depth 0: one linear layer, as the paper
sweeps 0 … 4), then a linear read-out to one logit. The drafter stays frozen: the head is a separate
pytree saved beside the drafter's export (`training.acceptance.save_head`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HeadConfig:
  """embed_dim: the drafter's hidden size E; depth: residual SiLU blocks before the read-out."""
  embed_dim: int
  depth: int = 1

  def __post_init__(self):
    if self.depth < 0 or self.embed_dim < 1:
      raise ValueError(f"HeadConfig needs depth >= 0 and embed_dim >= 1; got {self}")


class _Head(nn.Module):
  config: HeadConfig

  @nn.compact
  def __call__(self, hidden: Array) -> Array:
    x = hidden.astype(jnp.float32)
    for layer in range(self.config.depth):
      x = x + nn.silu(nn.Dense(self.config.embed_dim, name=f"block_{layer}")(x))
    return nn.Dense(1, name="readout")(x)[..., 0]


@struct.dataclass
class AcceptanceHead:
  """The head bound to its parameters (a pytree: a jitted decode loop takes them as arguments)."""
  params: Any
  config: HeadConfig = struct.field(pytree_node=False)

  def logits(self, hidden: Array) -> Array:
    """[.., E] -> [..]: the logit of P̂(accepted)."""
    return _Head(self.config).apply({"params": self.params}, hidden)

  def probability(self, hidden: Array) -> Array:
    """[.., E] -> [..]: P̂(accepted) in (0, 1)."""
    return jax.nn.sigmoid(self.logits(hidden))


def init_head(config: HeadConfig, key: Array) -> AcceptanceHead:
  """A randomly initialised head (flax's Dense initialisers)."""
  params = _Head(config).init(key, jnp.zeros((1, config.embed_dim), jnp.float32))["params"]
  return AcceptanceHead(params=params, config=config)
