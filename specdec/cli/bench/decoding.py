"""Speculative against autoregressive decoding, interleaved, and the theory's prediction.

Trained pair (`--task`): drafter and verifier exports (`--drafter`, `--verifier` directories; several
drafters may be given and are compared in the same run; `maxgram` is CS Drafting's Max-Gram drafter,
`feature:DIR` the feature drafter (EAGLE) of the head in DIR over the verifier), prompts from the task's
validation split (`--batch` rows at a time, padded to the longest rounded up to 32; batch 1: each at its own
length), each batch decoded by the verifier alone and then by each drafter's speculative decoding, so every
ratio comes from timings interleaved batch by batch. Greedy and/or sampled (`--temperatures`).
Reports per γ: accepted / drafted, the per-token acceptance α that gives the measured tokens per verifier
call if acceptances were i.i.d. ((1 − α^(γ+1)) / (1 − α); EOS and max_new_tokens cut the last block, so
it is a slight underestimate), tokens per verifier call, ms per generated token, the
speed-up over the verifier alone (ratio of ms per generated token: at T > 0 the outputs differ in length),
the mean wall-clock of a block (total time / verifier calls, prefills included), the speed-up that block
cost allows if every draft were accepted, and the acceptance 1.5x would need at that block cost.

  specdec-bench decoding --task debian_synopsis --source outputs/debian \
      --drafter data/models/debian_drafter --verifier data/models/debian_verifier --gamma 3 5
  specdec-bench decoding --task debian_en_de --source outputs/debian --verifier data/models/debian_verifier \
      --drafter data/models/debian_drafter_distilled maxgram csd:data/models/debian_drafter_distilled:lower_gamma=4

With CS Drafting cascades each run also prints CSD's EWIF from its measured acceptance and costs. `--trees K …`
adds EAGLE-2's dynamic tree (`dynamic_tree`, K beams of γ) with each drafter: tokens per verifier call
against the chain's, positions scored per call and the speed-up. `--stop_below τ …` adds the chain with a
confidence stop (`confidence_stop`, at most γ drafts, a block ending before the first draft with max q < τ).

Random-weight models (no `--task`; presets, the paper's LM1B sizes), batch size 1, greedy, one run:
  1. identical drafter and verifier: every draft is accepted (α = 1), so the measured speedup isolates
     the cost model — predicted (γ+1) / ((γ+1)·c + c_γ) with c = 1 and c_γ = t(score γ+1)/t(score 1)
     measured here (our blocks make γ+1 drafter calls; `theory.walltime_improvement` assumes γ drafter
     calls and a verification as cheap as one step);
  2. small drafter, large verifier: α measured from the run's acceptance, c measured; prediction
     `theory.walltime_improvement(α, γ, c)` and the refined one with the measured costs.
Random weights accept nearly every greedy draft (experiments/model_costs/README.md): their speed-ups are not those of
a trained pair.

  specdec-bench decoding [--drafter 6m] [--verifier 97m] [--gamma 3 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec import decoding, models, theory
from specdec.data import gguf_vocab, load_vocabulary, pretrained, tasks
from specdec.decoding.feature_drafter import FeatureDrafter
from specdec.evaluation import bench
from specdec.training import acceptance, export_name, exports, load_model


def _head_step_seconds(drafter, prefix: int, repeats: int, gamma: int = 4) -> float:
  """One draft step of a feature drafter at batch 1 after `prefix` committed positions: a block of γ greedy drafts
  (`bench.draft_seconds`: the head and its output layer over the draft vocabulary, sampling included) over γ."""
  return bench.draft_seconds(drafter, drafter.verifier, gamma=gamma, prefix=prefix, repeats=repeats) / gamma


def _acceptance_for(tokens_per_block: float, gamma: int) -> float:
  """The per-token acceptance α at which a block emits `tokens_per_block` tokens on average
  ((1 − α^(γ+1)) / (1 − α), i.i.d. acceptances), by bisection; inf when even α = 1 falls short."""
  if tokens_per_block > gamma + 1:
    return float("inf")
  lo, hi = 0.0, 1.0
  for _ in range(50):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if theory.expected_tokens_per_call(mid, gamma) < tokens_per_block else (lo, mid)
  return hi


class Entry(NamedTuple):
  """A --drafter entry: factory(γ) -> drafter; the model it calls (None: Max-Gram); its CS Drafting
  options (None: not a cascade); whether it drafts a variable number of tokens (gated Max-Gram, SpecDec++)."""
  factory: Callable[[int], Any]
  model: Any
  csd: dict | None
  adaptive: bool = False


def _drafters(args: argparse.Namespace, verifier) -> dict[str, Entry]:
  """--drafter entries by name (`--help`)."""
  vocab_size = verifier.vocab_size
  bigram = None   # chat prompts (--prompts): Max-Gram looks up the prompt and its output only
  if args.task:
    train = tasks.tokenized(args.task, "train", source=args.source)
    bigram = decoding.bigram_table(train.tokens, train.lengths, vocab_size)
  grams = decoding.MaxGram(vocab_size=vocab_size, max_match=args.max_match, bigram=bigram)
  drafters, loaded = {}, {}

  def load(path):   # one model object per export: the EWIF lines match runs by model
    if path not in loaded:
      loaded[path] = load_model(path)
    return loaded[path]

  for spec in args.drafter:
    if spec == "maxgram":   # CS Drafting's statistical drafter, its bigram fallback from the task's training rows
      drafters["maxgram"] = Entry(lambda gamma: grams, None, None)
    elif spec.startswith("maxgram:gate="):   # drafting only where the longest match has >= gate tokens
      gated = grams.replace(gate=int(spec.split("=")[1]))
      drafters[spec.replace(":", " ")] = Entry(lambda gamma, gated=gated: gated, None, None, adaptive=True)
    elif spec.startswith("csd:"):   # csd:PATH[:model_drafts=K][:lower_gamma=K][:lenience=L]
      path, *options = spec[4:].split(":")
      kw = {key: (float if key == "lenience" else int)(value) for key, value in (o.split("=") for o in options)}
      model = load(path)
      name = f"csd {export_name(path)} " + " ".join(f"{key}={value}" for key, value in kw.items())
      drafters[name] = Entry(lambda gamma, model=model, kw=kw: decoding.cs_drafter(model, gamma=gamma, grams=grams,
                                                                                  **kw), model, kw)
    elif spec.startswith("feature:"):   # feature:DIR: the feature drafter of DIR's head over the verifier
      directory = pretrained.resolve(spec[len("feature:"):])   # a directory, or a shipped head's name
      if not exports.is_feature_head(directory):
        raise ValueError(f"--drafter {spec}: {directory} holds no feature head (feature_head/)")
      drafter = exports.load_drafter(directory, verifier)
      drafters[f"feature {export_name(directory)}"] = Entry(lambda gamma, drafter=drafter: drafter, drafter, None)
    elif spec.startswith("pp:"):   # pp:PATH[:head=DIR][:h=H]: SpecDec++ with γ as its maximum Γ
      path, *options = spec[3:].split(":")
      kw = dict(o.split("=") for o in options)
      model, head = load(path), acceptance.load_head(kw.get("head", path))
      drafter = decoding.ModelDrafter(model, head=head, stop_threshold=float(kw.get("h", 0.5)))
      drafters[f"specdec++ {export_name(path)} h={float(kw.get('h', 0.5)):g}"] = Entry(
          lambda gamma, drafter=drafter: drafter, model, None, adaptive=True)
    else:
      model = load(spec)
      drafters[export_name(spec)] = Entry(lambda gamma, model=model: model, model, None)
  return drafters


def max_gram_cost(grams: decoding.MaxGram, gamma: int, history: int, repeats: int = 200) -> dict[int, float]:
  """Seconds per jitted Max-Gram proposal of γ drafts over a history of `history` tokens, at B = 1 and 8."""
  seconds = {}
  for batch in (1, 8):
    prompts = jnp.asarray(np.random.default_rng(0).integers(3, grams.vocab_size, (batch, history)), jnp.int32)
    state, last = grams.start(prompts, jnp.full((batch,), history), cache_length=history + 64)
    propose = jax.jit(lambda state, last: grams.propose(jax.random.PRNGKey(0), state, last, max_drafts=gamma,
                                                        sampling=decoding.Sampling()).tokens)
    seconds[batch] = bench.median_seconds(lambda: propose(state, last), repeats=repeats)
  return seconds


def _score_seconds(model, widths, prefix: int, repeats: int) -> dict[int, float]:
  return bench.score_seconds(model, widths, prefix=prefix, repeats=repeats)


def _prompt_set(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, int, int, str]:
  """(prompts [N, W], lengths [N], new tokens, EOS id, a description): `--examples` validation prompts of `--task`,
  or the lines of `--prompts` as user turns of the verifier's chat template (its GGUF file's vocabulary)."""
  if args.task:
    split = tasks.tokenized(args.task, "validation", source=args.source)
    rows = np.sort(np.random.default_rng(args.seed).permutation(len(split))[:args.examples])
    prompts, lengths = split.prompts(rows)
    return (prompts, lengths, args.tokens or tasks.get_task(args.task).max_target_tokens, load_vocabulary().eos_id,
            f"task {args.task}: {len(rows)} validation prompts")
  vocab = load_vocabulary(pretrained.resolve(args.verifier))
  with open(args.prompts) as f:
    texts = [line.strip() for line in f if line.strip()][:args.examples]
  if not texts:
    raise ValueError(f"--prompts {args.prompts} holds no prompt (one per line)")
  prompts, lengths = gguf_vocab.chat_batch(vocab, texts)
  return prompts, lengths, args.tokens or 128, vocab.eos_id, f"{args.prompts}: {len(texts)} chat prompts"


def trained_pairs(args: argparse.Namespace, record: dict[str, Any]) -> None:
  """Speculative decoding with each trained drafter against the trained verifier alone, interleaved."""
  verifier = load_model(args.verifier)
  drafters = _drafters(args, verifier)
  prompts, lengths, max_new, eos_id, described = _prompt_set(args)
  print(f"{described} (mean length {lengths.mean():.0f}), batch {args.batch}, up to {max_new} new tokens, eos "
        f"stops; verifier {export_name(args.verifier)} ({models.count_params(verifier):,} params)")
  measured = _print_costs(args, verifier, drafters, int(lengths.mean()), max_new)
  for temperature in args.temperatures:
    _trained_temperature(args, record, temperature, verifier, drafters, (prompts, lengths, max_new, eos_id), measured)


def _print_costs(args: argparse.Namespace, verifier, drafters: dict, prefix: int, max_new: int
                 ) -> tuple[float, dict[int, dict[int, float]], dict[int, float]]:
  """Prints the verifier's, each drafter's and Max-Gram's costs; (the seconds of one verifier scored token,
  {id(drafter model): {n: cost of scoring n tokens, in verifier steps}}, Max-Gram's {B: seconds})."""
  verifier_costs = _score_seconds(verifier, sorted({1, *(g + 1 for g in args.gamma)}), prefix, 50)
  t1 = verifier_costs[1]
  print(f"verifier: one scored token {t1 * 1e3:.2f} ms")
  costs = {}    # id(drafter model) -> {n: cost of scoring n tokens, in verifier steps}
  reviews = {1} | {entry.csd.get("lower_gamma", 4) + 1 for entry in drafters.values() if entry.csd}
  for name, (_, model, *_) in drafters.items():
    if model is None:
      print(f"drafter {name}: no model calls")
      continue
    if id(model) not in costs and isinstance(model, FeatureDrafter):
      costs[id(model)] = {1: _head_step_seconds(model, prefix, 50) / t1}
    elif id(model) not in costs:
      costs[id(model)] = {n: t / t1 for n, t in _score_seconds(model, sorted(reviews), prefix, 50).items()}
    cost = costs[id(model)]
    size = models.count_params(model.head if isinstance(model, FeatureDrafter) else model)
    print(f"drafter {name}: {size:,} params, c = {cost[1]:.3f} per scored token; "
          + ", ".join(f"{n} tokens {c:.3f}" for n, c in cost.items() if n > 1))
  grams_cost = {1: 0.0}
  if any(entry.model is None or entry.csd for entry in drafters.values()):
    grams_cost = max_gram_cost(drafters["maxgram"].factory(1) if "maxgram" in drafters else decoding.MaxGram(
        verifier.vocab_size, max_match=args.max_match), max(args.gamma), prefix + max_new)
    print(f"Max-Gram proposal of {max(args.gamma)} drafts over {prefix + max_new} tokens: "
          + ", ".join(f"B={b} {s * 1e6:.0f} us ({s / t1:.3f} verifier steps)" for b, s in grams_cost.items()))
  for gamma in args.gamma:
    c_gamma = verifier_costs[gamma + 1] / t1
    print(f"gamma={gamma}: the verifier scores gamma+1 tokens at {c_gamma:.2f}x one token")
  return t1, costs, grams_cost


