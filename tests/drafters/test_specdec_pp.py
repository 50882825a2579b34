"""SpecDec++: the stopping rule never changes the output (greedy ≡ the verifier's greedy at B = 1 and 8,
ragged; T = 1: the verifier's sequence law, by chi-square) for any head, random ones included; the head
decides the draft lengths; labels are the exact acceptance probabilities; a trained head beats the
constant prediction on held-out positions; export round trip."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, models, sampling
from specdec.data import tasks
from specdec.models.acceptance_head import AcceptanceHead, HeadConfig, init_head
from specdec.training import acceptance
from tests.stats import assert_law, sequence_codes, sequence_law
from tests.toy_models import PositionalTrigram, tiny_pair


def _head(drafter, *, seed=0, bias=None, depth=1):
  head = init_head(HeadConfig(drafter.config.embed_dim, depth=depth), jax.random.PRNGKey(seed))
  if bias is not None:   # a head that always predicts sigmoid(bias)
    params = jax.tree.map(jnp.zeros_like, head.params)
    params["readout"]["bias"] = jnp.full((1,), bias)
    head = head.replace(params=params)
  return head


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_specdec_pp_equals_the_verifiers_greedy(batch):
  drafter, verifier = tiny_pair(12, 96)
  rng = np.random.default_rng(batch)
  prompts = jnp.asarray(rng.integers(0, 12, (batch, 10)), jnp.int32)
  lengths = jnp.asarray(rng.integers(3, 11, batch), jnp.int32)
  kw = dict(temperature=0.0, max_new_tokens=20, eos_id=None)
  want = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, lengths, method="autoregressive", **kw)
  headed = decoding.ModelDrafter(drafter, head=_head(drafter, seed=batch))
  for threshold in (0.2, 0.6, 1.0):
    got = decoding.generate(jax.random.PRNGKey(0), headed, verifier, prompts, lengths, method="specdec_pp",
                            stop_threshold=threshold, max_gamma=5, **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_specdec_pp_sampling_keeps_the_verifiers_sequence_law():
  """V = 4, 3 new tokens, T = 1, a random head whose stops vary: the law is Π_t p_t (chi-square)."""
  vocab, n_new, samples = 4, 3, 60_000
  drafter, verifier = tiny_pair(vocab, 16)
  prompt = [1, 2, 1]
  prompts = jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, 3))
  headed = decoding.ModelDrafter(drafter, head=_head(drafter, seed=3, depth=0))
  out = decoding.generate(jax.random.PRNGKey(3), headed, verifier, prompts, method="specdec_pp",
                          stop_threshold=0.5, max_gamma=3, temperature=1.0, max_new_tokens=n_new, eos_id=None)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new), what="specdec_pp")
  assert len(np.unique(np.asarray(out.stats.drafted))) > 2           # blocks of different lengths occurred


@pytest.mark.parametrize("bias, threshold, drafts", [(-10.0, 0.5, 1), (10.0, 0.5, 4), (0.0, 0.3, 1),
                                                     (0.0, 0.8, 3)])
def test_the_head_decides_the_draft_length(bias, threshold, drafts):
  """P̂ ≡ σ(bias): drafting stops after the first draft i with 1 − P̂^i > h (or at max_gamma = 4)."""
  drafter, verifier = tiny_pair(12, 96)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, 12, (1, 8)), jnp.int32)
  headed = decoding.ModelDrafter(drafter, head=_head(drafter, bias=bias))
  out = decoding.generate(jax.random.PRNGKey(0), headed, verifier, prompts, method="specdec_pp",
                          stop_threshold=threshold, max_gamma=4, temperature=0.0, max_new_tokens=24, eos_id=None)
  assert int(out.stats.drafted[0]) == drafts * int(out.stats.verifier_calls[0])
  # A block that stops early made the call that decided it; a block of max_gamma drafts calls on its last
  # draft only if every draft was accepted (the call then puts it in the drafter's cache).
  calls, rejected = int(out.stats.verifier_calls[0]), int(out.stats.rejected[0])
  assert int(out.stats.drafter_calls[0]) == drafts * calls + (calls if drafts < 4 else calls - rejected)


def test_specdec_pp_refuses_a_drafter_without_head_and_bad_thresholds():
  drafter, verifier = tiny_pair(12, 96)
  prompts = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="acceptance head"):
    decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, method="specdec_pp", max_new_tokens=4)
  with pytest.raises(ValueError, match="stop_threshold"):
    decoding.generate(jax.random.PRNGKey(0), decoding.ModelDrafter(drafter, head=_head(drafter)), verifier,
                      prompts, method="specdec_pp", stop_threshold=1.5, max_new_tokens=4)


def _split(vocab, n, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (n, 32)).astype(np.int32)
  return tasks.Tokenized(tokens=tokens, prompt_lengths=np.full(n, 8, np.int32), lengths=np.full(n, 32, np.int32),
                         records=())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_labels_are_the_exact_acceptance_probabilities(temperature):
  drafter, verifier = tiny_pair(12, 96)
  split = _split(12, 4, 0)
  s = sampling.Sampling(temperature)
  rows = acceptance.label_rows(drafter, verifier, split, key=jax.random.PRNGKey(0), sampling=s, batch_size=4)
  _, q = s.checked().distributions(drafter.logits(jnp.asarray(split.tokens)))
  _, p = s.checked().distributions(verifier.logits(jnp.asarray(split.tokens)))
  q, p = np.asarray(q), np.asarray(p)
  b, i = np.nonzero(rows.response)
  assert np.all(i >= 8) and len(b) == 4 * 24
  x = rows.candidates[b, i]
  np.testing.assert_allclose(rows.labels[b, i], np.minimum(1.0, p[b, i - 1, x] / q[b, i - 1, x]), rtol=1e-5)
  assert np.all(q[b, i - 1, x] > 0)                                  # candidates are drafter samples
  if temperature == 0.0:
    np.testing.assert_array_equal(x, q[b, i - 1].argmax(-1))
    assert set(np.unique(rows.labels[b, i])) <= {0.0, 1.0}


def test_labels_need_a_decoder_only_drafter_with_hidden_states():
  """The head reads the drafter's hidden states: a model declaring no `feature_access` is named, before any compute."""
  _, verifier = tiny_pair(12, 96)
  with pytest.raises(ValueError, match="decoder-only drafters with hidden states .*PositionalTrigram is not one"):
    acceptance.label_rows(PositionalTrigram.random(0, 12), verifier, _split(12, 4, 0), key=jax.random.PRNGKey(0),
                          sampling=sampling.Sampling(0.0))


