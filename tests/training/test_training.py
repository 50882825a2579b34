"""Training layer: the weighted next-token loss, learning a Markov chain, exact resume, checkpoint errors,
model export, the gin entry point, and encoder-decoder (T5) training on the local seq2seq tasks."""

import functools
import gc
import itertools
import logging
import json
import os
import pathlib
import shutil
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import models, training
from specdec.data import seqio_tasks, tasks
from specdec.models import partitioning, t5
from tests.commands import load_script

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
V, L, B = 32, 32, 8
SHAPES = dict(preset="tiny", vocab_size=V, max_length=64, batch_size=B, seq_len=L)
# configs/train/tiny_synthetic.gin's optimizer: runs of equal length share one compiled step with it.
OPTIMIZER = dict(learning_rate=3e-3, warmup_steps=30, decay="cosine", weight_decay=0.1)
RESUME_STEPS, SAVE_EVERY, KILLED_AFTER = 30, 10, 25

# A damaged-checkpoint restore leaves orbax futures whose (expected) errors asyncio logs at interpreter
# exit, after pytest's summary; the tests assert those errors through CheckpointError already.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)


train_script = load_script("train")


def _run(model_dir, num_steps, data_source=training.markov_batches, **kw):
  return training.train_and_evaluate(
      model_dir=None if model_dir is None else str(model_dir), num_steps=num_steps, data_source=data_source,
      optimizer=functools.partial(training.make_optimizer, **OPTIMIZER), log_every=10, eval_every=0,
      save_every=SAVE_EVERY, **{**SHAPES, **kw})


_logits = jax.jit(lambda model, tokens: model.logits(tokens))