def _runs(args: argparse.Namespace, drafters: dict) -> list[tuple[str, Any, str, int, dict[str, Any]]]:
  """(label, drafter, method, γ, parameters) of each run: the verifier alone, each drafter's chain per γ, its
  chain with a confidence stop per τ and γ (at most γ drafts) and its dynamic tree per K and γ (where its drafter
  keeps copies)."""
  return [("verifier alone", None, "autoregressive", 1, {})] + [
      (f"{name} gamma={gamma}", factory(gamma), "speculative", gamma, {})
      for gamma in args.gamma for name, (factory, *_) in drafters.items()] + [
      (f"{name} stop<{tau:g} gamma={gamma}", factory(gamma), "confidence_stop", gamma, {"stop_below": tau})
      for tau in args.stop_below for gamma in args.gamma for name, (factory, *_) in drafters.items()] + [
      (f"{name} tree K={k} gamma={gamma}", factory(gamma), "dynamic_tree", gamma, {"num_drafts": k})
      for k in args.trees for gamma in args.gamma for name, (factory, *_) in drafters.items()
      if decoding.as_drafter(factory(gamma)).keeps_copies]   # Max-Gram, CSD, SpecDec++ heads cannot


def _trained_temperature(args: argparse.Namespace, record: dict[str, Any], temperature: float, verifier,
                         drafters: dict, data: tuple, measured: tuple) -> None:
  """Every run at one temperature, timed interleaved; prints (and records) a line per run, then CSD's EWIF."""
  prompts, lengths, max_new, eos_id = data
  t1, costs, grams_cost = measured
  runs = _runs(args, drafters)

  def decode(drafter, method, gamma, params, group, key):
    # Prompts as a user passes them: the group's longest (rounded up to 32: few shapes to compile).
    width = tasks.bucket_width(lengths[group].max())
    length = {"max_gamma" if method == "confidence_stop" else "gamma": gamma}
    return decoding.generate(key, drafter, verifier, prompts[group, :width], lengths[group],
                             method=method, temperature=temperature, max_new_tokens=max_new,
                             eos_id=eos_id, **length, **params)

  def decode_inner(model, k):
    """Per-token acceptance of Max-Gram drafts (k per block) under `model` alone, over the prompts."""
    drafter = drafters["maxgram"].factory(k) if "maxgram" in drafters else decoding.MaxGram(model.vocab_size)
    generated = calls = 0
    for row in range(len(lengths)):
      width = tasks.bucket_width(lengths[row])
      out = decoding.generate(jax.random.PRNGKey(row), drafter, model, prompts[row:row + 1, :width],
                              lengths[row:row + 1], method="speculative", gamma=k, temperature=temperature,
                              max_new_tokens=max_new, eos_id=eos_id)
      generated, calls = generated + int(out.stats.generated[0]), calls + int(out.stats.verifier_calls[0])
    return _acceptance_for(generated / max(calls, 1), k)

  seconds, totals = _time_runs(args, runs, decode, lengths)
  per_token = [seconds[i] / max(totals[i]["generated"], 1) for i in range(len(runs))]
  print(f"temperature {temperature}: {args.trials} trial(s) x {len(lengths)} examples, batch {args.batch}")
  for i, (label, _, method, gamma, _) in enumerate(runs):
    print(_run_line(args, runs[i], totals[i], seconds[i], per_token[i], per_token[0]), flush=True)
    record["rows"].append({"temperature": temperature, "run": label, "method": method, "gamma": gamma,
                           "ms_per_token": 1e3 * per_token[i], "speedup": per_token[0] / per_token[i],
                           **{f"total_{stat}": value for stat, value in totals[i].items()}})
  if args.rates_plot:
    _plot_rates(f"{args.rates_plot}.T{temperature:g}.png", runs, totals, per_token,
                f"{args.task or args.prompts}, T = {temperature:g}")
  alphas = {runs[i][0]: _acceptance_for(totals[i]["generated"] / max(totals[i]["verifier_calls"], 1), runs[i][3])
            for i in range(1, len(runs))}
  for i in range(1, len(runs)):
    if runs[i][2] != "speculative":
      continue
    name, gamma = runs[i][0].rsplit(" gamma=", 1)
    ewif = _ewif(name, int(gamma), alphas, drafters, costs, grams_cost[1] / t1, totals[i], temperature, decode_inner)
    print(f"  {runs[i][0]:<32} EWIF (CS Drafting) {ewif}")


