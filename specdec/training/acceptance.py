"""SpecDec++'s acceptance-prediction head on a frozen drafter (layer 4): labels, token mixing, weighted
BCE, training, evaluation and export (SpecDec++ §4.2).

Data: prompts with the verifier's own responses (`training.distill.write`; `tasks.read_generated`). For
response token i the drafter proposes x̂_i ~ S(q_{i−1}) and the label is the probability that the
verifier's test accepts it, a_i = min(1, S(p_{i−1})(x̂_i) / S(q_{i−1})(x̂_i)) (`label_rows`; at T = 0 this
is 1[argmax q = argmax p]). Token mixing: each response token is replaced by x̂_i with probability
`mix_fraction`, and the head reads the drafter's hidden state at the replaced positions only; the loss is
−w_acc·a·log P̂ − w_rej·(1 − a)·log(1 − P̂), averaged over them. The drafter's parameters never change.

  rows = label_rows(drafter, verifier, tokenized, key=…, sampling=Sampling(0.0))
  head, metrics = train_head(drafter, rows, validation_rows, config=HeadConfig(E, depth=1), steps=…)
  save_head(export_directory, head); load_head(export_directory)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from scipy.special import xlogy

from specdec import sampling as sampling_lib
from specdec.data import tasks
from specdec.models import base
from specdec.models.acceptance_head import AcceptanceHead, HeadConfig, init_head
from specdec.training import checkpoint
from specdec.training.train import TrainState, apply_gradients

Array = jax.Array
HEAD_DIRECTORY = "acceptance_head"        # inside a drafter's export directory
_HEAD_JSON = "head.json"


@dataclasses.dataclass(frozen=True)
class LabelledRows:
  """inputs [N, L] (prompt and verifier response), candidates [N, L] (x̂_i for token i), labels [N, L]
  (a_i), response [N, L] (token i is a response token with a candidate and a label)."""
  inputs: np.ndarray
  candidates: np.ndarray
  labels: np.ndarray
  response: np.ndarray

  def __len__(self) -> int:
    return len(self.inputs)

  def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The rows, cut after their last response token (rounded up to 32: few shapes to compile)."""
    last = np.nonzero(self.response[rows].any(axis=0))[0]
    width = min(self.inputs.shape[1], tasks.bucket_width(int(last[-1]) + 1 if len(last) else 1))
    return {name: getattr(self, name)[rows, :width] for name in ("inputs", "candidates", "labels", "response")}


@jax.jit
def _label_batch(key: Array, drafter: Any, verifier: Any, inputs: Array, sampling: sampling_lib.Sampling
                 ) -> tuple[Array, Array]:
  """Candidates and labels for tokens 1 … L−1 of inputs [B, L] (module docstring); index 0 is unused."""
  _, q = sampling.distributions(drafter.logits(inputs)[:, :-1])
  _, p = sampling.distributions(verifier.logits(inputs)[:, :-1])
  candidates = sampling_lib.sample(key, q)
  q_x = jnp.take_along_axis(q, candidates[..., None], axis=-1)[..., 0]
  p_x = jnp.take_along_axis(p, candidates[..., None], axis=-1)[..., 0]
  labels = jnp.minimum(1.0, p_x / jnp.where(q_x > 0, q_x, 1.0))
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
  return pad(candidates), pad(labels)


def label_rows(drafter: base.Features, verifier: base.Model, split: tasks.Tokenized, *, key: Array,
               sampling: sampling_lib.Sampling, batch_size: int = 32) -> LabelledRows:
  """Candidates and exact acceptance labels for every response token of `split` (prompts + the verifier's
  responses), in batches of rows of similar length cut to their longest (rounded up to 32). The head reads the
  drafter's hidden states: a decoder-only model that declares `feature_access` (`base.Features`)."""
  if drafter.encoder_decoder or not drafter.feature_access:
    raise ValueError("acceptance heads are trained for decoder-only drafters with hidden states "
                     f"(feature_access); {type(drafter).__name__} is not one")
  sampling = sampling.checked()
  n, width = split.tokens.shape
  candidates = np.zeros((n, width), np.int32)
  labels = np.zeros((n, width), np.float32)
  index = np.arange(width)[None, :]
  response = (index >= split.prompt_lengths[:, None]) & (index < split.lengths[:, None])
  order = np.argsort(split.lengths, kind="stable")
  for start in range(0, n, batch_size):
    rows = order[start:start + batch_size]
    rows_padded = np.concatenate([rows, np.full(batch_size - len(rows), rows[-1])])
    cut = min(width, tasks.bucket_width(split.lengths[rows].max()))
    c, a = _label_batch(jax.random.fold_in(key, start), drafter, verifier,
                        jnp.asarray(split.tokens[rows_padded, :cut]), sampling)
    candidates[rows, :cut] = np.asarray(c)[:len(rows)]
    labels[rows, :cut] = np.asarray(a)[:len(rows)]
  return LabelledRows(inputs=split.tokens.astype(np.int32), candidates=candidates, labels=labels, response=response)


