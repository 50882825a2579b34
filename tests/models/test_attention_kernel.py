"""The slot-major KV cache ([C, B, K·D] per layer, layout "slots": TPU programs' `base.cache_layout`) and the Pallas kernel that
attends over it in place (models/attention_kernel.py): the kernel, run by Pallas's interpreter on this CPU,
computes `base.attend`'s attention (grouped queries, T5's bias, Gemma's soft cap, heads of 32 to 256), and every
model decodes the same tokens with either layout (slot writes, tree-path copies, beam reorders). That the TPU
program has no cache relayout is tests/tpu/test_plan.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import decoding, models
from specdec.models import attention_kernel, base

# (rows, new tokens, key heads, query heads per key head, slots, head_dim, bias rows (0: none), soft cap)
CASES = [(2, 4, 3, 1, 16, 128, 0, None),      # one 128-lane head per block
         (2, 2, 2, 2, 24, 256, 0, 50.0),      # Gemma 2: grouped queries, soft cap, heads of 256
         (2, 3, 4, 1, 16, 64, 1, None),       # T5: two heads of 64 per 128-lane block, a bias shared by rows
         (3, 3, 4, 1, 8, 64, 3, None),        # a bias per row
         (1, 5, 4, 2, 16, 32, 0, 5.0)]        # four heads of 32 per block


# + a call in blocks of queries (a long prompt's prefill): 16 queries, 8 per grid step
BLOCKED = [(2, 16, 2, 2, 24, 128, 1, 30.0, 8), (1, 24, 4, 1, 16, 64, 1, None, 8)]


U = 2.0 ** -24   # float32's unit roundoff


def _gamma(m: int) -> float:
  return m * U / (1 - m * U)


def _exact_attention(query, keys, values, visible, bias, soft_cap):
  """Attention in float64 from float32 inputs (keys, values head-major [B, K, C, D]) and the bound on float32's
  error: scores err by at most E = γ_D·Σ|q·k| (+ the bias's and the soft cap's roundings) at a visible key, so each
  softmax weight by a factor e^{2E} − 1 (+ the exponential's, sum's and division's roundings), and an output by that
  times Σ_c w_c·|v_c| plus the weighted sum's own γ_C·Σ_c w_c·|v_c|."""
  q, kk, vv = (np.asarray(x, np.float64) for x in (query, keys, values))
  b, n, h, d = q.shape
  k, c = kk.shape[1], kk.shape[2]
  g = h // k
  qg = q.reshape(b, n, k, g, d)
  scores = np.einsum("bkcd,bnkgd->bkgnc", kk, qg).reshape(b, h, n, c)
  error = _gamma(d) * np.einsum("bkcd,bnkgd->bkgnc", np.abs(kk), np.abs(qg)).reshape(b, h, n, c)
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
    error = error + U * (np.abs(scores) + np.abs(np.asarray(bias, np.float64)))
  if soft_cap is not None:
    scores = np.tanh(scores / soft_cap) * soft_cap
    error = error + 16 * U * soft_cap        # the division, tanh (a few ulps) and the product
  lowest = np.finfo(np.float32).min
  shown = np.broadcast_to(np.asarray(visible)[:, None], scores.shape)
  scores = np.where(shown, scores, lowest)
  worst = np.max(np.where(shown, error, 0.0), axis=-1, keepdims=True)                  # E per query and head
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bkgnc,bkcd->bnkgd", weights.reshape(b, k, g, n, c), vv).reshape(b, n, h, d)
  spread = np.einsum("bkgnc,bkcd->bnkgd", weights.reshape(b, k, g, n, c), np.abs(vv)).reshape(b, n, h, d)
  factor = np.expm1(2 * worst) + 8 * U + 2 * _gamma(c)                                  # [B, H, n, 1]
  return out, factor.transpose(0, 2, 1, 3) * spread


@pytest.mark.parametrize("b, n, k, g, c, d, bias_rows, soft_cap, block",
                         [case + (None,) for case in CASES] + BLOCKED)
def test_the_kernel_attends_as_base_attend_does(b, n, k, g, c, d, bias_rows, soft_cap, block):
  """The kernel, `base.attend` on head-major and on slot-major arrays: each within float32's rounding bound of the
  exact attention (`_exact_attention`)."""
  rng = np.random.default_rng(c + d)
  keys, values = (jnp.asarray(rng.normal(size=(c, b, k * d)), jnp.float32) for _ in range(2))
  query = jnp.asarray(rng.normal(size=(b, n, k * g, d)) * 0.3, jnp.float32)
  visible = jnp.asarray(rng.random((b, n, c)) < 0.6).at[:, :, 0].set(True).at[0, 0].set(False)  # a row sees none
  bias = jnp.asarray(rng.normal(size=(bias_rows, k * g, n, c)), jnp.float32) if bias_rows else None
  head_major = lambda x: x.reshape(c, b, k, d).transpose(1, 2, 0, 3)  # noqa: E731
  exact, bound = _exact_attention(query, head_major(keys), head_major(values), visible, bias, soft_cap)
  runs = {"kernel": attention_kernel.attend(query, keys, values, visible, key_heads=k, bias=bias, soft_cap=soft_cap,
                                            block=block, interpret=True),
          "heads": base.attend(query, head_major(keys), head_major(values), visible, bias=bias, soft_cap=soft_cap),
          "slots": base.attend(query, keys, values, visible, layout="slots", bias=bias, soft_cap=soft_cap)}
  for name, got in runs.items():
    excess = np.abs(np.asarray(got, np.float64) - exact) - bound
    assert np.all(excess <= 0), f"{name}: {np.max(excess):.3g} beyond float32's bound"


def test_heads_that_make_no_whole_lane_block_are_left_to_xla():
  with pytest.raises(ValueError, match="3 key heads of 64"):
    attention_kernel.heads_per_block(3, 64)
  assert [attention_kernel.heads_per_block(k, d) for k, d in [(8, 128), (8, 64), (4, 32), (4, 256)]] == [1, 2, 4, 1]
  assert not attention_kernel.reads_in_place(2, 32)   # 64 lanes in all: XLA attends (test-sized models)


def test_a_long_prefill_is_attended_in_blocks_of_queries_that_fit_vmem():
  """GSM8K's shapes for Gemma 2 27B on 4 chips (4 key heads of 128 per chip, 2 queries per key head): the
  decode loop's calls over 2,370 slots take all their queries per grid step; the 2,048-token prompt's prefill
  (its visible mask alone 39 MB, the chip's scoped VMEM 16 MiB) takes them in blocks that fit."""
  shape = dict(key_heads=4, groups=2, head_dim=128, itemsize=2, has_bias=False)
  assert attention_kernel.query_block(1, 2370, **shape) == 1 and attention_kernel.query_block(2, 2370, **shape) == 2
  assert attention_kernel.vmem_bytes(2048, 2370, **shape) > 16 * 2**20
  block = attention_kernel.query_block(2048, 2370, **shape)
  assert block % 8 == 0 and 2048 % block == 0 and 8 <= block < 2048
  assert attention_kernel.vmem_bytes(block, 2370, **shape) <= attention_kernel.VMEM_BUDGET \
      < attention_kernel.vmem_bytes(2 * block, 2370, **shape)
  assert attention_kernel.takes(2048, 2370, **shape)
  # A width of no multiple of 8 is taken whole or not at all; heads with no whole-lane block never.
  assert attention_kernel.query_block(2047, 2370, **shape) is None
  assert not attention_kernel.takes(8, 64, **(shape | dict(head_dim=32, key_heads=2)))


def test_the_layout_is_the_platforms_unless_given_and_a_field_of_the_cache():
  assert [base.cache_layout(platform) for platform in ("cpu", "gpu", "tpu")] == ["heads", "heads", "slots"]
  assert base.cache_layout() == base.cache_layout(jax.default_backend())
  shapes = {}
  for layout in base.CACHE_LAYOUTS:
    cache = base.empty_cache(2, 16, max_length=32, num_layers=1, heads=4, head_dim=8, dtype=jnp.float32,
                             layout=layout)
    assert cache.layout == layout and base.cache_slots(cache) == 16
    assert jax.tree.structure(base.row_axes(cache)) == jax.tree.structure(cache)
    shapes[layout] = cache.kv["keys"][0].shape
  assert shapes == {"heads": (2, 4, 16, 8), "slots": (16, 2, 32)}
  assert base.empty_cache(2, 16, max_length=32, num_layers=1, heads=4, head_dim=8,
                          dtype=jnp.float32).layout == base.cache_layout()
  with pytest.raises(ValueError, match="cache layout must be one of"):
    base.empty_cache(2, 16, max_length=32, num_layers=1, heads=4, head_dim=8, dtype=jnp.float32, layout="rows")
  with pytest.raises(ValueError, match="cache layout must be one of"):
    decoding.lower(jax.random.PRNGKey(0), None, models.build("tiny", vocab_size=64, seed=1, max_length=64),
                   jnp.ones((1, 4), jnp.int32), method="autoregressive", max_new_tokens=2, cache_layout="rows")


# One decode per family, together covering every cache operation: slot writes and attention (all), a beam's
# reorder of rows (dynamic_tree), a tree path's copy (dynamic_tree, specinfer), grouped queries (Gemma 2) and
# an encoder-decoder (T5).
RUNS = {"transformer": (("tiny", "tiny"), "dynamic_tree", 1.0, {"num_drafts": 2}),
        "t5": (("t5_tiny", "t5_tiny"), "speculative", 1.0, {}),
        "gemma2": (("gemma2_tiny", "gemma2_tiny"), "specinfer", 1.0, {"num_drafts": 2})}


@pytest.mark.parametrize("family", sorted(RUNS))
def test_every_model_decodes_the_same_tokens_from_a_slot_major_cache(family):
  names, method, temperature, params = RUNS[family]
  drafter, verifier = (models.build(name, vocab_size=64, seed=seed, max_length=64) for seed, name in enumerate(names, 1))
  prompts = jnp.asarray(np.random.default_rng(0).integers(2, 64, (3, 8)), jnp.int32)
  lengths = jnp.array([8, 5, 3])

  def run(**layout) -> decoding.Output:
    return decoding.generate(jax.random.PRNGKey(7), drafter, verifier, prompts, lengths, method=method, gamma=3,
                             temperature=temperature, max_new_tokens=10, eos_id=None, **params, **layout)
  heads, slots = run(), run(cache_layout="slots")
  np.testing.assert_array_equal(slots.tokens, heads.tokens)
  np.testing.assert_array_equal(slots.stats.accepted, heads.stats.accepted)
  assert 0 < int(np.sum(heads.stats.accepted)) < int(np.sum(heads.stats.drafted))   # some drafts rejected


@pytest.mark.parametrize("b, n, k, g, c, d, bias_rows, soft_cap", CASES + [(1, 3, 2, 3, 12, 32, 1, None)])
@pytest.mark.parametrize("overhang", [False, True])
def test_attend_and_write_is_attend_over_the_written_cache(b, n, k, g, c, d, bias_rows, soft_cap, overhang):
  """`base.attend_and_write` (the "heads" layout: the old cache and the new entries apart, then the write; at batch 1
  one dynamic_update_slice) writes exactly the entries `write_slots` defines — dropped beyond C where a row's slots
  overhang the cache — and attends within float32's rounding bound of the exact attention over the written cache."""
  rng = np.random.default_rng(7 * c + d + n)
  keys, values = (jnp.asarray(rng.normal(size=(b, k, c, d)), jnp.float32) for _ in range(2))
  key, value = (jnp.asarray(rng.normal(size=(b, n, k, d)), jnp.float32) for _ in range(2))
  query = jnp.asarray(rng.normal(size=(b, n, k * g, d)) * 0.3, jnp.float32)
  lengths = rng.integers(c - n + 1, c, size=b) if overhang else rng.integers(0, c - n + 1, size=b)
  slots = jnp.asarray(lengths[:, None] + np.arange(n), jnp.int32)
  visible = jnp.asarray(rng.random((b, n, c)) < 0.6).at[:, :, 0].set(True)
  bias = jnp.asarray(rng.normal(size=(bias_rows, k * g, n, c)), jnp.float32) if bias_rows else None
  want_keys, want_values = np.array(keys), np.array(values)
  for row in range(b):
    for j in range(n):
      if lengths[row] + j < c:
        want_keys[row, :, lengths[row] + j] = np.asarray(key)[row, j]
        want_values[row, :, lengths[row] + j] = np.asarray(value)[row, j]
  attend_and_write = jax.jit(lambda *args: base.attend_and_write(*args[:3], (*args[3:6], "heads"), args[6], bias=bias,
                                                                  soft_cap=soft_cap))
  out, written_keys, written_values = attend_and_write(query, key, value, keys, values, slots, visible)
  np.testing.assert_array_equal(written_keys, want_keys)
  np.testing.assert_array_equal(written_values, want_values)
  exact, bound = _exact_attention(query, want_keys, want_values, visible, bias, soft_cap)
  excess = np.abs(np.asarray(out, np.float64) - exact) - bound
  assert np.all(excess <= 0), f"{np.max(excess):.3g} beyond float32's bound"
