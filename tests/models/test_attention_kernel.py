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


@pytest.mark.parametrize("b, n, k, g, c, d, bias_rows, soft_cap, block",
                         [case + (None,) for case in CASES] + BLOCKED)
def test_the_kernel_attends_as_base_attend_does(b, n, k, g, c, d, bias_rows, soft_cap, block):
  rng = np.random.default_rng(c + d)
  keys, values = (jnp.asarray(rng.normal(size=(c, b, k * d)), jnp.float32) for _ in range(2))
  query = jnp.asarray(rng.normal(size=(b, n, k * g, d)) * 0.3, jnp.float32)
  visible = jnp.asarray(rng.random((b, n, c)) < 0.6).at[:, :, 0].set(True).at[0, 0].set(False)  # a row sees none
  bias = jnp.asarray(rng.normal(size=(bias_rows, k * g, n, c)), jnp.float32) if bias_rows else None
  head_major = lambda x: x.reshape(c, b, k, d).transpose(1, 2, 0, 3)  # noqa: E731
  want = base.attend(query, head_major(keys), head_major(values), visible, bias=bias, soft_cap=soft_cap)
  got = attention_kernel.attend(query, keys, values, visible, key_heads=k, bias=bias, soft_cap=soft_cap,
                                block=block, interpret=True)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
  # and `base.attend` on the slot-major arrays (XLA's attention off TPU) is the same function
  np.testing.assert_allclose(base.attend(query, keys, values, visible, layout="slots", bias=bias, soft_cap=soft_cap),
                             want, atol=1e-6, rtol=1e-6)


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
