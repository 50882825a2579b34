"""SPMD on 8 fake CPU devices (`specdec.models.partitioning`): decoding under a (data, model) mesh gives the
one-device tokens, greedy and sampled with the same keys; a training step on sharded parameters equals the
one-device step; the training loop runs, checkpoints and resumes sharded.

Runs in its own pytest process (`make test`, `scripts/run_tests.py`: XLA_FLAGS set before Python starts): the 8
devices must be set before JAX starts its CPU backend. Collected in a pytest session that started JAX before this
module (a plain `pytest` from the root), its tests skip, naming the command that runs them.
"""

import os

OWN_PROCESS = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
if not OWN_PROCESS:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from specdec import decoding, models  # noqa: E402
from specdec.evaluation import hlo, sweep  # noqa: E402
from specdec.models import decoder, gemma2, partitioning, t5  # noqa: E402
from specdec.training import train  # noqa: E402

V = 64
VERIFIER = t5.T5Config(vocab_size=V, embed_dim=32, num_heads=4, head_dim=8, hidden_dim=48, num_encoder_layers=2,
                       num_decoder_layers=2, max_len=64)
GEMMA2 = gemma2.config(V, embed_dim=32, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       query_pre_attn_scalar=8.0, sliding_window=4, max_len=64)
MESHES = [(4, 2), (8, 1)]


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
  if jax.device_count() != 8:
    message = (f"expected 8 fake CPU devices, found {jax.device_count()}: JAX started before this module set "
               "XLA_FLAGS; run `python scripts/run_tests.py tests/sharding` (make test runs it so)")
    if OWN_PROCESS:   # the flags were set for this process: 8 devices are owed
      pytest.fail(message)
    pytest.skip(message)


def _perturbed_pair(kind):
  """(drafter, verifier): a random T5, a random Gemma 2 (4 query heads over 2 key/value heads, window 4: its
  heads split over 'model'), or a random decoder-only transformer with its weights scaled up so that greedy
  outputs vary, and a drafter that is the verifier with its weights perturbed (drafts sometimes rejected)."""
  if kind == "t5":
    verifier, noise = t5.init(VERIFIER, jax.random.PRNGKey(2)), 0.1
  elif kind == "gemma2":   # weights scaled down: random Gemma 2 logits are otherwise nearly one-hot
    verifier, noise = decoder.init(GEMMA2, jax.random.PRNGKey(2)), 0.3
    verifier = verifier.replace(params=jax.tree.map(lambda w: 0.25 * w, verifier.params))
  else:
    verifier, noise = models.build("tiny", vocab_size=V, seed=2, max_length=64), 0.3
    verifier = verifier.replace(params=jax.tree.map(lambda w: 3.0 * w, verifier.params))
  leaves, treedef = jax.tree.flatten(verifier.params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  noisy = [w * (1.0 + noise * jax.random.normal(k, w.shape)) for w, k in zip(leaves, keys)]
  return verifier.replace(params=jax.tree.unflatten(treedef, noisy)), verifier


def _prompts(batch=8, width=12):
  rng = np.random.default_rng(0)
  return rng.integers(2, V, (batch, width)).astype(np.int32), rng.integers(1, width + 1, batch).astype(np.int32)


def test_mesh_shape_must_use_every_device():
  assert partitioning.make_mesh(-1, 2).shape == {"data": 4, "model": 2}
  with pytest.raises(ValueError, match="must multiply to the 8 devices"):
    partitioning.make_mesh(3, 2)
  with pytest.raises(ValueError, match="model axis 3 does not divide"):
    partitioning.make_mesh(-1, 3)
  with pytest.raises(ValueError, match="model axis must be an integer ≥ 1"):
    partitioning.make_mesh(8, 0)


@pytest.mark.parametrize("kind", ["t5", "lm"])
def test_every_parameter_has_logical_axes_and_the_rules_split_the_large_dimensions(kind):
  _, verifier = _perturbed_pair(kind)
  mesh = partitioning.make_mesh(4, 2)
  specs = jax.tree.map(lambda s: s.spec, partitioning.param_shardings(verifier.params, mesh))
  flat = {"/".join(k.key for k in path): spec for path, spec in jax.tree_util.tree_flatten_with_path(specs)[0]}
  if kind == "t5":
    assert flat["token_embedder/embedding"] == P("model", None)                        # vocab
    assert flat["decoder/logits_dense/kernel"] == P(None, "model")
    assert flat["encoder/layers_0/attention/query/kernel"] == P(None, "model")         # joined heads
    assert flat["decoder/layers_1/encoder_decoder_attention/out/kernel"] == P("model", None)
    assert flat["decoder/layers_0/mlp/wi_1/kernel"] == P(None, "model")
    assert flat["decoder/relpos_bias/rel_embedding"] == P("model", None)
    assert flat["encoder/encoder_norm/scale"] == P(None)
  else:
    assert flat["embed/embedding"] == P("model", None)
    assert flat["block_0/attention/key/kernel"] == P(None, "model", None)              # [E, H, D]
    assert flat["block_1/mlp/dense_in/bias"] == P("model")
  # A dimension the model axis does not divide is replicated: 4 heads (T5's relative bias; the transformer's
  # [E, H, D] projections) over 8 devices.
  wide = jax.tree.map(lambda s: s.spec, partitioning.param_shardings(verifier.params, partitioning.make_mesh(1, 8)))
  if kind == "t5":
    assert wide["decoder"]["relpos_bias"]["rel_embedding"] == P(None, None)
  else:
    assert wide["block_0"]["attention"]["key"]["kernel"] == P(None, None, None)
  with pytest.raises(ValueError, match="no logical axis rule covers parameter extra/thing"):
    partitioning.logical_axes({**verifier.params, "extra": {"thing": np.zeros(3)}})


# Greedy: both loops on the (4, 2) mesh and `speculative` on the pure data mesh (8, 1) in the default run; the
# autoregressive loop on (8, 1) (the same loop as on (4, 2), the same row split as `speculative` on (8, 1)) is
# slow (make test-slow).
@pytest.mark.parametrize("kind, shape, method, temperature", [
    pytest.param(kind, shape, method, 0.0,
                 marks=pytest.mark.slow if (shape, method) == ((8, 1), "autoregressive") else ())
    for kind in ("t5", "lm") for shape in MESHES for method in ("autoregressive", "speculative")] + [
    ("t5", (4, 2), "speculative", 1.0), ("lm", (4, 2), "speculative", 1.0), ("lm", (4, 2), "spectr", 1.0),
    ("gemma2", (4, 2), "speculative", 1.0)])
def test_decoding_on_a_mesh_gives_the_one_device_tokens(kind, shape, method, temperature):
  """Parameters by the logical rules, prompts by rows over 'data': the same tokens as on one device, greedy
  and, for the same key, sampled (threefry's bits do not depend on the layout)."""
  drafter, verifier = _perturbed_pair(kind)
  prompts, lengths = _prompts()
  kw = dict(method=method, gamma=3, temperature=temperature, max_new_tokens=12, eos_id=None)
  if method == "spectr":
    kw["num_drafts"] = 2
  key = jax.random.PRNGKey(7)
  want = decoding.generate(key, drafter, verifier, prompts, lengths, **kw)
  mesh = partitioning.make_mesh(*shape)
  got = decoding.generate(key, partitioning.shard_model(drafter, mesh), partitioning.shard_model(verifier, mesh),
                          partitioning.shard_batch(jnp.asarray(prompts), mesh), lengths, **kw)
  assert got.tokens.sharding.device_set == set(jax.devices())
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.lengths, want.lengths)
  np.testing.assert_array_equal(got.stats.verifier_calls, want.stats.verifier_calls)
  if method != "autoregressive":
    assert 0 < int(np.sum(want.stats.accepted)) < int(np.sum(want.stats.drafted))


