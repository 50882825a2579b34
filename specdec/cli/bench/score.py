"""ms of one `score` of n tokens after a prefix, per model and batch: c_γ and the drafter/verifier c.

Models are presets with random weights (`--vocab`, seeds 0, 1, … in the order given) or models `load_model` reads
(the shipped pair: data/models/debian_drafter data/models/debian_verifier; a trained T5 pair: its export
directories; GGUF files; smollm2). A decoder-only model's cache holds `--prefix` positions of random tokens; a T5's decoder holds
them after its encoder read an `--encoder_input`-token input once (untimed). Each figure is the median of
`--repeats` jitted calls after a warm-up; only the logits are returned (the loops write n cache entries in
place, which a non-donated cache would turn into a copy of the whole cache). Rows: ms, and relative to n = 1
(c_γ = t(γ + 1) / t(1)); the table adds c = t_a(1) / t_b(1) for every pair of models, smaller over larger.

  specdec-bench score --models 6m 97m                      # random presets (SpecTr's LM1B sizes)
  specdec-bench score --models t5_tiny t5_mini t5_small --vocab 32128 --prefix 32
  specdec-bench score --models data/models/debian_drafter data/models/debian_verifier --batch 1 8
  specdec-bench score --models smollm2 --widths 1 2 3 4 5 6 8        # SmolLM2-135M-Instruct (make smollm2)
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--models", nargs="+", default=["6m", "97m"], help="presets or export directories")
  parser.add_argument("--vocab", type=int, default=32_000, help="the presets' vocabulary size")
  parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8], help="n tokens per call")
  parser.add_argument("--batch", type=int, nargs="+", default=[1])
  parser.add_argument("--prefix", type=int, default=128, help="cached positions before the scored tokens")
  parser.add_argument("--encoder_input", type=int, default=128, help="T5: encoder input tokens")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="weights and caches")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--feature_heads", type=int, nargs="*", default=[], metavar="K",
                      help="also time a block of --draft_gamma drafts of a feature drafter (EAGLE; random head) over "
                           "the first model, drafting among K tokens (a draft vocabulary; 0: the whole vocabulary)")
  parser.add_argument("--draft_gamma", type=int, default=4, help="drafts per timed block of --feature_heads")


def load(name: str, vocab_size: int, seed: int, max_length: int = 1024, dtype: str | None = None) -> tuple[str, Any]:
  """(label, model): a preset with random weights, or any model `training.load_model` reads (an export, a GGUF
  file, a pretrained checkpoint's name such as smollm2)."""
  import jax.numpy as jnp

  from specdec import models
  from specdec.training import export_name, load_model
  if name in models.families.presets():
    label, model = name, models.build(name, vocab_size=vocab_size, seed=seed, max_length=max_length)
  else:
    label, model = export_name(name), load_model(name)
  if dtype:
    model, label = models.with_dtype(model, getattr(jnp, dtype)), f"{label} {dtype}"
  return label, model


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  from specdec import models
  from specdec.evaluation import bench
  record = bench.new_record("score", command, keys=("model", "batch", "n"), prefix=args.prefix,
                            encoder_input=args.encoder_input, repeats=args.repeats)
  widths = sorted({1, *args.widths})
  step, sizes, models_loaded = {}, {}, {}
  for seed, name in enumerate(args.models):
    label, model = load(name, args.vocab, seed, args.prefix + max(widths) + args.draft_gamma + 2, args.dtype)
    models_loaded[label] = model
    sizes[label] = models.count_params(model)
    for batch in args.batch:
      seconds = bench.score_seconds(model, widths, batch=batch, prefix=args.prefix, repeats=args.repeats,
                                    encoder_input=args.encoder_input)
      step[label, batch] = seconds[1]
      for n, t in seconds.items():
        record["rows"].append({"model": label, "params": sizes[label], "batch": batch, "n": n, "ms": 1e3 * t,
                               "relative": t / seconds[1]})
      bench.log(f"{label} batch {batch}: " + ", ".join(f"n={n} {1e3 * t:.2f} ms" for n, t in seconds.items()))
  lines = [f"`score` of n tokens after {args.prefix} cached positions (T5: after a {args.encoder_input}-token "
           f"encoder input), median of {args.repeats} jitted calls; ms (relative to n = 1)", "",
           "| model | params | batch | " + " | ".join(f"n={n}" for n in widths) + " |",
           "|---|---:|---:|" + "---:|" * len(widths)]
  for (label, batch), _ in step.items():
    cells = {row["n"]: row for row in record["rows"] if row["model"] == label and row["batch"] == batch}
    lines.append(f"| {label} | {sizes[label]:,} | {batch} | " + " | ".join(
        f"{cells[n]['ms']:.2f} ({cells[n]['relative']:.2f})" for n in widths) + " |")
  lines.append("")
  if args.feature_heads:
    lines += _feature_heads(args, record, *next(iter(models_loaded.items())), step)
  for batch in args.batch:
    for a, b in itertools.combinations(sizes, 2):
      small, large = sorted((a, b), key=sizes.get)
      lines.append(f"- c = {small} / {large} (one token each, batch {batch}): "
                   f"{step[small, batch] / step[large, batch]:.3f}")
  return record, "\n".join(lines) + "\n"


def _feature_heads(args: argparse.Namespace, record: dict[str, Any], label: str, verifier: Any,
                   step: dict[tuple[str, int], float]) -> list[str]:
  """Rows of a feature drafter's block over `verifier` per draft vocabulary size: ms per draft and c = that / t(1)."""
  import jax
  import numpy as np
  from specdec.decoding.feature_drafter import FeatureDrafter
  from specdec.evaluation import bench
  from specdec.models import feature_head
  head = feature_head.init(verifier, jax.random.PRNGKey(0))
  lines = [f"Feature drafter (one-layer head, random weights) over {label}: a block of {args.draft_gamma} greedy "
           "drafts after the prefix; ms per draft (c: per draft / the verifier's n = 1 step)", "",
           "| draft vocabulary | batch | ms per draft | c |", "|---:|---:|---:|---:|"]
  for size in args.feature_heads:
    ids = None if size in (0, verifier.vocab_size) else np.linspace(0, verifier.vocab_size - 1, size).astype(int)
    drafter = FeatureDrafter(head.with_draft_vocabulary(ids), verifier, bonus_q=False)
    for batch in args.batch:
      per_draft = bench.draft_seconds(drafter, verifier, gamma=args.draft_gamma, batch=batch, prefix=args.prefix,
                                      repeats=args.repeats) / args.draft_gamma
      c = per_draft / step[label, batch]
      record["rows"].append({"model": f"{label} feature head", "draft_vocabulary": size or verifier.vocab_size,
                             "batch": batch, "n": 1, "ms": 1e3 * per_draft, "relative": c})
      bench.log(f"feature head over {label}, draft vocabulary {size or verifier.vocab_size}, batch {batch}: "
                f"{1e3 * per_draft:.2f} ms per draft (c = {c:.3f})")
      lines.append(f"| {size or verifier.vocab_size:,} | {batch} | {1e3 * per_draft:.2f} | {c:.3f} |")
  return lines + [""]
