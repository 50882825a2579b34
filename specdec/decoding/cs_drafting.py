"""Cascade Speculative Drafting (Chen et al., "Cascade Speculative Drafting for Even Faster LLM Inference").

Drafters built from drafters, so any speculative method can use them:

  VerticalCascade(upper, lower)   the model `upper` drafts, its own drafts proposed by `lower` (Max-Gram,
                                  or another VerticalCascade: the recursion of Alg. 1) and reviewed by
                                  `upper` in one call per `lower_gamma` of them, with lenience l ≥ 1
  HorizontalCascade(stages, limits)
                                  stages in turn along a block: the first limits[0] drafts from stages[0],
                                  the next limits[1] from stages[1], …, the rest from the last stage (CSD's
                                  K_nn rows: larger drafters early in the block, where acceptance matters most)

Each reports the exact law of every draft it emits as q (the lenient review's π, `targets.lenient_target`),
so the verifier's own test keeps the verifier's law whatever the lower levels do: lenience changes which
drafts are proposed, never what is emitted. The registered method `cs_drafting` is speculative decoding
with verifier ← [model ← Max-Gram] for the first `model_drafts` positions and Max-Gram for the rest.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from specdec import checks, rng, targets, verify
from specdec import sampling as sampling_lib
from specdec.decoding import common, speculative
from specdec.decoding.drafters import Draft, Drafter, MaxGram, ModelDrafter, observe_chunk
from specdec.decoding.methods import GAMMA, Bounds, Method, Param, count_bounds, register
from specdec.models.base import Cache, Model, prefill, rollback

Array = jax.Array


@struct.dataclass
class VerticalState:
  upper: Cache
  lower: Any


@struct.dataclass
class _ReviewCarry:
  key: Array
  upper: Cache
  lower: Any
  token: Array        # [B] the pending token (consumed by neither level yet)
  n: Array            # [B] tokens emitted so far in this block
  tokens: Array       # [B, γ+1] emitted tokens (the drafts, then one more whose q is the bonus q)
  q: Array            # [B, γ+1, V] the law each emitted token was drawn from
  q_raw: Array        # [B, γ+1, V] upper's distribution at temperature 1 there
  calls: Array        # [B] model calls (upper's and the lower levels')


@struct.dataclass
class VerticalCascade(Drafter):
  """CSD's vertical cascade (Alg. 1, one level): `upper` (a model) generates by speculative decoding with
  `lower` (any `Drafter`) as its drafter, reviewing `lower_gamma` lower drafts per call under lenience l:
  a lower draft x is kept with probability min(1, l·p_u(x)/q_l(x)), else replaced from the residual.
  l = 1 makes the drafts exact samples of `upper`; l > 1 keeps more of them (cheaper drafting) and the
  law it gives each draft is reported as q, so the verifier above stays exact (module docstring).
  """
  upper: Model
  lower: Drafter
  lower_gamma: int = struct.field(pytree_node=False, default=4)
  lenience: Array | float = 1.0

  def __post_init__(self):
    checks.check_count("lower_gamma", self.lower_gamma, 1)
    checks.check_range("lenience", self.lenience, 1.0, math.inf, hi_closed=False)
    if self.lower.vocab_size != self.upper.vocab_size:
      raise ValueError(f"VerticalCascade levels have different vocabularies: upper vocab_size="
                       f"{self.upper.vocab_size}, lower vocab_size={self.lower.vocab_size}")
    if self.lower.encoder_decoder != self.upper.encoder_decoder:
      raise ValueError("VerticalCascade levels must read the prompt alike (both decoder-only or both "
                       "encoder-decoder)")

  @property
  def vocab_size(self) -> int:
    return self.upper.vocab_size

  @property
  def max_length(self) -> int:
    return min(self.upper.max_length, self.lower.max_length)

  @property
  def encoder_decoder(self) -> bool:
    return self.upper.encoder_decoder

  @property
  def cache_overhang(self) -> int:
    """Cache positions written beyond the block: a review call reaches lower_gamma + 1 past it."""
    return self.lower_gamma + 1 + self.lower.cache_overhang

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return max(self.upper.prompt_cache_positions(prompt_width), self.lower.prompt_cache_positions(prompt_width))

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[VerticalState, Array]:
    last, upper = prefill(self.upper, self.upper.init_cache(prompts.shape[0], cache_length, layout), prompts,
                          prompt_lengths)
    lower, _ = self.lower.start(prompts, prompt_lengths, cache_length, layout)
    return VerticalState(upper=upper, lower=lower), last

  def rollback(self, state: VerticalState, lengths: Array) -> VerticalState:
    return VerticalState(upper=rollback(state.upper, lengths), lower=self.lower.rollback(state.lower, lengths))

  def observe(self, state: VerticalState, tokens: Array, counts: Array) -> VerticalState:
    return VerticalState(upper=ModelDrafter(self.upper).observe(state.upper, tokens, counts),
                         lower=self.lower.observe(state.lower, tokens, counts))

  def propose(self, key: Array, state: VerticalState, last: Array, *, max_drafts: int,
              sampling: sampling_lib.Sampling, keep_drafting: Callable[[Array], Array] | None = None) -> Draft:
    """γ = max_drafts drafts, and one token more whose law is q at the bonus position. Each review call
    scores [pending, x_1 … x_k] (k = lower_gamma lower drafts) and emits the kept prefix plus one token;
    rows stop once they hold γ + 1 tokens, the loop when all have."""
    if keep_drafting is not None:
      raise ValueError("a VerticalCascade drafts whole blocks: it has no per-position stopping rule "
                       "(BiLD's fallback); use a model drafter for bild")
    batch, vocab, k, width = last.shape[0], self.vocab_size, self.lower_gamma, max_drafts + 1
    rows, index = jnp.arange(batch), jnp.arange(k + 1)
    greedy = sampling.temperature <= 0.0

    def body(c: _ReviewCarry) -> _ReviewCarry:
      key, key_lower, key_review = rng.split(c.key, 3)
      active = c.n < width
      lower = self.lower.propose(key_lower, c.lower, c.token, max_drafts=k, sampling=sampling)
      scored = self.upper.score(c.upper, jnp.concatenate([c.token[:, None], lower.tokens], axis=1))
      logits, upper = scored.logits, scored.cache
      p_raw, p = sampling.distributions(logits)
      pi = targets.lenient_target(lower.q[:, :k], p[:, :k], q_raw=lower.q_raw[:, :k], p_raw=p_raw[:, :k],
                                  lenience=self.lenience, greedy=greedy)
      # After the lower level's last draft (k, or fewer for a gated Max-Gram) the upper model samples.
      pi = jnp.where((index >= lower.n_drafted[:, None])[..., None], p, jnp.pad(pi, ((0, 0), (0, 1), (0, 0))))
      n_kept, next_token = verify.verify_block(key_review, lower.tokens, lower.q[:, :k], pi, lower.n_drafted)
      # A row NaN reached reports NaN as its law (the verifier above flags it) and stops reviewing.
      failed = n_kept < 0
      pi = jnp.where(failed[:, None, None], jnp.nan, pi)
      count = jnp.where(failed, width, n_kept + 1)
      block = jnp.where(index < n_kept[:, None], jnp.pad(lower.tokens, ((0, 0), (0, 1))), next_token[:, None])
      slots = jnp.where(active[:, None] & (index < count[:, None]), c.n[:, None] + index, width)
      count = jnp.where(active, count, 0)
      committed = c.upper.lengths + count
      return _ReviewCarry(
          key=key, upper=rollback(upper, committed), lower=self.lower.rollback(lower.state, committed),
          token=jnp.where(active, next_token, c.token), n=c.n + count,
          tokens=c.tokens.at[rows[:, None], slots].set(block, mode="drop"),
          q=c.q.at[rows[:, None], slots].set(pi, mode="drop"),
          q_raw=c.q_raw.at[rows[:, None], slots].set(p_raw, mode="drop"),
          calls=c.calls + jnp.where(active, 1 + lower.calls, 0))

    zeros = jnp.zeros((batch, width, vocab), jnp.float32)
    start = _ReviewCarry(key=key, upper=state.upper, lower=state.lower, token=last,
                         n=jnp.zeros((batch,), jnp.int32), tokens=jnp.zeros((batch, width), jnp.int32),
                         q=zeros, q_raw=zeros, calls=jnp.zeros((batch,), jnp.int32))
    end = jax.lax.while_loop(lambda c: jnp.any(c.n < width), body, start)
    return Draft(tokens=end.tokens[:, :max_drafts], q=end.q, q_raw=end.q_raw,
                 n_drafted=jnp.full((batch,), max_drafts, jnp.int32), calls=end.calls,
                 state=VerticalState(upper=end.upper, lower=end.lower))


@struct.dataclass
class HorizontalState:
  """stages: each stage's state; consumed [S, B]: positions each stage holds; history [B, H]: committed
  tokens then the pending token and the block's drafts; length [B]: committed positions."""
  stages: tuple
  consumed: Array
  history: Array
  length: Array


