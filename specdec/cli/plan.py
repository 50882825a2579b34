r"""Plan decode programs for a Cloud TPU slice without a TPU: compile them for its chips ahead of time (libtpu's
compile-only devices) and report memory, per-call cost, waste inside the loops and roofline tokens/s.

  specdec-plan --topology v4-8 --mesh 1,4 --drafter gemma2_2b --verifier gemma2_9b --vocab_size 256000 \
      --method speculative --gamma 5 --batch_size 8 --prompt_width 64 --max_new_tokens 64 --acceptance 0.6,0.8
  specdec-plan --topology v4-8 --gin_file configs/experiments/paper_t5_wmt.gin \
      --drafter t5_small --verifier t5_large --vocab_size 32128        # every program of a sweep

A sweep's config (`--gin_file`, `--gin_bindings`) is read without its data or weights: its distinct programs
(one per model, method and static parameters: temperature, top-P and α are traced) at its batch size and its
task's prompt and target budgets, its pair named by presets (`--drafter`, `--verifier`: the architectures of
the checkpoints it loads) unless its ModelSource gives one.

Per chip: weights, KV caches, other temporaries and generated code against the chip's HBM (fits when libtpu
compiles the program; otherwise the smallest mesh of the slice's chips that fits); per call (the verifier's
call of γ + 1 tokens and its single-token step, the drafter's step, each prefill; each compiled alone):
flops, minimum HBM bytes, roofline time and collectives; per loop: relayouts and HBM <-> on-chip round
trips of KV-cache-sized arrays, copies of [B, γ + 1, V] arrays, collectives; and the roofline tokens/s of
the verifier alone and of speculative decoding at each acceptance rate (`--acceptance`, or a recorded
sweep's per point: `--results FILE.jsonl`). Writes `--output FILE.json` and FILE.md (a markdown table);
prints the table. Compiled programs are cached by key (`--cache_dir`): a re-run takes seconds.
Gemma programs take minutes each to compile on a laptop-class CPU. Needs libtpu (Linux x86-64; the test
extra installs it). docs/tpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from specdec import cli

PROG = "specdec-plan"


def _pair(text: str, flag: str) -> tuple[int, int]:
  try:
    data, model = (int(x) for x in text.split(","))
  except ValueError:
    raise ValueError(f"{flag} must be DATA,MODEL (e.g. 1,4); got {text!r}") from None
  return data, model


def _floats(text: str, flag: str) -> list[float]:
  try:
    values = [float(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated numbers in [0, 1]; got {text!r}") from None
  if not values or any(not 0.0 <= v <= 1.0 for v in values):
    raise ValueError(f"{flag} must be comma-separated numbers in [0, 1]; got {text!r}")
  return values


def _param(text: str) -> tuple[str, Any]:
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise ValueError(f"--param must be NAME=VALUE (e.g. rule=token_v3); got {text!r}")
  try:
    return name, json.loads(value)
  except json.JSONDecodeError:
    return name, value


def acceptances_from_results(path: str, method: str) -> list[float]:
  """Acceptance per drafted token (accepted / drafted over the point's examples) of each recorded point of
  `method` in a sweep's results file, sorted."""
  from specdec.evaluation import results
  found = set()
  for record in results.read_results(path):
    counters = record.get("counters") or {}
    if record["point"].get("method") == method and counters.get("drafted"):
      found.add(round(counters["accepted"] / counters["drafted"], 4))
  return sorted(found)


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _scope(row: dict[str, Any]) -> str:
  if row["depth"] < 0:
    return "outside loops"
  return f"decode loop ({row['scope']})" if row["depth"] == 0 else f"nested loop, depth {row['depth']} ({row['scope']})"


def markdown(report: dict[str, Any]) -> str:
  """The plan as markdown tables: memory per chip, per-call costs, waste in the loops, tokens/s."""
  gib = 2**30
  s, mesh = report["setting"], report["mesh"]
  lines = [f"# Plan: {s['drafter']} -> {s['verifier']}, {s['method']} {s['params']}, batch {s['batch_size']}, "
           f"prompt {s['prompt_width']}, new {s['max_new_tokens']}, {s['dtype']} on {report['topology']} "
           f"({report['chip']}), mesh (data {mesh['data']}, model {mesh['model']}), cache {report['cache_length']}",
           "", "## Memory per chip", ""]
  program = report["program"]
  pytrees = report["pytrees"]
  if program["fits"]:
    m = program["memory"]
    lines += ["| weights (pytree) | caches (pytree) | arguments | temporaries | code | total | HBM | fits |",
              "|---|---|---|---|---|---|---|---|",
              f"| {_size(pytrees['weights'])} | {_size(pytrees['caches'])} | {_size(m['arguments'])} "
              f"| {_size(m['temporaries'])} | {_size(m['code'])} | {_size(m['total'])} | {_size(report['hbm_bytes'])} "
              "| yes |"]
  else:
    required = program.get("required_bytes")
    lines += [f"Does not fit: libtpu refused it ({program['error']})"
              + (f"; needs {required / gib:.2f} GiB" if required else "") + "."]
    smallest = report.get("smallest_fitting_mesh")
    lines += ["", f"Smallest mesh that fits: {smallest['chips']} chip(s), (data {smallest['data']}, model "
                  f"{smallest['model']}), {smallest['total_bytes'] / gib:.2f} GiB per chip." if smallest
              else "No mesh of this slice's chips holds it."]
  lines += ["", "## Per call (compiled alone, per chip)", "",
            "| call | flops | HBM bytes (min) | × weights + cache | tile padding | roofline µs | bound | collectives |",
            "|---|---|---|---|---|---|---|---|"]
  for name, call in report["calls"].items():
    if "roofline_us" not in call:
      lines.append(f"| {name} | does not fit | | | | | | |")
      continue
    collectives = ", ".join(f"{op} {c['count']}" for op, c in call["collectives"].items() if c["count"]) or "-"
    lines.append(f"| {name} | {call['flops']:.3g} | {_size(call['hbm_bytes'])} | {call['over_arguments']:.3f}× "
                 f"| {call['padding']:.2f}× "
                 f"| {call['roofline_us']:.1f} "
                 f"| {call['bound']} | {collectives} |")
  if program["fits"]:
    lines += ["", "## Inside the program (per scope: each loop's body once)", "",
              "Each count is what every iteration runs, then (+ n) what lies in branches of conditionals, run only "
              "on the iterations that take them (e.g. the exact top-p search for a nucleus beyond the top-k "
              "candidates). A cache round trip is a transfer HBM -> on-chip memory and one back; [B, γ+1, V] "
              "moves are copies, relayouts and transfers of such arrays.", "",
              "| scope | cache relayouts (fused) | cache copies (materialized) | cache transfers HBM<->on-chip "
              "(MB) | [B, γ+1, V] moves (MB) | collectives |", "|---|---|---|---|---|---|"]
    for scope in program["loops"]:
      cache, block = scope["cache"], scope["block"]
      collectives = ", ".join(f"{op} {c['count']}" for op, c in scope["collectives"].items() if c["count"]) or "-"
      lines.append(f"| {_scope(scope)} | {_split(cache, 'fused')} | {_split(cache, 'materialized')} "
                   f"| {_split(cache, 'async')} | {_split(block, 'materialized', 'fused', 'async')} | {collectives} |")
  if "speeds" in report:
    sp = report["speeds"]
    lines += ["", "## Roofline tokens/s (every call at its roofline: an upper bound)", "",
              f"Verifier alone: {sp['autoregressive_tokens_per_s']:.0f} tokens/s; speculative decoding breaks even "
              f"at {sp['break_even_tokens_per_block']:.2f} tokens per block.", "",
              "| acceptance per drafted token | tokens per block | block µs | tokens/s | speed-up |",
              "|---|---|---|---|---|"]
    for row in sp["speculative"]:
      lines.append(f"| {row['acceptance']:.3g} | {row['tokens_per_block']:.2f} | {row['block_us']:.1f} "
                   f"| {row['tokens_per_s']:.0f} | {row['speedup']:.2f}× |")
  return "\n".join(lines) + "\n"


def _split(counts: dict[str, Any], *kinds: str) -> str:
  """'n (MB)' of the moves of `kinds` that every iteration runs, then '+ m (MB) in branches' if any."""
  def tally(row: dict[str, Any], minus: dict[str, Any] | None = None) -> tuple[int, int]:
    count = sum(row[k] - (minus[k] if minus else 0) for k in kinds)
    nbytes = sum(row[f"{k}_bytes"] - (minus[f"{k}_bytes"] if minus else 0) for k in kinds)
    return count, nbytes
  branch = counts["in_branches"]
  always, always_bytes = tally(counts, branch)
  text = f"{always} ({always_bytes / 1e6:.1f})"
  count, nbytes = tally(branch)
  return text + (f" + {count} ({nbytes / 1e6:.1f}) in branches" if count else "")


def _parser() -> argparse.ArgumentParser:
  parser = cli.parser(PROG, __doc__)
  parser.add_argument("--topology", required=True, help="a Cloud TPU accelerator type: v4-8, v4-16, …, v5e-4, "
                      "v5p-8, or <generation>-1chip")
  parser.add_argument("--mesh", default=None, help="DATA,MODEL over the slice's chips (default: 1,<chips>)")
  parser.add_argument("--gin_file", action="append", default=[], help="a sweep's config: plan its programs")
  parser.add_argument("--gin_bindings", action="append", default=[], help="a gin binding applied after the files")
  parser.add_argument("--verifier", default=None, help="the verifier's model preset (e.g. gemma2_9b, t5_large)")
  parser.add_argument("--drafter", default=None, help="the drafter's model preset (e.g. gemma2_2b, t5_small), or "
                      "'feature': a feature drafter (EAGLE) whose one-layer head is as wide as the verifier")
  parser.add_argument("--draft_vocabulary", type=int, default=0, help="with --drafter feature: the k token ids its head "
                      "drafts among (FR-Spec; the shipped smollm2_eagle's: 8192); 0: the whole vocabulary (default)")
  parser.add_argument("--vocab_size", type=int, default=None,
                      help="the models' vocabulary size (required without --gin_file)")
  parser.add_argument("--method", default="speculative", help="the decoding method (default speculative)")
  parser.add_argument("--gamma", type=int, default=5, help="γ, drafts per block (default 5)")
  parser.add_argument("--param", action="append", default=[], help="another method parameter NAME=VALUE")
  parser.add_argument("--batch_size", type=int, default=8, help="rows decoded together (default 8)")
  parser.add_argument("--prompt_width", type=int, default=64, help="prompt tokens per row (default 64)")
  parser.add_argument("--max_new_tokens", type=int, default=64, help="new tokens per row (default 64)")
  parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                      help="weights and caches (default bfloat16; a sweep: its ModelSource.dtype)")
  parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0: greedy (default 1)")
  parser.add_argument("--acceptance", default="0.5,0.6,0.7,0.8,0.9",
                      help="acceptance rates per drafted token for the speed table (default 0.5,…,0.9)")
  parser.add_argument("--results", default=None, help="a sweep's results .jsonl: its points' acceptance rates")
  parser.add_argument("--output", default=None, help="FILE.json (and FILE.md beside it)")
  parser.add_argument("--cache_dir", default=None, help="where analyses are cached (default ~/.cache/specdec/plan)")
  return parser


