"""Hugging Face T5 checkpoints (layer 4): a `T5ForConditionalGeneration` directory that `save_pretrained`
wrote (config.json + model.safetensors, or shards with model.safetensors.index.json) read into
`models.t5.T5` (T5 v1.1, mT5, Flan-T5: gated-GELU), and ours written back as one.

  model = load_hf_t5(directory)             # float32 `t5.T5`
  save_hf_t5(model, directory)              # what T5ForConditionalGeneration.from_pretrained reads

Hugging Face `T5ForConditionalGeneration` names (torch Linear weights are [out, in]: transposed here):
shared.weight -> token_embedder/embedding; {encoder,decoder}.block.0.layer.0.SelfAttention.
relative_attention_bias.weight [buckets, H] -> {encoder,decoder}/relpos_bias/rel_embedding [H, buckets];
encoder.block.N.layer.0 (SelfAttention.{q,k,v,o}, layer_norm) -> encoder/layers_N/attention/{query,key,
value,out}, pre_attention_layer_norm; encoder.block.N.layer.1 (DenseReluDense.{wi_0,wi_1,wo}, layer_norm)
-> mlp, pre_mlp_layer_norm; decoder.block.N.layer.{0,1,2} -> self_attention, encoder_decoder_attention
(EncDecAttention), mlp and their norms; {encoder,decoder}.final_layer_norm -> encoder_norm, decoder_norm;
lm_head.weight -> decoder/logits_dense/kernel. A config that scales the decoder output by d_model^−½
(original T5's tied head) has the factor folded into logits_dense; a missing lm_head means the tied one.
The export writes the same names (`hf_names`) and a config with an untied head and no rescaling
(`config_to_hf`), so transformers computes our logits.

The loader checks the presence and shape of each tensor before building a model and raises CheckpointError
naming the tensor; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from specdec.models import families, t5
from specdec.training.checkpoint import CheckpointError, abstract_model, checked_model, safetensors_files

_EMBEDDING_ALIASES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# HF keeps this unused tensor in some checkpoints and ignores it on load; so do we.
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def config_from_hf(hf: dict[str, Any], *, max_length: int = 512) -> t5.T5Config:
  """Our `T5Config` from a Hugging Face T5 config.json (T5 v1.1, mT5, Flan-T5: gated-GELU only)."""
  if hf.get("feed_forward_proj") != "gated-gelu":
    raise CheckpointError(f"only T5 v1.1 checkpoints (feed_forward_proj='gated-gelu') can be imported; this one "
                          f"has feed_forward_proj={hf.get('feed_forward_proj')!r}")
  if hf.get("layer_norm_epsilon", 1e-6) != 1e-6:
    raise CheckpointError(f"layer_norm_epsilon must be 1e-6 (T5's); got {hf['layer_norm_epsilon']}")
  if hf.get("decoder_start_token_id", t5.DECODER_START_TOKEN) != t5.DECODER_START_TOKEN:
    raise CheckpointError(f"decoder_start_token_id must be {t5.DECODER_START_TOKEN} (T5's pad id); "
                          f"got {hf['decoder_start_token_id']}")
  return t5.T5Config(vocab_size=hf["vocab_size"], embed_dim=hf["d_model"], num_heads=hf["num_heads"],
                     num_encoder_layers=hf["num_layers"],
                     num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"], head_dim=hf["d_kv"],
                     hidden_dim=hf["d_ff"], num_buckets=hf.get("relative_attention_num_buckets", 32),
                     max_distance=hf.get("relative_attention_max_distance", 128), max_len=max_length)


def config_to_hf(config: t5.T5Config) -> dict[str, Any]:
  """The Hugging Face config.json of `config`, the inverse of `config_from_hf` (`max_len` and the activation
  dtype are not part of it: pass `max_length` to `load_hf_t5`).

  Our head is untied and not rescaled. transformers < 5 reads that from tie_word_embeddings=False;
  transformers ≥ 5 forces tie_word_embeddings=True for T5 and reads scale_decoder_outputs (which it
  derives from the former unless given); both keys are written so either version computes our logits.
  """
  return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": config.vocab_size,
          "d_model": config.embed_dim, "d_kv": config.head_dim, "d_ff": config.hidden_dim,
          "num_heads": config.num_heads,
          "num_layers": config.num_encoder_layers, "num_decoder_layers": config.num_decoder_layers,
          "relative_attention_num_buckets": config.num_buckets,
          "relative_attention_max_distance": config.max_distance, "feed_forward_proj": "gated-gelu",
          "layer_norm_epsilon": 1e-6, "dropout_rate": 0.0, "is_encoder_decoder": True,
          "decoder_start_token_id": t5.DECODER_START_TOKEN, "pad_token_id": t5.DECODER_START_TOKEN,
          "eos_token_id": 1, "tie_word_embeddings": False, "scale_decoder_outputs": False, "dtype": "float32"}


def hf_names(config: t5.T5Config) -> dict[str, tuple[str, bool]]:
  """{our parameter path: (Hugging Face tensor name, transposed)} for every parameter."""
  names = {"token_embedder/embedding": ("shared.weight", False),
           "encoder/encoder_norm/scale": ("encoder.final_layer_norm.weight", False),
           "decoder/decoder_norm/scale": ("decoder.final_layer_norm.weight", False),
           "decoder/logits_dense/kernel": ("lm_head.weight", True)}

  def attention(ours: str, theirs: str) -> None:
    for projection, short in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
      names[f"{ours}/{projection}/kernel"] = (f"{theirs}.{short}.weight", True)

  def sublayer(ours: str, norm: str, theirs: str) -> None:
    names[f"{ours}/{norm}/scale"] = (f"{theirs}.layer_norm.weight", False)

  def mlp(ours: str, theirs: str) -> None:
    for dense in ("wi_0", "wi_1", "wo"):
      names[f"{ours}/mlp/{dense}/kernel"] = (f"{theirs}.DenseReluDense.{dense}.weight", True)

  for stack, n_layers in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    names[f"{stack}/relpos_bias/rel_embedding"] = (
        f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", True)
    for i in range(n_layers):
      ours, block = f"{stack}/layers_{i}", f"{stack}.block.{i}.layer"
      if stack == "encoder":
        sublayer(ours, "pre_attention_layer_norm", f"{block}.0")
        attention(f"{ours}/attention", f"{block}.0.SelfAttention")
        sublayer(ours, "pre_mlp_layer_norm", f"{block}.1")
        mlp(ours, f"{block}.1")
      else:
        sublayer(ours, "pre_self_attention_layer_norm", f"{block}.0")
        attention(f"{ours}/self_attention", f"{block}.0.SelfAttention")
        sublayer(ours, "pre_cross_attention_layer_norm", f"{block}.1")
        attention(f"{ours}/encoder_decoder_attention", f"{block}.1.EncDecAttention")
        sublayer(ours, "pre_mlp_layer_norm", f"{block}.2")
        mlp(ours, f"{block}.2")
  return names


def load_hf_t5(directory: str, *, max_length: int = 512, host: bool = False) -> t5.T5:
  """The `T5ForConditionalGeneration` that `save_pretrained` wrote to `directory`, as a float32 `t5.T5`
  (`host`: parameters left in host memory, `models.with_params`).

  Raises CheckpointError for a config that is not T5 v1.1 and for a missing, unexpected or mis-shaped
  tensor, naming it.
  """
  directory = os.path.abspath(directory)
  try:
    with open(os.path.join(directory, "config.json")) as f:
      hf_config = json.load(f)
    config = config_from_hf(hf_config, max_length=max_length)
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f"{directory}: config.json is missing or not a T5 config ({e!r})") from e
  files = safetensors_files(directory)
  where = f"Hugging Face checkpoint {directory}"
  embedding = next((name for name in _EMBEDDING_ALIASES if name in files), _EMBEDDING_ALIASES[0])
  names = hf_names(config)
  names["token_embedder/embedding"] = (embedding, False)
  if "lm_head.weight" not in files:
    names["decoder/logits_dense/kernel"] = (embedding, True)
  expected = {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_model(t5.init, config).params)[0]}
  sizes = (f"vocab_size={config.vocab_size}, d_model={config.embed_dim}, num_heads={config.num_heads}, "
           f"d_kv={config.head_dim}, d_ff={config.hidden_dim}")
  flat = {}
  for path, (name, transpose) in names.items():
    if name not in files:
      raise CheckpointError(f"{where}: tensor {name} is missing (needed for {path})")
    with safe_open(files[name], framework="flax") as f:
      array = np.asarray(f.get_tensor(name))
    want = expected[path][::-1] if transpose else expected[path]
    if array.shape != want:
      raise CheckpointError(f"{where}: tensor {name} has shape {array.shape}, expected {want} "
                            f"(config.json: {sizes})")
    flat[tuple(path.split("/"))] = array.T if transpose else array
  unexpected = sorted(set(files) - {name for name, _ in names.values()} - set(_EMBEDDING_ALIASES) - set(_IGNORED))
  if unexpected:
    raise CheckpointError(f"{where}: unexpected tensors ({len(unexpected)}), is config.json the checkpoint's? "
                          f"{', '.join(unexpected[:5])}{' …' if len(unexpected) > 5 else ''}")
  # Original T5 rescales the decoder output before its (tied) head; fold the factor into the kernel.
  if hf_config.get("scale_decoder_outputs", hf_config.get("tie_word_embeddings", True) is not False):
    flat[("decoder", "logits_dense", "kernel")] = flat[("decoder", "logits_dense", "kernel")] * config.embed_dim ** -0.5
  return checked_model(where, t5.init, config, traverse_util.unflatten_dict(flat), host=host)


def save_hf_t5(model: t5.T5, directory: str | os.PathLike) -> str:
  """Writes `model` as `T5ForConditionalGeneration.save_pretrained` would (config.json + model.safetensors,
  float32, Hugging Face's names from `hf_names`); returns the directory. `load_hf_t5` reads it back
  bit-identically (bfloat16 parameters come back as the same values in float32).

  Raises ValueError for a model that is not a `t5.T5` and FileExistsError for a directory that exists and
  is not empty: an export never overwrites or mixes with another checkpoint's files.
  """
  if families.for_model(model).hf_model_type != "t5":
    raise ValueError(f"save_hf_t5 exports a specdec.models.t5.T5; got {type(model).__name__}, which has no "
                     "Hugging Face T5ForConditionalGeneration equivalent")
  directory = os.path.abspath(directory)
  if os.path.isdir(directory) and os.listdir(directory):
    raise FileExistsError(f"{directory} exists and is not empty; save_hf_t5 writes a new export")
  os.makedirs(directory, exist_ok=True)
  flat = {"/".join(path): np.asarray(leaf, np.float32)
          for path, leaf in traverse_util.flatten_dict(model.params).items()}
  tensors = {name: np.ascontiguousarray(flat[path].T if transpose else flat[path])
             for path, (name, transpose) in hf_names(model.config).items()}
  # transformers reads the "format" metadata to tell torch checkpoints from others.
  save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config_to_hf(model.config), f, indent=2, sort_keys=True)
  return directory
