"""What decoding costs on this machine's JAX backend (CPU, GPU or TPU), in one command.

  python scripts/bench_backend.py          # or: make bench
  python scripts/bench_backend.py --quick  # the shipped pair only, fewer repeats: part of `make device-check`

Measures on `jax.default_backend()`, every ratio within this one run:
  1. `score` of n = 1 … 8 tokens after a 64-token prefix, at batch 1 and 8, in ms and relative to n = 1:
     the shipped pair (data/models/debian_drafter, debian_verifier) and random-weight 6m / 97m (SpecTr's
     LM1B sizes), float32 and the 97m in bfloat16 (`--quick`: the shipped pair only).
  2. autoregressive vs speculative decoding (γ = 3 and 5; greedy and T = 1) of the shipped pair on
     debian_synopsis validation prompts, 64 new tokens, at batch 1 and 8: tokens/s and speed-up;
  3. top-P at [8, 9, 32k] (a verification's p at batch 8, γ = 8) with each search against a softmax;
  4. the speculative run on a (data, model = 1) mesh of all local devices, batch 8 (not with `--quick`);
  5. the shipped pair in bfloat16 (weights and caches) against float32: greedy tokens that agree (on 8
     validation prompts, 64 tokens each) and tokens/s, autoregressive and speculative γ = 5, batch 8.
Writes experiments/backend_<backend>/results.json and results.md (machine, commit, command; `--quick`:
results_quick.*).

Every figure is printed as it is measured, with the seconds elapsed since the start. Programs are compiled
once per shape (the 64-token prefix too, jitted) and kept in JAX's persistent compilation cache
(`--cache_dir`), so that a second run on the same machine compiles almost nothing: XLA:GPU takes 1–4.5 s
per program.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding, models, sampling
from specdec.data import tasks
from specdec.evaluation.timing import median_seconds
from specdec.models import partitioning
from specdec.training import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX, NEW_TOKENS, TASK = 64, 64, "debian_synopsis"
_START = time.monotonic()


def _log(message: str) -> None:
  print(f"[{time.monotonic() - _START:6.1f} s] {message}", flush=True)


def _machine() -> dict:
  device = jax.devices()[0]
  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                         text=True).stdout.strip()
  return {"backend": jax.default_backend(), "device": device.device_kind, "devices": jax.local_device_count(),
          "cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
          "commit": commit.stdout.strip() + (" (+ uncommitted changes)" if dirty else ""),
          "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])}


def score_costs(pairs: dict, repeats: int) -> list[dict]:
  """ms of one `score` call of n tokens after a PREFIX-token prefix, per model and batch size."""
  score = jax.jit(lambda model, cache, tokens: model.score(cache, tokens).logits)
  prefill = jax.jit(lambda model, cache, tokens: model.score(cache, tokens).cache)
  rows = []
  for name, model in pairs.items():
    for batch in (1, 8):
      cache = prefill(model, model.init_cache(batch, PREFIX + 9), jnp.ones((batch, PREFIX), jnp.int32))
      times = [median_seconds(score, model, cache, jnp.ones((batch, n), jnp.int32), repeats=repeats)
               for n in range(1, 9)]
      rows.append({"model": name, "batch": batch, "ms": [1e3 * t for t in times],
                   "relative": [t / times[0] for t in times]})
      _log(f"score {name} batch {batch}: " + " ".join(f"{1e3 * t:.2f}" for t in times) + " ms")
  return rows


def decoding_speed(drafter, verifier, prompts, lengths, repeats: int, mesh=None) -> list[dict]:
  """Tokens/s of autoregressive and speculative decoding (γ 3, 5; T 0, 1) at the prompts' batch size."""
  if mesh is not None:
    drafter, verifier = partitioning.shard_model(drafter, mesh), partitioning.shard_model(verifier, mesh)
    prompts = partitioning.shard_batch(jnp.asarray(prompts), mesh)
  rows = []
  for temperature in (0.0, 1.0):
    runs = [("autoregressive", {})] + [("speculative", {"gamma": g}) for g in ((5,) if mesh else (3, 5))]
    baseline = None
    for method, params in runs:
      kw = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=temperature, eos_id=None, **params)
      out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, lengths, **kw)
      seconds = median_seconds(lambda: decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts,
                                                         lengths, **kw).tokens, repeats=repeats)
      tokens_per_s = int(np.sum(out.lengths)) / seconds
      baseline = baseline or tokens_per_s
      stats = jax.tree.map(lambda x: int(np.sum(x)), out.stats)
      rows.append({"method": method, **params, "temperature": temperature, "batch": int(prompts.shape[0]),
                   "tokens_per_s": tokens_per_s, "speedup": tokens_per_s / baseline,
                   "accepted_per_drafted": stats.accepted / stats.drafted if stats.drafted else None,
                   "drafter_calls": stats.drafter_calls, "verifier_calls": stats.verifier_calls})
      _log(f"decode batch {prompts.shape[0]} T={temperature} {method} {params}: {tokens_per_s:.1f} tokens/s "
           f"({tokens_per_s / baseline:.2f}×)")
  return rows


