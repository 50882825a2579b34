"""What a plan reads of its compiled programs (`evaluation.plan`): each call's flops, minimum HBM bytes and
roofline time on a chip, the moves and collectives in the decode program's loops (`evaluation.hlo`), and the
roofline tokens/s of autoregressive and speculative decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from specdec.evaluation import hlo
from specdec.evaluation.tpu_topology import Chip


def roofline_seconds(flops: float, hbm_bytes: float, chip: Chip) -> float:
  """The least time a call can take on one chip: compute- or HBM-bound, whichever is slower."""
  return max(flops / chip.peak_flops, hbm_bytes / chip.hbm_bandwidth)


def analyse_call(program_facts: dict[str, Any], chip: Chip) -> dict[str, Any]:
  """flops, minimum HBM bytes, roofline time and collectives of one call's program, per chip.

  Minimum HBM bytes: every argument the program reads, once, as the chip's tiles store it (padding
  included), plus its outputs, less what is updated in place (the donated cache): a call's weights and
  cache read once and its logits written once. Arguments it never reads (a T5 decoder step does not read
  the encoder's weights) are left out. `padding` is that read's size over its logical size;
  `over_arguments`, the minimum HBM bytes over the logical size of what it reads (its weights, cache and
  inputs): what tiles and outputs add to reading the weights and cache once."""
  if not program_facts["fits"]:
    return dict(fits=False, error=program_facts["error"])
  memory, flops = program_facts["memory"], program_facts["flops"]
  program = hlo.parse(program_facts["hlo"])
  read = [shape for parameter in hlo.entry_parameters(program, used_only=True) for shape in parameter.shapes]
  read_bytes = sum(shape.padded_bytes for shape in read)
  hbm_bytes = read_bytes + memory["outputs"] - memory["aliased"]
  logical = max(1, sum(shape.bytes for shape in read))
  return dict(flops=flops, hbm_bytes=hbm_bytes, read_bytes=read_bytes, padding=read_bytes / logical,
              over_arguments=hbm_bytes / logical,
              roofline_us=1e6 * roofline_seconds(flops, hbm_bytes, chip),
              bound="compute" if flops / chip.peak_flops > hbm_bytes / chip.hbm_bandwidth else "memory",
              collectives={op: tally._asdict() for op, tally in hlo.collectives(program, program.entry).items()},
              memory=memory)


def analyse_loop(hlo_text: str, *, cache_elements: int, cache_length: int, width: int, vocabs: Sequence[int]
                 ) -> list[dict[str, Any]]:
  """Per scope of the decode program (outside loops, each loop): relayouts and HBM↔on-chip round trips
  of arrays of at least one layer's KV cache per device with a cache_length dimension, copies of
  [.., γ + 1, V] arrays (`width` = γ + 1; `vocabs`: V whole, as the sampling math holds it after the
  logits' gather, and V per device), and collectives."""
  program = hlo.parse(hlo_text)

  def cache_sized(dims: Sequence[int]) -> bool:
    return cache_length in dims and math.prod(dims) >= cache_elements

  def block_sized(dims: Sequence[int]) -> bool:   # [.., γ+1, V] and its [.., γ+1, V/128, 128] tiling
    return width in dims and any(v in dims or (v % 128 == 0 and v // 128 in dims and 128 in dims) for v in vocabs)

  return hlo.summary(program, min_elements=1, selectors=dict(cache=cache_sized, block=block_sized))


def expected_tokens_per_block(acceptance: float, gamma: int) -> float:
  """E[tokens per block] = (1 − a^{γ+1}) / (1 − a) for an acceptance rate a per drafted token, i.i.d.
  across a block's positions (Leviathan et al., eq. 1)."""
  if acceptance >= 1.0:
    return float(gamma + 1)
  return (1.0 - acceptance ** (gamma + 1)) / (1.0 - acceptance)


# The methods whose block is γ drafter steps and one verifier call (`speeds`): speculative decoding, and the
# multi-draft methods, whose drafter steps K copies of each row and whose verifier call scores their token tree.
BLOCK_METHODS = ("speculative", "spectr", "specinfer", "dynamic_tree")


def speeds(calls: dict[str, dict[str, Any]], *, batch_size: int, gamma: int, acceptances: Iterable[float],
           feature: bool = False) -> dict[str, Any]:
  """Roofline tokens/s (an upper bound: every call at its roofline time; sampling math and collective
  latency not counted) of the verifier alone and of speculative decoding per acceptance rate a.

  A block costs γ drafter steps, one verifier call of γ + 1 tokens and, when every draft is accepted
  (probability a^γ), the drafter's step scoring its last draft (`ModelDrafter(bonus_q=False)`); a feature
  drafter's block, the head's re-read of the verified block instead (`FeatureDrafter.verified`). For K drafts
  per block (SpecTr, SpecInfer, a dynamic tree) `calls` holds the drafter's calls on K·B rows and the verifier's
  call on the K·γ + 1 tokens of their tree (its widest: shared prefixes can make it narrower), and a is the
  rate at which the block's selection keeps a position."""
  step, verify, draft = (calls[name]["roofline_us"] for name in ("verifier_step", "verifier_call", "drafter_step"))
  autoregressive = batch_size / (step * 1e-6)
  rows = []
  for a in acceptances:
    catch_up = calls["drafter_reread"]["roofline_us"] if feature else a ** gamma * draft
    block_us = gamma * draft + verify + catch_up
    tokens = expected_tokens_per_block(a, gamma)
    speculative = batch_size * tokens / (block_us * 1e-6)
    rows.append(dict(acceptance=a, tokens_per_block=tokens, block_us=block_us, tokens_per_s=speculative,
                     speedup=speculative / autoregressive))
  fixed = gamma * draft + verify + (calls["drafter_reread"]["roofline_us"] if feature else 0.0)
  return dict(autoregressive_tokens_per_s=autoregressive, break_even_tokens_per_block=fixed / step, speculative=rows)

