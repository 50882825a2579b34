"""Gemma 2 (models/gemma2.py): the same logits as Hugging Face's `Gemma2ForCausalLM` on its own checkpoint
(teacher-forced and through the cache, past the sliding window), the importer's refusals, and the decode
loops' exactness with a Gemma 2 pair (greedy speculative = the verifier's greedy; T = 1 sequence laws)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import orbax.checkpoint as ocp
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from specdec import decoding, models
from specdec.models import partitioning
from specdec.training import CheckpointError, convert, decoder_checkpoints, load_model, save_params
from tests.backends import tolerance
from tests.model_contract import assert_greedy_decoding_is_the_verifiers
from tests.stats import assert_law, sequence_codes, sequence_law
from tests.toy_models import tiny_pair

HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=6,
                 query_pre_attn_scalar=8)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  """A random 3-layer Gemma 2 (local, global, local; window 6) saved by transformers, with random norm
  gains (their 0 init would hide a wrong 1 + w), and its directory (skipped without PyTorch: `make
  test-device` machines may lack it)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**HF_CONFIG, attn_implementation="eager")).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.normal_(0.0, 0.3)
  directory = tmp_path_factory.mktemp("gemma2") / "hf"
  model.save_pretrained(directory)
  return model, directory


def test_load_hf_gives_transformers_logits_teacher_forced_and_through_the_cache(hf_model):
  model, directory = hf_model
  ours = convert.load_hf(str(directory))
  assert isinstance(ours, models.Decoder) and ours.config.attention_types == ("local", "global", "local")
  tokens = np.random.default_rng(0).integers(0, 64, (2, 20))          # longer than the window of 6
  torch = pytest.importorskip("torch")
  with torch.no_grad():
    want = model(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(ours.logits(jnp.asarray(tokens, jnp.int32)), want, atol=tolerance(1e-4), rtol=0)
  cache, got = ours.init_cache(2, 24), []
  for start, end in ((0, 7), (7, 8), (8, 13), (13, 20)):               # a prefill, one step, two blocks
    scored = ours.score(cache, jnp.asarray(tokens[:, start:end], jnp.int32))
    logits, cache = scored.logits, scored.cache
    got.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=tolerance(1e-4), rtol=0)
  # host=True (the sweep on a mesh): the same parameters, left in host memory to be sharded from there
  on_host = convert.load_hf(str(directory), host=True)
  assert all(type(leaf) is np.ndarray for leaf in jax.tree.leaves(on_host.params))
  jax.tree.map(np.testing.assert_array_equal, on_host.params, ours.params)


def test_load_hf_names_a_missing_or_misshaped_tensor_and_reads_t5_too(hf_model, tmp_path):
  _, directory = hf_model
  tensors = load_file(directory / "model.safetensors")
  config = json.loads((directory / "config.json").read_text())
  for name, broken, message in [("missing", {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k},
                                 "model.layers.1.mlp.up_proj.weight is missing"),
                                ("misshaped", {**tensors, "model.layers.2.self_attn.k_proj.weight": np.zeros((8, 32))},
                                 "model.layers.2.self_attn.k_proj.weight.*layer_2/attn/kv_einsum/w")]:
    (tmp_path / name).mkdir()
    save_file(broken, tmp_path / name / "model.safetensors")
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
      convert.load_hf(str(tmp_path / name))
  t5_model = models.build("t5_tiny", vocab_size=32, max_length=32)
  assert isinstance(convert.load_hf(convert.save_hf_t5(t5_model, tmp_path / "t5"), max_length=32), models.T5)


def test_logical_axes_cover_every_gemma2_parameter():
  axes = partitioning.logical_axes(models.build("gemma2_tiny", vocab_size=16).params)
  assert axes["layer_0"]["attn"]["kv_einsum"]["w"] == ("embed", "stack", "heads", "kv")
  assert axes["embedder"]["input_embedding"] == ("vocab", "embed")


def test_an_exported_gemma2_loads_back(tmp_path):
  model = models.build("gemma2_tiny", vocab_size=16, seed=3, max_length=32)
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  save_params(str(tmp_path / "export"), model, preset="gemma2_tiny")
  back = load_model(str(tmp_path / "export"))
  assert back.config == model.config
  np.testing.assert_array_equal(back.logits(tokens), model.logits(tokens))


