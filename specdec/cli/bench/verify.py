"""The block's sampling side in units of one softmax over the same [B, γ+1, V] logits.

Rows: S(·) at top-P ∈ {1, 0.9, 0.5}, every rule's target π = T(q, p), `verify_block`, and the whole block
(S(q), S(p) + token_v3 + verify) in one jit and in two, with the scratch memory of the one-jit block
(`memory_analysis`; glibc serves allocations above 32 MB from fresh, page-faulting pages). Each figure is
the median over `--rounds` of a median of `--repeats` calls; the softmax is timed before, between and after
the rows, and its median is the unit.

  specdec-bench verify --shapes 1,5,8192 8,8,32000 --repeats 30
  specdec-bench --before a649a8b verify --repeats 30     # the implementations at a649a8b, rounds alternating
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

TOP_PS = (1.0, 0.9, 0.5)
PIPELINE_RULE = "token_v3"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--shapes", nargs="+", default=["1,5,8192", "8,8,32000"], help="B,γ,V triples")
  parser.add_argument("--repeats", type=int, default=30)
  parser.add_argument("--rounds", type=int, default=3, help="medians of repeats per row")


def programs(gamma: int) -> dict[str, tuple[Any, float | None]]:
  """Row name -> (the jitted function, the top-P of a block row)."""
  import jax

  from specdec import sampling, targets, verify
  jitted = {f"S(.) top-P {top_p:g}": (jax.jit(lambda x, t=top_p: sampling.transform(x, 1.0, t)), None)
            for top_p in TOP_PS}
  for rule in targets.RULES:   # registration order (names; a tuple of names in early revisions)
    jitted[f"target {rule}"] = (jax.jit(lambda q, p, q_raw, p_raw, alpha, rule=rule: targets.target_distribution(
        rule, q=q, p=p, q_raw=q_raw, p_raw=p_raw, alpha=alpha)), None)
  jitted["verify_block (q, pi given)"] = (jax.jit(verify.verify_block), None)

  def transforms(logits_q, logits_p, temperature, top_p):
    return sampling.transform(logits_q, temperature, top_p), sampling.transform(logits_p, temperature, top_p)

  def rule_and_verify(key, drafts, q, p, alpha):  # the deferral rule reads S(·) as the raw distributions
    pi = targets.target_distribution(PIPELINE_RULE, q=q, p=p, q_raw=q, p_raw=p, alpha=alpha)
    return verify.verify_block(key, drafts, q[:, :gamma], pi)

  def block(key, drafts, logits_q, logits_p, temperature, top_p, alpha):
    return rule_and_verify(key, drafts, *transforms(logits_q, logits_p, temperature, top_p), alpha)

  transforms_jit, rule_and_verify_jit = jax.jit(transforms), jax.jit(rule_and_verify)

  def block_two_jits(key, drafts, logits_q, logits_p, temperature, top_p, alpha):
    return rule_and_verify_jit(key, drafts, *transforms_jit(logits_q, logits_p, temperature, top_p), alpha)

  for top_p in (1.0, 0.9):
    jitted[f"block top-P {top_p:g}, one jit"] = (jax.jit(block), top_p)
    jitted[f"block top-P {top_p:g}, two jits"] = (block_two_jits, top_p)
  return jitted


def bench_shape(batch: int, gamma: int, vocab: int, repeats: int, rounds: int) -> list[dict[str, Any]]:
  """Rows at one shape (module docstring)."""
  import jax
  import jax.numpy as jnp

  from specdec.evaluation import bench
  kq, kp, kd, kv = jax.random.split(jax.random.PRNGKey(0), 4)
  logits_q = jax.random.normal(kq, (batch, gamma + 1, vocab)) * 3
  logits_p = jax.random.normal(kp, (batch, gamma + 1, vocab)) * 3
  q, p = jax.nn.softmax(logits_q), jax.nn.softmax(logits_p)
  q_raw, p_raw = jax.nn.softmax(logits_q * 0.9), jax.nn.softmax(logits_p * 0.9)  # distinct arrays
  drafts = jax.random.categorical(kd, logits_q[:, :gamma]).astype(jnp.int32)

  def args(row: str, top_p: float | None) -> tuple:
    if row.startswith("S(.)"):
      return (logits_p,)
    if row.startswith("target"):
      return (q, p, q_raw, p_raw, jnp.float32(0.3))   # in every rule's α range: [0, 1) and [0, ∞)
    if row.startswith("verify"):
      return (kv, drafts, q[:, :gamma], p)
    return (kv, drafts, logits_q, logits_p, jnp.float32(1.0), jnp.float32(top_p), jnp.float32(0.3))

  softmax = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
  jitted = programs(gamma)
  units = [bench.median_seconds(softmax, logits_p, repeats=repeats)]
  timed = {}
  for i, (row, (fn, top_p)) in enumerate(jitted.items()):
    if i == len(jitted) // 2:
      units.append(bench.median_seconds(softmax, logits_p, repeats=repeats))
    timed[row] = statistics.median(bench.median_seconds(fn, *args(row, top_p), repeats=repeats)
                                   for _ in range(rounds))
  units.append(bench.median_seconds(softmax, logits_p, repeats=repeats))
  unit = statistics.median(units)
  shape = f"{batch},{gamma},{vocab}"
  rows = [{"shape": shape, "row": "softmax", "ms": 1e3 * unit, "softmaxes": 1.0}]
  for row, seconds in timed.items():
    fn, top_p = jitted[row]
    entry = {"shape": shape, "row": row, "ms": 1e3 * seconds, "softmaxes": seconds / unit}
    if row.endswith("one jit"):
      entry["temp_mib"] = fn.lower(*args(row, top_p)).compile().memory_analysis().temp_size_in_bytes / 2**20
    rows.append(entry)
  bench.log(f"B={batch}, γ={gamma}, V={vocab}: softmax {1e3 * unit:.3f} ms (timings "
            + ", ".join(f"{1e3 * t:.3f}" for t in units) + ")")
  return rows


def run(args: argparse.Namespace, command: str) -> tuple[dict[str, Any], str]:
  from specdec.evaluation import bench
  record = bench.new_record("verify", command, keys=("shape", "row"), repeats=args.repeats, rounds=args.rounds)
  for shape in args.shapes:
    batch, gamma, vocab = (int(x) for x in shape.split(","))
    record["rows"] += bench_shape(batch, gamma, vocab, args.repeats, args.rounds)
  table = (f"median over {args.rounds} rounds of the median of {args.repeats} calls after warm-up; softmaxes: "
           "the row's time over one softmax over the same logits (the median of three timings of it)\n\n"
           + bench.markdown_table(record["rows"], ("shape", "row", "ms", "softmaxes", "temp_mib")))
  return record, table + "\n"