def top_p_costs(repeats: int) -> list[dict]:
  """ms of S(·) at top-P 0.9 by each search, and of a softmax, at [8, 9, 32k]."""
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, 9, 32_000)) * 3, jnp.float32)
  softmax = jax.jit(jax.nn.softmax)
  base = median_seconds(softmax, logits, repeats=repeats)
  rows = [{"what": "softmax", "ms": 1e3 * base, "relative": 1.0}]
  for method in ("bisection", "top_k"):
    seconds = median_seconds(lambda: sampling.transform(logits, 1.0, 0.9, method=method), repeats=repeats)
    rows.append({"what": f"top-P 0.9 ({method})", "ms": 1e3 * seconds, "relative": seconds / base})
    _log(f"top-P 0.9 by {method}: {1e3 * seconds:.2f} ms ({seconds / base:.1f} softmaxes)")
  return rows


def bfloat16_agreement(drafter, verifier, prompts, lengths, repeats: int) -> list[dict]:
  """Greedy tokens of the pair in bfloat16 against float32 (same prompts), and the speed of each."""
  rows, reference = [], {}
  for dtype in ("float32", "bfloat16"):
    pair = [models.with_dtype(m, getattr(jnp, dtype)) for m in (drafter, verifier)]
    for method, params in (("autoregressive", {}), ("speculative", {"gamma": 5})):
      kw = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=None, **params)
      tokens = np.asarray(decoding.generate(jax.random.PRNGKey(0), *pair, prompts, lengths, **kw).tokens)
      seconds = median_seconds(lambda: decoding.generate(jax.random.PRNGKey(0), *pair, prompts, lengths,
                                                         **kw).tokens, repeats=repeats)
      want = reference.setdefault(method, tokens)
      agree = tokens == want
      first_difference = np.where(agree.all(axis=1), agree.shape[1], np.argmin(agree, axis=1))
      rows.append({"dtype": dtype, "method": method, **params, "tokens_per_s": tokens.size / seconds,
                   "same_tokens": float(agree.mean()), "mean_identical_prefix": float(first_difference.mean())})
      _log(f"{dtype} {method}: {tokens.size / seconds:.1f} tokens/s, {agree.mean():.3f} of tokens as float32's, "
           f"identical prefix {first_difference.mean():.1f} of {NEW_TOKENS}")
  return rows