def _same(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """A checkpointed run of RESUME_STEPS steps without interruption: (model_dir, final state)."""
  model_dir = tmp_path_factory.mktemp("uninterrupted")
  state, _ = _run(model_dir, RESUME_STEPS)
  return model_dir, state


def _copy_latest(model_dir, tmp_path):
  copy = tmp_path / "copy"
  shutil.copytree(model_dir, copy)
  return copy, copy / str(max(int(p.name) for p in copy.iterdir() if p.name.isdigit()))


def test_schedule_is_linear_warmup_then_rsqrt_or_cosine_decay():
  rsqrt = training.learning_rate_schedule(1e-3, 10, "rsqrt", 100)
  cosine = training.learning_rate_schedule(1e-3, 10, "cosine", 100)
  for schedule in (rsqrt, cosine):
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
  np.testing.assert_allclose(rsqrt(40), 1e-3 * np.sqrt(10 / 40), rtol=1e-6)   # lm1b: lr·√(w / (s + w))
  np.testing.assert_allclose([cosine(55), cosine(100)], [5e-4, 0.0], atol=1e-9)
  with pytest.raises(ValueError, match="decay"):
    training.learning_rate_schedule(1e-3, 10, "linear", 100)
  with pytest.raises(ValueError, match="optimizer name"):
    training.make_optimizer(100, name="sgd")


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_weight_decay_removes_lr_times_rate_of_matrices_only(name):
  tx = training.make_optimizer(10, name=name, learning_rate=0.5, warmup_steps=0, decay="rsqrt", weight_decay=0.1)
  params = {"kernel": jnp.full((4, 4), 2.0), "bias": jnp.full((4,), 2.0)}
  # Zero gradients: what remains of the update is the decay.
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  np.testing.assert_allclose(updates["kernel"], -0.5 * 0.1 * 2.0, rtol=1e-6)
  np.testing.assert_allclose(updates["bias"], 0.0, atol=1e-9)


def test_adafactor_learns_markov_chain():
  chain = training.MarkovChain.random(V, seed=0, concentration=0.1)
  adafactor = functools.partial(training.make_optimizer, name="adafactor", learning_rate=0.1, warmup_steps=10,
                                decay="rsqrt", weight_decay=0.1)
  _, metrics = training.train_and_evaluate(model_dir=None, num_steps=60, optimizer=adafactor, log_every=20,
                                           eval_every=0, **SHAPES)
  assert metrics["loss"] < (chain.unigram_entropy + chain.entropy_rate) / 2


def test_markov_source_fast_forwards_to_any_batch():
  kw = dict(batch_size=B, seq_len=L, vocab_size=V)
  sixth = next(itertools.islice(training.markov_batches("train", **kw), 5, None))
  np.testing.assert_array_equal(next(training.markov_batches("train", start=5, **kw))["inputs"], sixth["inputs"])
  assert not np.array_equal(next(training.markov_batches("validation", start=5, **kw))["inputs"], sixth["inputs"])


def test_tiny_model_learns_markov_chain_below_unigram_entropy():
  chain = training.MarkovChain.random(V, seed=0, concentration=0.1)
  _, metrics = _run(None, 300)
  # A context-free model cannot beat H(π); the floor is the entropy rate (3.26 and 1.75 nats here).
  assert chain.entropy_rate - 0.15 < metrics["loss"] < (chain.unigram_entropy + chain.entropy_rate) / 2
  np.testing.assert_allclose(metrics["perplexity"], np.exp(metrics["loss"]))


def _two_steps(batch, label_smoothing=0.0):
  """The model, the state after two steps on `batch` (the warmup's learning rate is 0 at step 0), and the
  first step's metrics (at the initial parameters)."""
  model = models.build("tiny", vocab_size=V, seed=0, max_length=64)
  state = training.TrainState.create(model.params, training.make_optimizer(300, **OPTIMIZER))
  state, metrics = training.train_step(state, batch, model, label_smoothing)
  state, _ = training.train_step(state, batch, model, label_smoothing)
  return model, state, metrics


def _prefix_lm_batch():
  """Rows of a prompt (tokens 0–9), a target (10–25) and padding (26–31): only the target counts."""
  inputs = next(training.markov_batches("train", batch_size=B, seq_len=L, vocab_size=V))["inputs"].copy()
  weights = np.zeros((B, L), np.float32)
  weights[:, 10:26] = 1.0
  return {"inputs": inputs, "weights": weights}


def test_loss_is_weighted_cross_entropy_of_next_tokens():
  batch = _prefix_lm_batch()
  model, _, metrics = _two_steps(batch)
  log_probs = jax.nn.log_softmax(_logits(model, jnp.asarray(batch["inputs"])))
  # logits[:, t − 1] predicts inputs[:, t]; weights[:, t] says whether token t counts.
  targets = np.arange(10, 26)
  predicted = np.asarray(log_probs[:, targets - 1])
  expected = -np.mean(np.take_along_axis(predicted, batch["inputs"][:, targets, None], -1))
  np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
  assert float(metrics["tokens"]) == B * 16


def test_label_smoothing_loss_is_kl_to_the_smoothed_target():
  batch, eps = _prefix_lm_batch(), 0.1
  model, _, metrics = _two_steps(batch, label_smoothing=eps)
  log_probs = np.asarray(jax.nn.log_softmax(_logits(model, jnp.asarray(batch["inputs"]))), np.float64)[:, 9:25]
  soft = np.full(log_probs.shape, eps / (V - 1))
  np.put_along_axis(soft, batch["inputs"][:, 10:26, None], 1 - eps, -1)
  np.testing.assert_allclose(metrics["loss"], np.mean(np.sum(soft * (np.log(soft) - log_probs), -1)), rtol=1e-5)


def test_zero_weight_positions_change_neither_loss_nor_update():
  batch = _prefix_lm_batch()
  padded = {**batch, "inputs": batch["inputs"].copy()}
  padded["inputs"][:, 26:] = (padded["inputs"][:, 26:] + 7) % V     # other padding tokens: weight 0
  retargeted = {**batch, "inputs": batch["inputs"].copy()}
  retargeted["inputs"][:, 20] = (retargeted["inputs"][:, 20] + 7) % V  # another target: weight 1
  _, state, metrics = _two_steps(batch)
  _, padded_state, padded_metrics = _two_steps(padded)
  _, retargeted_state, retargeted_metrics = _two_steps(retargeted)
  assert _same(padded_metrics, metrics) and _same(padded_state.params, state.params)
  assert float(retargeted_metrics["loss"]) != float(metrics["loss"])
  assert not _same(retargeted_state.params, state.params)


class Killed(Exception):
  """The process dies while fetching a batch."""


def _killed_after(n_batches):
  def data_source(split, **kw):
    batches = training.markov_batches(split, **kw)
    if split != "train":
      return batches

    def dying():
      yield from itertools.islice(batches, n_batches)
      raise Killed
    return dying()
  return data_source


def test_resume_after_kill_reproduces_uninterrupted_run_bitwise(uninterrupted, tmp_path):
  reference_dir, reference = uninterrupted
  with pytest.raises(Killed):
    _run(tmp_path, RESUME_STEPS, data_source=_killed_after(KILLED_AFTER))
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [10, 20]
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), reference)
  assert training.restore_latest(str(tmp_path), abstract).data_offset == 20
  # Nothing survives in memory: the resumed run rebuilds everything and reads the checkpoint at step 20.
  resumed, _ = _run(tmp_path, RESUME_STEPS)
  assert int(resumed.step) == RESUME_STEPS
  assert _same(resumed.params, reference.params) and _same(resumed.opt_state, reference.opt_state)
  restored = training.restore_latest(str(reference_dir), abstract)
  assert restored.data_offset == RESUME_STEPS and _same(restored.state.params, reference.params)