def _time_runs(args: argparse.Namespace, runs: list, decode: Callable, lengths: np.ndarray
               ) -> tuple[np.ndarray, list[dict[str, int]]]:
  """Each run over the prompts in `--batch` groups, interleaved group by group (`bench.interleaved`): its
  seconds summed over the groups, and its counters' totals (`blocks`: the batches' verifier calls)."""
  groups = [np.arange(start, min(start + args.batch, len(lengths))) for start in range(0, len(lengths), args.batch)]
  totals = [dict.fromkeys(("generated", "drafted", "accepted", "verifier_calls", "drafter_calls",
                           "verifier_positions", "blocks"), 0) for _ in runs]

  def count(i: int, _, out: decoding.Output) -> None:
    for stat in totals[i]:
      if stat != "blocks":
        totals[i][stat] += int(np.sum(getattr(out.stats, stat)))
    totals[i]["blocks"] += int(np.max(out.stats.verifier_calls))   # the batch's calls: its slowest row's

  timed = [lambda number, trial, run=run: decode(*run[1:], groups[number], jax.random.PRNGKey(
      trial * len(groups) + number)) for run in runs]
  # Untimed first: one group of each width and size (one compiled program each).
  shapes = {(tasks.bucket_width(lengths[group].max()), len(group)): number for number, group in enumerate(groups)}
  seconds = bench.interleaved(timed, range(len(groups)), trials=args.trials, warmup=sorted(shapes.values()),
                              on_output=count).sum(axis=1)
  return seconds, totals


