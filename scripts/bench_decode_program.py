"""Before/after costs of the compiled decode program, two revisions measured in one run, interleaved.

Each measurement runs in a fresh process with PYTHONPATH on one revision's tree (this file's code drives both,
through the public model interface and `decoding.generate`), alternating revisions round by round; each
figure is the median over rounds of each process's median over repeats. Measured per revision:
  - the shipped pair (data/models/debian_drafter → debian_verifier) at batch 1: the verifier's verify call
    (score γ+1 = 6 tokens) and one-token step on a 64-token prefix; autoregressive and speculative (γ = 5,
    greedy) ms per generated token over 64 new tokens;
  - random-weight 6m verifier (2m drafter) at batch 8 with a 300-position cache: the same figures;
  - temp memory (`memory_analysis()`) of each compiled `generate`;
  - on 8 fake CPU devices, mesh (data=4, model=2), batch 12, tiny random transformer pair, speculative γ = 3 at
    T = 1: the collectives of the compiled decode loop — those of one block (its body, conditionals
    included) and those of the loops nested in it (per drafter call, per top-P search step) — and the rows
    per device of the KV caches it carries.

  python scripts/bench_decode_program.py --before 86bdb81 [--after WORKTREE] [--rounds 3] \
      --out experiments/decode_program/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_TOKENS, GAMMA = 64, 5


def _compiled_generate(*args, **kwargs):
  """The compiled program `decoding.generate(*args, **kwargs)` runs, for the `specdec` on PYTHONPATH: its
  jitted kernel's arguments are captured from one call, so a revision without `decoding.lower` is read the
  same way."""
  from specdec import decoding

  kernel, captured = decoding._generate, {}

  def capture(*a, **k):
    captured.update(args=a, kwargs=k)
    return kernel(*a, **k)
  decoding._generate = capture
  try:
    decoding.generate(*args, **kwargs)
  finally:
    decoding._generate = kernel
  return kernel.lower(*captured["args"], **captured["kwargs"]).compile()


def _measure(models_dir: str, repeats: int) -> dict:
  """One process's figures for the `specdec` on PYTHONPATH."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import decoding, models
  from specdec.evaluation.timing import median_seconds
  from specdec.training import load_model

  def program_memory(*args, **kwargs) -> int:
    return int(_compiled_generate(*args, **kwargs).memory_analysis().temp_size_in_bytes)

  def case(drafter, verifier, batch: int, prompt_width: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, verifier.vocab_size, size=(batch, prompt_width)), jnp.int32)
    cache = verifier.init_cache(batch, prompt_width + NEW_TOKENS + GAMMA + 1)
    cache = verifier.score(cache, prompts).cache
    score = jax.jit(lambda m, c, t: m.score(c, t).logits)
    figures = {
        "verify_call_ms": 1e3 * median_seconds(score, verifier, cache, jnp.ones((batch, GAMMA + 1), jnp.int32),
                                               repeats=repeats),
        "one_token_step_ms": 1e3 * median_seconds(score, verifier, cache, jnp.ones((batch, 1), jnp.int32),
                                                  repeats=repeats)}
    for name, method, params in [("autoregressive", "autoregressive", {}),
                                 ("speculative", "speculative", dict(gamma=GAMMA))]:
      kwargs = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=None, **params)
      run = lambda: decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, **kwargs)  # noqa: E731
      seconds = median_seconds(run, repeats=max(1, repeats // 4))
      figures[f"{name}_ms_per_token"] = 1e3 * seconds / NEW_TOKENS
      figures[f"{name}_temp_mib"] = program_memory(jax.random.PRNGKey(0), drafter, verifier, prompts, **kwargs) / 2**20
    return figures

  shipped = (load_model(os.path.join(models_dir, "debian_drafter")),
             load_model(os.path.join(models_dir, "debian_verifier")))
  vocab = shipped[1].vocab_size
  random_pair = (models.build("2m", vocab_size=vocab, seed=1), models.build("6m", vocab_size=vocab, seed=2))
  return {"shipped pair, batch 1, 64-token prompt": case(*shipped, batch=1, prompt_width=64),
          "random 2m → 6m, batch 8, 300-position cache": case(*random_pair, batch=8,
                                                              prompt_width=300 - NEW_TOKENS - GAMMA - 1)}


_COLLECTIVE = re.compile(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(")
_CALLED = re.compile(r"(?:calls|to_apply|true_computation|false_computation|body|condition)=(%[\w.\-]+)|"
                     r"branch_computations=\{([^}]*)\}")


def _mesh_collectives() -> dict:
  """Collectives per block of the sharded decode loop (module docstring); runs on 8 fake CPU devices."""
  import collections

  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import models
  from specdec.models import partitioning

  mesh = partitioning.make_mesh(4, 2)
  pair = [partitioning.shard_model(models.build("tiny", vocab_size=64, seed=s, max_length=64), mesh) for s in (1, 2)]
  prompts = partitioning.shard_batch(jnp.asarray(np.random.default_rng(0).integers(2, 64, (12, 10)), jnp.int32), mesh)
  hlo = _compiled_generate(jax.random.PRNGKey(0), *pair, prompts, method="speculative", gamma=3, temperature=1.0,
                           max_new_tokens=12, eos_id=None).as_text()
  computations, name = {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
      computations[name] = []
    elif name:
      computations[name].append(line)

  def count(name: str, nested: list) -> collections.Counter:
    """Collectives run once per pass of `name` (conditionals and calls included); nested loops' bodies are
    appended to `nested` instead."""
    found = collections.Counter()
    for line in computations.get(name, []):
      found.update(m.group(1) for m in _COLLECTIVE.finditer(line))
      for called, branches in _CALLED.findall(line):
        for callee in ([called] if called else [b.strip() for b in branches.split(",")]):
          if " while(" in line and f"body={callee}" in line:
            nested.append(callee)
          elif " while(" not in line:
            found.update(count(callee, nested))
    return found

  entry = next(n for n in computations if n.startswith("%main") or "ENTRY" in n)
  loops = [re.search(r"body=(%[\w.\-]+)", l).group(1) for l in computations[entry] if " while(" in l]
  # The decode loop is the entry's loop whose carry holds the most arrays.
  carries = {b: next(l for l in computations[entry] if f"body={b}" in l).count("[") for b in loops}
  body = max(carries, key=carries.get)
  nested: list = []
  per_block = count(body, nested)
  per_nested = {n: dict(count(n, [])) for n in nested}
  # KV caches: [rows, heads, slots, head_dim] per layer, or (before) [layers, rows, heads, slots, head_dim].
  carry = next(line for line in computations[entry] if f"body={body}" in line).split(" while(")[0]
  rows = sorted({int(dims[-4]) for dims in (d.split(",") for d in re.findall(r"f32\[([\d,]+)\]", carry))
                 if len(dims) in (4, 5)})
  return {"per_block": dict(per_block), "nested_loops": list(per_nested.values()), "cache_rows_per_device": rows}


def _run(tree: str, models_dir: str, repeats: int) -> dict:
  env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
    subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", out.name, "--models", models_dir,
                    "--repeats", str(repeats)], env=env, check=True, cwd=tree)
    figures = json.load(open(out.name))
  with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
    subprocess.run([sys.executable, os.path.abspath(__file__), "--collectives", out.name], check=True, cwd=tree,
                   env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    figures["mesh"] = json.load(open(out.name))
  return figures


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--before", help="git revision measured as 'before' (checked out in a temporary worktree)")
  parser.add_argument("--after", default=ROOT, help="tree measured as 'after' (default: this checkout)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--models", default=os.path.join(ROOT, "data", "models"))
  parser.add_argument("--out", default=os.path.join(ROOT, "experiments", "decode_program", "results.json"))
  parser.add_argument("--measure", help=argparse.SUPPRESS)
  parser.add_argument("--collectives", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    json.dump(_measure(args.models, args.repeats), open(args.measure, "w"))
    return
  if args.collectives:
    json.dump(_mesh_collectives(), open(args.collectives, "w"))
    return
  if not args.before:
    parser.error("--before REVISION is required")
  worktree = tempfile.mkdtemp(prefix="before_")
  subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", worktree, args.before], check=True,
                 capture_output=True)
  runs: dict[str, list[dict]] = {"before": [], "after": []}
  try:
    for round_ in range(args.rounds):
      for label, tree in (("before", worktree), ("after", args.after)):
        start = time.time()
        runs[label].append(_run(tree, args.models, args.repeats))
        print(f"round {round_ + 1}/{args.rounds} {label}: {time.time() - start:.0f} s", flush=True)
  finally:
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", worktree], check=False)
  medians = {label: {case: {name: statistics.median(r[case][name] for r in rs) for name in rs[0][case]}
                     for case in rs[0] if case != "mesh"} for label, rs in runs.items()}
  commit = subprocess.run(["git", "-C", args.after, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  import jax
  record = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
            "machine": f"{platform.machine()} | {jax.devices()[0].device_kind} | {os.cpu_count()} cpus | "
                       f"jax {jax.__version__}",
            "before": args.before, "after": f"{commit} (+ working tree)" if args.after == ROOT else args.after,
            "rounds": args.rounds, "repeats": args.repeats, "medians": medians, "runs": runs}
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  json.dump(record, open(args.out, "w"), indent=1)
  lines = [f"machine: {record['machine']}", f"command: {record['command']}",
           f"before: {record['before']}, after: {record['after']}; medians over {args.rounds} interleaved rounds", "",
           "| case | figure | before | after | before / after |", "|---|---|---:|---:|---:|"]
  for case, figures in medians["after"].items():
    for name, after in figures.items():
      before = medians["before"][case][name]
      lines.append(f"| {case} | {name} | {before:.2f} | {after:.2f} | {before / after:.2f}× |")
  lines += ["", "Mesh (data=4, model=2), batch 12, speculative γ = 3, T = 1 (tiny random pair, 8 fake CPU devices):", ""]
  for label in ("before", "after"):
    mesh = runs[label][0]["mesh"]
    lines.append(f"- {label}: KV cache rows per device {mesh['cache_rows_per_device']}; collectives per block "
                 f"{mesh['per_block']}; per step of each nested loop {mesh['nested_loops']}")
  table = "\n".join(lines) + "\n"
  open(os.path.splitext(args.out)[0] + ".md", "w").write(table)
  print(table)


if __name__ == "__main__":
  main()