# orbax reads arrays concurrently; after the first failure the others die unawaited, which Python reports.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate largest array file", "delete state manifest", "delete metadata"])
def test_damaged_checkpoint_raises(uninterrupted, tmp_path, damage):
  model_dir, reference = uninterrupted
  copy, step_dir = _copy_latest(model_dir, tmp_path)
  if damage == "truncate largest array file":
    victim = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size // 2)
  elif damage == "delete state manifest":
    (step_dir / "state" / "manifest.ocdbt").unlink()
  else:
    (step_dir / "meta" / "metadata").unlink()
  with pytest.raises(training.CheckpointError, match="corrupt or incomplete"):
    training.restore_latest(str(copy), reference)
  with pytest.raises(training.CheckpointError):
    _run(copy, RESUME_STEPS)
  gc.collect()   # here, where the warning filter applies, not in a later test


def test_checkpoint_of_another_preset_or_batch_shape_raises(uninterrupted, tmp_path):
  model_dir, reference = uninterrupted
  other = jax.eval_shape(functools.partial(models.build, "2m", vocab_size=V, max_length=64))
  tx = training.make_optimizer(300, **OPTIMIZER)
  other_state = jax.eval_shape(functools.partial(training.TrainState.create, tx=tx), other.params)
  with pytest.raises(training.CheckpointError, match="model.preset is 'tiny' there, '2m' here"):
    training.restore_latest(str(model_dir), other_state, expected={"model": training.model_spec(other, "2m")})
  with pytest.raises(training.CheckpointError, match="does not fit the state"):
    training.restore_latest(str(model_dir), other_state)
  copy, _ = _copy_latest(model_dir, tmp_path)
  with pytest.raises(training.CheckpointError, match="data.batch_size is 8 there, 4 here"):
    _run(copy, RESUME_STEPS, batch_size=4)


def test_exported_model_gives_identical_logits(uninterrupted, tmp_path):
  _, reference = uninterrupted
  model = models.with_params(models.build("tiny", vocab_size=V, max_length=64), reference.params)
  tokens = jnp.asarray(_prefix_lm_batch()["inputs"])
  training.save_params(str(tmp_path / "f32"), model, preset="tiny")
  loaded = training.load_model(str(tmp_path / "f32"))
  assert loaded.config == model.config
  np.testing.assert_array_equal(_logits(loaded, tokens), _logits(model, tokens))
  # A bfloat16 export loads back as float32 holding exactly the rounded values.
  rounded = model.replace(params=training.cast_params(model.params, jnp.bfloat16))
  training.save_params(str(tmp_path / "bf16"), rounded)
  loaded = training.load_model(str(tmp_path / "bf16"))
  assert _same(loaded.params, training.cast_params(rounded.params, jnp.float32))
  np.testing.assert_allclose(_logits(loaded, tokens), _logits(model, tokens), atol=0.1)
  (tmp_path / "bf16" / "model.json").unlink()
  with pytest.raises(training.CheckpointError, match="not an exported model"):
    training.load_model(str(tmp_path / "bf16"))