def _loop_arrays(hlo_text):
  """Per-device shapes of the rank-4 float arrays that the compiled program's while loops carry (KV caches
  [rows, heads, slots, head_dim]: SPMD-partitioned HLO spells every shape per device), read with
  `specdec.evaluation.hlo`: a loop's carry is its while instruction's result."""
  program = hlo.parse(hlo_text)
  return [shape.dims for loop in hlo.loops(program) for shape in program.instructions[loop.name].shapes
          if shape.dtype == "f32" and len(shape.dims) == 4]


@pytest.mark.parametrize("kind, method, temperature", [("lm", "autoregressive", 0.0), ("lm", "speculative", 1.0),
                                                       ("t5", "speculative", 0.0), ("t5", "speculative", 1.0),
                                                       ("lm", "dynamic_tree", 1.0)])
def test_data_parallel_devices_hold_only_their_rows(kind, method, temperature):
  """Mesh (data=4, model=2), batch 8: every KV cache the decode loop carries holds 2 rows per device (each
  data replica decodes its own rows, model-parallel over heads; a dynamic tree's drafter 2 rows' K = 2
  beams, which trade states within their row), and the tokens are one device's. The batch, prompts and
  decoding parameters are those of `test_decoding_on_a_mesh_gives_the_one_device_tokens`, so that the cases
  both run reuse its compiled programs."""
  drafter, verifier = _perturbed_pair(kind)
  prompts, lengths = _prompts()
  beams = {"num_drafts": 2} if method == "dynamic_tree" else {}
  kw = dict(method=method, gamma=3, temperature=temperature, max_new_tokens=12, eos_id=None, **beams)
  key = jax.random.PRNGKey(5)
  want = decoding.generate(key, drafter, verifier, prompts, lengths, **kw)
  mesh = partitioning.make_mesh(4, 2)
  args = (key, partitioning.shard_model(drafter, mesh), partitioning.shard_model(verifier, mesh),
          partitioning.shard_batch(jnp.asarray(prompts), mesh), lengths)
  got = decoding.generate(*args, **kw)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  caches = _loop_arrays(decoding.lower(*args, **kw).compile().as_text())
  assert caches, "the decode loop carries no KV cache?"
  assert {shape[0] for shape in caches} == ({2, 4} if beams else {2}), caches