def _check(args: argparse.Namespace) -> None:
  """One line naming what the flags lack, before JAX is imported: the pair without a sweep, the gin files,
  the folder of --output."""
  if not args.gin_file:
    for flag in ("verifier", "vocab_size"):
      if getattr(args, flag) is None:
        raise ValueError(f"--{flag} is required (or a sweep's --gin_file)")
  cli.check_gin_files(args.gin_file)
  if args.output is not None:
    directory = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"--output {args.output}: no folder {directory}")


def _settings(args: argparse.Namespace, params: dict[str, Any]) -> list[Any]:
  """The `plan.Setting`s to plan: a sweep's distinct programs (--gin_file), else the one the flags name."""
  from specdec.evaluation import plan as planning
  if not args.gin_file:
    return [planning.Setting(verifier=args.verifier, drafter=args.drafter, vocab_size=args.vocab_size,
                             method=args.method, params=tuple(sorted(params.items())), batch_size=args.batch_size,
                             prompt_width=args.prompt_width, max_new_tokens=args.max_new_tokens,
                             dtype=args.dtype or "bfloat16", temperature=args.temperature,
                             draft_vocabulary=args.draft_vocabulary)]
  from specdec.evaluation import grid
  with cli.quiet_gin_lookups():
    experiment = grid.parse_gin(args.gin_file, args.gin_bindings)
  return [setting for setting, _ in planning.sweep_settings(
      experiment, verifier=args.verifier, drafter=args.drafter, vocab_size=args.vocab_size, dtype=args.dtype,
      draft_vocabulary=args.draft_vocabulary)]