def test_an_export_with_the_config_fields_older_names_loads(tmp_path):
  """model.json written when the transformer's fields were emb_dim and mlp_dim (the shipped exports' names)."""
  directory = _tiny_export(tmp_path / "old")
  spec = json.loads((directory / "model.json").read_text())
  spec["emb_dim"], spec["mlp_dim"] = spec.pop("embed_dim"), spec.pop("hidden_dim")
  (directory / "model.json").write_text(json.dumps(spec))
  assert training.load_model(str(directory)).config == models.build("tiny", vocab_size=V, max_length=64).config


def _tiny_export(directory: pathlib.Path, edit=lambda params: None) -> pathlib.Path:
  """A random tiny model exported to `directory`, its parameter tree changed in place by `edit` first."""
  model = models.build("tiny", vocab_size=V, max_length=64)
  params = jax.tree.map(lambda x: x, model.params)
  edit(params)
  training.save_params(str(directory), model.replace(params=params), preset="tiny")
  return directory


def test_export_with_a_missing_unexpected_or_misshaped_tensor_raises_naming_it(tmp_path):
  def reshape_and_add(params):
    params["block_0"]["mlp"]["dense_in"]["kernel"] = params["block_0"]["mlp"]["dense_in"]["kernel"][:, :10]
    params["block_1"]["mlp"]["extra"] = params["final_norm"]["bias"]

  # orbax itself reports these as a "pytree structure error" naming no tensor.
  for directory, edit, named in [
      ("missing", lambda params: params["final_norm"].pop("bias"), "missing (1): final_norm/bias"),
      ("misshaped", reshape_and_add, "unexpected (1): block_1/mlp/extra; "
                                     "different (1): block_0/mlp/dense_in/kernel: (32, 10) there, (32, 64) here")]:
    export = _tiny_export(tmp_path / directory, edit)
    with pytest.raises(training.CheckpointError) as error:
      training.load_model(str(export))
    assert f"exported model {export} does not match its model.json: {named}" == str(error.value)


