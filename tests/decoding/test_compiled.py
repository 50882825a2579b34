"""The compiled decode programs, read from their optimized HLO (what an accelerator would run): no copy or
transpose of a cache-sized buffer inside `generate`, for decoder-only and encoder-decoder pairs."""

import re

import jax
import jax.numpy as jnp
import pytest

from specdec import decoding, models
from specdec.decoding import common
from specdec.evaluation import hlo as hlo_text
from specdec.models import partitioning
from tests.toy_models import tiny_pair

V = 64
BATCH, PROMPT, NEW = 2, 8, 40


def cache_sized_moves(hlo: str, min_elements: int) -> list[str]:
  """The copy/transpose instructions of at least `min_elements` elements in optimized HLO text, but for
  the entry computation's copies of a broadcast: those materialise an initial value (the zeros of a new
  cache, one buffer per layer), they move no data (`evaluation.hlo.moves`)."""
  return hlo_text.moves(hlo_text.parse(hlo), min_elements)


def _per_layer_cache_elements(model, cache_length):
  cfg = model.config
  return BATCH * cfg.num_heads * cache_length * cfg.head_dim


@pytest.mark.parametrize("preset", ["tiny", "t5_tiny"])
@pytest.mark.parametrize("method,params,temperature", [
    ("autoregressive", {}, 1.0), ("speculative", dict(gamma=3), 0.0), ("speculative", dict(gamma=3), 1.0),
    ("speculative", dict(gamma=3, rule="token_v3", alpha=0.3), 1.0)])
def test_compiled_generate_copies_no_cache_sized_buffer(preset, method, params, temperature):
  drafter, verifier = tiny_pair(V, 128, seeds=(1, 2), preset=preset)
  prompts = jnp.ones((BATCH, PROMPT), jnp.int32)
  lowered = decoding.lower(jax.random.PRNGKey(0), drafter, verifier, prompts, method=method, max_new_tokens=NEW,
                           temperature=temperature, eos_id=None, **params)
  hlo = lowered.compile().as_text()
  # The smallest cache buffer: one layer's keys over the shortest cache the run could use.
  smallest = _per_layer_cache_elements(verifier, NEW)
  assert "while" in hlo  # the decode loop is in the program read
  assert cache_sized_moves(hlo, smallest) == []


@pytest.mark.parametrize("preset", ["tiny", "llama_tiny", "t5_tiny"])
@pytest.mark.parametrize("method,params", [("autoregressive", {}), ("speculative", dict(gamma=2))])
def test_at_batch_1_the_decode_loop_updates_the_caches_in_place(preset, method, params):
  """Batch 1, the latency case, on this CPU: each layer's keys and values are read before the step's new entries
  are written (`base.attend_and_write`) and written in place, with no copy of a cache buffer anywhere in the
  program (XLA:CPU copied each two to five times per step when the attention read the written cache)."""
  drafter, verifier = tiny_pair(V, 128, seeds=(1, 2), preset=preset)
  lowered = decoding.lower(jax.random.PRNGKey(0), drafter, verifier, jnp.ones((1, PROMPT), jnp.int32), method=method,
                           max_new_tokens=NEW, temperature=0.0, eos_id=None, **params)
  cfg = verifier.config
  heads = getattr(cfg, "num_kv_heads", cfg.num_heads)

  def of_a_cache_buffer(move: str) -> bool:   # [1, K, C, D] in any order (a transposed weight can be as large)
    dims = [int(x) for x in re.search(r"\[([\d,]+)\]", move).group(1).split(",")]
    for dim in (1, heads, cfg.head_dim):
      if dim not in dims:
        return False
      dims.remove(dim)
    return len(dims) == 1 and dims[0] >= NEW

  moves = cache_sized_moves(lowered.compile().as_text(), heads * NEW * cfg.head_dim)
  assert [move for move in moves if of_a_cache_buffer(move)] == []


