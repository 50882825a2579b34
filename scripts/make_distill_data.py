"""Writes sequence-level distillation data: task prompts with a model's own (greedy) continuations.

  python scripts/make_distill_data.py --model data/models/debian_verifier --source outputs/debian \
      --task debian_synopsis:20000:500 --task debian_en_de:10000:500 --out outputs/distill/debian_verifier

Each --task is name:train_examples:validation_examples (a seeded sample of each split). Chunks of 1024
examples are written as they finish; a rerun skips them. Train a drafter on the result with
`prefix_lm_batches.generated = '<out>'` (configs/train/debian_drafter_seqkd.gin).
"""

from __future__ import annotations

import argparse
import sys

from specdec import cli
from specdec.data import load_vocabulary
from specdec.training import distill, load_model


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", required=True, help="an exported model directory (the verifier)")
  parser.add_argument("--task", action="append", required=True, help="name:train_examples:validation_examples")
  parser.add_argument("--out", required=True)
  parser.add_argument("--source", default="auto")
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  model = load_model(args.model)
  eos_id = load_vocabulary().eos_id
  for spec in args.task:
    name, *counts = spec.split(":")
    if len(counts) != 2:
      raise ValueError(f"--task must be name:train_examples:validation_examples; got {spec!r}")
    for split, count in zip(("validation", "train"), reversed(counts)):
      distill.write(args.out, model, name, split, int(count), source=args.source, eos_id=eos_id,
                    batch_size=args.batch_size, temperature=args.temperature, seed=args.seed)


if __name__ == "__main__":
  sys.exit(cli.run(lambda argv: main(), sys.argv[1:], "scripts/make_distill_data.py"))