# A truncated array file fails orbax's concurrent reads; the others die unawaited, which Python reports.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("victim", ["largest array file", "_METADATA", "manifest.ocdbt"])
def test_truncated_export_raises_one_readable_line(tmp_path, victim):
  params = _tiny_export(tmp_path / "export") / "params"
  files = [p for p in params.rglob("*") if p.is_file()]
  victim = max(files, key=lambda p: p.stat().st_size) if victim == "largest array file" else params / victim
  os.truncate(victim, victim.stat().st_size // 2)
  with pytest.raises(training.CheckpointError) as error:
    training.load_model(str(tmp_path / "export"))
  message = str(error.value)
  assert message.startswith(f"exported model {tmp_path / 'export'} cannot be read, it is truncated, corrupt")
  # Not orbax's wrapper: a multi-line pybind repr of the TensorStore, or of a C++ status.
  assert "\n" not in message and "<" not in message and "Status" not in message, message
  # The reads still in flight end on tensorstore's threads, into orbax's closed event loop: here, where the
  # warning filter applies, not in a later test.
  time.sleep(0.5)
  gc.collect()


def test_gin_train_runs_tiny_synthetic_with_binding_override(tmp_path):
  gin.clear_config()
  try:
    state, metrics = train_script.main([
        "--gin_file=configs/train/tiny_synthetic.gin", f"--gin_bindings=train.num_steps = {RESUME_STEPS}",
        f"--gin_bindings=train.model_dir = '{tmp_path}'"])
  finally:
    gin.clear_config()
  assert int(state.step) == RESUME_STEPS and np.isfinite(metrics["loss"])
  assert (tmp_path / str(RESUME_STEPS)).is_dir()
  assert f"train.num_steps = {RESUME_STEPS}" in (tmp_path / "config.gin").read_text()


# --- encoder-decoder (T5) -------------------------------------------------------------------------------

# configs/train/debian_t5_drafter.gin on the shipped sample, shortened and narrowed for the CPU.
T5_STEPS = 40
T5_DATA = dict(batch_size=8, seq_len=33, encoder_len=64, source="sample")
T5_BINDINGS = [f"train.num_steps = {T5_STEPS}", "train.batch_size = 8", "train.seq_len = 33",
               "seq2seq_batches.encoder_len = 64", "seq2seq_batches.source = 'sample'",
               "make_optimizer.warmup_steps = 10", "train.log_every = 20", "train.eval_every = 0",
               "train.eval_batches = 4", "train.save_every = 20"]
_t5_logits = jax.jit(lambda model, batch: model.logits(batch["inputs"], encoder_tokens=batch["encoder_inputs"],
                                                       encoder_lengths=batch["encoder_lengths"]))


def _t5_validation_batches():
  return itertools.islice(tasks.seq2seq_batches("validation", vocab_size=8192, **T5_DATA), 4)


@pytest.fixture(scope="module")
def t5_run(tmp_path_factory):
  """The T5 drafter's gin config trained for T5_STEPS steps: (model_dir, final state, final metrics)."""
  model_dir = tmp_path_factory.mktemp("t5_drafter")
  bindings = T5_BINDINGS + [f"train.model_dir = '{model_dir}'", f"export.path = '{model_dir / 'export'}'"]
  gin.clear_config()
  try:
    state, metrics = train_script.main(["--gin_file=configs/train/debian_t5_drafter.gin",
                                        *[f"--gin_bindings={b}" for b in bindings]])
  finally:
    gin.clear_config()
  return model_dir, state, metrics


def test_t5_trains_on_the_seq2seq_mixture_and_lowers_the_validation_loss(t5_run):
  model_dir, state, metrics = t5_run
  # The run's own evaluation is on the same first validation batches.
  initial = models.build("t5_tiny", vocab_size=8192, seed=0, max_length=512)
  before = training.evaluate(initial, initial.params, _t5_validation_batches())
  assert int(state.step) == T5_STEPS and (model_dir / str(T5_STEPS)).is_dir()
  assert metrics["tokens"] == before["tokens"] > 0
  assert metrics["loss"] < before["loss"] - 1.0, (before["loss"], metrics["loss"])


def test_t5_train_step_uses_the_encoder_input():
  batch = next(tasks.seq2seq_batches("train", vocab_size=8192, **T5_DATA))
  other = {**batch, "encoder_inputs": np.roll(batch["encoder_inputs"], 1, axis=0),
           "encoder_lengths": np.roll(batch["encoder_lengths"], 1, axis=0)}
  model = models.build("t5_tiny", vocab_size=8192, seed=0, max_length=512)
  sums = training.eval_step(model.params, batch, model)
  other_sums = training.eval_step(model.params, other, model)
  assert float(sums["tokens"]) == float(other_sums["tokens"]) and float(sums["loss"]) != float(other_sums["loss"])


def test_t5_export_loads_with_identical_logits(t5_run, tmp_path):
  model_dir, state, _ = t5_run
  model = models.with_params(models.build("t5_tiny", vocab_size=8192, max_length=512), state.params)
  batch = next(_t5_validation_batches())
  training.save_params(str(tmp_path / "f32"), model, preset="t5_tiny")
  loaded = training.load_model(str(tmp_path / "f32"))
  assert isinstance(loaded, t5.T5) and loaded.config == model.config
  np.testing.assert_array_equal(_t5_logits(loaded, batch), _t5_logits(model, batch))
  # The gin run's export (bfloat16) holds exactly the rounded parameters and says what it is.
  exported = training.load_model(str(model_dir / "export"))
  assert _same(exported.params, training.cast_params(training.cast_params(state.params, jnp.bfloat16), jnp.float32))
  spec = training.model_spec(exported, "t5_tiny")
  assert spec["architecture"] == "t5" and spec["preset"] == "t5_tiny" and spec["vocab_size"] == 8192


def test_export_name_is_the_training_runs_for_an_export_directory():
  assert training.export_name("outputs/train/debian_t5_drafter/export/") == "debian_t5_drafter"
  assert training.export_name("data/models/debian_verifier") == "debian_verifier"
  assert training.export_name("/abs/run/export") == "run"


def test_exports_from_before_t5_load_as_decoder_only_models():
  """The shipped Debian pair's model.json names no architecture: it is a decoder-only transformer."""
  assert "architecture" not in (REPO_ROOT / "data/models/debian_drafter/model.json").read_text()
  model = training.load_model(str(REPO_ROOT / "data/models/debian_drafter"))
  assert isinstance(model, models.TransformerLM) and model.config.vocab_size == 8192


def _decoder_step_multiply_adds(model) -> int:
  """Multiply-adds of one cached decoder step: the decoder's matrices and the output projection, except the
  cross-attention keys and values (computed once per prompt) and the relative position table."""
  paths = [(jax.tree_util.keystr(path), leaf) for path, leaf in
           jax.tree_util.tree_flatten_with_path(model.params["decoder"])[0]]
  return sum(leaf.size for path, leaf in paths
             if leaf.ndim == 2 and "relpos_bias" not in path
             and not ("encoder_decoder_attention" in path and ("'key'" in path or "'value'" in path)))


def test_t5_pair_configs_share_the_data_and_the_verifier_step_costs_over_10x_the_drafters():
  presets = {}
  for name in ("drafter", "verifier"):
    gin.clear_config()
    try:
      train_script.parse_gin([f"configs/train/debian_t5_{name}.gin"], [])
      presets[name] = gin.query_parameter("train.preset")
      assert gin.query_parameter("train.vocab_size") == 8192 and gin.query_parameter("train.seq_len") == 129
      assert gin.query_parameter("seq2seq_batches.tasks") == ["debian_synopsis", "debian_en_de"]
    finally:
      gin.clear_config()
  assert presets == {"drafter": "t5_tiny", "verifier": "t5_25m"}
  drafter, verifier = (jax.eval_shape(functools.partial(models.build, presets[name], vocab_size=8192))
                       for name in ("drafter", "verifier"))
  assert _decoder_step_multiply_adds(verifier) > 10 * _decoder_step_multiply_adds(drafter)


# --- distillation ----------------------------------------------------------------------------------------

def _distill_first_step(student, teacher, batch, loss):
  """Metrics of the first distillation step (at the student's initial parameters)."""
  state = training.TrainState.create(student.params, training.make_optimizer(300, **OPTIMIZER))
  _, metrics = training.distill_step(state, batch, student, teacher, loss)
  return jax.device_get(metrics)


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_distillation_metrics_are_kl_acceptance_and_agreement_on_the_target_positions(loss):
  batch = _prefix_lm_batch()
  student = models.build("tiny", vocab_size=V, seed=0, max_length=64)
  teacher = models.build("tiny", vocab_size=V, seed=1, max_length=64)
  metrics = _distill_first_step(student, teacher, batch, loss)
  inputs = jnp.asarray(batch["inputs"])
  targets = np.arange(10, 26)   # weighted tokens; position t − 1 predicts token t
  log_q = np.asarray(jax.nn.log_softmax(_logits(student, inputs)), np.float64)[:, targets - 1]
  log_p = np.asarray(jax.nn.log_softmax(_logits(teacher, inputs)), np.float64)[:, targets - 1]
  p, q = np.exp(log_p), np.exp(log_q)
  kl = np.mean(np.sum(p * (log_p - log_q), -1))
  acceptance = np.mean(np.sum(np.minimum(p, q), -1))
  np.testing.assert_allclose(metrics["kl"], kl, rtol=1e-4)
  np.testing.assert_allclose(metrics["acceptance"], acceptance, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], kl if loss == "kl" else 1 - acceptance, rtol=1e-4)
  np.testing.assert_allclose(metrics["agreement"], np.mean(log_q.argmax(-1) == log_p.argmax(-1)))
  np.testing.assert_allclose(metrics["correct"], np.mean(log_q.argmax(-1) == batch["inputs"][:, targets]))
  assert 0 < acceptance < 1 and float(metrics["tokens"]) == B * 16