@pytest.mark.parametrize("method,params", [("bild", dict(gamma=3)), ("token_cascade", dict(alpha=0.3)),
                                           ("spectr", dict(gamma=2, num_drafts=2))])
def test_methods_with_variable_width_calls_copy_no_cache_on_the_accelerator_path(method, params, monkeypatch):
  """On TPU/GPU every verifier call takes the full width (`common.narrow_calls`): no `lax.switch` over calls
  that update the cache, whose branches XLA would give copies of it (as it does on the CPU path)."""
  monkeypatch.setattr(common, "narrow_calls", lambda platform: False)
  drafter, verifier = tiny_pair(V, 128, seeds=(1, 2))
  lowered = decoding.lower(jax.random.PRNGKey(0), drafter, verifier, jnp.ones((BATCH, PROMPT), jnp.int32),
                           method=method, max_new_tokens=NEW, temperature=1.0, eos_id=None, **params)
  assert cache_sized_moves(lowered.compile().as_text(), _per_layer_cache_elements(verifier, NEW)) == []


def test_the_check_sees_a_cache_copied_per_call():
  """The detector itself: scoring from a cache and keeping the old cache alive forces XLA to copy it."""
  model = models.build("tiny", vocab_size=V, seed=1)
  cache = model.init_cache(BATCH, 64)

  def keep_both(cache, tokens):
    new = model.score(cache, tokens).cache
    return cache.kv, new.kv

  hlo = jax.jit(keep_both).lower(cache, jnp.ones((BATCH, 3), jnp.int32)).compile().as_text()
  assert cache_sized_moves(hlo, _per_layer_cache_elements(model, 64))


def _instructions(compiled) -> list:
  """Every instruction's op and result shapes, computation by computation (names and metadata left out)."""
  program = hlo_text.parse(compiled.as_text())
  return [(i.op, i.shapes) for body in program.computations.values() for i in body]


def test_lower_from_shapes_alone_builds_the_program_of_the_arrays():
  """`decoding.lower` of abstract models (`partitioning.abstract_model`) and prompts (`jax.ShapeDtypeStruct`)
  compiles the same program as from weights and token ids: what `specdec-plan` compiles for a TPU."""
  drafter, verifier = tiny_pair(V, 128, seeds=(1, 2))
  device = jax.devices()[0]
  kwargs = dict(method="speculative", max_new_tokens=NEW, temperature=1.0, eos_id=None, gamma=3)
  from_shapes = decoding.lower(jax.random.PRNGKey(0), partitioning.abstract_model(drafter, device),
                               partitioning.abstract_model(verifier, device),
                               jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32), **kwargs).compile()
  from_arrays = decoding.lower(jax.random.PRNGKey(0), drafter, verifier, jnp.ones((BATCH, PROMPT), jnp.int32),
                               **kwargs).compile()
  assert _instructions(from_shapes) == _instructions(from_arrays)
  with pytest.raises(ValueError, match="abstract prompts need abstract models placed on a mesh or a device"):
    decoding.lower(jax.random.PRNGKey(0), drafter, jax.eval_shape(lambda: verifier),
                   jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32), **kwargs)


def test_backend_choices_follow_the_platform_traced_for():
  """The top-p search, call narrowing and the caches' layout follow the platform a program is built for (the
  models'), not the process's backend: a TPU program lowered on a CPU host makes the TPU's choices."""
  assert decoding.Sampling(top_p=0.9).checked("tpu").top_p_method == "top_k"
  assert decoding.Sampling(top_p=0.9).checked("cpu").top_p_method == "bisection"
  assert decoding.Sampling(top_p=0.9, top_p_method="bisection").checked("tpu").top_p_method == "bisection"
  tpu, cpu = common.Program.of("tpu"), common.Program.of("cpu")
  assert (tpu.narrow_calls, tpu.cache_layout) == (False, "slots")
  assert (cpu.narrow_calls, cpu.cache_layout) == (True, "heads")
  assert common.Program.of("cpu", "slots").cache_layout == "slots"
  assert common.Program.of() == common.Program.of(jax.default_backend())
