"""Trains a feature drafter's head (EAGLE) for a verifier on the local tasks' text, and saves it.

  python scripts/train_feature_head.py --verifier data/models/debian_verifier \
      --out data/models/debian_verifier_eagle --steps 3000

Features and targets come from the verifier itself (`specdec.training.feature_head`); the text is the
local Debian tasks' training split (descriptions, synopses, translations: `tasks.prefix_lm_batches`).
Writes <out>/feature_head/ (head.json with the config and the training record, the parameters) and
prints the validation losses and the head's top-1 agreement with the verifier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from specdec.data import tasks
from specdec.training import feature_head, load_model


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--verifier", default="data/models/debian_verifier")
  parser.add_argument("--out", required=True, help="the head is written to <out>/feature_head/")
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval_batches", type=int, default=20)
  args = parser.parse_args()
  verifier = load_model(args.verifier)
  vocab = verifier.vocab_size
  batches = tasks.prefix_lm_batches("train", batch_size=args.batch_size, seq_len=args.seq_len, vocab_size=vocab,
                                    seed=args.seed, length_window=8)
  start = time.monotonic()
  head, record = feature_head.train(verifier, batches, steps=args.steps, learning_rate=args.learning_rate,
                                    seed=args.seed)
  validation = tasks.prefix_lm_batches("validation", batch_size=args.batch_size, seq_len=args.seq_len,
                                       vocab_size=vocab, seed=0, length_window=8)
  record["validation"] = feature_head.evaluate(head, verifier, (next(validation) for _ in range(args.eval_batches)))
  record.update(verifier=os.path.normpath(args.verifier), batch_size=args.batch_size, seq_len=args.seq_len,
                command=" ".join(["python", *sys.argv]), backend=jax.default_backend(),
                wall_seconds=time.monotonic() - start)
  path = feature_head.save_head(args.out, head, record)
  print(json.dumps(record["validation"]), f"-> {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