def _gemma_library_layout(params):
  """{path: array} of our parameters laid out as the gemma library lays them out (q_einsum [N, E, H], kv_einsum
  [2, K, E, H], gating_einsum [2, F, E]; ours are input dimension first)."""
  library = {"q_einsum": (1, 0, 2), "kv_einsum": (1, 2, 0, 3), "gating_einsum": (1, 2, 0)}   # ours -> theirs
  return {path: np.asarray(leaf).transpose(next((axes for name, axes in library.items() if name in path),
                                                tuple(range(np.ndim(leaf)))))
          for path, leaf in traverse_util.flatten_dict(params).items()}


def test_a_gemma2_export_written_before_the_shared_decoder_loads(tmp_path):
  """Its model.json names no switch and its arrays are in the gemma library's layouts (Gemma2's then)."""
  model = models.build("gemma2_tiny", vocab_size=16, seed=5, max_length=32)
  old = model.replace(params=traverse_util.unflatten_dict(_gemma_library_layout(model.params)))
  save_params(str(tmp_path / "old"), old, preset="gemma2_tiny")
  spec = json.loads((tmp_path / "old" / "model.json").read_text())
  for field in ("norm_offset", "post_norms", "activation", "scale_embeddings", "tie_embeddings"):
    del spec[field]
  (tmp_path / "old" / "model.json").write_text(json.dumps(spec))
  back = load_model(str(tmp_path / "old"))
  assert back.config == model.config
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 16
  np.testing.assert_array_equal(back.logits(tokens), model.logits(tokens))


def test_a_checkpoint_in_the_gemma_librarys_layout_loads(tmp_path):
  """The released Flax checkpoints' Orbax tree: flat keys 'transformer/layer_i/…' holding {'w'} or {'scale'},
  the MLP's weights as modules of one 'w' each, the projections laid out as the library lays them out."""
  model = models.build("gemma2_tiny", vocab_size=16, seed=4)
  stored = {}
  for path, leaf in _gemma_library_layout(model.params).items():
    if path[-2] == "mlp":
      stored[f"transformer/{'/'.join(path)}"] = {"w": leaf}
    else:
      stored[f"transformer/{'/'.join(path[:-1])}"] = {path[-1]: leaf}
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(str(tmp_path / "2b"), stored)
  loaded = decoder_checkpoints.load_gemma(str(tmp_path / "2b"), "gemma2_tiny", max_length=64)
  tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]], jnp.int32)
  np.testing.assert_array_equal(loaded.logits(tokens), model.logits(tokens))
  with pytest.raises(CheckpointError, match="preset gemma2_2b.*wrong shape"):
    decoder_checkpoints.load_gemma(str(tmp_path / "2b"), "gemma2_2b")


# Smaller than gemma2_tiny (one key/value head of two query heads); drafter seed 1, verifier seed 2.
SMALL = dict(seeds=(1, 2), preset="gemma2_tiny", embed_dim=16, hidden_dim=32, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("method, params", [("speculative", dict(gamma=3)), ("spectr", dict(num_drafts=2, gamma=2))])
def test_greedy_decoding_with_a_gemma2_pair_is_the_verifiers_greedy(method, params):
  """Ragged prompts, 24 new tokens: decoding runs far past the window of 4."""
  drafter, verifier = tiny_pair(32, 64, sliding_window=4, **SMALL)
  assert_greedy_decoding_is_the_verifiers(drafter, verifier, method, params, vocab_size=32)


@pytest.mark.parametrize("method, params", [("speculative", dict(gamma=2)),
                                            pytest.param("spectr", dict(num_drafts=3, gamma=2), marks=pytest.mark.slow)])
def test_sampling_with_a_gemma2_pair_keeps_the_verifiers_sequence_law(method, params):
  """3 tokens over V = 4 after a 3-token prompt (20k rows, T = 1), window 2: the local layers' window moves
  within every sequence. spectr (slow: 20k rows of 3 drafts): the default run checks Gemma 2's token trees by
  the greedy test above, SpecTr's law on the toy model and SpecInfer's through the transformer's trees
  (tests/drafters/test_multi_draft.py)."""
  vocab, n_new, samples, prompt = 4, 3, 20_000, np.array([2, 0, 1])
  drafter, verifier = tiny_pair(vocab, 32, scale=0.25, sliding_window=2, **SMALL)   # far from one-hot laws
  out = decoding.generate(jax.random.PRNGKey(5), drafter, verifier, jnp.broadcast_to(jnp.asarray(prompt), (samples, 3)),
                          method=method, max_new_tokens=n_new, eos_id=None, **params)
  assert_law(sequence_codes(out.tokens, vocab), sequence_law(verifier, prompt, n_new), what=method)
  assert 0 < np.mean(np.asarray(out.stats.rejected)) and np.sum(np.asarray(out.stats.accepted)) > 0
