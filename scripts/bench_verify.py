"""Micro-benchmark of the block's sampling side, in units of one softmax over the same [B, γ+1, V] logits.

Rows: S(·) at top-P ∈ {1, 0.9, 0.5}, every rule's target π = T(q, p), `verify_block`, and the whole
block (S(q), S(p) + token_v3 + verify) in one jit and in two. With `--before REF` the implementations at
git revision REF (_top_p, sampling, targets and verify from `git show REF:specdec/...`) are timed in the
same process, alternating with the current ones row by row, so that the two columns share the machine's
load.

Usage: python scripts/bench_verify.py [--shapes 1,5,8192 8,8,32000] [--repeats 30] [--rounds 3] [--before REF]
Prints the machine, the command and the ratios measured in this run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import types

import jax
import jax.numpy as jnp

import specdec
from specdec import sampling, targets, verify
from specdec.evaluation.timing import median_seconds

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# In import order: sampling imports _top_p (a revision before it has none), targets and verify import sampling.
_MODULES = ("_top_p", "sampling", "targets", "verify")
TOP_PS = (1.0, 0.9, 0.5)
PIPELINE_RULE = "token_v3"


def load_revision(ref: str) -> types.SimpleNamespace:
  """_top_p, sampling, targets and verify as they are at git revision `ref`, loaded beside the current ones.

  Each file (specdec/core/<name>.py, or specdec/<name>.py in revisions before the core folder) is executed
  with `specdec.<name>` and `specdec.core.<name>` pointing at the revision's modules loaded before it, so
  the revision's sampling calls the revision's _top_p and its targets and verify the revision's sampling;
  the package is restored afterwards.
  """
  loaded = {}
  packages = (specdec, specdec.core)
  saved_modules = {key: sys.modules.get(key) for package in packages for key in
                   (f"{package.__name__}.{name}" for name in _MODULES)}
  saved_names = {(package, name): vars(package).get(name) for package in packages for name in _MODULES}
  try:
    for name in _MODULES:
      for path in (f"specdec/core/{name}.py", f"specdec/{name}.py"):
        shown = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=_ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
          break
      if shown.returncode and name == "_top_p":   # the revision's sampling holds the top-p search itself
        continue
      shown.check_returncode()
      module = types.ModuleType(f"specdec.{name}@{ref}")
      sys.modules[module.__name__] = module   # dataclasses look it up
      for package in packages:
        sys.modules[f"{package.__name__}.{name}"] = module
        setattr(package, name, module)
      exec(compile(shown.stdout, f"{ref}:{path}", "exec"), module.__dict__)
      loaded[name] = module
  finally:
    for key, module in saved_modules.items():
      if module is None:
        sys.modules.pop(key, None)
      else:
        sys.modules[key] = module
    for (package, name), module in saved_names.items():
      if module is None:
        vars(package).pop(name, None)
      else:
        setattr(package, name, module)
  return types.SimpleNamespace(**loaded)


def programs(impl: types.SimpleNamespace, gamma: int) -> dict:
  """Row name -> the jitted function of one implementation (with its top-P for the block rows)."""
  jitted = {f"S(.) top-P {top_p:g}": jax.jit(lambda x, t=top_p: impl.sampling.transform(x, 1.0, t))
            for top_p in TOP_PS}
  for rule in impl.targets.RULES:
    jitted[f"target {rule}"] = jax.jit(
        lambda q, p, q_raw, p_raw, alpha, rule=rule: impl.targets.target_distribution(
            rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha))
  jitted["verify_block (q, pi given)"] = jax.jit(impl.verify.verify_block)

  def transforms(logits_q, logits_p, temperature, top_p):
    return (impl.sampling.transform(logits_q, temperature, top_p),
            impl.sampling.transform(logits_p, temperature, top_p))

  def rule_and_verify(key, drafts, q, p, alpha):  # the deferral rule reads S(·) as the raw distributions
    pi = impl.targets.target_distribution(PIPELINE_RULE, q=q, p=p, q_raw=q, p_raw=p, alpha=alpha)
    return impl.verify.verify_block(key, drafts, q[:, :gamma], pi)

  def block(key, drafts, logits_q, logits_p, temperature, top_p, alpha):
    return rule_and_verify(key, drafts, *transforms(logits_q, logits_p, temperature, top_p), alpha)

  transforms_jit, rule_and_verify_jit = jax.jit(transforms), jax.jit(rule_and_verify)

  def block_two_jits(key, drafts, logits_q, logits_p, temperature, top_p, alpha):
    return rule_and_verify_jit(key, drafts, *transforms_jit(logits_q, logits_p, temperature, top_p), alpha)

  for top_p in (1.0, 0.9):
    jitted[f"block top-P {top_p:g}, one jit"] = (jax.jit(block), top_p)
    jitted[f"block top-P {top_p:g}, two jits"] = (block_two_jits, top_p)
  return jitted


def bench_shape(batch: int, gamma: int, vocab: int, impls: dict, repeats: int,
                rounds_per_row: int) -> tuple[list[float], list[tuple]]:
  """(softmax timings, [(row, {impl: seconds})]) at one shape: each row's time is the median over
  `rounds_per_row` rounds of a median of `repeats` calls, the implementations alternating."""
  kq, kp, kd, kv = jax.random.split(jax.random.PRNGKey(0), 4)
  logits_q = jax.random.normal(kq, (batch, gamma + 1, vocab)) * 3
  logits_p = jax.random.normal(kp, (batch, gamma + 1, vocab)) * 3
  q, p = jax.nn.softmax(logits_q), jax.nn.softmax(logits_p)
  q_raw, p_raw = jax.nn.softmax(logits_q * 0.9), jax.nn.softmax(logits_p * 0.9)  # distinct arrays
  drafts = jax.random.categorical(kd, logits_q[:, :gamma]).astype(jnp.int32)
  alpha = jnp.float32(0.3)

  def args(row, top_p=None):
    if row.startswith("S(.)"):
      return (logits_p,)
    if row.startswith("target"):
      return (q, p, q_raw, p_raw, jnp.float32(0.5 if row.endswith("_log") or row.endswith("bild") else 0.3))
    if row.startswith("verify"):
      return (kv, drafts, q[:, :gamma], p)
    return (kv, drafts, logits_q, logits_p, jnp.float32(1.0), jnp.float32(top_p), alpha)

  softmax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
  progs = {name: programs(impl, gamma) for name, impl in impls.items()}
  softmax_times = [median_seconds(softmax, logits_p, repeats=repeats)]
  rows = []
  for i, row in enumerate(progs["now"]):
    if i == len(progs["now"]) // 2:
      softmax_times.append(median_seconds(softmax, logits_p, repeats=repeats))
    rounds = {name: [] for name in impls if row in progs[name]}
    for _ in range(rounds_per_row):  # implementations alternate, so that both see the same load
      for name in rounds:
        fn, top_p = progs[name][row] if isinstance(progs[name][row], tuple) else (progs[name][row], None)
        rounds[name].append(median_seconds(fn, *args(row, top_p), repeats=repeats))
    rows.append((row, {name: statistics.median(t) for name, t in rounds.items()}))
  softmax_times.append(median_seconds(softmax, logits_p, repeats=repeats))
  return sorted(softmax_times), rows


def _machine() -> str:
  model = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"{platform.machine()} {model}, {os.cpu_count()} cores"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", nargs="+", default=["1,5,8192", "8,8,32000"],
                      help="B,gamma,V triples")
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--rounds", type=int, default=3, help="rounds per row, implementations alternating")
  parser.add_argument("--before", metavar="REF", default=None,
                      help="also time sampling/targets/verify at this git revision (e.g. HEAD)")
  args = parser.parse_args()

  impls = {"now": types.SimpleNamespace(sampling=sampling, targets=targets, verify=verify)}
  if args.before:
    impls[args.before] = load_revision(args.before)
  print(f"machine: {_machine()} | {jax.devices()[0].device_kind} | jax {jax.__version__} | "
        f"python {platform.python_version()}")
  print(f"command: {' '.join([sys.executable.split('/')[-1]] + sys.argv)}")
  print(f"median over {args.rounds} rounds of the median of {args.repeats} calls after warm-up, "
        "implementations alternating; ratios to one softmax over the same logits "
        "(the median of three timings of it: before, between and after the rows), measured in this run")
  for shape in args.shapes:
    batch, gamma, vocab = (int(x) for x in shape.split(","))
    softmax_times, rows = bench_shape(batch, gamma, vocab, impls, args.repeats, args.rounds)
    base = softmax_times[1]
    print(f"\nB={batch}, gamma={gamma}, V={vocab}: softmax over [B, gamma+1, V] {base * 1e3:.3f} ms "
          f"(timings {', '.join(f'{t * 1e3:.3f}' for t in softmax_times)})")
    print(f"{'':32s}" + "".join(f"{name + ' ms':>12s}{'ratio':>8s}" for name in impls))
    for row, times in rows:
      cells = "".join(f"{times[n] * 1e3:12.3f}{times[n] / base:7.2f}x" if n in times else " " * 20
                      for n in impls)
      print(f"{row:32s}{cells}")


if __name__ == "__main__":
  main()
