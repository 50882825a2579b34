"""Models behind the `base.Model` interface: `build(preset, ...)` makes a randomly initialised one.

Presets are the lm1b-style decoder-only transformers of SpecTr's LM1B experiment (§8, Table 4): a 6M
drafter, its halved (2M) and doubled (20M) variants (layers, embedding, MLP and heads all ×½ or ×2),
and the 97M target. Parameters at vocab_size 32000, shared input/output embedding (V·E of each total):

  preset  emb  layers  heads  mlp    parameters
  tiny     32     2      2      64    1,040,896  (for tests; 16,896 without the embedding)
  2m       64     2      2     512    2,213,632
  6m      128     4      4    1024    5,413,632
  20m     256     8      8    2048   18,704,896
  97m     768    10     12    3072   95,425,536
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from specdec.models import base
from specdec.models.transformer import TransformerConfig, TransformerLM, init

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(emb_dim=32, num_layers=2, num_heads=2, qkv_dim=32, mlp_dim=64),
    "2m": dict(emb_dim=64, num_layers=2, num_heads=2, qkv_dim=64, mlp_dim=512),
    "6m": dict(emb_dim=128, num_layers=4, num_heads=4, qkv_dim=128, mlp_dim=1024),
    "20m": dict(emb_dim=256, num_layers=8, num_heads=8, qkv_dim=256, mlp_dim=2048),
    "97m": dict(emb_dim=768, num_layers=10, num_heads=12, qkv_dim=768, mlp_dim=3072),
}


def build(preset: str, *, vocab_size: int, seed: int = 0, max_length: int = 512) -> TransformerLM:
  """A randomly initialised model of a preset; load trained parameters with `with_params`."""
  if preset not in PRESETS:
    raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
  config = TransformerConfig(vocab_size=vocab_size, max_len=max_length, **PRESETS[preset])
  return init(config, jax.random.PRNGKey(seed))


def count_params(model: Any) -> int:
  """The number of parameters (scalars) of a model with a `params` pytree."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))


def _path(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def with_params(model: Any, params: Any) -> Any:
  """`model` with `params` (e.g. from a checkpoint), checked against the model's own parameters.

  The trees must hold the same paths with the same shapes; the result keeps the model's container
  types and dtypes. Raises ValueError naming the missing, unexpected and mis-shaped entries.
  """
  expected_leaves, treedef = jax.tree_util.tree_flatten_with_path(model.params)
  expected = {_path(p): leaf for p, leaf in expected_leaves}
  given = {_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing = [p for p in expected if p not in given]
  unexpected = [p for p in given if p not in expected]
  misshaped = [f"{p}: {tuple(given[p].shape)} instead of {tuple(leaf.shape)}"
               for p, leaf in expected.items() if p in given and tuple(given[p].shape) != tuple(leaf.shape)]
  if missing or unexpected or misshaped:
    problems = [f"{name} ({len(items)}): {', '.join(items[:5])}{' …' if len(items) > 5 else ''}"
                for name, items in [("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped)]
                if items]
    raise ValueError("parameters do not match the model: " + "; ".join(problems))
  leaves = [jnp.asarray(given[p], expected[p].dtype) for p in expected]
  return model.replace(params=jax.tree_util.tree_unflatten(treedef, leaves))


__all__ = ["PRESETS", "TransformerConfig", "TransformerLM", "base", "build", "count_params", "with_params"]
