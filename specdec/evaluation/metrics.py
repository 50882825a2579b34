"""Quality and cost metrics of the speculative-cascades experiments (§6, App. F.1).

Quality: BLEU for translation (sacrebleu's corpus BLEU, 13a tokenisation), ROUGE-2 for summarization
(rouge-score's F-measure with stemming, averaged over examples, as Zhou et al. (2024)), for the LM task
the verifier's mean per-token log-likelihood of the generated text, and for the few-shot benchmarks of §6
exact match and token F1 of QA answers (SQuAD's normalisation, the best over a question's references) and
GSM8K's final-answer exact match (the last number of the response against the one after '####'), and
MBPP's pass@1 (the response's code run against the problem's tests in `sandbox`, whose isolation a result
names: `scoring`). Cost: the counters of `specdec.decoding.Output.stats`, summed over examples, as rates
(rejection rate: Figure 3, App. F.6).
"""

from __future__ import annotations

import collections
import functools
import re
import string
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu
from rouge_score import rouge_scorer
from sacrebleu.metrics.bleu import BLEU

from specdec.decoding.common import STAT_NAMES, Stats
from specdec.evaluation import sandbox
from specdec.models.base import Model


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Corpus BLEU in [0, 100] of hypotheses against one reference each (sacrebleu defaults: 13a)."""
  _check_pairs(hypotheses, references)
  return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


@functools.cache
def _rouge2_scorer() -> rouge_scorer.RougeScorer:
  return rouge_scorer.RougeScorer(["rouge2"], use_stemmer=True)


def rouge2(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Mean over examples of the ROUGE-2 F-measure (Porter stemming), × 100."""
  _check_pairs(hypotheses, references)
  scorer = _rouge2_scorer()
  return float(100.0 * np.mean([scorer.score(ref, hyp)["rouge2"].fmeasure
                                for hyp, ref in zip(hypotheses, references)]))


def normalize_answer(text: str) -> str:
  """SQuAD's answer normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
  text = "".join(c for c in text.lower() if c not in string.punctuation)
  return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _token_f1(prediction: str, truth: str) -> float:
  predicted, true = normalize_answer(prediction).split(), normalize_answer(truth).split()
  common = sum((collections.Counter(predicted) & collections.Counter(true)).values())
  if not predicted or not true:
    return float(predicted == true)
  if common == 0:
    return 0.0
  precision, recall = common / len(predicted), common / len(true)
  return 2 * precision * recall / (precision + recall)


def final_number(text: str) -> str | None:
  """GSM8K's answer: what follows '####' in a reference, else the last number of the text (commas and a
  trailing period dropped); None without one."""
  if "####" in text:
    text = text.split("####")[-1]
  numbers = re.findall(r"-?[\d,]*\.?\d+", text)
  return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def _answers(reference: str | Sequence[str]) -> list[str]:
  return [reference] if isinstance(reference, str) else list(reference)


def example_statistics(metric: str, hypotheses: Sequence[str], references: Sequence[str | Sequence[str]]
                       ) -> np.ndarray:
  """Per-example statistics [N, k] from which `from_statistics` recomputes the corpus metric of any subset
  or resample of the examples: for BLEU sacrebleu's [hypothesis length, reference length, n-gram matches
  (n = 1…4), n-gram totals (n = 1…4)], for the others the example's score × 100 (ROUGE-2 F-measure;
  exact_match, f1: the best over the example's references, a string or a list of them;
  gsm8k_exact_match: final answers equal; pass_at_1: the response's program (`sandbox.extract_code`) passes
  the reference (setup code, asserts), MBPP's, run in `sandbox` as setup, program, asserts)."""
  _check_pairs(hypotheses, references)
  if metric == "bleu":
    return np.asarray(BLEU()._extract_corpus_statistics(list(hypotheses), [list(references)]), np.int64)
  if metric == "rouge2":
    scorer = _rouge2_scorer()
    return 100.0 * np.array([[scorer.score(ref, hyp)["rouge2"].fmeasure] for hyp, ref in zip(hypotheses, references)])
  per_example = {
      "exact_match": lambda hyp, ref: max(float(normalize_answer(hyp) == normalize_answer(a)) for a in _answers(ref)),
      "f1": lambda hyp, ref: max(_token_f1(hyp, a) for a in _answers(ref)),
      "gsm8k_exact_match": lambda hyp, ref: float(final_number(hyp) is not None
                                                  and final_number(hyp) == final_number(ref)),
      "pass_at_1": lambda hyp, ref: float(sandbox.run_program(sandbox.extract_code(hyp), [ref[1]],
                                                              setup=ref[0]).passed),
  }
  if metric not in per_example:
    raise ValueError(f"metric must be one of bleu, rouge2, {', '.join(per_example)} for texts (log_likelihood "
                     f"scores tokens); got {metric!r}")
  return 100.0 * np.array([[per_example[metric](hyp, ref)] for hyp, ref in zip(hypotheses, references)])


def scoring(metric: str) -> dict[str, str]:
  """What a result scored with `metric` records of how it was scored, beyond the metric's name: for
  pass_at_1 the walls the programs ran behind (`sandbox`: "namespaces" or "audit-hook",
  `sandbox.default_isolation()`)."""
  return {"sandbox": sandbox.default_isolation()} if metric == "pass_at_1" else {}


def from_statistics(metric: str, statistics: np.ndarray) -> float:
  """The corpus metric of examples with `example_statistics` [N, k] (log_likelihood: per-example means
  [N, 1]): corpus BLEU from the summed counts, the mean for the others."""
  statistics = np.asarray(statistics, np.float64)
  if metric == "bleu":
    total = [int(x) for x in statistics.sum(axis=0)]
    return float(BLEU.compute_bleu(correct=total[2:6], total=total[6:10], sys_len=total[0], ref_len=total[1]).score)
  return float(np.mean(statistics[:, 0]))


