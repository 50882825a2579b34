"""Validation quality of trained models on the local tasks: perplexity, and ROUGE-2 / BLEU of greedy output.

  python scripts/evaluate_pair.py --models data/models/debian_drafter data/models/debian_verifier \
      --source outputs/debian --out experiments/debian_pair_quality.md

Per task and model: perplexity and token accuracy of the references (targets only, as trained; the LM
task's whole text), and, for the seq2seq tasks, the task metric (`Task.metric`) of greedy decoding
(autoregressive, temperature 0, `Task.max_target_tokens` new tokens) against the references. Writes a
Markdown table (and prints it).

Exported T5 models (e.g. the Debian T5 pair, `configs/train/debian_t5_*.gin`) read T5's format: the
encoder input is the task's T5 input ("summarize: <document>"), the decoder [0] + target + eos:

  python scripts/evaluate_pair.py --models outputs/train/debian_t5_drafter/export \
      outputs/train/debian_t5_verifier/export --tasks debian_synopsis debian_en_de --source outputs/debian
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import numpy as np

from specdec import cli, decoding
from specdec.data import load_vocabulary, tasks
from specdec.evaluation import metrics
from specdec.training import evaluate, export_name, load_model


def _perplexity(model, task: tasks.Task, rows: tasks.Tokenized, batch_size: int) -> dict[str, float]:
  def batch(rows_slice: slice) -> dict[str, np.ndarray]:
    if model.encoder_decoder:   # the task's widths: one compilation per task
      return rows.seq2seq(rows_slice, encoder_len=max(task.max_input_tokens, 1),
                          decoder_len=1 + task.max_target_tokens)
    width = int(rows.lengths[rows_slice].max())   # padding beyond the longest row is not scored
    return {"inputs": rows.tokens[rows_slice, :width], "weights": rows.weights(rows_slice)[:, :width]}

  batches = (batch(slice(i, i + batch_size)) for i in range(0, len(rows), batch_size))
  return evaluate(model, model.params, batches)


def _greedy_metric(model, task: tasks.Task, rows: tasks.Tokenized, vocab, batch_size: int,
                   limit: int | None) -> float:
  count = len(rows) if limit is None else min(limit, len(rows))
  hypotheses = []
  for start in range(0, count, batch_size):
    # Fixed batch shape (the last batch padded with row 0) and prompt width: one compilation per task.
    index = np.arange(start, start + batch_size) % count
    prompts, lengths = rows.prompts(index)
    prompts = np.pad(prompts, ((0, 0), (0, task.max_input_tokens - prompts.shape[1])))
    out = decoding.generate(jax.random.PRNGKey(0), None, model, prompts, lengths, method="autoregressive",
                            temperature=0.0, max_new_tokens=task.max_target_tokens, eos_id=vocab.eos_id)
    hypotheses += [vocab.decode(row) for row in np.asarray(out.tokens)[:count - start]]
  references = [vocab.decode(target) for target in rows.targets(np.arange(count))]
  score = metrics.rouge2 if task.metric == "rouge2" else metrics.bleu
  return score(hypotheses, references)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", required=True, help="exported model directories")
  parser.add_argument("--tasks", nargs="+", default=list(tasks.SHIPPED_VOCABULARY_TASKS))
  parser.add_argument("--split", default="validation")
  parser.add_argument("--source", default="auto", help="as debian.load: auto, apt, sample or a directory")
  parser.add_argument("--limit", type=int, default=None, help="greedy-decode only the first N examples")
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--out", default=None, help="write the Markdown table here")
  args = parser.parse_args()

  vocab = load_vocabulary()
  loaded = {export_name(path): load_model(path) for path in args.models}
  lines = ["| task | examples | model | perplexity | token accuracy | greedy metric |", "|---|---|---|---|---|---|"]
  for name in args.tasks:
    task = tasks.get_task(name)
    for label, model in loaded.items():
      # T5 reads T5's inputs (no decoder-only separator) as its encoder input.
      kw = dict(source=args.source, encoder_decoder=model.encoder_decoder)
      as_targets = tasks.tokenized(name, args.split, training=True, **kw)
      prompted = tasks.tokenized(name, args.split, **kw)
      start = time.perf_counter()
      quality = _perplexity(model, task, as_targets, args.batch_size)
      greedy = "–"
      if task.metric in ("rouge2", "bleu"):
        value = _greedy_metric(model, task, prompted, vocab, args.batch_size, args.limit)
        greedy = f"{'ROUGE-2' if task.metric == 'rouge2' else 'BLEU'} {value:.2f}"
      lines.append(f"| {name} | {len(as_targets)} | {label} | {quality['perplexity']:.2f} | "
                   f"{quality['accuracy']:.3f} | {greedy} |")
      print(lines[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
  header = (f"Split `{args.split}`, source `{args.source}`; {jax.devices()[0].device_kind}, jax {jax.__version__}, "
            f"python {platform.python_version()}.\nCommand: `python {' '.join(sys.argv)}`\n")
  table = header + "\n" + "\n".join(lines) + "\n"
  print(table)
  if args.out:
    with open(args.out, "w") as f:
      f.write(table)


if __name__ == "__main__":
  sys.exit(cli.run(lambda argv: main(), sys.argv[1:], "scripts/evaluate_pair.py"))
