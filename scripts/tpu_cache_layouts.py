"""Which KV-cache layout, slot write and attention form leave no cache relayout in a TPU v4 decode loop.

A bare loop, compiled for one TPU v4 chip on this CPU (libtpu's compile-only devices, `plan.topology`): each
of `--steps` iterations writes n = `--tokens` new keys and values per row at that row's own slots (a per-row
scatter, as `models.base.write_slots`) into every layer's cache, then attends over the cache. The caches are
made inside the program, as the decode programs make theirs (XLA then lays them out as it likes; caches passed
in as arguments keep the caller's row-major layout, and cost copies where XLA's scatter wants another). The HLO of the
compiled loop (`evaluation.hlo`) counts the copies of cache-sized arrays: materialized, fused (a relayout
inside a fusion) and asynchronous (HBM <-> on-chip memory), inside the loop and outside it.

It isolates what `specdec-plan` found in the decode programs (experiments/tpu_v4_plan): the drafter's
one-token steps carry no relayout, the verifier's γ + 1-token calls one per K and V of every layer.

  python scripts/tpu_cache_layouts.py                       # n = 1 and n = 4, both layouts
  python scripts/tpu_cache_layouts.py --tokens 4 --heads 16 --head_dim 64 --write per_token

Layouts: bhcd = [B, H, C, D] (the models' cache on CPU/GPU), bchd = [B, C, H, D], slots = [C, B, H·D] (the
models' cache on TPU: `base.write_slots` and `models/attention_kernel.py`'s Pallas kernel, whatever
`--write` and `--attention` say). Writes: scatter (one per-row scatter of the n tokens), per_token (n one-slot
scatters). Attention: dot (einsum), reduce (multiply and sum in float32, no MXU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from specdec.evaluation import hlo, plan
from specdec.models import attention_kernel, base


def _write(layout: str, write: str, cache, new, slots):
  """cache with new [B, n, H, D] at slots [B, n] of each row (dropped beyond the cache)."""
  if layout == "slots":
    return base.write_slots(cache, new, slots, "slots")
  if write == "per_token":
    axis = 1 if layout == "bhcd" else 0
    for j in range(new.shape[1]):
      def one(row, entry, slot):
        return row.at[(slice(None), slot) if axis else slot].set(entry, mode="drop")
      cache = jax.vmap(one)(cache, new[:, j], slots[:, j])
    return cache
  def row_write(row, entries, row_slots):
    if layout == "bhcd":
      return row.at[:, row_slots].set(entries.transpose(1, 0, 2), mode="drop")
    return row.at[row_slots].set(entries, mode="drop")
  return jax.vmap(row_write)(cache, new, slots)


def _attend(layout: str, attention: str, keys, values, query, visible):
  """Attention of query [B, n, H, D] over the cache where visible [B, n, C]: [B, n, H, D]."""
  cache = "bhcd" if layout == "bhcd" else "bchd"
  if layout == "slots":   # the models' TPU layout: attended in place by their Pallas kernel
    return attention_kernel.attend(query, keys, values, visible, key_heads=query.shape[2])
  if attention == "reduce":
    k = keys if layout == "bhcd" else keys.transpose(0, 2, 1, 3)
    v = values if layout == "bhcd" else values.transpose(0, 2, 1, 3)
    scores = jnp.sum(k[:, :, None].astype(jnp.float32) * query.transpose(0, 2, 1, 3)[:, :, :, None], axis=-1)
    weights = jax.nn.softmax(jnp.where(visible[:, None], scores, -1e30), axis=-1)
    out = jnp.sum(weights[..., None] * v[:, :, None].astype(jnp.float32), axis=-2)
    return out.transpose(0, 2, 1, 3).astype(keys.dtype)
  scores = jnp.einsum(f"{cache},bnhd->bhnc", keys, query).astype(jnp.float32)
  weights = jax.nn.softmax(jnp.where(visible[:, None], scores, -1e30), axis=-1).astype(keys.dtype)
  return jnp.einsum(f"bhnc,{cache}->bnhd", weights, values)


def _attend_split(layout: str, keys, values, new_keys, new_values, query, lengths):
  """Attention over the cache's committed slots (< lengths) and the n new tokens (causal), the cache not yet
  holding them: one softmax over both."""
  cache = "bhcd" if layout == "bhcd" else "bchd"
  n, c = query.shape[1], keys.shape[2] if layout == "bhcd" else keys.shape[1]
  old = jnp.einsum(f"{cache},bnhd->bhnc", keys, query).astype(jnp.float32)
  old = jnp.where((jnp.arange(c)[None, :] < lengths[:, None])[:, None, None], old, -1e30)
  own = jnp.einsum("bmhd,bnhd->bhnm", new_keys, query).astype(jnp.float32)
  own = jnp.where(jnp.tril(jnp.ones((n, n), bool)), own, -1e30)
  weights = jax.nn.softmax(jnp.concatenate([old, own], axis=-1), axis=-1).astype(keys.dtype)
  return (jnp.einsum(f"bhnc,{cache}->bnhd", weights[..., :c], values)
          + jnp.einsum("bhnm,bmhd->bnhd", weights[..., c:], new_values))


def compiled_loop(args: argparse.Namespace, layout: str, tokens: int) -> str:
  """The optimized HLO of the loop for one v4 chip."""
  device = plan.topology("v4-1chip").devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  b, h, c, d = args.batch, args.heads, args.cache_length, args.head_dim

  def step(_, carry):
    caches, lengths, x = carry
    slots = lengths[:, None] + jnp.arange(tokens)
    visible = jnp.arange(c)[None, None, :] <= slots[:, :, None]
    written = []
    for keys, values in caches:
      new_keys, new_values = x, x + 1
      if args.order == "write_first":
        keys, values = _write(layout, args.write, keys, new_keys, slots), _write(layout, args.write, values, new_values, slots)
        x = _attend(layout, args.attention, keys, values, x, visible) + x
      else:   # attend over the committed entries and the new tokens apart, then write the new ones
        x = _attend_split(layout, keys, values, new_keys, new_values, x, lengths) + x
        keys, values = _write(layout, args.write, keys, new_keys, slots), _write(layout, args.write, values, new_values, slots)
      written.append((keys, values))
    return written, lengths + tokens, x

  shape = {"bhcd": (b, h, c, d), "bchd": (b, c, h, d), "slots": (c, b, h * d)}[layout]

  def run(lengths, x):   # the caches made inside, as the decode programs make theirs: XLA lays them out
    caches = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)) for _ in range(args.layers)]
    return jax.lax.fori_loop(0, args.steps, step, (caches, lengths, x))[2]

  def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  lowered = jax.jit(run).lower(spec((b,), jnp.int32), spec((b, tokens, h, d)))
  return lowered.compile().as_text()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layouts", nargs="+", default=["bhcd", "bchd", "slots"], choices=["bhcd", "bchd", "slots"])
  parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="n new tokens per call")
  parser.add_argument("--write", default="scatter", choices=["scatter", "per_token"])
  parser.add_argument("--attention", default="dot", choices=["dot", "reduce"])
  parser.add_argument("--order", default="write_first", choices=["write_first", "attend_first"],
                      help="write the new keys then attend over the cache (the models), or attend over the "
                           "committed cache and the new keys apart, then write")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--cache_length", type=int, default=256)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--steps", type=int, default=4)
  args = parser.parse_args(argv)
  per_layer = args.batch * args.cache_length * args.head_dim   # one head of one layer's K or V
  print(f"TPU v4, one chip: batch {args.batch}, {args.heads} heads x {args.head_dim}, cache {args.cache_length}, "
        f"{args.layers} layers (K and V each), write {args.write}, attention {args.attention}, {args.order}")
  print("| layout | n | scope | materialized | fused (relayouts) | async (HBM <-> on-chip) |")
  print("|---|---|---|---|---|---|")
  for layout in args.layouts:
    for tokens in args.tokens:
      program = hlo.parse(compiled_loop(args, layout, tokens))
      for name, scope in [("loop", loop) for loop in hlo.loops(program)] + [("outside", program.entry)]:
        moves = hlo.count_moves(program, scope, min_elements=per_layer)
        print(f"| {layout} | {tokens} | {name} | {moves.materialized.count} | {moves.fused.count} | "
              f"{moves.async_copies.count} |")


if __name__ == "__main__":
  main()