def test_distillation_pulls_the_student_towards_the_teacher():
  teacher = models.build("tiny", vocab_size=V, seed=1, max_length=64)
  student = models.build("tiny", vocab_size=V, seed=0, max_length=64)
  state = training.TrainState.create(student.params, training.make_optimizer(60, **{**OPTIMIZER, "warmup_steps": 5}))
  batches = training.markov_batches("train", batch_size=B, seq_len=L, vocab_size=V)
  first = None
  for _ in range(60):
    state, metrics = training.distill_step(state, next(batches), student, teacher, "kl")
    first = first or jax.device_get(metrics)
  last = jax.device_get(metrics)
  assert last["kl"] < 0.5 * first["kl"] and last["acceptance"] > first["acceptance"] + 0.05


def test_distillation_run_starts_from_an_export_and_rejects_bad_settings(tmp_path):
  teacher = models.build("tiny", vocab_size=V, seed=1, max_length=64)
  training.save_params(str(tmp_path / "teacher"), teacher, preset="tiny")
  kwargs = dict(data_source=training.markov_batches, eval_batches=1, **{**SHAPES, "seed": 0})
  # Started from the teacher's own parameters, the student is the teacher: nothing to learn.
  _, result = _run(None, 1, teacher=str(tmp_path / "teacher"), init_from=str(tmp_path / "teacher"),
                   eval_batches=1)
  assert result["kl"] < 1e-5 and result["acceptance"] > 1 - 1e-5 and result["agreement"] == 1.0
  with pytest.raises(ValueError, match="distill_loss"):
    training.train_and_evaluate(model_dir=None, num_steps=1, teacher=str(tmp_path / "teacher"), distill_loss="js",
                                **kwargs)
  with pytest.raises(ValueError, match="vocab_size"):
    training.train_and_evaluate(model_dir=None, num_steps=1, teacher=str(tmp_path / "teacher"),
                                **{**kwargs, "vocab_size": 2 * V})


