"""GGUF checkpoints (llama.cpp's format) of the Llama family, read and written with the `gguf` package (layer 4).

  model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")     # any tensor type gguf dequantizes, as float32
  save_gguf(model, "smollm2.f16.gguf", dtype="f16", metadata_from=source)   # F32, F16, BF16, Q8_0, Q4_0, Q4_1

Reading: the config comes from the file's metadata (llama.block_count, embedding_length, feed_forward_length,
attention.head_count(_kv), rope.freq_base, attention.layer_norm_rms_epsilon, context_length), tensors are
dequantized by `gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K…Q6_K, …),
GGUF's dimension order (innermost first) is reversed into numpy's, and llama.cpp's permutation of the query and
key rows (it interleaves each head's rotary pairs for its RoPE; ours rotates halves) is undone. Tensors are then
named as Hugging Face names them (`GGUF_TO_HF`) and laid out by `decoder_checkpoints.from_hf_tensors`; an
`output.weight` makes the output layer untied. Errors name the file and the tensor.
"""

from __future__ import annotations

import os
import re
from typing import Any

import gguf
import numpy as np

from specdec import models
from specdec.models import decoder, families
from specdec.training.checkpoint import CheckpointError
from specdec.training.decoder_checkpoints import from_hf_tensors, hf_tensors