def _mixed(key: Array, batch: dict[str, Array], mix_fraction) -> tuple[Array, Array]:
  """Token mixing: response tokens replaced by the drafter's candidates with probability mix_fraction;
  returns the mixed inputs [B, L] and the replaced positions [B, L] (where the loss is taken)."""
  chosen = batch["response"] & (jax.random.uniform(key, batch["inputs"].shape) < mix_fraction)
  return jnp.where(chosen, batch["candidates"], batch["inputs"]), chosen


def _predictions(head: AcceptanceHead, drafter: Any, inputs: Array) -> Array:
  _, hidden = drafter.logits(inputs, return_hidden=True)
  return head.logits(jax.lax.stop_gradient(hidden))


def _bce_sums(head: AcceptanceHead, drafter: Any, batch: dict[str, Array], key: Array, mix_fraction,
              w_acc, w_rej) -> dict[str, Array]:
  inputs, chosen = _mixed(key, batch, mix_fraction)
  z = _predictions(head, drafter, inputs)
  a = batch["labels"]
  loss = -(w_acc * a * jax.nn.log_sigmoid(z) + w_rej * (1.0 - a) * jax.nn.log_sigmoid(-z))
  return {"loss": jnp.sum(jnp.where(chosen, loss, 0.0)), "tokens": jnp.sum(chosen).astype(jnp.float32)}


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("config",))
def head_train_step(state: TrainState, batch: dict[str, Array], key: Array, drafter: Any, *, config: HeadConfig,
                    mix_fraction, w_acc, w_rej) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer step of the head on the weighted BCE (module docstring); the drafter is fixed."""
  def loss_fn(params):
    sums = _bce_sums(AcceptanceHead(params, config), drafter, batch, key, mix_fraction, w_acc, w_rej)
    return sums["loss"] / jnp.maximum(sums["tokens"], 1.0), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  return apply_gradients(state, grads, sums)


@jax.jit
def _eval_batch(head: AcceptanceHead, drafter: Any, batch: dict[str, Array], key: Array, mix_fraction
                ) -> tuple[Array, Array, Array]:
  inputs, chosen = _mixed(key, batch, mix_fraction)
  return jax.nn.sigmoid(_predictions(head, drafter, inputs)), batch["labels"], chosen


def binary_kl(a: np.ndarray, prediction: np.ndarray) -> np.ndarray:
  """KL(Bernoulli(a) ‖ Bernoulli(P̂)) per position, the paper's fit metric (App. D.3)."""
  a = np.asarray(a, np.float64)
  prediction = np.clip(np.asarray(prediction, np.float64), 1e-7, 1 - 1e-7)
  return xlogy(a, a / prediction) + xlogy(1 - a, (1 - a) / (1 - prediction))


def evaluate_head(head: AcceptanceHead, drafter: Any, rows: LabelledRows, *, train_mean: float,
                  mix_fraction: float, batch_size: int = 32, seed: int = 0) -> dict[str, float]:
  """On held-out rows (mixed as in training, fixed seed): mean binary KL of the head; the same for the
  constant prediction `train_mean` (the mean training label: what a head that learned nothing predicts)
  and for the held-out rows' own mean label (the best constant, known only in hindsight); mean label and
  prediction, and the correlation of prediction with label."""
  predictions, labels = [], []
  for start in range(0, len(rows), batch_size):
    index = np.arange(start, min(start + batch_size, len(rows)))
    batch = {k: jnp.asarray(v) for k, v in rows.take(index).items()}
    p, a, chosen = jax.device_get(_eval_batch(head, drafter, batch, jax.random.PRNGKey(seed + start), mix_fraction))
    predictions.append(p[chosen])
    labels.append(a[chosen])
  p, a = np.concatenate(predictions), np.concatenate(labels)
  return {"binary_kl": float(binary_kl(a, p).mean()),
          "binary_kl_constant": float(binary_kl(a, np.full_like(p, train_mean)).mean()),
          "binary_kl_best_constant": float(binary_kl(a, np.full_like(p, a.mean())).mean()),
          "mean_label": float(a.mean()), "mean_prediction": float(p.mean()),
          "correlation": float(np.corrcoef(p, a)[0, 1]) if p.std() > 0 and a.std() > 0 else 0.0,
          "positions": int(len(a))}


