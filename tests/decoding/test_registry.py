"""The method registry is the single source of what a method is: a method defined outside the library (the
worked example of docs/extending.md) runs through `decoding.generate`, a sweep and the Pareto tables
without touching a library file; so does a drafter defined there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, sampling
from specdec.evaluation import grid, pareto, sweep
from tests import doc_examples
from tests.toy_models import tiny

V = 16


# The worked examples of docs/extending.md: a toy method (REPEAT) and a toy drafter (ConstantDrafter).
EXAMPLES = doc_examples.load("docs/extending.md")
TOY, ConstantDrafter = EXAMPLES["REPEAT"], EXAMPLES["ConstantDrafter"]


@pytest.fixture
def toy(monkeypatch):
  decoding.register(TOY)
  # How the plots label and order its series (optional: without these, unsplit and last).
  monkeypatch.setitem(pareto.SYMBOLS, "times", "×")
  monkeypatch.setitem(pareto.SERIES_ORDER, TOY.name, lambda params: -5)
  yield TOY
  del decoding.METHODS[TOY.name]


def test_a_method_registered_in_a_test_runs_through_generate(toy, eos_id=None):
  verifier = tiny(2, V, 64)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, V, (3, 5)), jnp.int32)
  greedy = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                             temperature=0.0, max_new_tokens=3, eos_id=None)
  out = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", times=2, shift=0.5,
                          max_new_tokens=6, eos_id=None)
  np.testing.assert_array_equal(out.tokens, np.repeat(np.asarray(greedy.tokens), 2, axis=1))
  np.testing.assert_array_equal(out.stats.verifier_calls, 3)
  np.testing.assert_array_equal(out.stats.generated, 6)
  # The traced parameter reuses the compiled loop; the static one does not.
  before = decoding._generate._cache_size()
  for shift in (0.1, 0.2, 0.9):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", shift=shift,
                      max_new_tokens=6, eos_id=None)
  assert decoding._generate._cache_size() == before
  decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", times=np.int64(1),
                    max_new_tokens=6, eos_id=None)
  assert decoding._generate._cache_size() == before + 1
  with pytest.raises(ValueError, match="times"):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", times=5,
                      max_new_tokens=6, eos_id=None)
  with pytest.raises(ValueError, match="shift must lie in"):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", shift=1.0,
                      max_new_tokens=6, eos_id=None)
  with pytest.raises(ValueError, match="unknown parameter.*tims"):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="repeat_toy", tims=2,
                      max_new_tokens=6, eos_id=None)


def test_a_method_registered_in_a_test_runs_through_a_sweep_and_the_tables(toy, tmp_path):
  experiment = grid.Experiment(
      drafter=grid.ModelSource(preset="tiny", seed=1, max_length=96),
      verifier=grid.ModelSource(preset="tiny", seed=2, max_length=96), task="debian_synopsis", source="sample",
      families=[grid.Family("Toy", "repeat_toy", params={"times": [1, 2], "shift": [0.0, 0.5]}),
                grid.Family("SD", "speculative", gammas=[2])],
      n_examples=2, batch_size=1, max_new_tokens=4, max_prompt_tokens=48, n_latency_examples=1,
      latency_trials=1, temperatures=[0.0], output=str(tmp_path / "results.jsonl"))
  # Batches of 1: the quality batches run the program that the latency examples (batch 1) run, one
  # compilation per point instead of two.
  with pytest.raises(ValueError, match="family 'Toy'.*times"):
    grid.expand_grid(experiment.__class__(**{**experiment.__dict__, "families": [
        grid.Family("Toy", "repeat_toy", params={"times": [0]})]}))
  points = grid.expand_grid(experiment)
  toys = [p for p in points if p.method == "repeat_toy"]
  assert sorted((p.times, p.shift) for p in toys) == [(1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5)]
  records = sweep.run(experiment, progress=False)
  by_family = {}
  for r in records:
    by_family.setdefault(r["family"], []).append(r)
  assert len(by_family["Toy"]) == 4 and all(r["counters"]["generated"] == 8 for r in by_family["Toy"])
  # The plots' symbol labels series that differ in `times`, their order puts them first.
  (group,) = pareto.group_records(records)
  names = list(group.series)
  assert names[:2] == ["Toy [×=1]", "Toy [×=2]"] and names[-1] == "SD"


def test_sampling_is_one_checked_value():
  s = sampling.Sampling(temperature=0.5, top_p=0.9, top_k=3).checked()
  assert s.temperature.dtype == jnp.float32 and s.top_k == 3
  with pytest.raises(ValueError, match="top_p"):
    sampling.Sampling(top_p=0.0).checked()
  verifier = tiny(2, V, 64)
  prompts = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="either sampling= or temperature"):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                      sampling=sampling.Sampling(), temperature=0.0, max_new_tokens=2, eos_id=None)
  a = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                        sampling=sampling.Sampling(temperature=0.7, top_p=0.8), max_new_tokens=5, eos_id=None)
  b = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive", temperature=0.7,
                        top_p=0.8, max_new_tokens=5, eos_id=None)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_any_drafter_object_drafts_for_speculative_decoding_and_keeps_the_verifiers_output():
  verifier = tiny(2, V, 64)
  prompts = jnp.asarray(np.random.default_rng(1).integers(0, V, (4, 6)), jnp.int32)
  greedy = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                             temperature=0.0, max_new_tokens=10, eos_id=None)
  token = int(np.bincount(np.asarray(greedy.tokens).ravel()).argmax())   # a draft that is sometimes right
  out = decoding.generate(jax.random.PRNGKey(0), ConstantDrafter(token, V), verifier, prompts,
                          method="speculative", gamma=3, temperature=0.0, max_new_tokens=10, eos_id=None)
  np.testing.assert_array_equal(out.tokens, greedy.tokens)
  expected = [sum(1 for t in row if t == token) for row in np.asarray(greedy.tokens)]
  assert 0 < int(np.sum(out.stats.accepted)) <= sum(expected)
  np.testing.assert_array_equal(out.stats.drafter_calls, 0)
  with pytest.raises(ValueError, match="needs the drafter's distribution at every step"):
    decoding.generate(jax.random.PRNGKey(0), ConstantDrafter(token, V), verifier, prompts,
                      method="token_cascade", max_new_tokens=4)