# GGUF tensor name (layer {i}) -> Hugging Face's.
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# save_gguf's dtypes: the tensor type of the matrices (norms stay F32) and the file type that says so.
_DTYPES = {"f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
           "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
           "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
           "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
           "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
           "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1)}


def _names(num_layers: int, source_to_target: dict[str, str]) -> dict[str, str]:
  """Every layer's names of a {pattern: pattern} map."""
  names = {}
  for source, target in source_to_target.items():
    layers = range(num_layers) if "{i}" in source else [None]
    names.update({source.format(i=i): target.format(i=i) for i in layers})
  return names


def rotary_rows(weight: np.ndarray, heads: int, *, to_gguf: bool) -> np.ndarray:
  """A query or key projection [heads·H, E] with each head's rows reordered between the rotate-half layout
  (rows 0…H/2−1 the first coordinates of the pairs) and llama.cpp's interleaved one (pair p in rows 2p, 2p+1)."""
  rows = weight.shape[0]
  split = (heads, 2, rows // heads // 2) if to_gguf else (heads, rows // heads // 2, 2)
  return weight.reshape(*split, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def config_from_metadata(reader: gguf.GGUFReader, where: str, *, max_length: int | None = None
                         ) -> decoder.DecoderConfig:
  """The Llama config that a GGUF file's metadata (and its tensors' presence and shapes) describe."""
  architecture = _field(reader, "general.architecture")
  try:
    family = families.for_gguf_architecture(architecture)
  except ValueError as e:
    raise CheckpointError(f"{where}: {e}") from None
  tensors = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in tensors:
    raise CheckpointError(f"{where}: tensor token_embd.weight is missing")
  if "rope_freqs.weight" in tensors or _field(reader, f"{architecture}.rope.scaling.type") not in (None, "none"):
    raise CheckpointError(f"{where}: RoPE scaling (rope_freqs.weight, rope.scaling.type) is not computed here")

  def value(key: str, default: Any = None) -> Any:
    found = _field(reader, f"{architecture}.{key}", default)
    if found is None:
      raise CheckpointError(f"{where}: metadata {architecture}.{key} is missing")
    return found

  embed_dim, heads = int(value("embedding_length")), int(value("attention.head_count"))
  vocab_size = int(tensors["token_embd.weight"].shape[1])
  return family.config(
      vocab_size, embed_dim=embed_dim, hidden_dim=int(value("feed_forward_length")),
      num_layers=int(value("block_count")), num_heads=heads,
      num_kv_heads=int(value("attention.head_count_kv", heads)),
      head_dim=int(value("attention.key_length", value("rope.dimension_count", embed_dim // heads))),
      rope_theta=float(value("rope.freq_base", 10_000.0)),
      rms_norm_eps=float(value("attention.layer_norm_rms_epsilon")),
      max_len=max_length or int(value("context_length")),
      tie_embeddings="output.weight" not in tensors)


def _reader(path: str, where: str) -> gguf.GGUFReader:
  try:
    return gguf.GGUFReader(path)
  except FileNotFoundError as e:
    raise CheckpointError(f"{where}: no such file") from e
  except Exception as e:   # the reader raises ValueError, KeyError, IndexError on bad or truncated files
    raise CheckpointError(f"{where} cannot be read: truncated or not a GGUF file ({type(e).__name__}: {e})") from e


def load_gguf(path: str | os.PathLike, *, max_length: int | None = None, dtype: Any = None, host: bool = False
              ) -> decoder.Decoder:
  """The Llama-family model in the GGUF file at `path`, dequantized to float32 (`dtype`: computing in it,
  `models.with_dtype`; `max_length`: the cache length accepted, default the file's context_length; `host`:
  parameters left in host memory). Raises CheckpointError naming the file and the tensor."""
  path = os.path.abspath(os.fspath(path))
  where = f"GGUF file {path}"
  reader = _reader(path, where)
  config = config_from_metadata(reader, where, max_length=max_length)
  tensors = {t.name: t for t in reader.tensors}
  to_hf = _names(config.num_layers, GGUF_TO_HF)
  from_hf = {hf: name for name, hf in to_hf.items()}
  unknown = sorted(set(tensors) - set(to_hf))
  if unknown:
    raise CheckpointError(f"{where}: unexpected tensors ({len(unknown)}), not of a Llama model: "
                          f"{', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''}")

  def read(hf_name: str) -> np.ndarray:
    name = from_hf[hf_name]
    tensor = tensors[name]
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
      array = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
    except (NotImplementedError, ValueError) as e:
      raise CheckpointError(f"{where}: tensor {name} ({tensor.tensor_type.name}, shape {shape}) cannot be "
                            f"dequantized: {e}") from e
    if re.fullmatch(r"blk\.\d+\.attn_[qk]\.weight", name):
      heads = config.num_heads if name.endswith("attn_q.weight") else config.num_kv_heads
      array = rotary_rows(array, heads, to_gguf=False)
    return array

  model = from_hf_tensors(config, {to_hf[name] for name in tensors}, read, where, host=host,
                          source_name=lambda hf_name: from_hf.get(hf_name, hf_name))
  return model if dtype is None else models.with_dtype(model, dtype)


def save_gguf(model: decoder.Decoder, path: str | os.PathLike, *, dtype: str = "f32",
              metadata_from: str | os.PathLike | None = None, name: str | None = None) -> str:
  """Writes a Llama-family `model` as a GGUF file at `path` with its matrices in `dtype` ('f32', 'f16', 'bf16', or
  quantized by `gguf.quants.quantize`: 'q8_0', 'q4_0', 'q4_1'; norms stay F32, as llama.cpp writes them) that
  llama.cpp and transformers read; `metadata_from`: a GGUF file whose tokenizer and
  general.* metadata are copied (a model without a tokenizer in its file cannot be run by llama.cpp). Returns
  the path."""
  config = model.config
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
  family = families.for_model(model)
  if family.gguf_architecture is None or (config.attn_logit_softcap, config.final_logit_softcap,
                                          config.sliding_window) != (None, None, None):
    raise ValueError(f"save_gguf writes models of the families GGUF files hold; this is a {family.name} model"
                     f"{' with soft caps or a sliding window' if family.gguf_architecture else ''}")
  path = os.path.abspath(os.fspath(path))
  if os.path.exists(path):
    raise FileExistsError(f"{path} exists; save_gguf writes a new file")
  tensor_type, file_type = _DTYPES[dtype]
  writer = gguf.GGUFWriter(path, family.gguf_architecture)
  if metadata_from is not None:
    source = _reader(os.fspath(metadata_from), f"GGUF file {metadata_from}")
    for key, field in source.fields.items():
      if (key.startswith("tokenizer.") or key.startswith("general.")) and key not in (
          "general.architecture", "general.file_type", "general.alignment", "general.quantization_version"):
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
  if name is not None:
    writer.add_name(name)
  writer.add_file_type(file_type)
  for key, value in (("context_length", config.max_len), ("embedding_length", config.embed_dim),
                     ("feed_forward_length", config.hidden_dim), ("block_count", config.num_layers),
                     ("head_count", config.num_heads), ("head_count_kv", config.num_kv_heads),
                     ("rope_dimension_count", config.head_dim), ("key_length", config.head_dim),
                     ("value_length", config.head_dim), ("rope_freq_base", config.rope_theta),
                     ("layer_norm_rms_eps", config.rms_norm_eps), ("vocab_size", config.vocab_size)):
    getattr(writer, f"add_{key}")(value)   # the architecture's keys: llama.<key>
  from_hf = {hf: name for name, hf in _names(config.num_layers, GGUF_TO_HF).items()}
  for hf_name, array in hf_tensors(model).items():
    name = from_hf[hf_name]
    if re.fullmatch(r"blk\.\d+\.attn_[qk]\.weight", name):
      array = rotary_rows(array, config.num_heads if "attn_q" in name else config.num_kv_heads, to_gguf=True)
    if array.ndim == 1 or tensor_type == gguf.GGMLQuantizationType.F32:
      writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
    elif tensor_type == gguf.GGMLQuantizationType.F16:
      writer.add_tensor(name, np.ascontiguousarray(array, np.float16))
    else:
      block = gguf.GGML_QUANT_SIZES[tensor_type][0]
      if array.shape[-1] % block:
        raise ValueError(f"{dtype} stores rows in blocks of {block}; tensor {name} has rows of {array.shape[-1]}")
      writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(array, np.float32), tensor_type),
                        raw_dtype=tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path
