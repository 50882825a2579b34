"""Models behind the `base.Model` interface: `build(preset, ...)` makes a randomly initialised one, of the model
family (`families`: the registry of families, their presets, configs, checkpoint formats and partitioning rules)
the preset belongs to.

The "transformer" family's presets (models/transformer.py) are the lm1b-style decoder-only transformers of
SpecTr's LM1B experiment (§8, Table 4): a 6M drafter, its halved (2M) and doubled (20M) variants (layers,
embedding, MLP and heads all ×½ or ×2), and the 97M target; 15m is the 20m with a 1024-wide MLP, the verifier of the shipped Debian pair (8.4M
parameters at the shipped vocabulary's 8192, 17 MB in bf16; its drafter is the 2m, 0.69M).
Parameters at vocab_size 32000, shared input/output embedding (V·E of each total):

  preset  emb  layers  heads  mlp    parameters
  tiny     32     2      2      64    1,040,896  (for tests; 16,896 without the embedding)
  2m       64     2      2     512    2,213,632
  6m      128     4      4    1024    5,413,632
  15m     256     8      8    1024   14,502,400
  20m     256     8      8    2048   18,704,896
  97m     768    10     12    3072   95,425,536

The "t5" family's presets build the encoder-decoder `t5.T5` (T5 v1.1, models/t5.py), whose prompt is its
encoder input. Sizes are T5 v1.1's (HF google/t5-v1_1-*) plus three for tests and the CPU; t5_tiny and
t5_25m are the drafter and verifier of the trained Debian T5 pair (0.57M and 13.6M parameters at the
shipped vocabulary's 8192; the verifier's decoder step takes ≈ 24× the drafter's multiply-adds).
Parameters at T5's vocab_size 32128 (untied input and output embeddings, 2·V·E of each total):

  preset    emb  layers(enc+dec)  heads  d_kv  mlp    parameters
  t5_tiny    32      2+2            2     16     64     2,105,856  (for tests; 49,664 without embeddings)
  t5_mini   128      4+4            4     32    256     9,800,704
  t5_25m    256      4+4            4     64   1024    25,892,608
  t5_small  512      8+8            6     64   1024    76,961,152
  t5_base   768     12+12          12     64   2048   247,577,856
  t5_large 1024     24+24          16     64   2816   783,150,080
  t5_xl    2048     24+24          32     64   5120 2,849,757,184

The "gemma2" family's presets (models/gemma2.py: Gemma 2's 2B, 9B and 27B shapes, vocabulary 256,128 for the
released checkpoints, which `training.load_hf` and `training.load_gemma` read, and gemma2_tiny for tests) and the
"llama" family's (models/llama.py: smollm2_135m, whose checkpoint `training.load_gguf` reads, and llama_tiny for tests)
build the shared decoder-only `decoder.Decoder` (models/decoder.py) with their family's switches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models import base, decoder, families, gemma2, llama, t5, transformer  # noqa: F401 (models.t5, …)
from specdec.models.decoder import Decoder, DecoderConfig
from specdec.models.t5 import T5, T5Config
from specdec.models.transformer import TransformerConfig, TransformerLM


def build(preset: str, *, vocab_size: int, seed: int = 0, max_length: int = 512, dtype: Any = jnp.float32
          ) -> TransformerLM | T5 | Decoder:
  """A randomly initialised model of a preset (`families.for_preset`; `max_length`: the largest cache length it
  accepts); load trained parameters with `with_params` (checkpoints: `specdec.training.load_model`). `dtype`: see
  `with_dtype`."""
  model = families.for_preset(preset).build(preset, vocab_size=vocab_size, seed=seed, max_length=max_length)
  return with_dtype(model, dtype)


def cast_params(params: Any, dtype: Any) -> Any:
  """Floating-point parameters cast to `dtype` (e.g. bfloat16 for export); other leaves unchanged."""
  return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def with_dtype(model: Any, dtype: Any) -> Any:
  """`model` computing in `dtype`: its weights stored, its activations and KV caches held in `dtype`
  (bfloat16 halves what a memory-bound accelerator reads per decode step); norms, softmaxes and the
  logits stay float32, and so does all sampling math downstream. float32 is the default everywhere."""
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating-point type (float32, bfloat16); got {dtype}")
  if dtype == model.config.dtype:
    return model
  return model.replace(params=cast_params(model.params, dtype),
                       config=dataclasses.replace(model.config, dtype=dtype))


def count_params(model: Any) -> int:
  """The number of parameters (scalars) of a model with a `params` pytree."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))


def _path(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def with_params(model: Any, params: Any, *, host: bool = False) -> Any:
  """`model` with `params` (e.g. from a checkpoint), checked against the model's own parameters.

  The trees must hold the same paths with the same shapes; the result keeps the model's container
  types and dtypes. `host`: the parameters stay NumPy arrays in host memory, for `with_dtype` to cast and
  `partitioning.shard_model` to place shard by shard (a model larger than one device's memory never lands
  whole on the first device). Raises ValueError naming the missing, unexpected and mis-shaped entries.
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
  to_array = np.asarray if host else jnp.asarray
  leaves = [to_array(given[p], expected[p].dtype) for p in expected]
  return model.replace(params=jax.tree_util.tree_unflatten(treedef, leaves))


# The families' modules (gemma2, llama, t5, transformer) are the registry's (`families`), not listed here.
__all__ = ["Decoder", "DecoderConfig", "T5", "T5Config", "TransformerConfig", "TransformerLM", "base", "build",
           "cast_params", "count_params", "decoder", "families", "with_dtype", "with_params"]
