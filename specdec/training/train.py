"""Training (layer 4): optax optimizers, jitted train/eval steps on a `TrainState`, the training loop.

Laid out like flax `examples/lm1b/train.py`: the step functions are pure and jitted once; all that
training changes lives in one pytree (`TrainState`), which is also what a checkpoint holds.

Loss convention (decoder-only LM, teacher forcing). A batch is
  {'inputs': [B, L] int32 tokens, 'weights': [B, L] float}
and `model.logits(inputs)[:, t]` predicts `inputs[:, t+1]` (the model does not shift its inputs), so the
loss is the cross-entropy of logits[:, :-1] against targets inputs[:, 1:], weighted by weights[:, 1:]:
`weights[b, t]` says whether token t of row b counts as a target. Padding and the prompt of a prefix-LM
example ("summarize: … synopsis:") get weight 0; weights[:, 0] is never used (nothing predicts the first
token). The model has no segment ids: packed documents attend to the ones before them in their row, and
a document's first token is predicted from them unless its weight is 0.

Encoder-decoder models (T5) take the same loss on their decoder tokens: a batch also carries
'encoder_inputs' [B, L_enc] int32 and 'encoder_lengths' [B] (row b's encoder input is
encoder_inputs[b, :encoder_lengths[b]]), and 'inputs' are the decoder tokens, T5's start token 0 then the
target and eos (weights 0 on the start token and padding); `model.logits` gets the encoder input too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import zlib
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import scipy.special
from flax import struct

from specdec import models
from specdec.models import partitioning
from specdec.training import checkpoint, t5x_checkpoints

Array = jax.Array
Batch = dict[str, Any]  # 'inputs' [B, L] int32, 'weights' [B, L] float (+ 'encoder_inputs', 'encoder_lengths')
# data_source(split, *, batch_size, seq_len, vocab_size, start) -> the batches start, start+1, … of a
# split ('train' or 'validation'), each batch a pure function of its index, so resuming is `start=offset`.
DataSource = Callable[..., Iterator[Batch]]


@struct.dataclass
class TrainState:
  """What a training step changes: the step count, float32 parameters and the optimizer state."""
  step: Array
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = struct.field(pytree_node=False)

  @classmethod
  def create(cls, params: Any, tx: optax.GradientTransformation) -> TrainState:
    """Step 0: a copy of `params` and `tx`'s initial state."""
    # A copy: `train_step` donates the state's buffers, and the model's own parameters must outlive them.
    params = jax.tree.map(jnp.copy, params)
    state = cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), tx=tx)
    # Committed to the default device, as a restored checkpoint is: jit keys on commitment, and a fresh
    # and a resumed state then share one compiled step.
    return jax.device_put(state, jax.devices()[0])


def learning_rate_schedule(learning_rate: float, warmup_steps: int, decay: str,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then 'rsqrt' (lm1b: lr·√(w / (s + w)), s counted from the
  end of warmup), 'cosine' (to 0 at `total_steps`) or 'constant' (T5X's fine-tuning schedule)."""
  if decay == "rsqrt":
    shift = max(warmup_steps, 1)
    # join_schedules evaluates every piece at every step: clamp the counts before the boundary.
    after = lambda count: learning_rate * jnp.sqrt(shift / (jnp.maximum(count, 0) + shift))
  elif decay == "cosine":
    after = optax.cosine_decay_schedule(learning_rate, max(total_steps - warmup_steps, 1))
  elif decay == "constant":
    after = optax.constant_schedule(learning_rate)
  else:
    raise ValueError(f"decay must be 'rsqrt', 'cosine' or 'constant'; got {decay!r}")
  if warmup_steps == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), after], [warmup_steps])


def _decay_mask(params: Any) -> Any:
  # Decoupled weight decay on matrices and embeddings only, not on biases or LayerNorm scales.
  return jax.tree.map(lambda p: p.ndim > 1, params)


