"""The CPU kernel for a few rows times a weight matrix (specdec/models/cpu_kernel.{py,cc}): its products within
float32's rounding bound of the exact ones, each row the same bits whatever the number of rows, used exactly
where it applies, with the plain path's gradients, and the plain path when it cannot be built."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec.models import cpu_kernel, decoder

U = 2.0 ** -24   # float32's unit roundoff

# (equation, x shape, w shape): the shared decoder's projections, then shapes off the kernel's tiles (columns not a
# multiple of 16 or 32, contracted axes not a multiple of 16, more rows than one register tile holds).
CASES = [
    ("bne,eNh->bnNh", (1, 3, 64), (64, 4, 16)),
    ("bne,eckh->cbnkh", (2, 3, 48), (48, 2, 3, 16)),
    ("bnNh,Nhe->bne", (1, 5, 4, 16), (4, 16, 72)),
    ("bne,ecf->bncf", (1, 4, 40), (40, 2, 100)),
    ("bnf,fe->bne", (2, 8, 1537), (1537, 35)),
    ("bne,ve->bnv", (1, 7, 576), (1000, 576)),
    ("bne,ve->bnv", (3, 5, 33), (77, 33)),
    ("bne,ve->bnv", (1, 16, 20), (9, 20)),
    ("bk,kn->bn", (13, 300), (300, 333)),    # 13 rows: tiles of 8, 5 (AVX-512) or 6, 6, 1 (AVX2) rows ([K, N])
    ("bk,kn->bn", (3, 0), (0, 20)),          # an empty sum: zeros
]


def _arrays(x_shape, w_shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32))


def _kernel_einsum(equation):
  return jax.jit(lambda x, w: cpu_kernel.einsum(equation, x, w))


def _lowered_text(equation, x, w):
  return _kernel_einsum(equation).lower(x, w).as_text()


@pytest.fixture(autouse=True)
def _built():
  if not cpu_kernel.available():
    pytest.skip("the CPU kernel could not be built here (no C++ compiler; the warning names why)")
  with cpu_kernel.enabled(True):   # on, whether or not it is this CPU's default (`suited`)
    yield


def test_it_is_on_by_default_where_the_cpu_suits_it(monkeypatch):
  x, w = _arrays((1, 2, 24), (24, 40))
  with cpu_kernel.enabled(None):
    assert (cpu_kernel.TARGET in _lowered_text("bne,ef->bnf", x, w)) == cpu_kernel.suited()
  cpu_kernel.suited.cache_clear()
  try:
    monkeypatch.setattr(cpu_kernel.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernel.Path, "read_text", lambda self: "flags\t: fpu sse2 avx avx2\n")
    assert not cpu_kernel.suited()
    cpu_kernel.suited.cache_clear()
    monkeypatch.setattr(cpu_kernel.Path, "read_text", lambda self: "flags\t: fpu sse2 avx avx2 fma\n")
    assert cpu_kernel.suited()
    cpu_kernel.suited.cache_clear()
    monkeypatch.setattr(cpu_kernel.Path, "read_text", lambda self: "flags\t: fpu avx2 avx512f avx512bw\n")
    assert cpu_kernel.suited()
    cpu_kernel.suited.cache_clear()
    monkeypatch.setattr(cpu_kernel.platform, "machine", lambda: "aarch64")
    assert not cpu_kernel.suited()
  finally:
    cpu_kernel.suited.cache_clear()


@pytest.mark.parametrize("equation,x_shape,w_shape", CASES)
def test_products_within_float32_rounding_of_the_exact_ones(equation, x_shape, w_shape):
  x, w = _arrays(x_shape, w_shape)
  assert cpu_kernel.TARGET in _lowered_text(equation, x, w)
  got = np.asarray(_kernel_einsum(equation)(x, w), np.float64)
  exact = np.einsum(equation, x.astype(np.float64), w.astype(np.float64))
  magnitude = np.einsum(equation, np.abs(x).astype(np.float64), np.abs(w).astype(np.float64))
  contracted = _contracted_length(equation, x_shape)
  # A float32 sum of K products, in any order: |error| ≤ γ_K · Σ|x_k·w_k| with γ_K = K·u / (1 − K·u) (Higham
  # 2002, eq. 3.5), plus the final rounding to float32.
  gamma = contracted * U / (1 - contracted * U)
  assert np.all(np.abs(got - exact) <= gamma * magnitude + U * np.abs(exact))


def _contracted_length(equation, x_shape):
  lhs, rhs = equation.split("->")[0].split(",")
  return int(np.prod([d for c, d in zip(lhs, x_shape) if c in rhs]))


@pytest.mark.parametrize("transposed", [False, True])
def test_each_row_has_the_same_bits_whatever_the_number_of_rows(transposed):
  x, w = _arrays((16, 200), (200, 150) if not transposed else (150, 200), seed=1)
  rows = jax.jit(lambda x, w: cpu_kernel.rows_matmul(x, w, transposed))
  together = np.asarray(rows(x, w))
  for start, width in [(0, 1), (3, 1), (0, 3), (2, 5), (1, 8), (7, 9), (0, 16)]:
    np.testing.assert_array_equal(np.asarray(rows(x[start:start + width], w)), together[start:start + width])


def test_plain_path_where_the_kernel_does_not_apply():
  x, w = _arrays((1, cpu_kernel.MAX_ROWS + 1, 24), (24, 40))
  assert cpu_kernel.TARGET not in _lowered_text("bne,ef->bnf", x, w)                       # a prefill: a GEMM
  assert cpu_kernel.TARGET in _lowered_text("bne,ef->bnf", x[:, :cpu_kernel.MAX_ROWS], w)
  assert cpu_kernel.TARGET not in _lowered_text("bne,ef->bnf", x[:, :2].astype(jnp.bfloat16), w)   # not float32
  assert cpu_kernel.TARGET not in _lowered_text("bne,cfe->bncf", x[:, :2], np.ones((2, 40, 24), np.float32))
  assert cpu_kernel.TARGET not in _lowered_text("bne,bef->bnf", x[:, :2], w[None])           # a batch axis
  with cpu_kernel.enabled(False):
    assert cpu_kernel.TARGET not in _lowered_text("bne,ef->bnf", x[:, :2], w)


def test_programs_for_other_platforms_never_contain_it():
  x, w = _arrays((1, 2, 24), (24, 40))
  traced = _kernel_einsum("bne,ef->bnf").trace(x, w)
  assert cpu_kernel.TARGET in traced.lower(lowering_platforms=("cpu",)).as_text()
  assert cpu_kernel.TARGET not in traced.lower(lowering_platforms=("cuda",)).as_text()


def test_gradients_are_the_plain_einsums():
  x, w = _arrays((1, 3, 24), (24, 2, 20))
  loss = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f("bne,ecf->bncf", x, w))), argnums=(0, 1))(x, w)
  for got, want in zip(loss(cpu_kernel.einsum), loss(jnp.einsum)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_over_rows_and_a_clear_error_for_batched_weights():
  x, w = _arrays((4, 3, 24), (24, 40))
  mapped = jax.jit(jax.vmap(lambda x: cpu_kernel.rows_matmul(x, w)))(x)
  np.testing.assert_array_equal(mapped, jax.jit(lambda x: cpu_kernel.rows_matmul(x, w))(x.reshape(12, 24))
                                .reshape(4, 3, 40))
  with pytest.raises(Exception, match="w is batched"):
    jax.jit(jax.vmap(cpu_kernel.rows_matmul))(x, np.stack([w] * 4)).block_until_ready()


def test_decoder_logits_with_and_without_the_kernel():
  config = decoder.DecoderConfig(vocab_size=97, embed_dim=64, hidden_dim=96, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16)
  model = decoder.init(config, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, 97)
  positions = jnp.arange(6)[None]
  visible = jnp.tril(jnp.ones((6, 6), bool))[None]

  def logits():
    apply = jax.jit(lambda m, t: m._apply(t, positions, visible, positions)[0])
    return apply(model, tokens), apply.lower(model, tokens).as_text().count(cpu_kernel.TARGET)

  fast, calls = logits()
  assert calls == 2 * 5 + 1   # per layer q, kv, o, gate+up, down; the output table
  with cpu_kernel.enabled(False):
    plain, plain_calls = logits()
  assert plain_calls == 0
  np.testing.assert_allclose(fast, plain, rtol=1e-4, atol=1e-4)


def test_without_a_compiler_the_plain_path_runs_with_a_warning(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  cpu_kernel.available.cache_clear()
  try:
    with caplog.at_level(logging.WARNING):
      assert not cpu_kernel.available()
    assert "plain XLA path" in caplog.text
    x, w = _arrays((1, 2, 24), (24, 40))
    assert cpu_kernel.TARGET not in _lowered_text("bne,ef->bnf", x, w)
  finally:
    cpu_kernel.available.cache_clear()
  monkeypatch.undo()
  assert cpu_kernel.available()