def _t5_batch(batch=8):
  rng = np.random.default_rng(1)
  decoder = rng.integers(2, V, (batch, 10)).astype(np.int32)
  decoder[:, 0] = t5.DECODER_START_TOKEN
  weights = (np.arange(10) < rng.integers(4, 11, batch)[:, None]).astype(np.float32)
  return {"inputs": decoder, "weights": weights, "encoder_inputs": rng.integers(2, V, (batch, 12)).astype(np.int32),
          "encoder_lengths": rng.integers(3, 13, batch).astype(np.int32)}


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
@pytest.mark.parametrize("shape", MESHES)
def test_a_sharded_training_step_equals_the_one_device_step(optimizer, shape):
  _, model = _perturbed_pair("t5")
  tx = train.make_optimizer(100, name=optimizer, learning_rate=1e-2, warmup_steps=0, decay="cosine")
  batch = _t5_batch()
  want, want_metrics = model, None
  state = train.TrainState.create(model.params, tx)
  for _ in range(2):
    state, want_metrics = train.train_step(state, batch, model)
  want = jax.device_get(state.params)

  mesh = partitioning.make_mesh(*shape)
  shardings = partitioning.param_shardings(model.params, mesh)
  state = train.TrainState.create(model.params, tx)
  state = partitioning.shard_like(state, state.params, mesh)
  sharded_batch = partitioning.shard_batch(batch, mesh)
  for _ in range(2):
    state, metrics = train.train_step(state, sharded_batch, model)
  kernel = state.params["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert kernel.sharding.is_equivalent_to(shardings["decoder"]["layers_0"]["mlp"]["wi_0"]["kernel"], 2)
  for name in ("loss", "accuracy", "tokens", "grad_norm"):
    np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=2e-5, err_msg=name)
  # Parameters to 1e-3 of one step's largest update (lr): a sharding fault (a missing all-reduce, a wrong
  # slice) moves them by O(lr). AdamW divides each gradient by its own RMS, so a gradient near zero whose
  # sum another reduction order rounds differently moves by up to ~4e-4·lr (measured on AVX-512 CPUs).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               jax.device_get(state.params), want)


def test_the_training_loop_checkpoints_and_resumes_sharded(tmp_path, capsys):
  """`train_and_evaluate(mesh_shape=…)`: 6 steps in one go equal 3 steps, a sharded checkpoint, and 3 more
  after restoring it onto the mesh."""
  kw = dict(preset="tiny", vocab_size=32, max_length=64, batch_size=8, seq_len=16, log_every=3, eval_every=0,
            eval_batches=1, save_every=3, mesh_shape=(4, 2),
            optimizer=lambda total_steps: train.make_optimizer(6, learning_rate=1e-2, warmup_steps=0))
  whole, _ = train.train_and_evaluate(model_dir=None, num_steps=6, **kw)
  train.train_and_evaluate(model_dir=str(tmp_path), num_steps=3, **kw)
  resumed, _ = train.train_and_evaluate(model_dir=str(tmp_path), num_steps=6, **kw)
  assert "resumed from" in capsys.readouterr().out
  embedding = resumed.params["embed"]["embedding"]
  assert embedding.sharding.mesh.shape == {"data": 4, "model": 2}
  assert embedding.sharding.is_equivalent_to(NamedSharding(embedding.sharding.mesh, P("model", None)), 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               jax.device_get(resumed.params), jax.device_get(whole.params))


def test_a_sweep_on_a_mesh_records_the_one_device_quality(tmp_path):
  """`Experiment.mesh_shape`: quality batches on a (4, 2) mesh of this host's devices give the records of a
  one-device run (quality and counters; latency is wall-clock at batch 1 either way)."""
  from tests.sweeps import outcomes, smoke
  # The smoke grid cut to the verifier alone and one speculative cascade point: both pass through the mesh.
  smaller = ("Experiment.families = [@token_v3/Family()]", "token_v3/Family.alphas = [0.5]",
             "Experiment.n_latency_examples = 1")
  one = sweep.run(smoke(tmp_path / "one.jsonl", *smaller), progress=False)
  mesh = sweep.run(smoke(tmp_path / "mesh.jsonl", "Experiment.mesh_shape = (4, 2)", *smaller), progress=False)
  assert len(one) == 2 and outcomes(mesh) == outcomes(one)
  with pytest.raises(ValueError, match=r"batch_size 4 must be a multiple of the mesh's data axis \(8"):
    sweep.load_workload(smoke(tmp_path / "bad.jsonl", "Experiment.mesh_shape = (8, 1)"))