def train_head(drafter: Any, train_rows: LabelledRows, validation_rows: LabelledRows, *, config: HeadConfig,
               steps: int = 2000, batch_size: int = 32, learning_rate: float = 1e-3, mix_fraction: float = 0.5,
               w_acc: float = 1.0, w_rej: float = 1.0, seed: int = 0, log_every: int = 200
               ) -> tuple[AcceptanceHead, dict[str, float]]:
  """Adam with a cosine schedule (SpecDec++ App. B) on batches of rows drawn in a seeded random order;
  evaluates on `validation_rows` at the end. Returns the head and the validation metrics."""
  if config.embed_dim != drafter.config.embed_dim:
    raise ValueError(f"head embed_dim {config.embed_dim} != the drafter's hidden size {drafter.config.embed_dim}")
  key = jax.random.PRNGKey(seed)
  head = init_head(config, key)
  state = TrainState.create(head.params, optax.adam(optax.cosine_decay_schedule(learning_rate, steps)))
  rng = np.random.default_rng(seed)
  order, cursor, start_time, window = rng.permutation(len(train_rows)), 0, time.perf_counter(), []
  for step in range(1, steps + 1):
    if cursor + batch_size > len(order):
      order, cursor = rng.permutation(len(train_rows)), 0
    batch = {k: jnp.asarray(v) for k, v in train_rows.take(order[cursor:cursor + batch_size]).items()}
    cursor += batch_size
    state, metrics = head_train_step(state, batch, jax.random.fold_in(key, step), drafter, config=config,
                                     mix_fraction=mix_fraction, w_acc=w_acc, w_rej=w_rej)
    window.append(metrics)
    if step % log_every == 0 or step == steps:
      window = jax.device_get(window)
      tokens = sum(m["tokens"] for m in window)
      loss = sum(m["loss"] * m["tokens"] for m in window) / max(tokens, 1e-9)
      print(f"step {step}/{steps} | weighted BCE {loss:.4f} | {time.perf_counter() - start_time:.0f} s", flush=True)
      window = []
  head = AcceptanceHead(state.params, config)
  train_mean = float(train_rows.labels[train_rows.response].mean())
  metrics = evaluate_head(head, drafter, validation_rows, train_mean=train_mean, mix_fraction=mix_fraction,
                          batch_size=batch_size, seed=seed)
  return head, {**metrics, "train_mean_label": train_mean}


def save_head(drafter_directory: str, head: AcceptanceHead, *, metadata: dict[str, Any] | None = None) -> str:
  """Writes the head to `drafter_directory`/acceptance_head (a new directory): parameters (orbax) and
  head.json (config and `metadata`, e.g. training settings and validation figures). Returns the path."""
  path = os.path.join(os.path.abspath(drafter_directory), HEAD_DIRECTORY)
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; save_head writes a new directory")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(path, "params"), head.params)
    checkpointer.wait_until_finished()
  with open(os.path.join(path, _HEAD_JSON), "w") as f:   # written last: marks a complete head
    json.dump({"config": dataclasses.asdict(head.config), **(metadata or {})}, f, indent=2)
  return path


def load_head(drafter_directory: str) -> AcceptanceHead:
  """The head `save_head` wrote beside a drafter's export (FileNotFoundError naming the path if none)."""
  path, stored = checkpoint.read_head(drafter_directory, HEAD_DIRECTORY, _HEAD_JSON,
                                      "train one with scripts/train_acceptance_head.py")
  config = HeadConfig(**base.current_fields(stored["config"]))
  return AcceptanceHead(params=checkpoint.restore_head_params(path, lambda key: init_head(config, key)), config=config)
