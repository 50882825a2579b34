"""The compiled decode program's costs: verify call, one-token step, ms per token, temp memory, collectives.

Measured through the public model interface and `decoding.generate` (so that `specdec-bench --before REV
program` reads old revisions the same way):
  - the shipped pair (data/models/debian_drafter → debian_verifier) at batch 1: the verifier's verify call
    (score γ+1 = 6 tokens) and one-token step on a 64-token prefix; autoregressive and speculative (γ = 5,
    greedy) ms per generated token over 64 new tokens;
  - random-weight 6m verifier (2m drafter) at batch 8 with a 300-position cache: the same figures;
  - temp memory (`memory_analysis()`) of each compiled `generate`;
  - with `--mesh` (a fresh process on 8 fake CPU devices): mesh (data=4, model=2), batch 12, tiny random
    transformer pair, speculative γ = 3 at T = 1: the collectives of the compiled decode loop — those of one
    block (its body, conditionals included) and those of the loops nested in it (per drafter call, per top-P
    search step), read by `evaluation.hlo` — and the rows per device of the KV caches it carries.

  specdec-bench --before 86bdb81 --rounds 3 program --mesh --out experiments/decode_program/results
"""

from __future__ import annotations

import argparse
import json
import os
import types
from typing import Any

NEW_TOKENS, GAMMA = 64, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
  from specdec.evaluation.bench import REPO_ROOT
  parser.add_argument("--models", default=os.path.join(REPO_ROOT, "data", "models"))
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--mesh", action="store_true", help="also the collectives on 8 fake CPU devices")
  parser.add_argument("--collectives_only", action="store_true", help=argparse.SUPPRESS)   # the --mesh process


def compiled_generate(*args, **kwargs):
  """The compiled program `decoding.generate(*args, **kwargs)` runs: `decoding.lower`'s.

  An adapter to the revisions `--before` measures: those before f1e0e0f (86bdb81, issue 38's before) have no
  `lower`. Their `generate` calls the jitted kernel `_generate`, whose arguments are captured from one call of a
  copy of `generate` that reads a capturing kernel as its `_generate`: the revision's module is left as it is."""
  from specdec import decoding

  if hasattr(decoding, "lower"):
    return decoding.lower(*args, **kwargs).compile()
  kernel, captured, generate = decoding._generate, {}, decoding.generate

  def capture(*a, **k):
    captured.update(args=a, kwargs=k)
    return kernel(*a, **k)
  capturing = types.FunctionType(generate.__code__, {**generate.__globals__, "_generate": capture},
                                 generate.__name__, generate.__defaults__, generate.__closure__)
  capturing.__kwdefaults__ = generate.__kwdefaults__
  capturing(*args, **kwargs)
  return kernel.lower(*captured["args"], **captured["kwargs"]).compile()


def _case(name: str, drafter, verifier, batch: int, prompt_width: int, repeats: int) -> dict[str, Any]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import decoding
  from specdec.evaluation import bench
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, verifier.vocab_size, (batch, prompt_width)), jnp.int32)
  step = bench.score_seconds(verifier, (1, GAMMA + 1), batch=batch, prefix=prompt_width, repeats=repeats)
  row = {"case": name, "verify_call_ms": 1e3 * step[GAMMA + 1], "one_token_step_ms": 1e3 * step[1]}
  for method, params in (("autoregressive", {}), ("speculative", dict(gamma=GAMMA))):
    kwargs = dict(method=method, max_new_tokens=NEW_TOKENS, temperature=0.0, eos_id=None, **params)
    run = lambda: decoding.generate(jax.random.PRNGKey(0), drafter, verifier, prompts, **kwargs)  # noqa: E731
    row[f"{method}_ms_per_token"] = 1e3 * bench.median_seconds(run, repeats=max(1, repeats // 4)) / NEW_TOKENS
    memory = compiled_generate(jax.random.PRNGKey(0), drafter, verifier, prompts, **kwargs).memory_analysis()
    row[f"{method}_temp_mib"] = memory.temp_size_in_bytes / 2**20
  bench.log(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "case"))
  return row


def mesh_collectives() -> dict[str, Any]:
  """Collectives per block of the sharded decode loop and per step of its nested loops, and the KV cache rows
  per device (module docstring); needs 8 devices."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from specdec import models
  from specdec.evaluation import hlo
  from specdec.models import partitioning

  mesh = partitioning.make_mesh(4, 2)
  pair = [partitioning.shard_model(models.build("tiny", vocab_size=64, seed=s, max_length=64), mesh) for s in (1, 2)]
  prompts = partitioning.shard_batch(jnp.asarray(np.random.default_rng(0).integers(2, 64, (12, 10)), jnp.int32), mesh)
  program = hlo.parse(compiled_generate(jax.random.PRNGKey(0), *pair, prompts, method="speculative", gamma=3,
                                        temperature=1.0, max_new_tokens=12, eos_id=None).as_text())
  loops = hlo.loops(program)
  # The decode loop: the outermost loop whose carry holds the most arrays.
  decode = max((loop for loop in loops if loop.depth == 0),
               key=lambda loop: len(program.instructions[loop.name].shapes))
  tally = lambda scope: {op: t.count for op, t in hlo.collectives(program, scope).items()}  # noqa: E731
  # KV caches: [rows, heads, slots, head_dim] per layer (or [layers, rows, …] in early revisions).
  rows = sorted({shape.dims[-4] for shape in program.instructions[decode.name].shapes
                 if shape.dtype == "f32" and len(shape.dims) in (4, 5)})
  return {"per_block": tally(decode), "nested_loops": [tally(loop) for loop in loops if loop.parent == decode.name],
          "cache_rows_per_device": rows}


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  from specdec.evaluation import bench
  record = bench.new_record("program", command, keys=("case",), new_tokens=NEW_TOKENS, gamma=GAMMA,
                            repeats=args.repeats)
  if args.collectives_only:
    record["mesh"] = mesh_collectives()
    return record, json.dumps(record["mesh"]) + "\n"
  from specdec import models
  from specdec.training import load_model
  shipped = (load_model(os.path.join(args.models, "debian_drafter")),
             load_model(os.path.join(args.models, "debian_verifier")))
  vocab = shipped[1].vocab_size
  random_pair = (models.build("2m", vocab_size=vocab, seed=1), models.build("6m", vocab_size=vocab, seed=2))
  record["rows"] = [
      _case("shipped pair, batch 1, 64-token prompt", *shipped, batch=1, prompt_width=64, repeats=args.repeats),
      _case("random 2m → 6m, batch 8, 300-position cache", *random_pair, batch=8,
            prompt_width=300 - NEW_TOKENS - GAMMA - 1, repeats=args.repeats)]
  table = bench.markdown_table(record["rows"])
  if args.mesh:   # 8 fake devices: a flag read when JAX starts, so a process of its own on this tree's library
    mesh = bench.run_in_tree(bench.REPO_ROOT, ["program", "--collectives_only"],
                             env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"})
    record["mesh"] = mesh["mesh"]
    table += (f"\n\nMesh (data=4, model=2), batch 12, speculative γ = 3, T = 1 (tiny random pair, 8 fake CPU "
              f"devices): KV cache rows per device {record['mesh']['cache_rows_per_device']}; collectives per "
              f"block {record['mesh']['per_block']}; per step of each nested loop {record['mesh']['nested_loops']}\n")
  return record, table