def _scaled_weight_decay(schedule: optax.Schedule, rate: float) -> optax.GradientTransformation:
  """Adds −schedule(t)·rate·p to the updates of `_decay_mask`'s parameters: AdamW's decoupled weight
  decay, which scales with the learning rate (optax.adafactor's weight_decay_rate does not)."""
  def init_fn(params):
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params):
    step_size = schedule(state.count) * rate
    updates = jax.tree.map(lambda u, p, decayed: u - step_size * p if decayed else u,
                           updates, params, _decay_mask(params))
    return updates, optax.ScaleByScheduleState(count=optax.safe_int32_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(total_steps: int, *, name: str = "adamw", learning_rate: float = 0.0016,
                   warmup_steps: int = 1000, decay: str = "rsqrt",
                   weight_decay: float = 0.1) -> optax.GradientTransformation:
  """AdamW (lm1b's β1 = 0.9, β2 = 0.98, ε = 1e-9) or Adafactor (optax defaults; its learning rate is
  relative to each parameter's scale), with `learning_rate_schedule`'s warmup and decay. Both decay
  matrices and embeddings by learning_rate(t)·weight_decay of their value per step."""
  return _make_optimizer(total_steps, name, learning_rate, warmup_steps, decay, weight_decay)


# Memoised: a transformation is stateless, and `train_step` holds it as static data of the state, so
# equal settings sharing one object compile the step once instead of once per call (resumes, sweeps).
@functools.cache
def _make_optimizer(total_steps: int, name: str, learning_rate: float, warmup_steps: int, decay: str,
                    weight_decay: float) -> optax.GradientTransformation:
  schedule = learning_rate_schedule(learning_rate, warmup_steps, decay, total_steps)
  if name == "adamw":
    return optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=weight_decay, mask=_decay_mask)
  if name == "adafactor":
    if not weight_decay:
      return optax.adafactor(schedule)
    return optax.chain(optax.adafactor(schedule), _scaled_weight_decay(schedule, weight_decay))
  raise ValueError(f"optimizer name must be 'adamw' or 'adafactor'; got {name!r}")


def _logits(model: Any, params: Any, batch: Batch) -> Array:
  """Teacher-forced logits [B, L, V] of a batch's 'inputs', given its encoder input if it has one."""
  model = model.replace(params=params)
  if "encoder_inputs" in batch:
    return model.logits(batch["inputs"], encoder_tokens=batch["encoder_inputs"],
                        encoder_lengths=batch.get("encoder_lengths"))
  return model.logits(batch["inputs"])


def _weighted_sums(logits: Array, batch: Batch, label_smoothing: float | Array) -> dict[str, Array]:
  """Σ w·loss, Σ w·correct and Σ w over the targets inputs[:, 1:] of logits[:, :-1] (module docstring).

  With label smoothing ε the target is (1 − ε) on the token and ε/(V − 1) elsewhere, and the loss is
  the cross-entropy minus that target's own entropy (lm1b), so a perfect fit scores 0; ε = 0 is the
  plain −log p(token).
  """
  logits, targets = logits[:, :-1], batch["inputs"][:, 1:]
  weights = jnp.asarray(batch["weights"], jnp.float32)[:, 1:]
  vocab_size = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab_size - 1)
  entropy = -(jax.scipy.special.xlogy(confidence, confidence)
              + (vocab_size - 1) * jax.scipy.special.xlogy(low, low))
  loss = -((confidence - low) * target_log_probs + low * jnp.sum(log_probs, axis=-1)) - entropy
  correct = jnp.argmax(logits, axis=-1) == targets
  return {"loss": jnp.sum(weights * loss), "correct": jnp.sum(weights * correct), "tokens": jnp.sum(weights)}


def _per_token(total: Array, tokens: Array) -> Array:
  # A batch with no target tokens contributes 0, not NaN.
  return total / jnp.where(tokens > 0, tokens, 1.0)


@jax.jit
def eval_step(params: Any, batch: Batch, model: Any) -> dict[str, Array]:
  """Weighted sums 'loss' (plain cross-entropy), 'correct', 'tokens' of one batch; `evaluate` adds them."""
  return _weighted_sums(_logits(model, params, batch), batch, 0.0)


