"""Training a feature drafter's head on a frozen verifier (EAGLE §3.2; layer 4).

Features and targets come from the verifier itself, teacher-forced on text: f_t, its last hidden states
(what its output layer reads). At position t the head reads (f_{t−1}, e(x_t)) and predicts f̂_t; the loss is

  L = SmoothL1(f̂_t, f_t) + w_cls · CE(softmax(out(f_t)), softmax(out(f̂_t)))

with EAGLE's weights (regression 1, classification w_cls = 0.1), the classification target being the
verifier's own next-token distribution. A head reading fused features (EAGLE-3: `FeatureHead.reduce`) reads
g_{t−1}, the verifier's chosen layers beside f_{t−1}, and still predicts f_t. EAGLE's feature noise (U(−0.1, 0.1)
added to the input features, `noise`) makes the head robust to its own errors when it reads its predictions while
drafting. The verifier's parameters never change.

  head, record = train(verifier, batches, steps=…, learning_rate=…)
  save_head(directory, head, record); load_head(directory)

`train_and_save` is the whole recipe on the local Debian tasks' text (`specdec-train` with
configs/train/debian_feature_head.gin).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from specdec.data import tasks
from specdec.models import base
from specdec.models.feature_head import FeatureHead, FeatureHeadConfig, init, init_from_config
from specdec.training import checkpoint
from specdec.training.train import TrainState, apply_gradients, make_optimizer

Array = jax.Array
HEAD_DIRECTORY = "feature_head"
HEAD_JSON = "head.json"
# EAGLE §3.2: L = L_reg + w_cls · L_cls, w_cls = 0.1; input-feature noise U(−0.1, 0.1).
REGRESSION_WEIGHT, CLASSIFICATION_WEIGHT, NOISE = 1.0, 0.1, 0.1
# The weight of an unrolled pass r's losses: UNROLL_DECAY^(r−1) (later drafts matter less: they count only where
# the earlier ones were accepted).
UNROLL_DECAY = 0.8
EVAL_UNROLL = 3   # held-out agreement is reported for the head's first three drafts
EVAL_EVERY = 200  # the recipe's held-out curve: the first draft's agreement every this many steps


def _smooth_l1(x: Array) -> Array:
  x = jnp.abs(x)
  return jnp.where(x < 1.0, 0.5 * x * x, x - 0.5)


def losses(params: Any, head: FeatureHead, verifier: Any, inputs: Array, weights: Array, key: Array | None,
           noise: float, features: Array | None = None, unroll: int = 1, per_position: bool = False
           ) -> dict[str, Array]:
  """Weighted sums over positions 1 … L−1 of rows inputs [B, L] (weights [B, L]: 1 on real tokens): the
  regression and classification losses, the head's top-1 agreement with the verifier, and the count.
  `features` [B, L, F]: the verifier's, cached (`feature_cache`; F = E, or (k + 1)·E fused with f last); None:
  computed here (by a verifier returning the head's `feature_layers`). With a draft vocabulary
  (`head.draft_ids`) both distributions are over its tokens (the verifier's renormalised to them): the q the
  head drafts from. `unroll` s > 1: EAGLE-3's training-time test (`FeatureHead.predict_unrolled`), pass r's
  losses weighted UNROLL_DECAY^(r−1) and its agreement as top1_agreement_r (the head's r-th draft reading its own
  earlier ones; pass 1 is EAGLE's loss). chain_accepted_r: the positions u from which a greedy block would accept
  its first r drafts (the head's argmax equals the verifier's at u, …, u + r − 1, pass r at u + r − 1 being draft
  r of the block whose pending token is x_{u+1}, as `decoding.feature_drafter` drafts it), so that on the
  verifier's greedy text 1 + Σ_{r ≤ γ} chain_accepted_r / tokens is the tokens per call at γ of blocks starting at
  uniformly drawn positions (a decode's blocks start where the last one stopped: `accepted_lengths` replays them).
  `per_position`: also 'accepted_lengths' [B, L−1], at u the drafts (≤ `unroll`) the block from u accepts, and
  'confidences' [unroll, B, L−1], at [r − 1, u] the top probability max q_raw of draft r of that block (pass r
  at u + r − 1, over the draft vocabulary: what a confidence stop reads)."""
  if features is None:
    _, features = verifier.logits(inputs, return_hidden=True)
  features = jax.lax.stop_gradient(features.astype(jnp.float32))
  previous = features[:, :-1]
  if key is not None and noise:
    previous = previous + jax.random.uniform(key, previous.shape, minval=-noise, maxval=noise)
  passes = head.replace(params=params).predict_unrolled(previous, verifier.token_embeddings(inputs[:, 1:]), unroll)
  target = features[:, 1:, -head.config.embed_dim:]
  table = None if head.draft_ids is None else jnp.take(verifier.output_table(), head.draft_ids, axis=0)
  target_logits = jax.lax.stop_gradient(verifier.output_logits(target, table))
  target_top1 = jnp.argmax(target_logits, -1)
  target_probabilities = jax.nn.softmax(target_logits)
  mask = weights[:, 1:] * weights[:, :-1]
  sums = {"regression": 0.0, "classification": 0.0}
  chain = mask > 0   # [B, L−1] at u: the chain from u so far accepted (draft r of it is pass r at u + r − 1)
  accepted, confidences = jnp.zeros(mask.shape, jnp.int32), []
  for step in range(unroll):
    predicted = passes[step]
    step_mask = mask * (jnp.arange(mask.shape[1]) >= step)
    weight = UNROLL_DECAY ** step
    predicted_logits = verifier.output_logits(predicted, table)
    regression = jnp.mean(_smooth_l1(predicted - target), axis=-1)
    classification = -jnp.sum(target_probabilities * jax.nn.log_softmax(predicted_logits), axis=-1)
    sums["regression"] += weight * jnp.sum(regression * step_mask)
    sums["classification"] += weight * jnp.sum(classification * step_mask)
    match = jnp.argmax(predicted_logits, -1) == target_top1
    sums["top1_agreement" if step == 0 else f"top1_agreement_{step + 1}"] = jnp.sum(match * step_mask)
    chain &= jnp.pad(match & (mask > 0), ((0, 0), (0, step)))[:, step:]
    sums[f"chain_accepted_{step + 1}"] = jnp.sum(chain)
    accepted += chain
    if per_position:
      top = jnp.max(jax.nn.softmax(predicted_logits), axis=-1)
      confidences.append(jnp.pad(top, ((0, 0), (0, step)))[:, step:])
  return sums | {"tokens": jnp.sum(mask)} | (
      {"accepted_lengths": accepted, "confidences": jnp.stack(confidences)} if per_position else {})


@functools.partial(jax.jit, static_argnames=("gamma",))
def accepted_lengths(head: FeatureHead, verifier: Any, inputs: Array, weights: Array, gamma: int
                     ) -> tuple[Array, Array]:
  """On the verifier's greedy text inputs [B, L] (`losses`' chains): [B, L−1] int32, at u how many of its γ drafts
  a greedy block whose pending token is x_{u+1} accepts (0 where weights mark no pair), and [γ, B, L−1] the top
  probability of each of its drafts (teacher-forced on the text's tokens: after a rejected draft the decode's later
  drafts read other tokens)."""
  out = losses(head.params, head, verifier, inputs, weights, None, 0.0, unroll=gamma, per_position=True)
  return out["accepted_lengths"], out["confidences"]


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("noise", "unroll"))
def train_step(state: TrainState, head: FeatureHead, verifier: Any, batch: dict[str, Array], key: Array,
               noise: float = NOISE, unroll: int = 1) -> tuple[TrainState, dict[str, Array]]:
  """One AdamW step on L = L_reg + 0.1·L_cls (per-token means; summed over `unroll` passes, `losses`)."""
  def loss(params):
    sums = losses(params, head, verifier, batch["inputs"], batch["weights"], key, noise, batch.get("features"),
                  unroll)
    total = (REGRESSION_WEIGHT * sums["regression"] + CLASSIFICATION_WEIGHT * sums["classification"])
    return total / jnp.maximum(sums["tokens"], 1.0), sums

  grads, sums = jax.grad(loss, has_aux=True)(state.params)
  return apply_gradients(state, grads, sums)


@functools.partial(jax.jit, static_argnames=("unroll",))
def eval_sums(params: Any, head: FeatureHead, verifier: Any, batch: dict[str, Array], unroll: int = 1
              ) -> dict[str, Array]:
  return losses(params, head, verifier, batch["inputs"], batch["weights"], None, 0.0, batch.get("features"), unroll)


def evaluate(head: FeatureHead, verifier: Any, batches, unroll: int = 1) -> dict[str, float]:
  """Per-token regression and classification losses and top-1 agreement over `batches` (with `unroll` > 1 also
  the agreement of the head's r-th draft on its own earlier ones, top1_agreement_r, and the share of positions
  whose greedy block would accept its first r drafts, chain_accepted_r: `losses`)."""
  totals: dict[str, float] = {}
  for batch in batches:
    for name, value in eval_sums(head.params, head, verifier, batch, unroll).items():
      totals[name] = totals.get(name, 0.0) + float(value)
  tokens = max(totals.pop("tokens", 0.0), 1.0)
  return {name: value / tokens for name, value in totals.items()} | {"tokens": tokens}


def train(verifier: Any, batches: Iterator[dict[str, np.ndarray]], *, steps: int, learning_rate: float = 1e-3,
          warmup_steps: int = 100, seed: int = 0, num_heads: int = 4, noise: float = NOISE,
          draft_ids: Any = None, unroll: int = 1, feature_layers: tuple[int, ...] = (),
          checkpoint_dir: str | None = None, save_every: int = 200,
          log_every: int = 100, held_out: list[dict[str, np.ndarray]] | None = None, eval_every: int = 0,
          log=print) -> tuple[FeatureHead, dict[str, Any]]:
  """A head for `verifier` trained `steps` AdamW steps on `batches` ({'inputs', 'weights'} rows, and the verifier's
  cached 'features' where a `feature_cache` gives them), drafting among `draft_ids` (a draft vocabulary; None: all
  tokens), reading the verifier's `feature_layers` beside its last hidden state (EAGLE-3's fused features: the
  batches' features, or `verifier`'s hidden states, hold them); returns it and its training record (settings, the
  last logged metrics, seconds). With `checkpoint_dir` the state is saved every `save_every` steps and a run
  resumes from the latest checkpoint there (the batches it had used skipped). With `held_out` batches and
  `eval_every` > 0 the head's top-1 agreement on them is logged every `eval_every` steps, and the record keeps that
  curve ('held_out_curve': [step, agreement] pairs, from this run's first step; the final head is returned whatever
  the curve)."""
  if steps < 1:
    raise ValueError(f"steps must be >= 1; got {steps}")
  key = jax.random.PRNGKey(seed)
  head = init(verifier, key, num_heads=num_heads, feature_layers=feature_layers).with_draft_vocabulary(draft_ids)
  tx = make_optimizer(steps, learning_rate=learning_rate, warmup_steps=min(warmup_steps, steps), decay="cosine",
                      weight_decay=0.0)
  state = TrainState.create(head.params, tx)
  checkpoints, first = None, 0
  if checkpoint_dir:
    metadata = {"head": dataclasses.asdict(head.config) | {"dtype": jnp.dtype(head.config.dtype).name,
                                                           "feature_layers": list(head.config.feature_layers)},
                "steps": steps, "learning_rate": learning_rate, "seed": seed, "unroll": unroll,
                "draft_vocabulary": None if draft_ids is None else np.asarray(draft_ids).tolist()}
    restored = checkpoint.restore_latest(checkpoint_dir, state, expected=metadata)
    if restored is not None:
      state, first = restored.state, restored.data_offset
      log(f"resumed from {checkpoint_dir} at step {first}")
      for _ in range(first):
        next(batches)
    checkpoints = checkpoint.Checkpointer(checkpoint_dir, metadata=metadata, save_every=save_every, keep=1)
  start, metrics, curve = time.monotonic(), {}, []
  try:   # a Ctrl-C still lets the save under way finish, so that a rerun resumes from it
    for step in range(first, steps):
      batch = next(batches)
      state, metrics = train_step(state, head, verifier, {k: jnp.asarray(v) for k, v in batch.items()},
                                  jax.random.fold_in(key, step), noise=noise, unroll=unroll)
      if (step + 1) % log_every == 0 or step + 1 == steps:
        metrics = {name: float(value) for name, value in metrics.items()}
        log(f"step {step + 1}/{steps}: regression {metrics['regression']:.4f} classification "
            f"{metrics['classification']:.4f} top-1 agreement {metrics['top1_agreement']:.3f}"
            + "".join(f", draft {r} {metrics[f'top1_agreement_{r}']:.3f}" for r in range(2, unroll + 1))
            + f" ({time.monotonic() - start:.0f} s)")
      if held_out and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
        agreement = evaluate(head.replace(params=state.params), verifier, held_out)["top1_agreement"]
        curve.append([step + 1, agreement])
        log(f"step {step + 1}/{steps}: held-out top-1 agreement {agreement:.3f}")
      if checkpoints is not None:
        checkpoints.save(step + 1, state, data_offset=step + 1, force=step + 1 == steps)
  finally:
    if checkpoints is not None:
      checkpoints.close()
  record = {"steps": steps, "learning_rate": learning_rate, "warmup_steps": warmup_steps, "seed": seed,
            "unroll": unroll, "draft_vocabulary": None if draft_ids is None else len(draft_ids),
            "feature_layers": list(feature_layers),
            "noise": noise, "regression_weight": REGRESSION_WEIGHT,
            "classification_weight": CLASSIFICATION_WEIGHT, "last_metrics": metrics,
            "held_out_curve": curve, "seconds": time.monotonic() - start}
  return head.replace(params=state.params), record


def draft_vocabulary(token_counts: Any, size: int, always: Iterable[int] = ()) -> np.ndarray:
  """The draft vocabulary of a head (FR-Spec): the `size` most frequent tokens by `token_counts` [V] (counts of its
  training text; ties to the lower id) together with the ids `always` (EOS, a chat's special tokens), sorted.
  ValueError for a size outside [1, V]."""
  counts = np.asarray(token_counts)
  if not 1 <= size <= counts.shape[0]:
    raise ValueError(f"a draft vocabulary's size must lie in [1, {counts.shape[0]}] (the vocabulary); got {size}")
  frequent = np.argsort(-counts, kind="stable")[:size]
  return np.unique(np.concatenate([frequent, np.asarray(list(always), np.int64)]).astype(np.int64))


def save_head(directory: str, head: FeatureHead, record: dict[str, Any] | None = None) -> str:
  """Writes directory/feature_head/ (a new directory): the parameters (orbax) and head.json (config, draft
  vocabulary and training record), into a temporary folder beside it renamed into place once complete, so an
  interrupted save leaves nothing that blocks the next. Returns the path."""
  path = os.path.join(os.path.abspath(directory), HEAD_DIRECTORY)
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; save_head writes a new directory")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{HEAD_DIRECTORY}-", dir=os.path.dirname(path))
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(os.path.join(staging, "params"), jax.device_get(head.params))
      checkpointer.wait_until_finished()
    config = dataclasses.asdict(head.config) | {"dtype": jnp.dtype(head.config.dtype).name}
    draft_ids = None if head.draft_ids is None else np.asarray(head.draft_ids).tolist()
    with open(os.path.join(staging, HEAD_JSON), "w") as f:
      json.dump({"config": config, "draft_ids": draft_ids, "training": record or {}}, f, indent=1)
    os.rename(staging, path)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return path


def load_head(directory: str) -> FeatureHead:
  """The head `save_head` wrote under directory/feature_head/ (FileNotFoundError naming the path if none)."""
  path, stored = checkpoint.read_head(directory, HEAD_DIRECTORY, HEAD_JSON, "train one with "
                                      "specdec-train --gin_file=configs/train/debian_feature_head.gin")
  config = base.current_fields(stored["config"])
  config = FeatureHeadConfig(**(config | {"dtype": jnp.dtype(config["dtype"])}))
  head = FeatureHead(params=checkpoint.restore_head_params(path, lambda key: init_from_config(config, key)),
                     config=config)
  return head.with_draft_vocabulary(stored.get("draft_ids"))


def saved_draft_vocabulary(directory: str) -> int:
  """How many token ids the head saved under directory/feature_head/ drafts among (0: the whole vocabulary), read
  from its record alone (no weights)."""
  _, stored = checkpoint.read_head(directory, HEAD_DIRECTORY, HEAD_JSON, "a feature head's export")
  return len(stored.get("draft_ids") or ())


def train_and_save(*, verifier: str, out: str, steps: int = 3000, batch_size: int = 16, seq_len: int = 128,
                   learning_rate: float = 1e-3, seed: int = 0, eval_batches: int = 20, source: str = "auto",
                   data: str = "debian", prompts: int = 2000, max_new_tokens: int = 192, draft_vocabulary_size: int = 0,
                   unroll: int = 1, feature_layers: tuple[int, ...] = (), work_dir: str | None = None,
                   corpus: str = "", command: str = "", log=print) -> str:
  """The recipe: a head for the verifier `verifier` (`loading.load_model`: an export, a GGUF file, smollm2), trained
  `steps` steps and written to `out`/feature_head/ with its training record (settings, losses, top-1 agreement with
  the verifier on `eval_batches` held-out batches, seconds, `command`). Returns the head's path.

  `data` 'debian': the local Debian tasks' training text (`tasks.prefix_lm_batches`: descriptions, synopses,
  translations; `source` as `debian.load`'s), rows of `seq_len`, features computed each step. 'self_distilled':
  `prompts` chat prompts of many kinds answered by the verifier itself (`self_distill`, up to `max_new_tokens`
  each), its features computed once and cached (`feature_cache`), all in `work_dir` (default out/self_distilled;
  every stage, training included, resumes where an interrupted run stopped); the last 5 % of the rows are held out.
  `corpus`: a folder of prompts and answers written before (`self_distill.export_corpus`; a path, or a name under
  the shipped data/self_distilled/) that a fresh `work_dir` starts from.
  `draft_vocabulary_size` k > 0: the head drafts among the k most frequent tokens of its training text, EOS and the
  vocabulary's special tokens (`draft_vocabulary`). `unroll` > 1: EAGLE-3's training-time test over that many
  drafts (`losses`); the held-out record gives the agreement of the first EVAL_UNROLL drafts either way.
  `feature_layers`: the head reads those layers' outputs beside the last hidden state (EAGLE-3's fused features,
  cached apart from the plain ones; later drafts then need unroll ≥ 2 to learn to read the head's predictions)."""
  from specdec.data import load_vocabulary
  from specdec.training import feature_cache, self_distill
  from specdec.data.pretrained import resolve
  from specdec.data.shipped import find
  from specdec.training.loading import load_model
  if corpus and data != "self_distilled":
    raise ValueError(f"corpus {corpus!r} seeds self-distilled data only; data is {data!r}")
  start = time.monotonic()
  model = load_model(verifier).with_feature_layers(tuple(feature_layers))
  if os.path.exists(os.path.join(os.path.abspath(out), HEAD_DIRECTORY)):
    raise FileExistsError(f"{os.path.join(out, HEAD_DIRECTORY)} exists; give another out directory")
  checkpoint_dir, vocab_path = None, None
  if data == "debian":
    batches = tasks.prefix_lm_batches("train", batch_size=batch_size, seq_len=seq_len, vocab_size=model.vocab_size,
                                      seed=seed, length_window=8, source=source)
    validation = tasks.prefix_lm_batches("validation", batch_size=batch_size, seq_len=seq_len,
                                         vocab_size=model.vocab_size, seed=0, length_window=8, source=source)
    held_out = [next(validation) for _ in range(eval_batches)]
    counting = tasks.prefix_lm_batches("train", batch_size=batch_size, seq_len=seq_len, vocab_size=model.vocab_size,
                                       seed=seed + 1, length_window=8, source=source)
    counts = np.bincount(np.concatenate([b["inputs"][b["weights"] > 0] for b in (next(counting) for _ in range(200))]),
                         minlength=model.vocab_size)
    vocab = load_vocabulary()
  elif data == "self_distilled":
    work_dir = work_dir or os.path.join(out, "self_distilled")
    vocab_path = resolve(verifier)
    vocab = load_vocabulary(vocab_path)
    if corpus:
      log(f"corpus: {self_distill.seed_from(find(corpus, 'data/self_distilled'), work_dir)} answers in {work_dir}")
    self_distill.write_prompts(work_dir, model, vocab, n=prompts, seed=seed, source=source, log=log)
    responses = self_distill.write_responses(work_dir, model, vocab, n=prompts, max_new_tokens=max_new_tokens,
                                             seed=seed, log=log)
    shards = feature_cache.load_shards(feature_cache.write_features(work_dir, model, responses, log=log))
    rows = [(s, r) for s, shard in enumerate(shards) for r in range(shard["tokens"].shape[0])]
    cut = len(rows) - max(1, len(rows) // 20)
    batches = feature_cache.cached_batches(shards, batch_size=batch_size, seed=seed, rows_of=rows[:cut])
    held = feature_cache.cached_batches(shards, batch_size=min(batch_size, len(rows) - cut), seed=0,
                                        rows_of=rows[cut:])
    held_out = [next(held) for _ in range(max(1, min(eval_batches, (len(rows) - cut) // batch_size)))]
    counts = np.bincount(np.concatenate([r["response_ids"] for r in responses]), minlength=model.vocab_size)
    # A head reading fused features checkpoints apart (checkpoints_l2_15/, beside its features_l2_15/).
    layers_suffix = feature_cache.folder_name(model)[len(feature_cache.FEATURES):]
    checkpoint_dir = os.path.join(os.path.abspath(work_dir), "checkpoints" + layers_suffix)
  else:
    raise ValueError(f"data must be 'debian' or 'self_distilled'; got {data!r}")
  draft_ids = None
  if draft_vocabulary_size:
    draft_ids = draft_vocabulary(counts[:model.vocab_size], draft_vocabulary_size, always=vocab.special_ids)
  head, record = train(model, batches, steps=steps, learning_rate=learning_rate, seed=seed, draft_ids=draft_ids,
                       unroll=unroll, feature_layers=tuple(feature_layers), checkpoint_dir=checkpoint_dir,
                       held_out=held_out, eval_every=EVAL_EVERY, log=log)
  record["validation"] = evaluate(head, model, held_out, unroll=max(unroll, EVAL_UNROLL))
  record.update(verifier=os.path.normpath(verifier), data=data, batch_size=batch_size, seq_len=seq_len,
                prompts=prompts if data == "self_distilled" else None, corpus=corpus or None, command=command,
                backend=jax.default_backend(), wall_seconds=time.monotonic() - start)
  path = save_head(out, head, record)
  log(f"validation: {json.dumps(record['validation'])} -> {path}")
  return path