@struct.dataclass
class HorizontalCascade(Drafter):
  """CSD's horizontal cascade (Alg. 1's for loop): stages[i] drafts limits[i] positions of each block in
  turn, the last stage the rest. A stage that did not see the tokens drafted by the others (or accepted
  from them) reads them first (`observe`, one call for a model), so every stage drafts from the true
  prefix. Stages must implement `observe(state, tokens [B, W], counts [B])` (models, Max-Gram and vertical
  cascades do).
  """
  stages: tuple[Drafter, ...]
  limits: tuple = struct.field(pytree_node=False, default=())

  def __post_init__(self):
    if len(self.stages) < 2 or len(self.limits) != len(self.stages) - 1:
      raise ValueError(f"HorizontalCascade needs ≥ 2 stages and one limit per stage but the last; got "
                       f"{len(self.stages)} stages, limits={self.limits}")
    for limit in self.limits:
      checks.check_count("limits", limit, 1)
    vocabs = {stage.vocab_size for stage in self.stages}
    if len(vocabs) != 1:
      raise ValueError(f"HorizontalCascade stages have different vocabularies: {sorted(vocabs)}")
    if len({stage.encoder_decoder for stage in self.stages}) != 1:
      raise ValueError("HorizontalCascade stages must read the prompt alike (all decoder-only or all "
                       "encoder-decoder)")
    if any(stage.variable_length for stage in self.stages[:-1]):
      raise ValueError("only the last stage of a HorizontalCascade may draft a variable number of tokens")

  @property
  def variable_length(self) -> bool:
    return self.stages[-1].variable_length

  @property
  def vocab_size(self) -> int:
    return self.stages[0].vocab_size

  @property
  def encoder_decoder(self) -> bool:
    return self.stages[0].encoder_decoder

  @property
  def max_length(self) -> int:
    return min(stage.max_length for stage in self.stages)

  @property
  def cache_overhang(self) -> int:
    return max(stage.cache_overhang for stage in self.stages)

  def prompt_cache_positions(self, prompt_width: int) -> int:
    return max(stage.prompt_cache_positions(prompt_width) for stage in self.stages)

  def allotment(self, max_drafts: int) -> list[int]:
    """Drafts per stage in a block of `max_drafts` (the last stage takes what the limits leave)."""
    counts, left = [], max_drafts
    for limit in self.limits:
      counts.append(min(limit, left))
      left -= counts[-1]
    return counts + [left]

  def start(self, prompts: Array, prompt_lengths: Array, cache_length: int, layout: str | None = None
            ) -> tuple[HorizontalState, Array]:
    states = tuple(stage.start(prompts, prompt_lengths, cache_length, layout)[0] for stage in self.stages)
    batch, width = prompts.shape
    history = jnp.zeros((batch, cache_length + 1), jnp.int32).at[:, :width].set(prompts)
    length = (prompt_lengths - 1).astype(jnp.int32)
    last = prompts[jnp.arange(batch), prompt_lengths - 1].astype(jnp.int32)
    return HorizontalState(stages=states, consumed=jnp.broadcast_to(length, (len(states), batch)),
                           history=history, length=length), last

  def rollback(self, state: HorizontalState, lengths: Array) -> HorizontalState:
    lengths = jnp.asarray(lengths, jnp.int32)
    consumed = jnp.minimum(state.consumed, lengths[None])
    return HorizontalState(stages=tuple(stage.rollback(s, held) for stage, s, held in
                                        zip(self.stages, state.stages, consumed)),
                           consumed=consumed, history=state.history, length=lengths)

  def propose(self, key: Array, state: HorizontalState, last: Array, *, max_drafts: int,
              sampling: sampling_lib.Sampling, keep_drafting: Callable[[Array], Array] | None = None) -> Draft:
    if keep_drafting is not None:
      raise ValueError("a HorizontalCascade drafts whole blocks: it has no per-position stopping rule "
                       "(BiLD's fallback); use a model drafter for bild")
    batch = last.shape[0]
    rows = jnp.arange(batch)
    history = state.history.at[rows, state.length].set(last, mode="drop")
    position = state.length                       # where the next stage's pending token sits
    keys = rng.split(key, len(self.stages))
    stages, consumed = list(state.stages), [state.consumed[i] for i in range(len(self.stages))]
    tokens, q, q_raw, calls = [], [], [], jnp.zeros((batch,), jnp.int32)
    for i, (stage, drafts) in enumerate(zip(self.stages, self.allotment(max_drafts))):
      if drafts == 0:
        continue
      # Catch up on what the other stages drafted (and the verifier kept) since this stage last ran.
      behind = observe_chunk(history, consumed[i], max_drafts)
      held = stage.observe(stages[i], behind, position - consumed[i])
      draft = stage.propose(keys[i], held, history[rows, position], max_drafts=drafts, sampling=sampling)
      history = history.at[rows[:, None], position[:, None] + 1 + jnp.arange(drafts)].set(draft.tokens, mode="drop")
      consumed[i] = position + drafts + 1
      stages[i] = stage.rollback(draft.state, consumed[i])
      tokens.append(draft.tokens)
      q.append(draft.q[:, :drafts])
      q_raw.append(draft.q_raw[:, :drafts])
      calls += draft.calls
      position = position + drafts
      bonus = draft.q[:, drafts:], draft.q_raw[:, drafts:]
    # Only the last stage may stop early (`variable_length`): its q at its stop is the bonus q, in place.
    return Draft(tokens=jnp.concatenate(tokens, axis=1), q=jnp.concatenate(q + [bonus[0]], axis=1),
                 q_raw=jnp.concatenate(q_raw + [bonus[1]], axis=1),
                 n_drafted=max_drafts - drafts + draft.n_drafted, calls=calls,
                 state=HorizontalState(stages=tuple(stages), consumed=jnp.stack(consumed), history=history,
                                       length=state.length))