def _markdown(result: dict) -> str:
  m = result["machine"]
  lines = [f"# Decoding costs on {m['backend']} ({m['device']}, {m['devices']} local devices)", "",
           f"machine: {m['platform']}, {m['cpus']} cpus, jax {m['jax']}; commit {m['commit']}",
           f"command: `{m['command']}` ({result['seconds']:.0f} s)", "",
           "## score(n tokens) after a 64-token prefix, ms (relative to n = 1)", "",
           "| model | batch | " + " | ".join(f"n={n}" for n in range(1, 9)) + " |", "|---|---:|" + "---:|" * 8]
  for row in result["score"]:
    lines.append(f"| {row['model']} | {row['batch']} | " + " | ".join(
        f"{ms:.2f} ({rel:.2f})" for ms, rel in zip(row["ms"], row["relative"])) + " |")
  lines += ["", f"## Decoding the shipped pair, {NEW_TOKENS} new tokens, {TASK} prompts", "",
            "| batch | T | method | γ | tokens/s | speed-up | accepted / drafted |", "|---:|---:|---|---:|---:|---:|---:|"]
  mesh = result.get("mesh", {"decoding": []})
  for row in result["decoding"] + mesh["decoding"]:
    accepted = "" if row["accepted_per_drafted"] is None else f"{row['accepted_per_drafted']:.2f}"
    where = f" (mesh {mesh['shape']})" if row in mesh["decoding"] else ""
    lines.append(f"| {row['batch']}{where} | {row['temperature']:g} | {row['method']} | {row.get('gamma', '')} | "
                 f"{row['tokens_per_s']:.1f} | {row['speedup']:.2f}× | {accepted} |")
  lines += ["", "## S(·) at [8, 9, 32000]", "", "| what | ms | softmaxes |", "|---|---:|---:|"]
  lines += [f"| {row['what']} | {row['ms']:.2f} | {row['relative']:.1f} |" for row in result["top_p"]]
  lines += ["", "## bfloat16 weights and caches against float32 (shipped pair, greedy, batch 8)", "",
            "| dtype | method | tokens/s | tokens as float32's | identical prefix (of 64) |", "|---|---|---:|---:|---:|"]
  lines += [f"| {row['dtype']} | {row['method']} | {row['tokens_per_s']:.1f} | {row['same_tokens']:.3f} | "
            f"{row['mean_identical_prefix']:.1f} |" for row in result["bfloat16"]]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run, not a measurement")
  parser.add_argument("--models", default=os.path.join(ROOT, "data", "models"))
  parser.add_argument("--out", default=None, help="default: experiments/backend_<backend>/")
  parser.add_argument("--cache_dir", default=os.path.join(ROOT, ".cache", "jax"),
                      help="JAX's persistent compilation cache (default .cache/jax)")
  args = parser.parse_args()
  jax.config.update("jax_compilation_cache_dir", args.cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  repeats = 3 if args.quick else 10
  start = time.perf_counter()
  result = {"machine": _machine()}
  _log(json.dumps(result["machine"]))
  drafter = load_model(os.path.join(args.models, "debian_drafter"))
  verifier = load_model(os.path.join(args.models, "debian_verifier"))
  vocab = verifier.vocab_size
  scored = {"shipped drafter (2m)": drafter, "shipped verifier (15m)": verifier}
  if not args.quick:
    big = models.build("97m", vocab_size=vocab, seed=2)
    scored.update({"random 6m": models.build("6m", vocab_size=vocab, seed=1), "random 97m": big,
                   "random 97m bf16": models.with_dtype(big, jnp.bfloat16)})
  result["score"] = score_costs(scored, repeats)
  split = tasks.tokenized(TASK, "validation")
  result["decoding"] = []
  for batch in (1, 8):
    prompts, lengths = split.prompts(np.arange(batch))
    result["decoding"] += decoding_speed(drafter, verifier, prompts, lengths, max(2, repeats // 3))
  result["top_p"] = top_p_costs(repeats)
  prompts, lengths = split.prompts(np.arange(8))
  result["bfloat16"] = bfloat16_agreement(drafter, verifier, prompts, lengths, max(2, repeats // 3))
  if not args.quick:
    mesh = partitioning.make_mesh(-1, 1)
    prompts, lengths = split.prompts(np.arange(8 * mesh.shape["data"]))
    result["mesh"] = {"shape": dict(mesh.shape), "decoding": decoding_speed(
        drafter, verifier, prompts, lengths, max(2, repeats // 3), mesh=mesh)}
  result["seconds"] = time.perf_counter() - start
  out = args.out or os.path.join(ROOT, "experiments", f"backend_{jax.default_backend()}")
  os.makedirs(out, exist_ok=True)
  stem = "results_quick" if args.quick else "results"     # a quick run never replaces a full one
  with open(os.path.join(out, f"{stem}.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(out, f"{stem}.md"), "w") as f:
    f.write(_markdown(result))
  print(_markdown(result))


if __name__ == "__main__":
  main()
