"""How many drafts of a feature head a greedy block accepts, position by position, on the verifier's own greedy
answers to chat prompts — the acceptance that a timed run (`specdec-bench decoding`) only shows in total.

  python scripts/head_acceptance.py --prompts experiments/smollm2_eagle/heldout_prompts.txt \
      --heads smollm2_eagle outputs/train/smollm2_eagle_v3 --gamma 5 --out experiments/smollm2_eagle/acceptance

The verifier (`--verifier`, default smollm2) answers each prompt greedily (`--tokens` new tokens, through its chat
template); each head then runs teacher-forced over prompt and answer (`training.feature_head.losses` with γ
unrolled passes, pass r being the head's r-th draft reading its own earlier ones, as it drafts). From every
position u of the answer (the first being the last prompt token, where the first block starts): whether a greedy
block there would accept its first r drafts. Reported per head and r = 1 … γ: the share of positions accepting
r drafts, the acceptance of draft r given drafts 1 … r − 1 were accepted (the chain's a_r), the tokens per call a
chain of r drafts would give from uniformly drawn positions, 1 + Σ_{j ≤ r} P(first j accepted), and the tokens per
verifier call of a greedy decode with γ = r, its blocks replayed from the first one (each starts where the last
stopped: hard stretches hold more blocks, so this is lower) — what `specdec-bench decoding` measures at T = 0,
without timing anything. `--stop_below τ …` adds the replay of a decode with a confidence stop (`confidence_stop`,
at most γ drafts, a block ending before the first draft whose top probability is below τ): tokens per call (exact:
a draft up to the first rejected one reads the text's tokens) and drafts per block (those after a rejected draft
are counted from the text's tokens, not the decode's). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding
from specdec.data import gguf_vocab, load_vocabulary, pretrained
from specdec.evaluation import bench
from specdec.training import exports, feature_head, load_model

WIDTH_STEP = 64


def greedy_rows(verifier, vocab, texts: list[str], tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray]:
  """Prompt and greedy answer (EOS included where it came) of each text: ids [N, W] and weights [N, W], 1 from the
  prompt's last two tokens (the first block's pending pair) to the answer's end; prompt and answer lengths [N]."""
  prompts, lengths = gguf_vocab.chat_batch(vocab, texts)
  out = decoding.generate(jax.random.PRNGKey(0), None, verifier, jnp.asarray(prompts), jnp.asarray(lengths),
                          method="autoregressive", temperature=0.0, max_new_tokens=tokens, eos_id=vocab.eos_id)
  answers, answer_lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  rows = [np.concatenate([prompts[i, :lengths[i]], answers[i, :answer_lengths[i]]]) for i in range(len(texts))]
  width = -(-max(len(r) for r in rows) // WIDTH_STEP) * WIDTH_STEP
  ids, weights = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.float32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
    weights[i, lengths[i] - 2:len(row)] = 1.0
  return ids, weights, lengths, answer_lengths


def replayed_calls(accepted: np.ndarray, prompt_lengths: np.ndarray, answer_lengths: np.ndarray, gamma: int,
                   confidences: np.ndarray | None = None, stop_below: float | None = None) -> tuple[int, int]:
  """Verifier calls and drafts of a greedy decode with γ drafts a block, from `accepted` [N, L − 1] (at u, the
  drafts the block whose pending token is x_{u+1} accepts, of `feature_head.accepted_lengths`): the first block of
  row i starts at u = prompt length − 2, each next one after the last one's accepted drafts and its verifier
  token. With `stop_below` τ a block drafts only up to the first draft r whose top probability confidences[r − 1,
  row, u] is below τ (exclusive) and accepts at most those."""
  calls = drafts = 0
  for row, (start, n) in enumerate(zip(prompt_lengths, answer_lengths)):
    u, generated = int(start) - 2, 0
    while generated < n:
      drafted = gamma
      if stop_below is not None:
        low = np.flatnonzero(confidences[:gamma, row, u] < stop_below)
        drafted = int(low[0]) if low.size else gamma
      step = min(int(accepted[row, u]), drafted) + 1
      u, generated, calls, drafts = u + step, generated + step, calls + 1, drafts + drafted
  return calls, drafts


def chain_rows(name: str, sums: dict[str, float], accepted: np.ndarray, prompt_lengths: np.ndarray,
               answer_lengths: np.ndarray, gamma: int) -> list[dict]:
  """Per r: P(first r drafts accepted), a_r = P(draft r | drafts < r), the tokens per call of a γ = r chain from
  uniformly drawn positions and replayed (`replayed_calls`)."""
  rows, previous, tokens_per_call = [], 1.0, 1.0
  for r in range(1, gamma + 1):
    first_r = sums[f"chain_accepted_{r}"]
    tokens_per_call += first_r
    rows.append({"head": name, "draft": r, "stop_below": None, "first_r_accepted": first_r,
                 "acceptance_given_earlier": first_r / previous if previous else None,
                 "tokens_per_call_uniform": tokens_per_call,
                 "tokens_per_call_replayed": int(answer_lengths.sum()) / replayed_calls(
                     accepted, prompt_lengths, answer_lengths, r)[0]})
    previous = first_r
  return rows


def stop_rows(name: str, accepted: np.ndarray, confidences: np.ndarray, prompt_lengths: np.ndarray,
              answer_lengths: np.ndarray, gamma: int, stops: list[float]) -> list[dict]:
  """Per τ: the replayed tokens per call and drafts per block of a decode with a confidence stop at τ, ≤ γ drafts."""
  rows = []
  for tau in stops:
    calls, drafts = replayed_calls(accepted, prompt_lengths, answer_lengths, gamma, confidences, tau)
    rows.append({"head": name, "draft": gamma, "stop_below": tau,
                 "tokens_per_call_replayed": int(answer_lengths.sum()) / calls, "drafts_per_block": drafts / calls})
  return rows


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--verifier", default="smollm2", help="a verifier with a chat template (its GGUF file's)")
  parser.add_argument("--heads", nargs="+", default=["smollm2_eagle"], help="feature heads: directories or names")
  parser.add_argument("--prompts", required=True, help="chat prompts, one per line")
  parser.add_argument("--tokens", type=int, default=128, help="new tokens of each greedy answer")
  parser.add_argument("--gamma", type=int, default=5, help="drafts per block to report (unrolled passes)")
  parser.add_argument("--stop_below", type=float, nargs="*", default=[],
                      help="also replay a confidence stop at each τ given (at most --gamma drafts a block)")
  parser.add_argument("--out", required=True, help="OUT.json and OUT.md are written")
  args = parser.parse_args(argv)
  if args.gamma < 1 or args.tokens < 1:
    raise SystemExit(f"--gamma and --tokens must be >= 1; got {args.gamma} and {args.tokens}")
  if any(not 0.0 <= tau <= 1.0 for tau in args.stop_below):
    raise SystemExit(f"--stop_below values must lie in [0, 1]; got {args.stop_below}")
  with open(args.prompts) as f:
    texts = [line.strip() for line in f if line.strip()]
  if not texts:
    raise SystemExit(f"--prompts {args.prompts} holds no prompt (one per line)")
  verifier = load_model(args.verifier)
  vocab = load_vocabulary(pretrained.resolve(args.verifier))
  ids, weights, prompt_lengths, answer_lengths = greedy_rows(verifier, vocab, texts, args.tokens)
  batch = {"inputs": jnp.asarray(ids), "weights": jnp.asarray(weights)}
  record = bench.new_record("head_acceptance", bench.command_line(argv, "python scripts/head_acceptance.py"),
                            ["head", "draft", "stop_below"], verifier=args.verifier, prompts=args.prompts,
                            examples=len(texts), tokens=args.tokens, gamma=args.gamma)
  for spec in args.heads:
    drafter = exports.load_drafter(spec, verifier)
    head, reads = drafter.head, drafter.decoding_verifier(verifier)   # fused features where the head reads them
    sums = feature_head.evaluate(head, reads, [batch], unroll=args.gamma)
    accepted, confidences = map(np.asarray, feature_head.accepted_lengths(head, reads, batch["inputs"],
                                                                          batch["weights"], args.gamma))
    rows = chain_rows(spec, sums, accepted, prompt_lengths, answer_lengths, args.gamma)
    stopped = stop_rows(spec, accepted, confidences, prompt_lengths, answer_lengths, args.gamma, args.stop_below)
    record["rows"] += rows + stopped
    print(f"{spec}: {int(sums['tokens'])} positions, a_r " + " ".join(
        f"{row['acceptance_given_earlier']:.3f}" for row in rows) + f"; tokens per call at γ = 1 … {args.gamma}, "
          "replayed: " + " ".join(f"{row['tokens_per_call_replayed']:.2f}" for row in rows) + "".join(
          f"; stop below {row['stop_below']:g}: {row['tokens_per_call_replayed']:.2f} tokens per call, "
          f"{row['drafts_per_block']:.2f} drafts per block" for row in stopped), flush=True)
  markdown = (f"{len(texts)} prompts of {args.prompts}, the verifier's greedy answers ({args.tokens} new tokens at "
              f"most); T = 0, teacher-forced chains from every answer position.\n\n" + bench.markdown_table(record["rows"]))
  bench.write_record(record, args.out, markdown)


if __name__ == "__main__":
  main(sys.argv[1:])
