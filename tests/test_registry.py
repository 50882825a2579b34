"""The method registry is the single source of what a method is: a method defined in this file only runs
through `decoding.generate`, a sweep and the Pareto tables without touching a library file."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specdec import checks, decoding, models, sampling
from specdec.decoding import common
from specdec.evaluation import pareto, sweep
from specdec.models.base import prefill

V = 16


def _repeat(key, drafter, verifier, prompts, prompt_lengths, *, sampling, times, shift, max_new_tokens, eos_id,
            cache_length):
  """A toy method: the verifier's token, emitted `times` times per call (`shift` is traced and unused)."""
  batch = prompts.shape[0]
  last, cache = prefill(verifier, verifier.init_cache(batch, cache_length), prompts, prompt_lengths)

  def step(state, done):
    cache, last = state
    logits, cache = verifier.score(cache, last[:, None])
    token = jnp.argmax(logits[:, 0] + 0.0 * shift, axis=-1).astype(jnp.int32)
    return (cache, token), common.Emission(block=jnp.repeat(token[:, None], times, axis=1),
                                           count=jnp.full((batch,), times, jnp.int32),
                                           failed=common.has_nan(logits), counters={"verifier_calls": 1})

  output, _ = common.decode_loop((cache, last), step, batch_size=batch, max_new_tokens=max_new_tokens,
                                 eos_id=eos_id, slack=times)
  return output


TOY = decoding.Method(
    "repeat_toy", decode=_repeat, drafter="none", slack=lambda p: p["times"], rank=lambda p: -5,
    params=(decoding.Param("times", 2, traced=False, symbol="×",
                           check=lambda v, p: checks.check_count("times", v, 1, 4)),
            decoding.Param("shift", 0.0, traced=True,
                           check=lambda v, p: checks.check_range("shift", v, 0.0, 1.0, hi_closed=False))))


@pytest.fixture
def toy():
  decoding.register(TOY)
  yield TOY
  del decoding.METHODS[TOY.name]


def test_a_method_registered_in_a_test_runs_through_generate(toy, eos_id=None):
  verifier = models.build("tiny", vocab_size=V, seed=2, max_length=64)
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
  experiment = sweep.Experiment(
      drafter=sweep.ModelSource(preset="tiny", seed=1, max_length=96),
      verifier=sweep.ModelSource(preset="tiny", seed=2, max_length=96), task="debian_synopsis", source="sample",
      families=[sweep.Family("Toy", "repeat_toy", params={"times": [1, 2], "shift": [0.0, 0.5]}),
                sweep.Family("SD", "speculative", gammas=[2])],
      n_examples=2, batch_size=2, max_new_tokens=4, max_prompt_tokens=48, n_latency_examples=1,
      latency_trials=1, temperatures=[0.0], output=str(tmp_path / "results.jsonl"))
  with pytest.raises(ValueError, match="family 'Toy'.*times"):
    sweep.expand_grid(experiment.__class__(**{**experiment.__dict__, "families": [
        sweep.Family("Toy", "repeat_toy", params={"times": [0]})]}))
  points = sweep.expand_grid(experiment)
  toys = [p for p in points if p.method == "repeat_toy"]
  assert sorted((p.times, p.shift) for p in toys) == [(1, 0.0), (1, 0.5), (2, 0.0), (2, 0.5)]
  records = sweep.run(experiment, progress=False)
  by_family = {}
  for r in records:
    by_family.setdefault(r["family"], []).append(r)
  assert len(by_family["Toy"]) == 4 and all(r["counters"]["generated"] == 8 for r in by_family["Toy"])
  # The registry's symbol labels series that differ in `times`, its rank orders them first.
  (group,) = pareto.group_records(records)
  names = list(group.series)
  assert names[:2] == ["Toy [×=1]", "Toy [×=2]"] and names[-1] == "SD"


def test_sampling_is_one_checked_value():
  s = sampling.Sampling(temperature=0.5, top_p=0.9, top_k=3).checked()
  assert s.temperature.dtype == jnp.float32 and s.top_k == 3
  with pytest.raises(ValueError, match="top_p"):
    sampling.Sampling(top_p=0.0).checked()
  verifier = models.build("tiny", vocab_size=V, seed=2, max_length=64)
  prompts = jnp.zeros((1, 3), jnp.int32)
  with pytest.raises(ValueError, match="either sampling= or temperature"):
    decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                      sampling=sampling.Sampling(), temperature=0.0, max_new_tokens=2, eos_id=None)
  a = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                        sampling=sampling.Sampling(temperature=0.7, top_p=0.8), max_new_tokens=5, eos_id=None)
  b = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive", temperature=0.7,
                        top_p=0.8, max_new_tokens=5, eos_id=None)
  np.testing.assert_array_equal(a.tokens, b.tokens)


@struct.dataclass
class _ConstantDrafter:
  """A drafter that is not a model: it always proposes `token` (q one-hot on it); its state is a length."""
  token: int = struct.field(pytree_node=False)
  vocab_size: int = struct.field(pytree_node=False)
  max_length: int = struct.field(pytree_node=False, default=1 << 20)

  def start(self, prompts, prompt_lengths, cache_length):
    return prompt_lengths - 1, prompts[jnp.arange(prompts.shape[0]), prompt_lengths - 1]

  def propose(self, key, state, last, *, max_drafts, sampling, keep_drafting=None):
    batch = last.shape[0]
    q = jax.nn.one_hot(jnp.full((batch, max_drafts + 1), self.token), self.vocab_size)
    return decoding.Draft(tokens=jnp.full((batch, max_drafts), self.token, jnp.int32), q=q, q_raw=q,
                          n_drafted=jnp.full((batch,), max_drafts, jnp.int32), calls=jnp.zeros((batch,), jnp.int32),
                          state=state + max_drafts)

  def rollback(self, state, lengths):
    return lengths


def test_any_drafter_object_drafts_for_speculative_decoding_and_keeps_the_verifiers_output():
  verifier = models.build("tiny", vocab_size=V, seed=2, max_length=64)
  prompts = jnp.asarray(np.random.default_rng(1).integers(0, V, (4, 6)), jnp.int32)
  greedy = decoding.generate(jax.random.PRNGKey(0), None, verifier, prompts, method="autoregressive",
                             temperature=0.0, max_new_tokens=10, eos_id=None)
  token = int(np.bincount(np.asarray(greedy.tokens).ravel()).argmax())   # a draft that is sometimes right
  out = decoding.generate(jax.random.PRNGKey(0), _ConstantDrafter(token, V), verifier, prompts,
                          method="speculative", gamma=3, temperature=0.0, max_new_tokens=10, eos_id=None)
  np.testing.assert_array_equal(out.tokens, greedy.tokens)
  expected = [sum(1 for t in row if t == token) for row in np.asarray(greedy.tokens)]
  assert 0 < int(np.sum(out.stats.accepted)) <= sum(expected)
  np.testing.assert_array_equal(out.stats.drafter_calls, 0)
  with pytest.raises(ValueError, match="needs the drafter's distribution at every step"):
    decoding.generate(jax.random.PRNGKey(0), _ConstantDrafter(token, V), verifier, prompts,
                      method="token_cascade", max_new_tokens=4)
