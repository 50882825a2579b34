"""Checkpoint import and export (layer 4): T5 v1.1 weights from Hugging Face and from T5X into
`models.t5.T5`, and back.

  model = load_hf_t5(directory)             # save_pretrained output: config.json + model.safetensors
                                            # (or sharded, with model.safetensors.index.json)
  save_hf_t5(model, directory)              # the inverse: what T5ForConditionalGeneration.from_pretrained reads
  model = load_t5x(path, config)            # a T5X checkpoint_<step> directory, or the directory holding them
  save_t5x(directory, params, step=0)       # T5X's native layout (tests, export)

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

T5X's tree is ours, so a T5X checkpoint maps one to one. T5X's native layout (t5x/checkpoints.py,
VERSION 3): `checkpoint_<step>/checkpoint` is a msgpack {'version', 'optimizer': {'target': params,
'state': …}} whose leaves are arrays or tensorstore specs of zarr arrays stored next to it, named
`target.<path with dots>`. T5X's Orbax layout keeps the same tree in `checkpoint_<step>/state/`.

Every loader checks the presence and shape of each tensor before building a model and raises
CheckpointError naming the tensor; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization, traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from specdec.models import decoder, families, t5
from specdec.training.checkpoint import CheckpointError, abstract_model, checked_model, hf_config, safetensors_files
from specdec.training.decoder_checkpoints import load_hf_decoder

_T5X_VERSION = 3
_EMBEDDING_ALIASES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# HF keeps this unused tensor in some checkpoints and ignores it on load; so do we.
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


# --- Hugging Face -------------------------------------------------------------------------------------

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
          "d_model": config.embed_dim, "d_kv": config.head_dim, "d_ff": config.hidden_dim, "num_heads": config.num_heads,
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
  if not isinstance(model, t5.T5):
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


def load_hf(directory: str, **kwargs: Any) -> t5.T5 | decoder.Decoder:
  """The model `save_pretrained` wrote to `directory`, by its config's model_type: the family that reads it
  (`families.for_hf_model_type`: t5, gemma2, llama) and its architecture's loader (`load_hf_t5`,
  `decoder_checkpoints.load_hf_decoder`); `kwargs` (max_length, host) go to that loader."""
  model_type = hf_config(os.path.abspath(directory)).get("model_type")
  try:
    family = families.for_hf_model_type(model_type)
  except ValueError as e:
    raise CheckpointError(f"{directory}: config.json's {e}") from None
  loaders = {t5: load_hf_t5, decoder: load_hf_decoder}   # by architecture
  return loaders[family.architecture](directory, **kwargs)


# --- T5X ----------------------------------------------------------------------------------------------

def _step_directory(path: str) -> str:
  """`path` itself if it is one checkpoint, else its newest checkpoint_<step> subdirectory."""
  if os.path.exists(os.path.join(path, "checkpoint")) or os.path.isdir(os.path.join(path, "state")):
    return path
  steps = [int(m.group(1)) for name in (os.listdir(path) if os.path.isdir(path) else [])
           if (m := re.fullmatch(r"checkpoint_(\d+)", name))]
  if not steps:
    raise CheckpointError(f"{path} is not a T5X checkpoint (no checkpoint file, no state/ directory, "
                          "no checkpoint_<step> subdirectory)")
  return os.path.join(path, f"checkpoint_{max(steps)}")


def _is_tensorstore_spec(node: Any) -> bool:
  return isinstance(node, dict) and {"driver", "kvstore"} <= node.keys()


def _read_tensorstore(directory: str, name: str, spec: dict[str, Any]) -> np.ndarray:
  """Reads one parameter's zarr array; its spec's path is relative to the checkpoint directory."""
  kvstore = spec["kvstore"]
  # tensorstore ≥ 0.1.14 puts the path in the kvstore, older versions (and T5X's GCS specs) beside it.
  relative = kvstore.get("path", spec.get("path"))
  # A checkpoint copied from GCS is read from the local disk; the stored metadata is read from .zarray.
  local = {"driver": spec["driver"], "kvstore": {"driver": "file", "path": os.path.join(directory, relative)}}
  try:
    return np.asarray(ts.open(local, open=True, read=True).result().read().result())
  except Exception as e:  # tensorstore raises ValueError/OSError subclasses with long messages
    raise CheckpointError(f"T5X checkpoint {directory}: parameter {name} cannot be read from {relative} "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e


def load_t5x(path: str, config: t5.T5Config) -> t5.T5:
  """The T5X checkpoint at `path` (a checkpoint_<step> directory, or a model directory: its newest step)
  as a float32 `t5.T5` of architecture `config` (T5X keeps the architecture in gin, not in the
  checkpoint). Reads the native layout and the Orbax one; optimizer states are not read.

  Raises CheckpointError naming a missing, unexpected, mis-shaped or unreadable parameter.
  """
  directory = _step_directory(os.path.abspath(path))
  where = f"T5X checkpoint {directory}"
  try:
    if os.path.isdir(os.path.join(directory, "state")):
      checkpointer, state = ocp.PyTreeCheckpointer(), os.path.join(directory, "state")
      # Host numpy arrays: a checkpoint's sharding need not fit this machine.
      as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                              checkpointer.metadata(state).item_metadata.tree)
      contents = checkpointer.restore(state, restore_args=as_numpy)
    else:
      with open(os.path.join(directory, "checkpoint"), "rb") as f:
        contents = serialization.msgpack_restore(f.read())
  except Exception as e:  # msgpack and orbax raise many types; all mean the same here
    raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
  contents = contents.get("optimizer", contents) if isinstance(contents, dict) else None
  if not isinstance(contents, dict) or not isinstance(contents.get("target"), dict):
    raise CheckpointError(f"{where} holds no 'target' (parameter) tree")

  def read(node: Any, prefix: str) -> Any:
    if _is_tensorstore_spec(node):
      return _read_tensorstore(directory, prefix, node)
    if isinstance(node, dict):
      return {key: read(child, f"{prefix}/{key}" if prefix else key) for key, child in node.items()}
    return np.asarray(node)

  return checked_model(where, t5.init, config, read(contents["target"], ""))


def save_t5x(directory: str, params: Any, *, step: int = 0) -> str:
  """Writes `params` (our/T5X tree) as T5X's native checkpoint directory/checkpoint_<step>; returns it.

  One gzip-compressed zarr array per parameter, named target.<path with dots>, and the msgpack
  `checkpoint` file {'version': 3, 'optimizer': {'target': specs, 'state': {'step': step}}} with
  relative paths, written last (a directory with that file is complete). No optimizer state is written.
  """
  step_directory = os.path.join(os.path.abspath(directory), f"checkpoint_{step}")
  if os.path.exists(step_directory):
    raise FileExistsError(f"{step_directory} exists; save_t5x writes a new checkpoint")
  os.makedirs(step_directory)
  specs = {}
  for path, leaf in traverse_util.flatten_dict(jax.tree.map(np.asarray, params)).items():
    name = ".".join(("target",) + path)
    spec = {"driver": "zarr", "dtype": np.dtype(leaf.dtype).name, "kvstore": {"driver": "file", "path": name},
            "metadata": {"compressor": {"id": "gzip"}, "shape": list(leaf.shape), "chunks": list(leaf.shape)}}
    absolute = {**spec, "kvstore": {"driver": "file", "path": os.path.join(step_directory, name)}}
    ts.open(absolute, create=True).result().write(leaf).result()
    specs[path] = spec
  contents = {"version": _T5X_VERSION, "optimizer": {"target": traverse_util.unflatten_dict(specs),
                                                     "state": {"step": np.int32(step)}}}
  with open(os.path.join(step_directory, "checkpoint"), "wb") as f:
    f.write(serialization.msgpack_serialize(contents))
  return step_directory