def test_a_trained_head_beats_the_constant_prediction_and_round_trips(tmp_path):
  """Greedy labels of a tiny pair depend on the context the drafter's hidden state encodes: on held-out
  rows the trained head's binary KL is below that of predicting the mean training label."""
  drafter, verifier = tiny_pair(12, 96)
  s = sampling.Sampling(0.0)
  train = acceptance.label_rows(drafter, verifier, _split(12, 256, 1), key=jax.random.PRNGKey(1), sampling=s)
  valid = acceptance.label_rows(drafter, verifier, _split(12, 64, 2), key=jax.random.PRNGKey(2), sampling=s)
  head, metrics = acceptance.train_head(drafter, train, valid, config=HeadConfig(drafter.config.embed_dim, depth=1),
                                        steps=300, batch_size=32, learning_rate=3e-3, log_every=300)
  assert 0.05 < metrics["mean_label"] < 0.95
  assert metrics["binary_kl"] < 0.8 * metrics["binary_kl_constant"], metrics
  acceptance.save_head(str(tmp_path), head, metadata={"validation": metrics})
  loaded = acceptance.load_head(str(tmp_path))
  hidden = jax.random.normal(jax.random.PRNGKey(0), (5, drafter.config.embed_dim))
  np.testing.assert_array_equal(np.asarray(loaded.probability(hidden)), np.asarray(head.probability(hidden)))
  assert isinstance(loaded, AcceptanceHead) and loaded.config == head.config
  with pytest.raises(FileExistsError):
    acceptance.save_head(str(tmp_path), head)
  with pytest.raises(FileNotFoundError, match="acceptance head"):
    acceptance.load_head(str(tmp_path / "nothing"))


def test_a_sweep_runs_specdec_pp_with_the_drafters_head(tmp_path):
  """The smoke sweep's tiny pair, with a head given by drafter/ModelSource.head: one record per threshold,
  the head in the run context (so a new head reruns the points); without a head the sweep says so."""
  import gin
  from specdec.evaluation import grid, sweep
  drafter = models.build("tiny", vocab_size=8192, seed=1)
  acceptance.save_head(str(tmp_path / "head"), _head(drafter, seed=1))
  # Batches of 1: the quality batches run the latency examples' program, one compilation per point, not two.
  bindings = ["Experiment.families = [@specdec_pp/Family()]", "specdec_pp/Family.params = "
              "{'stop_threshold': [0.2, 0.8], 'max_gamma': [3]}", "Experiment.n_latency_examples = 1",
              "Experiment.batch_size = 1"]

  def parse(output, *extra):
    gin.clear_config()
    try:
      return grid.parse_gin(["configs/experiments/smoke.gin"], [f"Experiment.output = '{output}'", *bindings,
                                                                 *extra])
    finally:
      gin.clear_config()

  experiment = parse(tmp_path / "with.jsonl", f"drafter/ModelSource.head = '{tmp_path / 'head'}'")
  records = sweep.run(experiment, progress=False)
  pp = [r for r in records if r["point"]["method"] == "specdec_pp"]
  assert len(pp) == 2 and all(r["counters"]["drafted"] > 0 for r in pp)
  assert "drafter_head" in sweep.context(experiment, sweep.load_workload(experiment))
  with pytest.raises(ValueError, match="acceptance head"):
    sweep.run(parse(tmp_path / "without.jsonl"), progress=False)
