"""What decoding costs on this machine's JAX backend (CPU, GPU or TPU), in one command.

  specdec-bench backend           # or: make bench
  specdec-bench backend --quick   # the shipped pair only, fewer repeats: part of `make device-check`

Measures on `jax.default_backend()`, every ratio within this one run:
  1. `score` of n = 1 … 8 tokens after a 64-token prefix, at batch 1 and 8, in ms and relative to n = 1:
     the shipped pair (data/models/debian_drafter, debian_verifier) and random-weight 6m / 97m (SpecTr's
     LM1B sizes), float32 and the 97m in bfloat16 (`--quick`: the shipped pair only);
  2. autoregressive vs speculative decoding (γ = 3 and 5; greedy and T = 1) of the shipped pair on
     debian_synopsis validation prompts, 64 new tokens, at batch 1 and 8: tokens/s and speed-up;
  3. top-P at [8, 9, 32k] (a verification's p at batch 8, γ = 8) with each search against a softmax;
  4. the speculative run on a (data, model = 1) mesh of all local devices, batch 8 (not with `--quick`);
  5. the shipped pair in bfloat16 (weights and caches) against float32: greedy tokens that agree (on 8
     validation prompts, 64 tokens each) and tokens/s, autoregressive and speculative γ = 5, batch 8.
Writes experiments/backend_<backend>/results.{json,md} (`--quick`: results_quick.*) unless `--out` says where.

Every figure is printed as it is measured, with the seconds elapsed since the start. Programs are compiled
once per shape and kept in JAX's persistent compilation cache (`--cache_dir`), so that a second run on the
same machine compiles almost nothing: XLA:GPU takes 1–4.5 s per program.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

PREFIX, NEW_TOKENS, TASK = 64, 64, "debian_synopsis"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  from specdec.evaluation.bench import REPO_ROOT
  parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run, not a measurement")
  parser.add_argument("--models", default=os.path.join(REPO_ROOT, "data", "models"))
  parser.add_argument("--cache_dir", default=os.path.join(REPO_ROOT, ".cache", "jax"),
                      help="JAX's persistent compilation cache (default .cache/jax)")


def decoding_speed(drafter, verifier, prompts, lengths, repeats: int, mesh=None) -> list[dict]:
  """Tokens/s of autoregressive and speculative decoding (γ 3, 5; T 0, 1) at the prompts' batch size."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import decoding
  from specdec.evaluation import bench
  from specdec.models import partitioning
  if mesh is not None:
    drafter, verifier = partitioning.shard_model(drafter, mesh), partitioning.shard_model(verifier, mesh)
    prompts = partitioning.shard_batch(jnp.asarray(prompts), mesh)
  rows = []
  for temperature in (0.0, 1.0):
    runs = [("autoregressive", {})] + [("speculative", {"gamma": g}) for g in ((5,) if mesh else (3, 5))]
    baseline = None
    for method, params in runs:
      kw = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=temperature, eos_id=None, **params)
      decode = lambda: decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, **kw)  # noqa: E731
      out = decode()
      tokens_per_s = int(np.sum(out.lengths)) / bench.median_seconds(lambda: decode().tokens, repeats=repeats)
      baseline = baseline or tokens_per_s
      stats = jax.tree.map(lambda x: int(np.sum(x)), out.stats)
      rows.append({"part": "decoding" if mesh is None else f"decoding on mesh {dict(mesh.shape)}", "method": method,
                   "gamma": params.get("gamma"), "temperature": temperature, "batch": int(prompts.shape[0]),
                   "tokens_per_s": tokens_per_s, "speedup": tokens_per_s / baseline,
                   "accepted_per_drafted": stats.accepted / stats.drafted if stats.drafted else None,
                   "drafter_calls": stats.drafter_calls, "verifier_calls": stats.verifier_calls})
      bench.log(f"decode batch {prompts.shape[0]} T={temperature} {method} {params}: {tokens_per_s:.1f} tokens/s "
                f"({tokens_per_s / baseline:.2f}×)")
  return rows


