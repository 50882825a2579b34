"""The verifier's features of a feature head's training text, computed once and kept on disk (layer 4): a head
then trains without running the verifier (EAGLE's teacher forcing; one verifier forward per token, not one per
token per epoch).

  write_features(out, verifier, responses)   # out/features/shard_00000.npz, … (resumed shard by shard)
  batches = cached_batches(out, batch_size=8, seed=0)   # {'inputs', 'weights', 'features'} rows, endlessly

A shard holds `SHARD_ROWS` sequences (a prompt's ids then its response's) cut to `max_length`: tokens [N, W] int32,
weights [N, W] float32 (1 from the prompt's last token on: the response is what the head learns to draft), features
[N, W, F] float16 (the verifier's hidden states after each token: its last, what its output layer reads, F = E; for
a verifier with `feature_layers` (EAGLE-3's fused features, `Decoder.with_feature_layers`) those layers' outputs
before it, F = (k + 1)·E, in a folder of their own: features_l2_15/ for layers 2 and 15). Each shard is written
whole (to a temporary name, renamed), so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FEATURES = "features"
SHARD_ROWS = 64
LENGTH_GROUP = 16   # batches whose rows are sorted by length together (`cached_batches`)
WIDTH_STEP = 32     # batch widths are multiples of it: few compiled programs


def _hidden(verifier: Any, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(_hidden_jit(verifier, jnp.asarray(tokens)), np.float16)


@jax.jit
def _hidden_jit(verifier: Any, tokens: jax.Array) -> jax.Array:
  return verifier.logits(tokens, return_hidden=True)[1]


def _features(verifier: Any, tokens: np.ndarray, weights: np.ndarray, batch_size: int) -> np.ndarray:
  """The verifier's features [N, W, E] (float16) of rows tokens [N, W]: rows of like length batched together, each
  batch cut to its longest row (rounded up to WIDTH_STEP) — the verifier is causal, so the right padding changes
  no real position's feature; the padding's features are left 0 (no loss reads them)."""
  lengths = np.array([_length(row) for row in weights])
  features = None
  order = np.argsort(lengths, kind="stable")
  for start in range(0, len(order), batch_size):
    batch = order[start:start + batch_size]
    width = min(-(-max(int(lengths[batch].max()), 1) // WIDTH_STEP) * WIDTH_STEP, tokens.shape[1])
    hidden = _hidden(verifier, tokens[batch, :width])
    if features is None:
      features = np.zeros(tokens.shape + hidden.shape[-1:], hidden.dtype)
    features[batch, :width] = hidden
  return features


def folder_name(verifier: Any) -> str:
  """The shards' folder under a work directory: FEATURES, or FEATURES_l2_15 for a verifier returning its layers 2
  and 15 before its last hidden state."""
  layers = getattr(getattr(verifier, "config", None), "feature_layers", ())
  return FEATURES + "".join(f"{'_l' if i == 0 else '_'}{layer}" for i, layer in enumerate(layers))


def rows(records: Sequence[dict], max_length: int, width_step: int = 64) -> tuple[np.ndarray, np.ndarray]:
  """Sequences prompt_ids + response_ids cut to `max_length`, right-padded with 0 to a multiple of `width_step`:
  tokens [N, W] and weights [N, W]: 1 from the prompt's last token on, so that the head's loss (on pairs of
  weighted positions) covers every response token's prediction, the first one's from the prompt included."""
  sequences = [(r["prompt_ids"] + r["response_ids"])[:max_length] for r in records]
  width = -(-max(map(len, sequences)) // width_step) * width_step
  tokens, weights = np.zeros((len(records), width), np.int32), np.zeros((len(records), width), np.float32)
  for row, (record, sequence) in enumerate(zip(records, sequences)):
    tokens[row, :len(sequence)] = sequence
    weights[row, len(record["prompt_ids"]) - 1:len(sequence)] = 1.0
  return tokens, weights


def write_features(out: str, verifier: Any, responses: Sequence[dict], *, max_length: int = 512,
                   batch_size: int = 8, log: Callable[[str], None] = print) -> list[str]:
  """Shards of `responses` (self_distill's records) with the verifier's features, under out/`folder_name`/;
  shards already there are kept (resumed). Returns the shards' paths."""
  folder = os.path.join(out, folder_name(verifier))
  os.makedirs(folder, exist_ok=True)
  paths = []
  for shard, start in enumerate(range(0, len(responses), SHARD_ROWS)):
    path = os.path.join(folder, f"shard_{shard:05d}.npz")
    paths.append(path)
    records = responses[start:start + SHARD_ROWS]
    tokens, weights = rows(records, max_length)
    if os.path.exists(path):   # kept where it holds these very rows (a longer run rewrites its last shard)
      with np.load(path) as data:
        if np.array_equal(data["tokens"], tokens) and np.array_equal(data["weights"], weights):
          continue
    features = _features(verifier, tokens, weights, batch_size)
    partial = path + ".partial.npz"
    np.savez(partial, tokens=tokens, weights=weights, features=features)
    os.replace(partial, path)
    log(f"features: shard {shard + 1}/{-(-len(responses) // SHARD_ROWS)} ({int(weights.sum())} response tokens)")
  return paths


def load_shards(paths: Sequence[str]) -> list[dict[str, np.ndarray]]:
  """The shards `write_features` wrote (FileNotFoundError naming a missing one)."""
  if not paths:
    raise FileNotFoundError("no feature shards given: write them with feature_cache.write_features")
  shards = []
  for path in paths:
    with np.load(path) as data:
      shards.append({name: data[name] for name in ("tokens", "weights", "features")})
  return shards


def cached_batches(shards: Sequence[dict[str, np.ndarray]], *, batch_size: int, seed: int = 0,
                   rows_of: Sequence[tuple[int, int]] | None = None) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches of `batch_size` rows drawn without replacement, epoch by epoch (`seed`), from the shards'
  rows (or the (shard, row) pairs `rows_of`): {'inputs' [B, W], 'weights' [B, W], 'features' [B, W, E] float32}.

  Rows of like length go together (each run of LENGTH_GROUP batches of the epoch's order is sorted by length, and
  its batches shuffled), and W is the batch's longest row (to its last response token) rounded up to WIDTH_STEP:
  a shard is as wide as its longest row, and most rows are far shorter."""
  rows_of = list(rows_of if rows_of is not None else
                 [(s, r) for s, shard in enumerate(shards) for r in range(shard["tokens"].shape[0])])
  if len(rows_of) < batch_size:
    raise ValueError(f"{len(rows_of)} rows make no batch of {batch_size}: give more prompts or a smaller batch_size")
  lengths = np.array([_length(shards[s]["weights"][r]) for s, r in rows_of])
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(rows_of))[:len(rows_of) // batch_size * batch_size]
    batches = []
    for start in range(0, len(order), LENGTH_GROUP * batch_size):
      group = order[start:start + LENGTH_GROUP * batch_size]
      group = group[np.argsort(lengths[group], kind="stable")]
      batches += [group[i:i + batch_size] for i in rng.permutation(range(0, len(group), batch_size))]
    for batch in batches:
      picked = [rows_of[i] for i in batch]
      width = min(-(-max(lengths[batch].max(), 1) // WIDTH_STEP) * WIDTH_STEP,
                  max(shards[s]["tokens"].shape[1] for s, _ in picked))

      def stack(name: str, dtype: Any) -> np.ndarray:
        rows = [shards[s][name][r][:width] for s, r in picked]
        return np.stack([np.pad(row, [(0, width - row.shape[0])] + [(0, 0)] * (row.ndim - 1))
                         for row in rows]).astype(dtype)
      yield {"inputs": stack("tokens", np.int32), "weights": stack("weights", np.float32),
             "features": stack("features", np.float32)}


def _length(weights: np.ndarray) -> int:
  """A row's length up to its last response token (0 if it has none)."""
  nonzero = np.flatnonzero(weights)
  return int(nonzero[-1]) + 1 if nonzero.size else 0