def _plans(args: argparse.Namespace, settings: Sequence[Any], topology: Any, mesh: tuple[int, int],
           acceptances: list[float]) -> list[dict[str, Any]]:
  """`plan.plan` of each setting, with a progress bar over several; speeds at `acceptances`, or at the
  acceptance rates --results recorded for the setting's method."""
  from specdec.evaluation import plan as planning
  import tqdm
  cache = planning.ProgramCache(args.cache_dir or planning.default_cache_dir())
  plans = []
  bar = tqdm.tqdm(settings, desc=PROG, unit="program", file=sys.stderr, leave=False, disable=len(settings) < 2)
  try:
    for setting in bar:
      method_acceptances = acceptances
      if args.results is not None and setting.drafter is not None:
        method_acceptances = acceptances_from_results(args.results, setting.method)
        if not method_acceptances and not args.gin_file:
          raise ValueError(f"--results {args.results}: no point of method {setting.method!r} with drafted tokens")
      plans.append(planning.plan(setting, topology, mesh, acceptances=method_acceptances, cache=cache,
                                 progress=lambda what: bar.set_postfix_str(f"compiling {what}") if not bar.disable
                                 else print(f"{PROG}: compiling {what}", file=sys.stderr, flush=True)))
  finally:
    bar.close()
  return plans