def top_p_costs(repeats: int) -> list[dict]:
  """ms of S(·) at top-P 0.9 by each search, and of a softmax, at [8, 9, 32k]."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import sampling
  from specdec.evaluation import bench
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, 9, 32_000)) * 3, jnp.float32)
  base = bench.median_seconds(jax.jit(jax.nn.softmax), logits, repeats=repeats)
  rows = [{"part": "top_p", "what": "softmax", "ms": 1e3 * base, "relative": 1.0}]
  for method in ("bisection", "top_k"):
    seconds = bench.median_seconds(lambda: sampling.transform(logits, 1.0, 0.9, method=method), repeats=repeats)
    rows.append({"part": "top_p", "what": f"top-P 0.9 ({method})", "ms": 1e3 * seconds, "relative": seconds / base})
    bench.log(f"top-P 0.9 by {method}: {1e3 * seconds:.2f} ms ({seconds / base:.1f} softmaxes)")
  return rows


def bfloat16_agreement(drafter, verifier, prompts, lengths, repeats: int) -> list[dict]:
  """Greedy tokens of the pair in bfloat16 against float32 (same prompts), and the speed of each."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import decoding, models
  from specdec.evaluation import bench
  rows, reference = [], {}
  for dtype in ("float32", "bfloat16"):
    pair = [models.with_dtype(m, getattr(jnp, dtype)) for m in (drafter, verifier)]
    for method, params in (("autoregressive", {}), ("speculative", {"gamma": 5})):
      kw = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=None, **params)
      decode = lambda: decoding.generate(jax.random.PRNGKey(0), *pair, prompts, lengths, **kw).tokens  # noqa: E731
      tokens = np.asarray(decode())
      seconds = bench.median_seconds(decode, repeats=repeats)
      agree = tokens == reference.setdefault(method, tokens)
      first_difference = np.where(agree.all(axis=1), agree.shape[1], np.argmin(agree, axis=1))
      rows.append({"part": "bfloat16", "dtype": dtype, "method": method, "gamma": params.get("gamma"),
                   "tokens_per_s": tokens.size / seconds, "same_tokens": float(agree.mean()),
                   "mean_identical_prefix": float(first_difference.mean())})
      bench.log(f"{dtype} {method}: {tokens.size / seconds:.1f} tokens/s, {agree.mean():.3f} of tokens as "
                f"float32's, identical prefix {first_difference.mean():.1f} of {NEW_TOKENS}")
  return rows


def _markdown(rows: list[dict]) -> str:
  from specdec.evaluation.bench import markdown_table
  def part(name: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "part"} for r in rows if r["part"].startswith(name)]
  score = part("score")
  widths = sorted({r["n"] for r in score})
  lines = [f"## score(n tokens) after a {PREFIX}-token prefix, ms (relative to n = 1)", "",
           "| model | batch | " + " | ".join(f"n={n}" for n in widths) + " |", "|---|---:|" + "---:|" * len(widths)]
  for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in score):
    cells = {r["n"]: r for r in score if r["model"] == model and r["batch"] == batch}
    lines.append(f"| {model} | {batch} | " + " | ".join(f"{cells[n]['ms']:.2f} ({cells[n]['relative']:.2f})"
                                                       for n in widths) + " |")
  lines += ["", f"## Decoding the shipped pair, {NEW_TOKENS} new tokens, {TASK} prompts", "",
            markdown_table([r for r in rows if r["part"].startswith("decoding")]),
            "", "## S(·) at [8, 9, 32000]", "", markdown_table(part("top_p")),
            "", "## bfloat16 weights and caches against float32 (shipped pair, greedy, batch 8)", "",
            markdown_table(part("bfloat16"))]
  return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import models
  from specdec.data import tasks
  from specdec.evaluation import bench
  from specdec.models import partitioning
  from specdec.training import load_model
  jax.config.update("jax_compilation_cache_dir", args.cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  args.out = args.out or os.path.join(bench.REPO_ROOT, "experiments", f"backend_{jax.default_backend()}",
                                      "results_quick" if args.quick else "results")   # quick never replaces full
  repeats = 3 if args.quick else 10
  record = bench.new_record("backend", command, keys=("part", "model", "what", "dtype", "method", "gamma",
                                                      "temperature", "batch", "n"), quick=args.quick)
  bench.log(str(record["machine"]))
  drafter = load_model(os.path.join(args.models, "debian_drafter"))
  verifier = load_model(os.path.join(args.models, "debian_verifier"))
  scored = {"shipped drafter (2m)": drafter, "shipped verifier (15m)": verifier}
  if not args.quick:
    big = models.build("97m", vocab_size=verifier.vocab_size, seed=2)
    scored.update({"random 6m": models.build("6m", vocab_size=verifier.vocab_size, seed=1), "random 97m": big,
                   "random 97m bf16": models.with_dtype(big, jnp.bfloat16)})
  rows = record["rows"]
  for name, model in scored.items():
    for batch in (1, 8):
      times = bench.score_seconds(model, range(1, 9), batch=batch, prefix=PREFIX, repeats=repeats)
      rows += [{"part": "score", "model": name, "batch": batch, "n": n, "ms": 1e3 * t, "relative": t / times[1]}
               for n, t in times.items()]
      bench.log(f"score {name} batch {batch}: " + " ".join(f"{1e3 * t:.2f}" for t in times.values()) + " ms")
  split = tasks.tokenized(TASK, "validation")
  for batch in (1, 8):
    prompts, lengths = split.prompts(np.arange(batch))
    rows += decoding_speed(drafter, verifier, prompts, lengths, max(2, repeats // 3))
  rows += top_p_costs(repeats)
  prompts, lengths = split.prompts(np.arange(8))
  rows += bfloat16_agreement(drafter, verifier, prompts, lengths, max(2, repeats // 3))
  if not args.quick:
    mesh = partitioning.make_mesh(-1, 1)
    prompts, lengths = split.prompts(np.arange(8 * mesh.shape["data"]))
    rows += decoding_speed(drafter, verifier, prompts, lengths, max(2, repeats // 3), mesh=mesh)
  return record, _markdown(rows)
