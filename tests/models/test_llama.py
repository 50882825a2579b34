"""The Llama family (models/llama.py over models/decoder.py) and its GGUF files (training/gguf_checkpoints.py), on
tiny models the tests write themselves: every tensor type read as transformers' own GGUF loader reads it (its
dequantization and its undoing of llama.cpp's query/key row order are independent of ours), exports read back,
Hugging Face Llama checkpoints, the loader's refusals, and greedy speculative decoding with a Llama pair."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec import models
from specdec.models import llama, partitioning
from specdec.training import CheckpointError, gguf_checkpoints, load_model, save_gguf
from tests.model_contract import assert_greedy_decoding_is_the_verifiers

# Rows of 256 values: the K-quants' blocks.
CONFIG = llama.config(64, embed_dim=256, hidden_dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      rope_theta=50_000.0, rms_norm_eps=1e-5, max_len=64)
TOKENS = np.array([[5, 17, 3, 60, 2, 9, 41, 33, 8, 1, 0, 12], [63, 7, 7, 7, 30, 29, 28, 4, 50, 51, 11, 6]])
Q = gguf.GGMLQuantizationType
# The offsets of the float16 scales (d, dmin) in a block of each K-quant (ggml's block_q*_K structs); the other
# bytes are quantized values and packed sub-block scales, any value of which is valid.
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _model(config=CONFIG, seed=0):
  """Random weights with random norm gains (their 1 init would hide a wrong offset)."""
  model = models.decoder.init(config, jax.random.PRNGKey(seed))
  rng = np.random.default_rng(seed)
  return model.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, w: w + 0.3 * rng.standard_normal(w.shape).astype(np.float32) if "scale" in str(path[-1]) else w,
      model.params))


def _transformers_logits(path, tokens):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
  with torch.no_grad():
    return hf(torch.as_tensor(tokens)).logits.numpy()


def _k_quant_file(path, qtype, seed=0):
  """A GGUF file of CONFIG's shapes whose matrices are random `qtype` blocks (gguf has no K-quant quantizer)."""
  rng = np.random.default_rng(seed)
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, value in (("context_length", 64), ("embedding_length", 256), ("feed_forward_length", 256),
                     ("block_count", 2), ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 64)):
    writer.add_uint32(f"llama.{key}", value)
  writer.add_float32("llama.rope.freq_base", 50_000.0)
  writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  shapes = {"token_embd.weight": (64, 256), "output_norm.weight": (256,)}
  for i in range(2):
    shapes.update({f"blk.{i}.attn_norm.weight": (256,), f"blk.{i}.ffn_norm.weight": (256,),
                   f"blk.{i}.attn_q.weight": (256, 256), f"blk.{i}.attn_k.weight": (128, 256),
                   f"blk.{i}.attn_v.weight": (128, 256), f"blk.{i}.attn_output.weight": (256, 256),
                   f"blk.{i}.ffn_gate.weight": (256, 256), f"blk.{i}.ffn_up.weight": (256, 256),
                   f"blk.{i}.ffn_down.weight": (256, 256)})
  for name, shape in shapes.items():
    if len(shape) == 1:
      writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
      continue
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
      # Q6_K's sub-block scales are int8 (up to 127), the others' 4 to 6 bits: weights of about 0.1 either way.
      scale = (0.05 if name == "token_embd.weight" else 0.004) * (0.1 if qtype == Q.Q6_K else 1.0)
      scales = rng.uniform(0.5, 1.5, blocks.shape[:2]) * scale
      blocks[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    writer.add_tensor(name, blocks.reshape(shape[0], -1), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"])
def test_a_gguf_file_of_each_type_computes_transformers_logits(tmp_path, dtype):
  """Written by `save_gguf` (quantized by gguf), read by ours and by transformers: the same logits; the weights
  read back within the type's rounding of the model's."""
  model = _model()
  path = tmp_path / f"tiny.{dtype}.gguf"
  save_gguf(model, path, dtype=dtype)
  ours = load_model(str(path))
  assert dataclasses.replace(ours.config, rms_norm_eps=1e-5) == CONFIG   # GGUF stores ε in float32
  assert ours.config.rms_norm_eps == np.float32(1e-5)
  np.testing.assert_allclose(np.asarray(ours.logits(jnp.asarray(TOKENS))), _transformers_logits(path, TOKENS),
                             atol=2e-4, rtol=1e-4)
  error = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 1e-2, "q4_0": 0.2, "q4_1": 0.2}[dtype]
  for path_, ours_w, model_w in zip(jax.tree_util.tree_leaves_with_path(ours.params),
                                    jax.tree.leaves(ours.params), jax.tree.leaves(model.params)):
    scale = float(np.abs(model_w).max())
    assert np.abs(np.asarray(ours_w) - np.asarray(model_w)).max() <= error * scale, path_[0]
  if dtype == "f32":   # exact: the row orders undone are the ones applied
    jax.tree.map(np.testing.assert_array_equal, ours.params, model.params)


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda q: q.name)
def test_k_quants_dequantize_as_transformers_does(tmp_path, qtype):
  path = _k_quant_file(tmp_path / f"tiny.{qtype.name}.gguf", qtype)
  ours = load_model(str(path))
  logits = np.asarray(ours.logits(jnp.asarray(TOKENS)))
  assert np.all(np.isfinite(logits)) and logits.std() > 0.1
  want = _transformers_logits(path, TOKENS)
  # Logits of up to a few hundred: float32 sums of that size differ by their rounding, about 1e-5 of it.
  np.testing.assert_allclose(logits, want, atol=2e-4 + 1e-5 * np.abs(want).max(), rtol=1e-4)