def test_init_from_t5x_needs_a_t5_preset():
  """Read from the preset's family (`models.families`), before any model is built."""
  with pytest.raises(ValueError, match="init_from_t5x needs a T5 preset .*'tiny' is of family 'transformer'"):
    training.train_and_evaluate(model_dir=None, preset="tiny", init_from_t5x="/nonexistent", num_steps=1)


@functools.lru_cache(maxsize=None)
def _abstract_t5(preset: str):
  """The preset's shapes at T5's vocabulary (traced once per preset: an XL init traces for seconds)."""
  return jax.eval_shape(functools.partial(models.build, preset, vocab_size=32128))


@pytest.mark.parametrize("size, preset, mesh", [("small", "t5_small", (-1, 1)), ("large", "t5_large", (-1, 2)),
                                                ("xl", "t5_xl", (-1, 8))])
@pytest.mark.parametrize("task, steps", [("wmt", 250_000), ("xsum", 100_000), ("cnndm", 200_000)])
def test_paper_t5_configs_bind_the_papers_fine_tuning(size, preset, mesh, task, steps):
  """configs/train/paper_t5_<size>.gin + paper_task_<task>.gin: T5 v1.1 from its T5X checkpoint, a seqio
  task, Adafactor at a constant 1e-3, the paper's step budget, a mesh whose model axis divides the
  preset's sharded dimensions."""
  gin.clear_config()
  try:
    train_script.parse_gin([f"configs/train/paper_t5_{size}.gin", f"configs/train/paper_task_{task}.gin"], [])
    query = gin.query_parameter
    assert (query("train.preset"), query("train.mesh_shape"), query("train.num_steps")) == (preset, mesh, steps)
    assert query("train.init_from_t5x").endswith(f"t5_1_1_{size}/checkpoint_1000000")
    assert query("train.vocab_size") == 32128 and query("train.data_source").selector == "seqio_batches"
    assert (query("make_optimizer.name"), query("make_optimizer.decay")) == ("adafactor", "constant")
    assert "specdec_" + query("seqio_batches.task") in seqio_tasks.SEQIO_TASKS
  finally:
    gin.clear_config()
  model = _abstract_t5(preset)
  assert models.count_params(model) > 7e7
  axes = jax.tree.leaves(partitioning.logical_axes(model.params), is_leaf=lambda x: isinstance(x, tuple))
  for names, leaf in zip(axes, jax.tree.leaves(model.params)):
    for name, dim in zip(names, leaf.shape):
      assert name not in ("vocab", "mlp", "joined_kv") or dim % mesh[1] == 0, (names, leaf.shape)