def _run_line(args: argparse.Namespace, run: tuple, t: dict[str, int], seconds: float, per_token: float,
              alone_per_token: float) -> str:
  """A run's printed line: ms/token and, for a chain or a tree, its acceptance, rates and speed-up."""
  label, _, method, gamma, _ = run
  line = f"  {label:<32} {per_token * 1e3:6.2f} ms/token"
  if method == "dynamic_tree":   # K beams of γ: the chain's acceptance formulas do not apply
    line += (f" | {t['generated'] / max(t['verifier_calls'], 1):.2f} tokens/verifier call, "
             f"{t['verifier_positions'] / max(t['verifier_calls'], 1):.1f} positions scored/call, "
             f"{t['drafter_calls'] / max(t['verifier_calls'], 1):.2f} drafter calls/block | "
             f"speed-up {alone_per_token / per_token:.2f}x")
  if method == "confidence_stop":   # blocks of 0 … γ drafts
    line += (f" | {t['generated'] / max(t['verifier_calls'], 1):.2f} tokens/verifier call, "
             f"{t['drafted'] / max(t['verifier_calls'], 1):.2f} drafts/block, accepted/drafted "
             f"{t['accepted'] / max(t['drafted'], 1):.3f}, {t['drafter_calls'] / max(t['verifier_calls'], 1):.2f} "
             f"drafter calls/block | speed-up {alone_per_token / per_token:.2f}x | "
             f"{seconds / max(t['blocks'], 1) * 1e3:.2f} ms/block")
  if method == "speculative":
    # Mean wall-clock of a block of the whole batch, prefills included.
    block = seconds / max(t["blocks"], 1)
    tokens_per_call = t["generated"] / max(t["verifier_calls"], 1)
    line += (f" | accepted/drafted {t['accepted'] / max(t['drafted'], 1):.3f}, per-token acceptance "
             f"{_acceptance_for(tokens_per_call, gamma):.2f} | {tokens_per_call:.2f} tokens/verifier call, "
             f"{t['drafter_calls'] / max(t['verifier_calls'], 1):.2f} drafter calls/block, discard rate "
             f"{(t['drafted'] - t['accepted']) / max(t['generated'], 1):.3f}, verification rate "
             f"{t['verifier_calls'] / max(t['generated'], 1):.3f} | "
             f"speed-up {alone_per_token / per_token:.2f}x | {block * 1e3:.2f} ms/block: at most "
             f"{(gamma + 1) * args.batch * alone_per_token / block:.2f}x if every draft were accepted, 1.5x needs "
             f"acceptance {_acceptance_for(1.5 * block / (args.batch * alone_per_token), gamma):.2f}")
  return line