def _write(output: str, report: dict[str, Any], table: str) -> None:
  """The report to `output` (JSON) and its table beside it (.md), each written whole."""
  stem = output[:-5] if output.endswith(".json") else output
  for path, text in ((output, json.dumps(report, indent=1)), (stem + ".md", table)):
    with open(path + ".partial", "w") as f:
      f.write(text)
    os.replace(path + ".partial", path)
  print(f"wrote {output} and {stem}.md")


def main(argv: list[str] | None = None) -> dict[str, Any]:
  """Plans the programs the flags name (module docstring); prints the tables and returns the report:
  {"topology", "mesh", "plans": [`plan.plan` per setting]}."""
  args = _parser().parse_args(argv)
  mesh = None if args.mesh is None else _pair(args.mesh, "--mesh")
  acceptances = _floats(args.acceptance, "--acceptance")
  params = dict(_param(p) for p in args.param) | {"gamma": args.gamma}
  _check(args)

  from specdec.evaluation import plan as planning   # JAX from here on
  settings = _settings(args, params)
  topology = planning.topology(args.topology)
  mesh = mesh or (1, topology.chips)
  for setting in settings:
    planning.check_mesh(mesh, topology, setting.batch_size)
  plans = _plans(args, settings, topology, mesh, acceptances)
  report = dict(topology=args.topology, mesh=list(mesh), plans=plans)
  table = "\n".join(markdown(one) for one in plans)
  print(table)
  if args.output is not None:
    _write(args.output, report, table)
  return report


console = cli.console_for(main, PROG)

if __name__ == "__main__":
  console()