def cs_drafter(model: Model, *, gamma: int, model_drafts: int | None = None, lower_gamma: int = 4,
               lenience: Array | float = 1.0, gate: int = 0, grams: MaxGram | None = None) -> Drafter:
  """CSD's two-drafter configuration (App. E, Table 5): [model ← Max-Gram] (a vertical cascade; the model
  alone when lower_gamma = 0) drafts the first `model_drafts` positions of a block (None: all γ),
  Max-Gram the rest (a horizontal cascade; Max-Gram alone when model_drafts = 0). `grams`: the Max-Gram
  drafter to use at both places (default `MaxGram(V, gate=gate)`: no bigram table)."""
  model_drafts = gamma if model_drafts is None else model_drafts
  if grams is not None and gate:
    raise ValueError("give the gate to your MaxGram (MaxGram(V, gate=…)), not to cs_drafter with grams=")
  grams = MaxGram(model.vocab_size, gate=gate) if grams is None else grams
  if model_drafts == 0:
    return grams
  top = ModelDrafter(model) if lower_gamma == 0 else VerticalCascade(model, grams, lower_gamma=lower_gamma,
                                                                     lenience=lenience)
  return top if model_drafts >= gamma else HorizontalCascade((top, grams), (model_drafts,))


def cs_drafting(key: Array, drafter: Model, verifier: Model, prompts: Array, prompt_lengths: Array, *,
                sampling: sampling_lib.Sampling, gamma: int, model_drafts: int | None, lower_gamma: int,
                lenience, gate: int = 0, max_new_tokens: int, eos_id: int | None, cache_length: int,
                program: common.Program) -> common.Output:
  """SpecDecode (lossless) with `cs_drafter(drafter, …)` as the drafter: the verifier's law, CSD's drafting."""
  cascade = cs_drafter(drafter, gamma=gamma, model_drafts=model_drafts, lower_gamma=lower_gamma, lenience=lenience,
                       gate=gate)
  return speculative.speculative(key, cascade, verifier, prompts, prompt_lengths, sampling=sampling, rule="spec",
                                 alpha=0.0, gamma=gamma, max_new_tokens=max_new_tokens, eos_id=eos_id,
                                 cache_length=cache_length, program=program)