def _plot_rates(path: str, runs: list, totals: list, per_token: list, title: str) -> None:
  """SpecDec++'s Figure 3: discard rate (drafted but rejected tokens per emitted token) against
  verification rate (verifier calls per emitted token), one series per drafter over its γ (or Γ), with
  the wall-clock speed-up over the verifier alone written at each point."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  series: dict[str, list] = {}
  for i in range(1, len(runs)):
    if runs[i][2] != "speculative":
      continue
    name, gamma = runs[i][0].rsplit(" gamma=", 1)
    family = name.split(" h=")[0] + (f" Γ={gamma}" if " h=" in name else "")
    t = totals[i]
    series.setdefault(family, []).append(((t["drafted"] - t["accepted"]) / max(t["generated"], 1),
                                          t["verifier_calls"] / max(t["generated"], 1),
                                          (name.split(" h=")[1] if " h=" in name else f"γ={gamma}"),
                                          per_token[0] / per_token[i]))
  fig, ax = plt.subplots(figsize=(7, 5))
  for family, points in series.items():
    points.sort(key=lambda point: point[1])
    ax.plot([p[1] for p in points], [p[0] for p in points], "o-", label=family)
    for discard, verification, label, speedup in points:
      ax.annotate(f"{label} ({speedup:.2f}×)", (verification, discard), fontsize=7, xytext=(3, 3),
                  textcoords="offset points")
  ax.set_xlabel("verification rate (verifier calls per emitted token)")
  ax.set_ylabel("discard rate (rejected drafts per emitted token)")
  ax.set_title(f"{title}; labels: γ or h (speed-up vs the verifier alone)", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", flush=True)


def _ewif(name, gamma, alphas, drafters, costs, c_grams, totals, temperature, decode_inner) -> str:
  """CS Drafting's expected walltime improvement from this run's acceptance and the measured costs:
  Cor. 4.2 for one drafter, Thm 4.3 for a vertical cascade (α' of Max-Gram under the model measured by
  a separate untimed run), Thm 4.5 for model-then-Max-Gram horizontal cascades. EWIF counts a verifier
  call as one decode step (the measured block cost above says how far that is from this machine)."""
  alpha = min(alphas[f"{name} gamma={gamma}"], 0.999999)
  _, model, csd, adaptive = drafters[name]
  if adaptive:
    return "n/a (a variable number of drafts per block)"
  if csd is None:
    c = c_grams / gamma if model is None else costs[id(model)][1]
    return f"{float(theory.walltime_improvement(alpha, gamma, c)):.2f}x (Cor. 4.2, c = {c:.3f} per draft)"
  lower_gamma, model_drafts = csd.get("lower_gamma", 4), csd.get("model_drafts", gamma)
  if lower_gamma > 0 and model_drafts >= gamma:
    inner = min(decode_inner(model, lower_gamma), 0.999999)
    reviews = totals["drafter_calls"] / max(totals["verifier_calls"], 1)
    n = max(1, round(reviews))
    c_review = costs[id(model)].get(lower_gamma + 1, float("nan"))
    value = theory.vertical_cascade_ewif(alpha, inner, lower_gamma, n, c_review, c_grams / lower_gamma)
    return (f"{float(value):.2f}x (Thm 4.3: alpha' = {inner:.2f} Max-Gram under the model, k = {lower_gamma}, "
            f"n = {n} reviews, c_d1 = {c_review:.3f})")
  if lower_gamma == 0 and f"maxgram gamma={gamma}" in alphas:
    plain = [key for key, entry in drafters.items() if entry.model is model and entry.csd is None
             and not entry.adaptive]
    if plain and f"{plain[0]} gamma={gamma}" in alphas:
      a_model, a_grams = alphas[f"{plain[0]} gamma={gamma}"], alphas[f"maxgram gamma={gamma}"]
      value = theory.horizontal_cascade_ewif(
          [a_model] * model_drafts + [a_grams] * (gamma - model_drafts),
          [costs[id(model)][1]] * model_drafts + [c_grams / gamma] * (gamma - model_drafts))
      return f"{value:.2f}x (Thm 4.5 with the model's and Max-Gram's own acceptance per position)"
  return "no closed form for this configuration"


def random_pair(args: argparse.Namespace, record: dict[str, Any]) -> None:
  """The random-weight presets (module docstring)."""
  small = models.build(args.drafter[0], vocab_size=args.vocab, seed=1, max_length=256)
  large = models.build(args.verifier, vocab_size=args.vocab, seed=2, max_length=256)
  prompts = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (1, args.prompt)), jnp.int32)
  lengths = jnp.array([args.prompt], jnp.int32)
  key = jax.random.PRNGKey(0)

  def run(drafter, verifier, method, gamma=1):
    return decoding.generate(key, drafter, verifier, prompts, lengths, method=method, gamma=gamma,
                             temperature=0.0, max_new_tokens=args.tokens, eos_id=None)

  large_costs = _score_seconds(large, sorted({1, *(g + 1 for g in args.gamma)}), args.prompt, 20)
  t1 = {"small": _score_seconds(small, (1,), args.prompt, 20)[1], "large": large_costs[1]}
  c = t1["small"] / t1["large"]
  print(f"models: drafter {args.drafter[0]} ({models.count_params(small) / 1e6:.1f}M params), verifier "
        f"{args.verifier} ({models.count_params(large) / 1e6:.1f}M), V={args.vocab}, batch 1, greedy, "
        f"{args.tokens} new tokens, prompt {args.prompt}")
  print(f"one decode step: drafter {t1['small'] * 1e3:.2f} ms, verifier {t1['large'] * 1e3:.2f} ms, "
        f"c = {c:.3f}")
  t_ar = bench.median_seconds(lambda: run(None, large, "autoregressive").tokens, repeats=args.repeats)
  print(f"autoregressive verifier: {t_ar * 1e3:.1f} ms ({t_ar / args.tokens * 1e3:.2f} ms/token)")
  for gamma in args.gamma:
    c_gamma = large_costs[gamma + 1] / t1["large"]
    same = run(large, large, "speculative", gamma)
    t_same = bench.median_seconds(lambda: run(large, large, "speculative", gamma).tokens, repeats=args.repeats)
    assert int(same.stats.rejected[0]) == 0
    predicted_same = (gamma + 1) / ((gamma + 1) * 1.0 + c_gamma)
    print(f"gamma={gamma}: verifier scoring gamma+1 tokens costs {c_gamma:.2f}x one token")
    print(f"  identical pair (alpha=1): speedup {t_ar / t_same:.2f}x measured, {predicted_same:.2f}x "
          f"predicted from measured costs, {theory.walltime_improvement(1.0, gamma, 1.0):.2f}x by "
          f"walltime_improvement(1, gamma, c=1)")
    mixed = run(small, large, "speculative", gamma)
    t_mixed = bench.median_seconds(lambda: run(small, large, "speculative", gamma).tokens, repeats=args.repeats)
    s = jax.tree.map(lambda x: float(x[0]), mixed.stats)
    alpha = s.accepted / s.drafted  # per-token acceptance rate of this run
    refined = theory.expected_tokens_per_call(min(alpha, 0.999999), gamma) / ((gamma + 1) * c + c_gamma)
    print(f"  {args.drafter[0]} -> {args.verifier}: acceptance {alpha:.3f}, "
          f"{s.generated / s.verifier_calls:.2f} tokens/verifier call, speedup {t_ar / t_mixed:.2f}x measured, "
          f"{refined:.2f}x predicted from measured costs, "
          f"{theory.walltime_improvement(min(alpha, 0.999999), gamma, c):.2f}x by walltime_improvement")
    record["rows"] += [
        {"temperature": 0.0, "run": f"identical pair gamma={gamma}", "gamma": gamma, "speedup": t_ar / t_same,
         "predicted_speedup": predicted_same, "c_gamma": c_gamma},
        {"temperature": 0.0, "run": f"{args.drafter[0]} -> {args.verifier} gamma={gamma}", "gamma": gamma,
         "speedup": t_ar / t_mixed, "predicted_speedup": refined, "acceptance": alpha, "c": c, "c_gamma": c_gamma}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--drafter", nargs="+", default=["6m"],
                      help="presets, or with --task export directories, 'maxgram' or 'maxgram:gate=K' "
                           "(decoding.MaxGram), CS "
           "Drafting cascades 'csd:EXPORT[:model_drafts=K][:lower_gamma=K][:lenience=L]' (decoding.cs_drafter) "
           "and/or SpecDec++ drafters 'pp:EXPORT[:head=DIR][:h=H]' (γ is their maximum Γ)")
  parser.add_argument("--max_match", type=int, default=8, help="MaxGram's longest suffix match")
  parser.add_argument("--rates_plot", help="with --task: write PATH.T<temperature>.png, discard rate against "
                                           "verification rate of every run (SpecDec++ Fig. 3)")
  parser.add_argument("--verifier", default="97m", help="a preset, or an export directory with --task")
  parser.add_argument("--task", help="a local task: trained exports on its validation prompts")
  parser.add_argument("--prompts", metavar="FILE", help="instead of --task: the prompts of FILE (one per line) as "
                      "user turns of the verifier's chat template (a GGUF verifier's, e.g. smollm2's)")
  parser.add_argument("--source", default="auto", help="the task's data (specdec.data.load)")
  parser.add_argument("--examples", type=int, default=16, help="validation prompts (--task)")
  parser.add_argument("--trials", type=int, default=1, help="passes over the prompts (--task)")
  parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (--task)")
  parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="(--task)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--vocab", type=int, default=32_000)
  parser.add_argument("--gamma", type=int, nargs="+", default=[3, 5])
  parser.add_argument("--trees", type=int, nargs="*", default=[],
                      help="(--task) also EAGLE-2's dynamic tree (method dynamic_tree) with K beams, per K given")
  parser.add_argument("--stop_below", type=float, nargs="*", default=[],
                      help="(--task) also the chain with a confidence stop (method confidence_stop) at each "
                           "threshold given, at most γ drafts")
  parser.add_argument("--tokens", type=int, default=None,
                      help="new tokens (default: 64 for random weights, the task's target budget with --task)")
  parser.add_argument("--prompt", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  if args.batch < 1:
    raise ValueError(f"--batch must be >= 1; got {args.batch}")
  record = bench.new_record("decoding", command, keys=("temperature", "run"), **{
      k: v for k, v in vars(args).items() if k not in ("out", "before", "after", "rounds", "subcommand")})
  if args.task and args.prompts:
    raise ValueError("--task and --prompts each give the prompts: give one")
  if args.task or args.prompts:
    trained_pairs(args, record)
  else:
    args.tokens = args.tokens or 64
    random_pair(args, record)
  return record, bench.markdown_table(record["rows"]) + "\n"