def apply_gradients(state: TrainState, grads: Any, sums: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer update of `state` with `grads`, and its metrics: the per-token means of the weighted
  `sums` (every key but 'tokens', which holds the target count), 'tokens' and 'grad_norm' (the gradients'
  global norm). The step of every training loop here (next-token, distillation, SpecDec++'s head)."""
  updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
  state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                        opt_state=opt_state)
  metrics = {name: _per_token(total, sums["tokens"]) for name, total in sums.items() if name != "tokens"}
  return state, {**metrics, "tokens": sums["tokens"], "grad_norm": optax.global_norm(grads)}


# Donating the state lets XLA update parameters and optimizer moments in place.
@functools.partial(jax.jit, donate_argnums=0)
def train_step(state: TrainState, batch: Batch, model: Any, label_smoothing: float | Array = 0.0
               ) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer step on the weighted next-token loss (module docstring). `model` supplies the
  architecture; its own parameters are not used. The input state is donated (invalid afterwards).
  Returns the new state and metrics: per-token 'loss', 'accuracy' ('correct' summed), target 'tokens',
  'grad_norm'."""
  def loss_fn(params):
    sums = _weighted_sums(_logits(model, params, batch), batch, label_smoothing)
    return _per_token(sums["loss"], sums["tokens"]), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  state, metrics = apply_gradients(state, grads, sums)
  metrics["accuracy"] = metrics.pop("correct")
  return state, metrics


DISTILL_LOSSES = ("kl", "tv")


def _distill_sums(logits: Array, teacher_logits: Array, batch: Batch, loss: str) -> dict[str, Array]:
  """Token-level distillation of a drafter q on a verifier p (DistillSpec), weighted sums over the targets.

  'loss' is `loss` per target position: forward KL(p ‖ q) = Σ p (log p − log q), or the total variation
  TV(p, q) = ½ Σ |p − q| = 1 − Σ min(p, q), one minus the probability that speculative sampling at
  temperature 1 accepts q's draft (Leviathan et al., Thm 3.5), so it bounds acceptance directly.
  Also summed whatever the loss: 'kl', 'acceptance' (Σ min(p, q)), 'agreement' (argmax q = argmax p: a
  greedy draft accepted), 'correct' (argmax q = the data's token), 'tokens'.
  """
  if loss not in DISTILL_LOSSES:
    raise ValueError(f"distill loss must be one of {DISTILL_LOSSES}; got {loss!r}")
  log_q = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  log_p = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits[:, :-1].astype(jnp.float32)))
  p, q = jnp.exp(log_p), jnp.exp(log_q)
  weights = jnp.asarray(batch["weights"], jnp.float32)[:, 1:]
  kl = jnp.sum(p * (log_p - log_q), axis=-1)
  acceptance = jnp.sum(jnp.minimum(p, q), axis=-1)
  agreement = jnp.argmax(log_q, axis=-1) == jnp.argmax(log_p, axis=-1)
  correct = jnp.argmax(log_q, axis=-1) == batch["inputs"][:, 1:]
  per_position = kl if loss == "kl" else 1.0 - acceptance
  weighted = lambda x: jnp.sum(weights * x)
  return {"loss": weighted(per_position), "kl": weighted(kl), "acceptance": weighted(acceptance),
          "agreement": weighted(agreement), "correct": weighted(correct), "tokens": jnp.sum(weights)}


@functools.partial(jax.jit, donate_argnums=0, static_argnames="loss")
def distill_step(state: TrainState, batch: Batch, model: Any, teacher: Any, loss: str = "kl"
                 ) -> tuple[TrainState, dict[str, Array]]:
  """One optimizer step of the student `model` (parameters in `state`) towards the frozen `teacher`'s
  next-token distributions on the batch's target positions (`_distill_sums`; `loss` 'kl' or 'tv').
  The state is donated. Metrics: per-token 'loss', 'kl', 'acceptance', 'agreement', 'correct', 'tokens',
  'grad_norm'."""
  teacher_logits = _logits(teacher, teacher.params, batch)

  def loss_fn(params):
    sums = _distill_sums(_logits(model, params, batch), teacher_logits, batch, loss)
    return _per_token(sums["loss"], sums["tokens"]), sums

  grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
  return apply_gradients(state, grads, sums)


@functools.partial(jax.jit, static_argnames="loss")
def distill_eval_step(params: Any, batch: Batch, model: Any, teacher: Any, loss: str = "kl") -> dict[str, Array]:
  """`_distill_sums` of one batch plus the plain cross-entropy sum 'ce' of the student."""
  logits = _logits(model, params, batch)
  sums = _distill_sums(logits, _logits(teacher, teacher.params, batch), batch, loss)
  return {**sums, "ce": _weighted_sums(logits, batch, 0.0)["loss"]}


def evaluate(model: Any, params: Any, batches: Iterable[Batch], *, teacher: Any = None) -> dict[str, float]:
  """Per-token cross-entropy 'loss', 'accuracy' and 'perplexity' = exp(loss) over all target tokens of
  `batches` (weighted as in training), and their number 'tokens'. With a `teacher` (a distillation run),
  also the per-token 'kl' = KL(p_teacher ‖ q), 'acceptance' = Σ min(p, q) and greedy 'agreement'
  (`_distill_sums`)."""
  totals: dict[str, float] = {}
  for batch in batches:
    sums = eval_step(params, batch, model) if teacher is None else distill_eval_step(params, batch, model, teacher)
    for name, value in jax.device_get(sums).items():
      totals[name] = totals.get(name, 0.0) + float(value)
  if totals.get("tokens", 0.0) <= 0:
    raise ValueError("evaluate: the batches hold no target tokens (all weights are 0)")
  tokens = totals.pop("tokens")
  if teacher is not None:
    totals["loss"] = totals.pop("ce")
  result = {name: total / tokens for name, total in totals.items()}
  result["accuracy"] = result.pop("correct")
  return {**result, "perplexity": float(np.exp(result["loss"])), "tokens": tokens}


@dataclasses.dataclass(frozen=True)
class MarkovChain:
  """A random first-order Markov chain over a (small) vocabulary, the synthetic training data: each row
  of `transitions` [V, V] is drawn from Dirichlet(concentration), the first token from the stationary law.

  Its next-token loss floor is the entropy rate Σ_i π_i H(T_i); a model that ignores context can do no
  better than the unigram entropy H(π).
  """
  transitions: np.ndarray

  @classmethod
  def random(cls, vocab_size: int, seed: int, concentration: float) -> MarkovChain:
    rng = np.random.default_rng(seed)
    return cls(rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size))

  @functools.cached_property
  def stationary(self) -> np.ndarray:
    """π with π = π T, by power iteration from the uniform law."""
    pi = np.full(len(self.transitions), 1.0 / len(self.transitions))
    for _ in range(10_000):
      pi, previous = pi @ self.transitions, pi
      if np.abs(pi - previous).max() < 1e-13:
        break
    return pi / pi.sum()

  @property
  def unigram_entropy(self) -> float:
    """H(π) in nats."""
    return float(_entropy(self.stationary))

  @property
  def entropy_rate(self) -> float:
    """Σ_i π_i H(T_i) in nats."""
    return float(self.stationary @ _entropy(self.transitions))

  def sample(self, rng: np.random.Generator, batch_size: int, seq_len: int) -> np.ndarray:
    """Sequences [batch_size, seq_len] int32, by inverse-CDF sampling one position at a time."""
    vocab_size = len(self.transitions)
    cdf = np.cumsum(self.transitions, axis=1)
    tokens = np.empty((batch_size, seq_len), np.int32)
    tokens[:, 0] = rng.choice(vocab_size, size=batch_size, p=self.stationary)
    uniforms = rng.random((batch_size, seq_len - 1))
    for t in range(1, seq_len):
      below = (cdf[tokens[:, t - 1]] < uniforms[:, t - 1, None]).sum(axis=1)
      tokens[:, t] = np.minimum(below, vocab_size - 1)   # a CDF ending just below 1 must not overflow
    return tokens


def _entropy(probs: np.ndarray) -> np.ndarray:
  return scipy.special.entr(probs).sum(axis=-1)


def markov_batches(split: str, *, batch_size: int, seq_len: int, vocab_size: int, start: int = 0,
                   seed: int = 0, concentration: float = 0.1) -> Iterator[Batch]:
  """A `DataSource` of `MarkovChain.random(vocab_size, seed, concentration)` sequences, all weights 1.

  Batch i of a split is drawn from its own generator seeded by (seed, split, i): splits share the chain
  but not the samples, and fast-forwarding to `start` costs nothing. Holds a [V, V] matrix: small V only.
  """
  chain = MarkovChain.random(vocab_size, seed, concentration)
  split_id = zlib.crc32(split.encode())
  weights = np.ones((batch_size, seq_len), np.float32)
  for index in itertools.count(start):
    rng = np.random.default_rng([seed, split_id, index])
    yield {"inputs": chain.sample(rng, batch_size, seq_len), "weights": weights}


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train_and_evaluate(*, model_dir: str | None, preset: str = "tiny", vocab_size: int = 32,
                       max_length: int = 512, seed: int = 0, data_source: DataSource = markov_batches,
                       batch_size: int = 8, seq_len: int = 32, num_steps: int = 300,
                       optimizer: Callable[..., optax.GradientTransformation] = make_optimizer,
                       label_smoothing: float = 0.0, log_every: int = 50, eval_every: int = 100,
                       eval_batches: int = 4, save_every: int = 100, keep_checkpoints: int = 3,
                       init_from: str | None = None, init_from_t5x: str | None = None,
                       teacher: str | None = None, distill_loss: str = "kl",
                       mesh_shape: tuple[int, int] | None = None) -> tuple[TrainState, dict[str, float]]:
  """Trains `models.build(preset, …)` for `num_steps` steps, resuming from `model_dir`'s latest checkpoint.

  `optimizer(total_steps=num_steps)` makes the optax transformation. Every `log_every` steps one line
  (step, loss, accuracy, tokens/s, ETA); every `eval_every` steps and at the end, `evaluate` on the first
  `eval_batches` validation batches. With a `model_dir`, a checkpoint (state, data offset, model and data
  description) every `save_every` steps and at the end, the last `keep_checkpoints` kept; a checkpoint
  of another model, optimizer or batch shape there raises `checkpoint.CheckpointError`.
  `init_from`: an exported model directory (`save_params`) of the same preset to start from instead of a
  random initialisation; `init_from_t5x`: a T5X checkpoint (`t5x_checkpoints.load_t5x`, e.g. the public T5 v1.1
  ones) for a "t5_…" preset. `teacher`: an exported model directory; the run then distils it into the model
  (`distill_step` with `distill_loss`, label_smoothing unused) and reports acceptance and agreement.
  `mesh_shape` (data, model): train on a `partitioning.make_mesh(data, model)` over all devices (data = -1:
  all the model axis leaves), parameters and optimizer state sharded by the logical axis rules, each batch's
  rows over 'data' (the global batch is `batch_size`); the step functions are unchanged (XLA's SPMD
  partitioner), and checkpoints are written and restored sharded (orbax: each host its own shards).
  Returns the final state and evaluation metrics.
  """
  if seq_len > max_length:
    raise ValueError(f"seq_len ({seq_len}) exceeds the model's max_length ({max_length})")
  model = _initial_model(preset, vocab_size=vocab_size, seed=seed, max_length=max_length, init_from=init_from,
                         init_from_t5x=init_from_t5x)
  metadata = {"model": checkpoint.model_spec(model, preset),
              "data": {"batch_size": batch_size, "seq_len": seq_len}}
  teacher_model = None
  if teacher is not None:
    teacher_model = _teacher(teacher, distill_loss, vocab_size)
    metadata["distill"] = {"teacher": checkpoint.model_spec(teacher_model), "loss": distill_loss}
  state = TrainState.create(model.params, optimizer(total_steps=num_steps))
  place_batch = lambda batch: batch
  if mesh_shape is not None:
    mesh = partitioning.make_mesh(*mesh_shape)
    model, state = partitioning.shard_model(model, mesh), partitioning.shard_like(state, state.params, mesh)
    place_batch = functools.partial(partitioning.shard_batch, mesh=mesh)
  data_offset, checkpoints = 0, None
  if model_dir is not None:
    state, data_offset = _resumed(model_dir, state, metadata)
    checkpoints = checkpoint.Checkpointer(model_dir, metadata=metadata, save_every=save_every,
                                          keep=keep_checkpoints)

  def run_eval(step: int) -> dict[str, float]:
    batches = data_source("validation", batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size, start=0)
    return _evaluate_and_print(model, state.params, map(place_batch, itertools.islice(batches, eval_batches)),
                               teacher_model, step)

  step = first_step = int(state.step)
  batches = data_source("train", batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size, start=data_offset)
  window = _LogWindow(first_step)
  try:
    for step in range(first_step + 1, num_steps + 1):
      batch = place_batch(next(batches))
      if teacher_model is None:
        state, metrics = train_step(state, batch, model, label_smoothing)
      else:
        state, metrics = distill_step(state, batch, model, teacher_model, distill_loss)
      data_offset += 1
      window.add(metrics, batch["inputs"].size)   # a length-bucketed source cuts rows to less than seq_len
      if step % log_every == 0 or step == num_steps:
        shown = ["loss", "accuracy"] if teacher_model is None else ["loss", "kl", "acceptance", "agreement"]
        print(window.line(step, num_steps, shown), flush=True)
        window = _LogWindow(step)
      if eval_every and step % eval_every == 0 and step != num_steps:
        run_eval(step)
      if checkpoints is not None:
        checkpoints.save(step, state, data_offset=data_offset, force=step == num_steps)
  finally:
    if checkpoints is not None:
      checkpoints.close()
  return state, run_eval(step)


def _initial_model(preset: str, *, vocab_size: int, seed: int, max_length: int, init_from: str | None,
                   init_from_t5x: str | None) -> Any:
  """`models.build(preset, …)`, its weights those of an export (`init_from`) or of a T5X checkpoint
  (`init_from_t5x`, a T5 preset) when given."""
  if init_from is not None and init_from_t5x is not None:
    raise ValueError("give init_from or init_from_t5x, not both")
  family = models.families.for_preset(preset)
  if init_from_t5x is not None and family.name != "t5":
    raise ValueError(f"init_from_t5x needs a T5 preset ('t5_…'); {preset!r} is of family {family.name!r}")
  model = models.build(preset, vocab_size=vocab_size, seed=seed, max_length=max_length)
  if init_from is not None:
    model = models.with_params(model, checkpoint.load_export(init_from).params)
  if init_from_t5x is not None:
    model = models.with_params(model, t5x_checkpoints.load_t5x(init_from_t5x, model.config).params)
  return model


def _resumed(model_dir: str, state: TrainState, metadata: dict[str, Any]) -> tuple[TrainState, int]:
  """(state, data offset) of `model_dir`'s latest checkpoint (`checkpoint.restore_latest`, which checks
  `metadata`), else `state` at offset 0."""
  restored = checkpoint.restore_latest(model_dir, state, expected=metadata)
  if restored is None:
    return state, 0
  print(f"resumed from {model_dir} at step {int(restored.state.step)}, data offset {restored.data_offset}", flush=True)
  return restored.state, restored.data_offset


def _teacher(teacher: str, distill_loss: str, vocab_size: int) -> Any:
  """The exported model a run distils from, checked against the student's loss and vocabulary."""
  if distill_loss not in DISTILL_LOSSES:
    raise ValueError(f"distill_loss must be one of {DISTILL_LOSSES}; got {distill_loss!r}")
  teacher_model = checkpoint.load_export(teacher)
  if teacher_model.vocab_size != vocab_size:
    raise ValueError(f"teacher {teacher} has vocab_size {teacher_model.vocab_size}; the student has {vocab_size}")
  return teacher_model


def _evaluate_and_print(model: Any, params: Any, batches: Iterable[Batch], teacher: Any, step: int
                        ) -> dict[str, float]:
  """`evaluate` on `batches`, printed as one line for `step`."""
  result = evaluate(model, params, batches, teacher=teacher)
  distilled = "".join(f" | {name} {result[name]:.4f}" for name in ("kl", "acceptance", "agreement") if name in result)
  print(f"eval step {step}: loss {result['loss']:.4f} | acc {result['accuracy']:.4f} | "
        f"ppl {result['perplexity']:.3f}{distilled}", flush=True)
  return result


@dataclasses.dataclass
class _LogWindow:
  """The steps since the last log line (after `first_step`): their metrics, left on the device until the line
  (no host round trip per step), and the token positions they trained on."""
  first_step: int
  start: float = dataclasses.field(default_factory=time.perf_counter)
  metrics: list[dict[str, Array]] = dataclasses.field(default_factory=list)
  positions: int = 0

  def add(self, metrics: dict[str, Array], positions: int) -> None:
    self.metrics.append(metrics)
    self.positions += positions

  def line(self, step: int, num_steps: int, shown: list[str]) -> str:
    """The window's log line: step s/n, each `shown` metric's token-weighted mean, tokens/s and the ETA."""
    window = jax.device_get(self.metrics)
    elapsed, done = time.perf_counter() - self.start, step - self.first_step
    tokens = sum(m["tokens"] for m in window)
    mean = lambda name: sum(m[name] * m["tokens"] for m in window) / max(tokens, 1e-9)
    return (f"step {step}/{num_steps} | " + " | ".join(f"{name} {mean(name):.4f}" for name in shown)
            + f" | {self.positions / elapsed:,.0f} tok/s | ETA {_duration(elapsed / done * (num_steps - step))}")