def bootstrap_interval(n_examples: int, statistic: Callable[[np.ndarray], float], *, resamples: int = 1000,
                       level: float = 0.95, seed: int = 0) -> tuple[float, float]:
  """Percentile bootstrap interval of `statistic(rows)` over examples resampled with replacement (rows: an
  index array [n_examples]); paired quantities (a point and its baseline timed on the same examples) are
  resampled together by indexing both with the same rows."""
  rng = np.random.default_rng(seed)
  values = np.array([statistic(rng.integers(0, n_examples, n_examples)) for _ in range(resamples)])
  tail = 100.0 * (1.0 - level) / 2
  return float(np.percentile(values, tail)), float(np.percentile(values, 100.0 - tail))


def _check_pairs(hypotheses: Sequence[str], references: Sequence[str]) -> None:
  if len(hypotheses) != len(references) or not hypotheses:
    raise ValueError(f"need as many hypotheses as references, at least one; got {len(hypotheses)} "
                     f"and {len(references)}")


@jax.jit
def _next_token_log_probs(model: Model, rows: jax.Array) -> jax.Array:
  """log p_raw(rows[:, t+1] | rows[:, :t+1]) [B, W-1] at temperature 1, teacher-forced."""
  log_probs = jax.nn.log_softmax(model.logits(rows[:, :-1]).astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(log_probs, rows[:, 1:, None], axis=-1)[..., 0]


def log_likelihood(model: Model, prompts: np.ndarray, prompt_lengths: np.ndarray, tokens: np.ndarray,
                   lengths: np.ndarray) -> np.ndarray:
  """Per row, the mean of log p_raw(x_t | prompt, x_<t) over the generated tokens x_1 … x_n [B].

  prompts [B, L] (row b's prompt is prompts[b, :prompt_lengths[b]], at least one token), tokens [B, N]
  with lengths [B] ≥ 1 generated tokens (EOS included when emitted), as `decoding.generate` returns them.
  The LM task's quality: `model` is the verifier, whose log-likelihood of the text scores it (§6).
  """
  prompts, tokens = np.asarray(prompts), np.asarray(tokens)
  prompt_lengths, lengths = np.asarray(prompt_lengths), np.asarray(lengths)
  if np.any(prompt_lengths < 1) or np.any(lengths < 1):
    raise ValueError("log_likelihood needs at least one prompt token and one generated token per row")
  # Row b: its prompt, then its generated tokens, then padding (causal attention never sees it).
  positions = np.arange(prompts.shape[1] + tokens.shape[1])[None, :]
  generated_index = np.clip(positions - prompt_lengths[:, None], 0, tokens.shape[1] - 1)
  rows = np.where(positions < prompt_lengths[:, None],
                  np.pad(prompts, ((0, 0), (0, tokens.shape[1]))),
                  np.take_along_axis(tokens, generated_index, axis=1))
  log_probs = np.asarray(_next_token_log_probs(model, jnp.asarray(rows, jnp.int32)))
  # log_probs[:, j] scores the token at position j + 1.
  targets = positions[:, 1:]
  is_generated = (targets >= prompt_lengths[:, None]) & (targets < (prompt_lengths + lengths)[:, None])
  return np.sum(np.where(is_generated, log_probs, 0.0), axis=1) / lengths


def cost_metrics(stats: Stats | Mapping[str, np.ndarray]) -> dict[str, float | None]:
  """Cost rates of a run from per-row counters (summed over rows first); None where undefined.

  rejection_rate            rejected / drafted (blocks with a rejection per draft token)
  draft_rejection_rate      (drafted − accepted) / drafted: rejected draft tokens per draft token, the
                            paper's rejection rate (Figure 3's x-axis; equal to rejection_rate at γ = 1)
  deferral_rate             deferred / generated (emitted tokens deferred to the verifier: δ = 1 for a
                            deferral rule, π ≠ q for any other target; see decoding.common.Stats)
  tokens_per_verifier_call  generated / verifier_calls
  drafter_calls_per_token   drafter_calls / generated
  verifier_calls_per_token  verifier_calls / generated
  verifier_positions_per_token  verifier_positions / generated (the verifier's compute per token: above
                            verifier_calls_per_token when calls score blocks or token trees)
  """
  totals = count_totals(stats)

  def ratio(num: str, den: str) -> float | None:
    return totals[num] / totals[den] if totals[den] else None

  return {"rejection_rate": ratio("rejected", "drafted"),
          "draft_rejection_rate": ((totals["drafted"] - totals["accepted"]) / totals["drafted"] if totals["drafted"]
                                   else None),
          "deferral_rate": ratio("deferred", "generated"),
          "tokens_per_verifier_call": ratio("generated", "verifier_calls"),
          "drafter_calls_per_token": ratio("drafter_calls", "generated"),
          "verifier_calls_per_token": ratio("verifier_calls", "generated"),
          "verifier_positions_per_token": ratio("verifier_positions", "generated")}


def count_totals(stats: Stats | Mapping[str, np.ndarray]) -> dict[str, int]:
  """Each counter of `Stats` summed over rows (0 for a counter a mapping lacks: records written before
  `verifier_positions` existed)."""
  get = (lambda name: stats.get(name, 0)) if isinstance(stats, Mapping) else functools.partial(getattr, stats)
  return {name: int(np.sum(np.asarray(get(name)))) for name in STAT_NAMES}