def _uses_max_gram(params) -> bool:
  model_drafts = params["gamma"] if params["model_drafts"] is None else params["model_drafts"]
  return model_drafts < params["gamma"] or params["lower_gamma"] > 0


register(Method(
    "cs_drafting", decode=cs_drafting, drafter="model", cache_overhang=lambda p: p["gamma"] + p["lower_gamma"] + 2,
    summary="lossless SpecDecode with CS Drafting's drafter (`cs_drafter`): the model, itself drafted by "
            "Max-Gram (lower_gamma per call, 0: alone) under lenience ≥ 1, for the first model_drafts "
            "positions of a block, Max-Gram for the rest (0: Max-Gram alone); Max-Gram drafts only on suffix "
            "matches of ≥ gate tokens (0: always)",
    params=(
        GAMMA,
        Param("model_drafts", None, traced=False, type=int,
              bounds=count_bounds(0, "gamma", "model_drafts (positions of a block the model drafts; None: all gamma)"),
              help="positions of a block the model drafts, in [0, gamma] (default: all gamma; 0: Max-Gram alone)"),
        Param("lower_gamma", 4, traced=False, used=lambda p: p["model_drafts"] != 0,
              bounds=count_bounds(0, label="lower_gamma (Max-Gram drafts per model call; 0: the model drafts alone)"),
              help="Max-Gram drafts per model call, an int >= 0 (0: the model drafts alone)"),
        Param("lenience", 1.0, traced=True, used=lambda p: p["model_drafts"] != 0 and p["lower_gamma"] > 0,
              bounds=Bounds(1.0, math.inf, hi_closed=False),
              help="the model's lenience reviewing Max-Gram's drafts, >= 1 (1: exact)"),
        Param("gate", 0, traced=False, used=lambda p: p["gate"] != 0 and _uses_max_gram(p),
              bounds=count_bounds(0, MaxGram.max_match, "gate (shortest suffix match Max-Gram drafts on)"),
              help=f"Max-Gram drafts only where the text's longest suffix match is >= gate tokens, in "
                   f"[0, {MaxGram.max_match}] (0: always)"))))