def test_an_untied_output_layer_is_read_and_written(tmp_path):
  config = llama.config(64, **{**llama.PRESETS["llama_tiny"], "tie_embeddings": False, "max_len": 32})
  model = _model(config, seed=3)
  assert "output_embedding" in model.params["embedder"]
  path = save_gguf(model, tmp_path / "untied.gguf")
  back = load_model(path)
  assert not back.config.tie_embeddings
  np.testing.assert_array_equal(back.logits(jnp.asarray(TOKENS[:, :8])), model.logits(jnp.asarray(TOKENS[:, :8])))
  np.testing.assert_allclose(np.asarray(back.logits(jnp.asarray(TOKENS))),
                             _transformers_logits(tmp_path / "untied.gguf", TOKENS), atol=2e-4, rtol=1e-4)


def test_a_hugging_face_llama_checkpoint_loads(tmp_path):
  """`LlamaForCausalLM.save_pretrained` read by `load_model` (config.json, safetensors): transformers' logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=64, rope_theta=30_000.0, tie_word_embeddings=False)).eval()
  with torch.no_grad():
    for name, weight in hf.named_parameters():
      if "norm" in name:
        weight.add_(0.3 * torch.randn_like(weight))
    want = hf(torch.as_tensor(TOKENS)).logits.numpy()
  hf.save_pretrained(tmp_path / "llama")
  ours = load_model(str(tmp_path / "llama"))
  assert ours.config.rope_theta == 30_000.0 and not ours.config.tie_embeddings
  np.testing.assert_allclose(np.asarray(ours.logits(jnp.asarray(TOKENS))), want, atol=2e-4, rtol=1e-4)


def test_bad_files_are_refused_naming_file_and_tensor(tmp_path):
  good = save_gguf(_model(), tmp_path / "good.gguf")
  data = open(good, "rb").read()
  (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
  with pytest.raises(CheckpointError, match="truncated.gguf"):
    load_model(str(tmp_path / "truncated.gguf"))
  (tmp_path / "header.gguf").write_bytes(data[:64])
  with pytest.raises(CheckpointError, match="header.gguf.*cannot be read"):
    load_model(str(tmp_path / "header.gguf"))
  writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
  with pytest.raises(CheckpointError, match="gpt2.gguf: architecture 'gpt2' is of no registered model family; known: llama"):
    load_model(str(tmp_path / "gpt2.gguf"))
  # Missing a tensor: the first layer's up projection.
  reader = gguf.GGUFReader(good)
  writer = gguf.GGUFWriter(str(tmp_path / "missing.gguf"), "llama")
  for key, field in reader.fields.items():
    if key.startswith("llama."):
      writer.add_key_value(key, field.contents(), field.types[0])
  for tensor in reader.tensors:
    if tensor.name != "blk.0.ffn_up.weight":
      writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape([int(d) for d in reversed(tensor.shape)]))
  writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
  with pytest.raises(CheckpointError, match=r"missing.gguf: tensor blk.0.ffn_up.weight is missing"):
    load_model(str(tmp_path / "missing.gguf"))
  with pytest.raises(FileExistsError):
    save_gguf(_model(), good)
  with pytest.raises(ValueError, match="q4_0 stores rows in blocks of 32"):
    save_gguf(models.decoder.init(llama.config(32, **{**llama.PRESETS["llama_tiny"], "hidden_dim": 48}),
                                  jax.random.PRNGKey(0)), tmp_path / "odd.gguf", dtype="q4_0")


def test_rotary_row_orders_are_inverse():
  weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
  there = gguf_checkpoints.rotary_rows(weight, 4, to_gguf=True)
  assert not np.array_equal(there, weight)
  np.testing.assert_array_equal(gguf_checkpoints.rotary_rows(there, 4, to_gguf=False), weight)
  # Head 0's rows 0..3 (the pairs' first coordinates) and 4..7 (second) interleave: 0, 4, 1, 5, …
  np.testing.assert_array_equal(there[:8, 0], weight[[0, 4, 1, 5, 2, 6, 3, 7], 0])


@pytest.mark.parametrize("method, params", [("speculative", dict(gamma=3)), ("spectr", dict(num_drafts=2, gamma=2))])
def test_greedy_decoding_with_a_llama_pair_is_the_verifiers_greedy(method, params):
  drafter, verifier = (models.build("llama_tiny", vocab_size=32, seed=seed, max_length=64) for seed in (1, 2))
  assert_greedy_decoding_is_the_verifiers(drafter, verifier, method, params, vocab_size=32)


def test_every_llama_parameter_has_logical_axes():
  config = llama.config(64, **{**llama.PRESETS["llama_tiny"], "tie_embeddings": False})
  axes = partitioning.logical_axes(models.decoder.init(config, jax.random.PRNGKey(0)).params)
  assert axes["embedder"]["output_embedding"] == ("vocab", "embed")
  assert axes["layer_1"]["mlp"]["gating_einsum"] == ("embed", "stack", "mlp")
  assert models.families.for_preset("smollm2_135m").name == "llama"
