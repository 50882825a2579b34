"""Quality and cost metrics (specdec.evaluation.metrics) on hand-checked cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import models
from specdec.decoding import Stats
from specdec.evaluation import metrics, sandbox


def test_bleu_of_identical_corpora_is_100():
  sentences = ["the cat sat on the mat", "ein Haus am See"]
  assert metrics.bleu(sentences, sentences) == pytest.approx(100.0)


def test_bleu_is_the_geometric_mean_of_ngram_precisions():
  # Precisions 5/6, 3/5, 2/4, 1/3 (by hand); equal lengths, so no brevity penalty.
  expected = 100.0 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
  assert metrics.bleu(["the cat sat on the mat"], ["the cat sat on a mat"]) == pytest.approx(expected, abs=1e-9)


def test_bleu_brevity_penalty():
  # "the cat sat on" against "the cat sat on the mat": every n-gram matches, BP = exp(1 − 6/4).
  assert metrics.bleu(["the cat sat on"], ["the cat sat on the mat"]) == pytest.approx(
      100.0 * math.exp(1 - 6 / 4), abs=1e-9)


def test_rouge2_is_the_mean_f_measure_with_stemming():
  # Example 2: hypothesis bigrams {the cat, cat sat}, reference {the cat, cat was, was sit} (stemmed):
  # P = 1/2, R = 1/3, F = 0.4. Example 1 is identical (1.0); "cats sitting" stems to "cat sit" (1.0).
  hypotheses = ["a new editor", "the cat sat", "cats sitting"]
  references = ["a new editor", "the cat was sitting", "cat sits"]
  assert metrics.rouge2(hypotheses, references) == pytest.approx(100.0 * (1.0 + 0.4 + 1.0) / 3)


def test_rouge2_without_shared_bigrams_is_zero():
  assert metrics.rouge2(["library for parsing"], ["daemon to monitor disks"]) == 0.0


def test_metrics_reject_mismatched_lists():
  with pytest.raises(ValueError, match="as many hypotheses as references"):
    metrics.bleu(["a"], ["a", "b"])
  with pytest.raises(ValueError, match="as many hypotheses as references"):
    metrics.rouge2([], [])


HYPOTHESES = ["the cat sat on the mat", "a quick brown fox", "tools for the gnu system", "x y z", "library files"]
REFERENCES = ["the cat sat on a mat", "the quick brown fox", "tools for the GNU system", "x y", "shared library files"]


@pytest.mark.parametrize("metric", ["bleu", "rouge2"])
def test_example_statistics_recompute_the_corpus_metric_of_any_subset(metric):
  score = {"bleu": metrics.bleu, "rouge2": metrics.rouge2}[metric]
  statistics = metrics.example_statistics(metric, HYPOTHESES, REFERENCES)
  assert metrics.from_statistics(metric, statistics) == pytest.approx(score(HYPOTHESES, REFERENCES))
  rows = [4, 0, 0, 2]   # a bootstrap resample: repeated examples count twice
  assert metrics.from_statistics(metric, statistics[rows]) == pytest.approx(
      score([HYPOTHESES[i] for i in rows], [REFERENCES[i] for i in rows]))


def test_bootstrap_interval_covers_the_mean_at_its_stated_rate():
  """The percentile interval of a mean of 200 normal draws holds the true mean in ≈ 95 % of 200 samples."""
  rng = np.random.default_rng(0)
  covered = 0
  for seed in range(200):
    x = rng.normal(1.0, 2.0, 200)
    lo, hi = metrics.bootstrap_interval(len(x), lambda rows: x[rows].mean(), resamples=300, seed=seed)
    covered += lo <= 1.0 <= hi
  assert 0.88 <= covered / 200 <= 0.99   # binomial(200, 0.95) lies in [178, 197] with probability > 1 − 1e-4


def test_log_likelihood_matches_scoring_each_row_alone():
  model = models.build("tiny", vocab_size=64, seed=3, max_length=32)
  rng = np.random.default_rng(0)
  prompt_lengths, lengths = np.array([3, 1, 5]), np.array([4, 6, 1])
  prompts = rng.integers(2, 64, (3, 5)) * (np.arange(5) < prompt_lengths[:, None])
  tokens = rng.integers(2, 64, (3, 6)) * (np.arange(6) < lengths[:, None])
  got = metrics.log_likelihood(model, prompts, prompt_lengths, tokens, lengths)
  for b in range(3):
    text = np.concatenate([prompts[b, :prompt_lengths[b]], tokens[b, :lengths[b]]])
    log_probs = jax.nn.log_softmax(model.logits(jnp.asarray(text[None]))[0], axis=-1)
    expected = np.mean([log_probs[t - 1, text[t]] for t in range(prompt_lengths[b], len(text))])
    assert got[b] == pytest.approx(float(expected), abs=1e-5)


def test_log_likelihood_needs_a_prompt_token():
  model = models.build("tiny", vocab_size=64, seed=3, max_length=32)
  with pytest.raises(ValueError, match="at least one prompt token"):
    metrics.log_likelihood(model, np.zeros((1, 2), int), np.array([0]), np.ones((1, 2), int), np.array([2]))


def test_cost_metrics_sum_counters_over_examples_first():
  stats = Stats(drafter_calls=jnp.array([14, 8]), verifier_calls=jnp.array([4, 2]),
                verifier_positions=jnp.array([24, 12]), drafted=jnp.array([10, 5]),
                accepted=jnp.array([8, 4]), rejected=jnp.array([2, 1]), deferred=jnp.array([3, 0]),
                generated=jnp.array([12, 8]))
  assert metrics.cost_metrics(stats) == pytest.approx({
      "rejection_rate": 3 / 15, "draft_rejection_rate": 3 / 15, "deferral_rate": 3 / 20,
      "tokens_per_verifier_call": 20 / 6,
      "drafter_calls_per_token": 22 / 20, "verifier_calls_per_token": 6 / 20,
      "verifier_positions_per_token": 36 / 20})


def test_cost_metrics_of_a_model_alone_leave_undefined_rates_out():
  totals = {"drafter_calls": 0, "verifier_calls": 9, "drafted": 0, "accepted": 0, "rejected": 0, "deferred": 0,
            "generated": 9}
  costs = metrics.cost_metrics(totals)
  assert costs["rejection_rate"] is None
  assert costs["tokens_per_verifier_call"] == 1.0 and costs["drafter_calls_per_token"] == 0.0


def test_qa_exact_match_and_f1_follow_squads_normalisation_and_take_the_best_reference():
  stats = metrics.example_statistics("exact_match", ["The Eiffel Tower!", "paris", "Rome"],
                                     [["Eiffel tower", "la tour"], "Paris, France", ["Rome"]])
  np.testing.assert_array_equal(stats[:, 0], [100.0, 0.0, 100.0])
  # "paris" vs "paris france": precision 1, recall 1/2 -> F1 2/3; no shared token -> 0.
  f1 = metrics.example_statistics("f1", ["paris", "an apple a day", "London"], ["Paris, France", "apple day", "Rome"])
  np.testing.assert_allclose(f1[:, 0], [200.0 / 3, 100.0, 0.0])
  assert metrics.from_statistics("f1", f1) == pytest.approx((200.0 / 3 + 100.0) / 3)
  assert metrics.normalize_answer("  The  Answer, is: A cat. ") == "answer is cat"


def test_gsm8k_exact_match_compares_final_numbers():
  references = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 1,200", "#### -3"]
  hypotheses = ["48 + 24 = 72 clips. The answer is 72.", "She pays $1,200 in all.", "It is 3 degrees colder"]
  np.testing.assert_array_equal(metrics.example_statistics("gsm8k_exact_match", hypotheses, references)[:, 0],
                                [100.0, 100.0, 0.0])
  assert metrics.final_number("no number here") is None and metrics.final_number("x = 3.5.") == "3.5"
  assert metrics.example_statistics("gsm8k_exact_match", ["no answer"], ["#### 4"])[0, 0] == 0.0
  with pytest.raises(ValueError, match="gsm8k_exact_match"):
    metrics.example_statistics("accuracy", ["a"], ["a"])


def test_pass_at_1_results_name_the_sandbox_isolation():
  assert metrics.scoring("pass_at_1") == {"sandbox": sandbox.default_isolation()}
  assert metrics.scoring("bleu") == {} and metrics.scoring("exact_match") == {}
  solved = ["[BEGIN]\ndef add(a, b):\n    return a + b\n[DONE]", "def add(a, b):\n    return a - b", ""]
  references = [("", "assert add(1, 2) == 3")] * 3
  assert metrics.example_statistics("pass_at_1", solved, references)[:, 0].tolist() == [100.0, 0.0, 0.0]
