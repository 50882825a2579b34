"""Head to head with Hugging Face transformers: the same T5 weights, the same prompts, greedy, tokens/s.

No T5 pair is shipped (`data/models` holds decoder-only exports; the trained T5 pair of
experiments/t5_pair/README.md is not), so the weights are random T5 v1.1: a verifier of
6 + 6 layers, d_model 512 (8 heads × 64, MLP 1024) over the shipped vocabulary's 8192 tokens, and a drafter
cut from it (its first `--drafter-layers` decoder layers; embedding, encoder and head shared). Both are
exported with `save_hf_t5`, loaded by `T5ForConditionalGeneration.from_pretrained` and read back with
`load_hf_t5`, so both libraries run the very same float32 weights.

Random weights decide the acceptance, so the output head comes in three settings (`--heads`):
  tied    head = the input embedding, as transformers ≥ 5 initialises a random T5: greedy output copies one
          token per row and every draft is accepted, which flatters both libraries (the issue's setting);
  mixed   embedding + `--mix` × an independent head: acceptance below 1, outputs still repetitive;
  untied  specdec's own (T5X) initialisation: varied outputs, and the cut drafter almost never agrees.

Prompts: `--examples` seeded rows of the task's validation split (`source='auto'`: the shipped sample), each
the whole T5 encoder input ("summarize: <document>"). Greedy, `--tokens` new tokens per row, no EOS (every
row does the same work). Per setting, example by example (so every ratio comes from one run): transformers
`generate` (cached greedy) and specdec `generate(method='autoregressive')`, transformers
`generate(assistant_model=drafter)` with γ drafts per block (constant schedule, no confidence stop: the
blocks specdec makes) and specdec `generate(method='speculative', gamma=γ)`, all at batch 1 (transformers'
assisted generation has no batch > 1); after each group of 8 examples, specdec on those 8 as one batch.
Every output is checked against transformers' greedy tokens.

Where the time goes, per setting: specdec's per-call costs (jitted `prefill` and `score`, measured after each
example and each batch between the timed runs) split its time into prefills, model calls and the loop's own
overhead; forward hooks split transformers' time into its forward calls and generate's Python loop.

  specdec-bench peer [--task debian_synopsis] [--source auto] [--examples 16] [--tokens 32] [--gamma 3]
                     [--drafter-layers 1] [--heads tied mixed untied] [--mix 80] [--torch-threads 1]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from specdec import decoding, models
from specdec.data import tasks
from specdec.evaluation import bench
from specdec.models import base, t5
from specdec.training import load_hf_t5, save_hf_t5

VERIFIER = t5.T5Config(vocab_size=8192, embed_dim=512, num_heads=8, head_dim=64, hidden_dim=1024, num_encoder_layers=6,
                       num_decoder_layers=6, max_len=128)
BATCH = 8
MODES = ("hf_autoregressive", "specdec_autoregressive", "hf_assisted", "specdec_speculative")

_prefill = jax.jit(base.prefill)
_score_cache = jax.jit(lambda model, cache, tokens: model.score(cache, tokens).cache)


def _with_head(model: t5.T5, head: str, mix: float) -> t5.T5:
  """`model` with the output head of a setting (module docstring): its embedding, mixed, or its own."""
  embedding, kernel = model.params["token_embedder"]["embedding"], model.params["decoder"]["logits_dense"]["kernel"]
  new = {"tied": embedding.T, "mixed": embedding.T + mix * kernel, "untied": kernel}[head]
  decoder = {**model.params["decoder"], "logits_dense": {"kernel": new}}
  return model.replace(params={**model.params, "decoder": decoder})


def _cut(model: t5.T5, n_layers: int) -> t5.T5:
  """The drafter: `model` with only its first n decoder layers (everything else shared)."""
  decoder = {name: value for name, value in model.params["decoder"].items()
             if not name.startswith("layers_") or int(name.split("_")[1]) < n_layers}
  return t5.T5({**model.params, "decoder": decoder}, dataclasses.replace(model.config, num_decoder_layers=n_layers))


class ForwardClock:
  """Calls and seconds inside the forward of each hooked torch module (transformers' own work per call)."""

  def __init__(self, modules: dict[str, torch.nn.Module]):
    self.calls, self.seconds = collections.Counter(), collections.Counter()
    for name, module in modules.items():
      module.register_forward_pre_hook(lambda *_, name=name: self.seconds.subtract({name: time.perf_counter()}))
      module.register_forward_hook(lambda *_, name=name: self._stop(name))

  def _stop(self, name: str) -> None:
    self.seconds[name] += time.perf_counter()
    self.calls[name] += 1

  def reset(self) -> None:
    self.calls.clear()
    self.seconds.clear()


def _export(model: t5.T5, directory: str) -> tuple[t5.T5, Any]:
  """(specdec model, transformers model) read back from `model`'s Hugging Face export."""
  save_hf_t5(model, directory)
  hf, info = transformers.T5ForConditionalGeneration.from_pretrained(directory, output_loading_info=True)
  if any(info.values()):
    raise RuntimeError(f"transformers did not load {directory} cleanly: {info}")
  hf.generation_config.eos_token_id = None   # no EOS: every row decodes --tokens tokens
  return load_hf_t5(directory, max_length=model.config.max_len), hf.eval()


def _counters(out: decoding.Output) -> dict[str, int]:
  """Totals over the rows, and the loop's iterations: a batched call serves every row at once."""
  stats = out.stats
  return {"verifier_calls": int(stats.verifier_calls.sum()), "drafter_calls": int(stats.drafter_calls.sum()),
          "drafted": int(stats.drafted.sum()), "accepted": int(stats.accepted.sum()),
          "generated": int(stats.generated.sum()), "loop_verifier_calls": int(stats.verifier_calls.max()),
          "loop_drafter_calls": int(stats.drafter_calls.max())}


def _groups(n: int) -> list[np.ndarray]:
  return [np.arange(start, min(start + BATCH, n)) for start in range(0, n, BATCH)]


def _call_costs(verifier: t5.T5, drafter: t5.T5, prompts: np.ndarray, lengths: np.ndarray, gamma: int,
                context: int, repeats: int) -> collections.Counter:
  """Median seconds of specdec's calls on these rows as one batch: each model's prefill of the prompts, and
  the verifier scoring 1 and γ+1 decoder positions and the drafter 1 after `context` positions."""
  prompts, lengths = jnp.asarray(prompts[:, :tasks.bucket_width(lengths.max())]), jnp.asarray(lengths)
  costs = collections.Counter()
  for name, model in (("verifier", verifier), ("drafter", drafter)):
    empty = model.init_cache(len(lengths), context + gamma + 1)
    costs[f"{name} prefill"] = bench.median_seconds(_prefill, model, empty, prompts, lengths, repeats=repeats)
    _, cache = _prefill(model, empty, prompts, lengths)
    cache = _score_cache(model, cache, jnp.ones((len(lengths), context), jnp.int32))
    for n in ((1, gamma + 1) if name == "verifier" else (1,)):
      costs[f"{name} {n}"] = bench.median_seconds(bench.score_logits, model, cache,
                                                  jnp.ones((len(lengths), n), jnp.int32), repeats=repeats)
  return costs


def run_setting(head: str, args: argparse.Namespace, prompts: np.ndarray, lengths: np.ndarray,
                base_verifier: t5.T5, workdir: str) -> dict[str, Any]:
  """Times every mode on every prompt for one head setting; returns totals, counters and outputs."""
  verifier, hf_verifier = _export(_with_head(base_verifier, head, args.mix), os.path.join(workdir, f"{head}_v"))
  drafter, hf_drafter = _export(_cut(verifier, args.drafter_layers), os.path.join(workdir, f"{head}_d"))
  hf_drafter.generation_config.update(num_assistant_tokens=args.gamma, num_assistant_tokens_schedule="constant",
                                      assistant_confidence_threshold=0.0)
  clock = ForwardClock({"verifier decoder": hf_verifier, "verifier encoder": hf_verifier.encoder,
                        "drafter decoder": hf_drafter, "drafter encoder": hf_drafter.encoder})
  settings = dict(do_sample=False, num_beams=1, max_new_tokens=args.tokens, decoder_start_token_id=0,
                  pad_token_id=0)

  def hf(row: int, assisted: bool) -> np.ndarray:
    ids = torch.from_numpy(prompts[row:row + 1, :lengths[row]]).long()
    with torch.inference_mode():
      out = hf_verifier.generate(input_ids=ids, assistant_model=hf_drafter if assisted else None, **settings)
    return out.numpy()[:, 1:]

  def ours(rows: np.ndarray, method: str) -> decoding.Output:
    width = tasks.bucket_width(lengths[rows].max())
    out = decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts[rows, :width], lengths[rows],
                            method=method, gamma=args.gamma, temperature=0.0, max_new_tokens=args.tokens, eos_id=None)
    return jax.tree.map(np.asarray, out)

  run = {"hf_autoregressive": lambda r: hf(r, False), "hf_assisted": lambda r: hf(r, True),
         "specdec_autoregressive": lambda r: ours(np.array([r]), "autoregressive"),
         "specdec_speculative": lambda r: ours(np.array([r]), "speculative")}
  batched = {f"specdec_{method}_batch{BATCH}": functools.partial(ours, method=method)
             for method in ("speculative", "autoregressive")}
  outputs, counters = collections.defaultdict(list), collections.defaultdict(collections.Counter)
  hf_calls, hf_seconds = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)

  def timed(mode: str, run: Any) -> Any:
    def call(item: Any, _) -> Any:
      clock.reset()
      return run(item)
    return call

  def keep(mode: str, out: Any) -> None:
    if mode.startswith("hf"):
      outputs[mode].append(out[0])
      hf_calls[mode].update(clock.calls)
      hf_seconds[mode].update(clock.seconds)
    else:
      outputs[mode].extend(out.tokens)
      counters[mode].update(_counters(out))

  # Every mode on each example in turn, then the batched modes on each group of BATCH examples in turn
  # (`bench.interleaved`: compiles and torch's first calls untimed).
  rows, groups = range(len(prompts)), _groups(len(prompts))
  seconds = collections.Counter()
  for modes, items in ((dict((mode, run[mode]) for mode in MODES), rows), (batched, groups)):
    names = list(modes)
    elapsed = bench.interleaved([timed(mode, modes[mode]) for mode in names], items,
                                on_output=lambda i, _, out: keep(names[i], out))
    seconds.update(dict(zip(names, elapsed.sum(axis=1))))
  tokens = collections.Counter({mode: sum(len(row) for row in out) for mode, out in outputs.items()})
  costs = {1: collections.Counter(), BATCH: collections.Counter()}   # summed over the examples / the groups
  for row in rows:
    costs[1].update(_call_costs(verifier, drafter, prompts[[row]], lengths[[row]], args.gamma, args.tokens // 2,
                                args.repeats))
  for group in groups:
    costs[BATCH].update(_call_costs(verifier, drafter, prompts[group], lengths[group], args.gamma, args.tokens // 2,
                                    args.repeats))
  reference = np.stack(outputs["hf_autoregressive"])
  mismatches = {mode: int((np.stack(out) != reference).any(axis=1).sum()) for mode, out in outputs.items()}
  distinct = np.mean([len(set(row.tolist())) for row in reference])
  return dict(head=head, seconds=seconds, tokens=tokens, counters=counters, hf_calls=hf_calls,
              hf_seconds=hf_seconds, mismatches=mismatches, distinct=distinct, costs=costs)


