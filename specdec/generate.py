"""Decode texts from the command line with a drafter/verifier pair.

  python -m specdec.generate --drafter data/models/debian_drafter --verifier data/models/debian_verifier \
      --task debian_synopsis --method speculative --rule spec --gamma 3 --temperature 0 \
      --prompt "A command-line tool that converts images between many formats."

`--input FILE` reads one prompt per line instead. With `--task` each prompt is formatted as that task's
input ("summarize: … synopsis:"); without it the text is continued as it is. Prints each decoded text and
its counters (tokens, serial model calls, drafts accepted / drafted). Every method of
`specdec.decoding.METHODS` and its parameters are available as options (`--help` lists them).
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np

from specdec import decoding
from specdec.data import load_vocabulary, tasks
from specdec.training import load_model


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m specdec.generate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--verifier", required=True, help="an exported model directory")
  parser.add_argument("--drafter", help="an exported model directory (methods that use a drafter)")
  text = parser.add_mutually_exclusive_group(required=True)
  text.add_argument("--prompt", action="append", help="a prompt text (repeatable)")
  text.add_argument("--input", help="a file with one prompt per line")
  parser.add_argument("--task", choices=list(tasks.TASKS), help="format prompts as this task's inputs")
  parser.add_argument("--method", default="speculative", choices=list(decoding.METHODS))
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--max_new_tokens", type=int, help="default: the task's target budget, else 64")
  parser.add_argument("--no_eos", action="store_true", help="do not stop at the vocabulary's end-of-sequence")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--batch_size", type=int, default=8)
  seen: set[str] = set()
  for method in decoding.METHODS.values():
    for param in method.params:
      if param.name not in seen:
        seen.add(param.name)
        parser.add_argument(f"--{param.name}", type=type(param.default), default=None,
                            help=f"(method parameter; default {param.default!r})")
  return parser


def main(argv: list[str] | None = None) -> list[str]:
  args = _parser().parse_args(argv)
  if args.input:
    with open(args.input, encoding="utf-8") as f:
      texts = [line.rstrip("\n") for line in f if line.strip()]
  else:
    texts = args.prompt
  vocab = load_vocabulary()
  verifier = load_model(args.verifier)
  drafter = load_model(args.drafter) if args.drafter else None
  encoder_decoder = hasattr(verifier, "prefill")
  max_new_tokens = args.max_new_tokens or (tasks.get_task(args.task).max_target_tokens if args.task else 64)
  params = {name: value for name, value in vars(args).items()
            if name in decoding.methods.all_param_names() and value is not None}
  decoded = []
  for start in range(0, len(texts), args.batch_size):
    batch = texts[start:start + args.batch_size]
    prompts, lengths = tasks.prompt_batch(batch, task=args.task, vocab=vocab, encoder_decoder=encoder_decoder)
    out = decoding.generate(jax.random.PRNGKey(args.seed + start), drafter, verifier, prompts, lengths,
                            method=args.method, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=max_new_tokens, eos_id=None if args.no_eos else vocab.eos_id, **params)
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    stats = {name: np.asarray(getattr(out.stats, name)) for name in decoding.common.STAT_NAMES}
    for i, text in enumerate(batch):
      decoded.append(vocab.decode(tokens[i, :n[i]].tolist()))
      counters = " ".join(f"{name}={int(stats[name][i])}" for name in decoding.common.STAT_NAMES)
      if stats["drafted"][i]:
        counters += f" acceptance={stats['accepted'][i] / stats['drafted'][i]:.2f}"
      print(f"> {text}\n{decoded[-1]}\n  [{counters}]", flush=True)
  return decoded


if __name__ == "__main__":
  main(sys.argv[1:])