def profile(result: dict[str, Any], args: argparse.Namespace) -> None:
  """Where the time goes. specdec: its prefills and its loop iterations (one verifier call each, batched
  over the rows), split into model calls (per-call costs measured between the timed runs) and the loop's
  own overhead (sampling, verification, bookkeeping, dispatch). transformers: inside its forward calls
  (encoder, decoder steps) and outside them (generate's Python loop)."""
  seconds, counters, costs, g = result["seconds"], result["counters"], result["costs"], args.gamma
  n_calls = {1: args.examples, BATCH: args.examples // BATCH}
  mean = {batch: {name: value / n_calls[batch] for name, value in costs[batch].items()} for batch in costs}
  for batch in (1, BATCH):
    print(f"specdec calls at batch {batch} (medians of {args.repeats}, mean over the run): prefill verifier "
          f"{1e3 * mean[batch]['verifier prefill']:.2f} ms, drafter {1e3 * mean[batch]['drafter prefill']:.2f} ms; "
          f"score verifier 1 position {1e3 * mean[batch]['verifier 1']:.2f} ms, {g + 1} positions "
          f"{1e3 * mean[batch][f'verifier {g + 1}']:.2f} ms, drafter 1 position "
          f"{1e3 * mean[batch]['drafter 1']:.2f} ms")
  print(f"one call at batch {BATCH} / batch 1: " + ", ".join(
      f"{name} {mean[BATCH][name] / mean[1][name]:.2f}x" for name in costs[1]) + f" (prefills: {BATCH} padded "
        f"prompts in one call against one prompt at its own width)")
  for mode in ("specdec_autoregressive", "specdec_speculative", f"specdec_autoregressive_batch{BATCH}",
               f"specdec_speculative_batch{BATCH}"):
    c, batch = counters[mode], BATCH if mode.endswith(f"batch{BATCH}") else 1
    speculative = "speculative" in mode
    prefills = costs[batch]["verifier prefill"] + speculative * costs[batch]["drafter prefill"]
    iterations = c["loop_verifier_calls"]
    per_iteration = (mean[batch][f"verifier {g + 1}"] + c["loop_drafter_calls"] / iterations
                     * mean[batch]["drafter 1"]) if speculative else mean[batch]["verifier 1"]
    loop = (seconds[mode] - prefills) / iterations
    print(f"{mode}: {seconds[mode]:.2f} s = prefills {prefills:.2f} s ({prefills / seconds[mode]:.0%}) + "
          f"{iterations} loop iterations x {1e3 * loop:.2f} ms (model calls {1e3 * per_iteration:.2f} ms, "
          f"loop overhead {1e3 * (loop - per_iteration):.2f} ms)")
  for mode, calls in result["hf_calls"].items():
    secs = result["hf_seconds"][mode]
    outside = seconds[mode] - sum(secs.values())
    print(f"{mode}: {seconds[mode]:.2f} s = " + " + ".join(
        f"{name} {secs[name]:.2f} s ({calls[name] / args.examples:.1f} calls/row x "
        f"{1e3 * secs[name] / calls[name]:.2f} ms)" for name in sorted(calls))
          + f" + outside forward calls {outside:.2f} s ({outside / seconds[mode]:.0%})")


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
  """Prints one setting's table, ratios, counters and where the time goes."""
  seconds, tokens, counters = result["seconds"], result["tokens"], result["counters"]
  rate = {mode: tokens[mode] / seconds[mode] for mode in seconds}
  print(f"\n== head '{result['head']}': {result['distinct']:.1f} distinct tokens per row of {args.tokens} "
        f"(verifier greedy); rows whose tokens differ from transformers' greedy ones: "
        + ", ".join(f"{mode} {n}/{args.examples}" for mode, n in result["mismatches"].items()))
  print(f"{'mode':34s} {'tokens/s':>9s} {'ms/token':>9s}")
  for mode in (*MODES, f"specdec_speculative_batch{BATCH}", f"specdec_autoregressive_batch{BATCH}"):
    print(f"{mode:34s} {rate[mode]:9.1f} {1e3 / rate[mode]:9.2f}")
  print(f"specdec / transformers at batch 1: autoregressive "
        f"{rate['specdec_autoregressive'] / rate['hf_autoregressive']:.2f}x, speculative "
        f"{rate['specdec_speculative'] / rate['hf_assisted']:.2f}x")
  print(f"speculative / autoregressive: specdec {rate['specdec_speculative'] / rate['specdec_autoregressive']:.2f}x, "
        f"transformers {rate['hf_assisted'] / rate['hf_autoregressive']:.2f}x")
  print(f"specdec batch {BATCH} / batch 1 throughput: speculative "
        f"{rate[f'specdec_speculative_batch{BATCH}'] / rate['specdec_speculative']:.2f}x, autoregressive "
        f"{rate[f'specdec_autoregressive_batch{BATCH}'] / rate['specdec_autoregressive']:.2f}x")
  for mode in ("specdec_speculative", f"specdec_speculative_batch{BATCH}"):
    c = counters[mode]
    print(f"{mode}: acceptance {c['accepted'] / max(c['drafted'], 1):.3f} (accepted/drafted), "
          f"{c['generated'] / c['verifier_calls']:.2f} tokens per verifier call, "
          f"{c['drafter_calls'] / c['verifier_calls']:.2f} drafter calls per verifier call")
  calls = result["hf_calls"]["hf_assisted"]
  print(f"hf_assisted: {tokens['hf_assisted'] / calls['verifier decoder']:.2f} tokens per verifier call, "
        f"{calls['drafter decoder'] / calls['verifier decoder']:.2f} drafter calls per verifier call")
  profile(result, args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--task", default="debian_synopsis")
  parser.add_argument("--source", default="auto")
  parser.add_argument("--examples", type=int, default=16, help="validation prompts (a multiple of 8)")
  parser.add_argument("--tokens", type=int, default=32, help="new tokens per row")
  parser.add_argument("--gamma", type=int, default=3)
  parser.add_argument("--drafter-layers", type=int, default=1)
  parser.add_argument("--heads", nargs="+", default=["tied", "mixed", "untied"],
                      choices=["tied", "mixed", "untied"])
  parser.add_argument("--mix", type=float, default=80.0, help="weight of the independent head in 'mixed'")
  parser.add_argument("--repeats", type=int, default=3, help="repeats of each per-call cost (per example)")
  parser.add_argument("--seed", type=int, default=0)
  # On this shared 2-core machine torch's default (one OpenMP thread per core) ran a 32-token generate 5x slower
  # than one thread whenever other jobs ran (3.0 s vs 0.5-0.6 s): the peer gets its faster setting.
  parser.add_argument("--torch-threads", type=int, default=1, help="torch's intra-op threads (0: torch's default)")


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  if args.examples % BATCH:
    raise ValueError(f"--examples must be a multiple of {BATCH}; got {args.examples}")
  transformers.logging.set_verbosity_error()   # generate's per-call notices; loading is checked by _export

  split = tasks.tokenized(args.task, "validation", source=args.source, encoder_decoder=True)
  rows = np.sort(np.random.default_rng(args.seed).permutation(len(split))[:args.examples])
  prompts, lengths = split.prompts(rows)
  prompts = np.pad(prompts, ((0, 0), (0, tasks.bucket_width(prompts.shape[1]) - prompts.shape[1])))
  base_verifier = t5.init(VERIFIER, jax.random.PRNGKey(args.seed))
  print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}")
  print(f"verifier: random T5 v1.1, {VERIFIER.num_encoder_layers}+{VERIFIER.num_decoder_layers} layers, d_model "
        f"{VERIFIER.embed_dim}, {VERIFIER.num_heads} heads x {VERIFIER.head_dim}, MLP {VERIFIER.hidden_dim}, vocab "
        f"{VERIFIER.vocab_size} ({models.count_params(base_verifier):,} params); drafter: its first "
        f"{args.drafter_layers} decoder layer(s), the rest shared "
        f"({models.count_params(_cut(base_verifier, args.drafter_layers)):,} params)")
  print(f"task {args.task} validation ({args.source}): {args.examples} prompts of {lengths.min()}-{lengths.max()} "
        f"tokens (mean {lengths.mean():.0f}); greedy, {args.tokens} new tokens per row, no EOS, gamma = {args.gamma}; "
        f"float32 on CPU for both; random weights (module docstring: what each head setting does to acceptance)")
  with tempfile.TemporaryDirectory() as workdir:
    results = [run_setting(head, args, prompts, lengths, base_verifier, workdir) for head in args.heads]
  for result in results:
    report(result, args)
  record = bench.new_record("peer", command, keys=("head", "mode"), torch=torch.__version__,
                            transformers=transformers.__version__, torch_threads=torch.get_num_threads(),
                            **{k: v for k, v in vars(args).items() if k in ("task", "examples", "tokens", "gamma")})
  for result in results:
    report(result, args)
    for mode, seconds in result["seconds"].items():
      record["rows"].append({"head": result["head"], "mode": mode, "tokens_per_s": result["tokens"][mode] / seconds,
                             "rows_unlike_hf_greedy": result["mismatches"][mode]})
  print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
  return record, bench.markdown_table(record["rows"]) + "\n"
