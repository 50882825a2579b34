"""Checkpoints of the shared decoder (`models.decoder`: Gemma 2, Llama) in Hugging Face's layout and in the gemma
library's (layer 4).

  load_hf_decoder(directory)            # Gemma2ForCausalLM / LlamaForCausalLM save_pretrained output (safetensors)
  load_gemma(path, preset)              # the gemma library's Orbax checkpoints (the released Flax Gemma 2)
  from_hf_tensors(config, tensors, …)   # any {Hugging Face name: array} source (GGUF files: `training.gguf`)

Hugging Face's names (torch Linear weights [out, in]) map to ours as `hf_tensor_names` says: model.embed_tokens →
embedder/input_embedding; model.layers.i.self_attn.{q,k,v,o}_proj → layer_i/attn/{q_einsum [E, N, H], kv_einsum
[E, 2, K, H] (keys, values), attn_vec_einsum [N, H, E]}; mlp.{gate,up}_proj → mlp/gating_einsum [E, 2, F],
mlp.down_proj → mlp/linear [F, E]; input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
post_feedforward_layernorm → the norms (Llama's post_attention_layernorm is the norm before its MLP: our
pre_ffw_norm); model.norm → final_norm; lm_head → embedder/output_embedding where the model does not tie it.
Every loader checks presence and shape of each tensor before building a model and raises CheckpointError
naming it; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from safetensors import safe_open

from specdec.models import decoder, families, gemma2
from specdec.training.checkpoint import CheckpointError, abstract_model, checked_model, hf_config, safetensors_files



def hf_tensor_names(config: decoder.DecoderConfig) -> dict[str, tuple[tuple[str, ...], Callable[..., np.ndarray]]]:
  """{our parameter path: (the Hugging Face tensors it is made of, how their [out, in] arrays become it)}."""
  n, k, e, h = config.num_heads, config.num_kv_heads, config.embed_dim, config.head_dim
  names = {"embedder/input_embedding": (("model.embed_tokens.weight",), lambda w: w),
           "final_norm/scale": (("model.norm.weight",), lambda w: w)}
  if not config.tie_embeddings:
    names["embedder/output_embedding"] = (("lm_head.weight",), lambda w: w)
  norms = {"input_layernorm": "pre_attention_norm", "pre_feedforward_layernorm": "pre_ffw_norm",
           "post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
  if not config.post_norms:   # Llama names the norm before its MLP post_attention_layernorm
    norms = {"input_layernorm": "pre_attention_norm", "post_attention_layernorm": "pre_ffw_norm"}
  for i in range(config.num_layers):
    hf, ours = f"model.layers.{i}", f"layer_{i}"
    names[f"{ours}/attn/q_einsum/w"] = ((f"{hf}.self_attn.q_proj.weight",), lambda w: w.T.reshape(e, n, h))
    names[f"{ours}/attn/kv_einsum/w"] = ((f"{hf}.self_attn.k_proj.weight", f"{hf}.self_attn.v_proj.weight"),
                                         lambda *kv: np.stack([w.T.reshape(e, k, h) for w in kv], axis=1))
    names[f"{ours}/attn/attn_vec_einsum/w"] = ((f"{hf}.self_attn.o_proj.weight",), lambda w: w.T.reshape(n, h, e))
    names[f"{ours}/mlp/gating_einsum"] = ((f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
                                          lambda gate, up: np.stack([gate.T, up.T], axis=1))
    names[f"{ours}/mlp/linear"] = ((f"{hf}.mlp.down_proj.weight",), lambda w: w.T)
    for theirs, norm in norms.items():
      names[f"{ours}/{norm}/scale"] = ((f"{hf}.{theirs}.weight",), lambda w: w)
  return names


def hf_tensors(model: decoder.Decoder) -> dict[str, np.ndarray]:
  """{Hugging Face name: float32 [out, in] array} of a model's parameters: the inverse of `hf_tensor_names`."""
  config, e = model.config, model.config.embed_dim
  params = {"/".join(keys): np.asarray(leaf, np.float32)
            for keys, leaf in traverse_util.flatten_dict(jax.device_get(model.params)).items()}
  tensors = {}
  for ours, (sources, _) in hf_tensor_names(config).items():
    w = params[ours]
    if ours.endswith("attn/q_einsum/w"):
      arrays = [w.reshape(e, -1).T]
    elif ours.endswith("attn/kv_einsum/w"):
      arrays = [w[:, 0].reshape(e, -1).T, w[:, 1].reshape(e, -1).T]
    elif ours.endswith("attn/attn_vec_einsum/w"):
      arrays = [w.reshape(-1, e).T]
    elif ours.endswith("mlp/gating_einsum"):
      arrays = [w[:, 0].T, w[:, 1].T]
    elif ours.endswith("mlp/linear"):
      arrays = [w.T]
    else:
      arrays = [w]
    tensors.update(zip(sources, arrays))
  return tensors


def from_hf_tensors(config: decoder.DecoderConfig, names: set[str], read: Callable[[str], np.ndarray], where: str,
                    *, host: bool = False, source_name: Callable[[str], str] = str) -> decoder.Decoder:
  """A model of `config` from tensors under Hugging Face's names: `names` are those the source holds, `read(name)`
  gives one as a float32 array [out, in]. A tied lm_head must equal the embedding. Raises CheckpointError naming
  a missing, unexpected or mis-shaped tensor by its name in the source (`source_name` of the Hugging Face one)."""
  expected = {jax.tree_util.keystr(path, simple=True, separator="/"): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_model(decoder.init, config).params)[0]}
  flat, used = {}, set()
  for path, (sources, convert) in hf_tensor_names(config).items():
    missing = [name for name in sources if name not in names]
    if missing:
      raise CheckpointError(f"{where}: tensor {source_name(missing[0])} is missing (needed for {path})")
    arrays = [read(name) for name in sources]
    try:
      array = convert(*arrays)
    except ValueError:   # a reshape that does not fit
      array = None
    if array is None or array.shape != expected[path]:
      raise CheckpointError(f"{where}: tensor{'s' * (len(sources) > 1)} {', '.join(map(source_name, sources))} of shape "
                            f"{', '.join(str(a.shape) for a in arrays)} do not give {path} {expected[path]}")
    flat[tuple(path.split("/"))] = array
    used.update(sources)
  if config.tie_embeddings and "lm_head.weight" in names:   # a tied head may be saved as well
    if not np.array_equal(read("lm_head.weight"), flat[("embedder", "input_embedding")]):
      raise CheckpointError(f"{where}: {source_name('lm_head.weight')} differs from the embedding, but the config ties "
                            "them")
    used.add("lm_head.weight")
  unexpected = sorted(source_name(name) for name in set(names) - used)
  if unexpected:
    raise CheckpointError(f"{where}: unexpected tensors ({len(unexpected)}), is the config the checkpoint's? "
                          f"{', '.join(unexpected[:5])}{' …' if len(unexpected) > 5 else ''}")
  return checked_model(where, decoder.init, config, traverse_util.unflatten_dict(flat), host=host)


def config_from_hf(hf: Mapping[str, Any], *, max_length: int | None = None) -> decoder.DecoderConfig:
  """Our config of a Hugging Face `Gemma2Config` or `LlamaConfig` (config.json, by its model_type); ValueError for
  what the decoder does not compute (attention or MLP biases, RoPE scaling, another activation)."""
  family = families.for_hf_model_type(hf.get("model_type"))
  if family.architecture is not decoder:
    raise ValueError(f"model_type {hf.get('model_type')!r} is not of the decoder's families")
  activation = hf.get("hidden_activation") or hf.get("hidden_act")
  activations = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu", None: None}
  if activation not in activations:
    raise ValueError(f"hidden activation {activation!r}: the decoder computes silu or gelu_pytorch_tanh")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ValueError("attention or MLP biases: not computed by the decoder")
  rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}   # transformers ≥ 5: rope_parameters
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"RoPE {rope!r}: the decoder computes plain RoPE (rope_type 'default')")
  fields = dict(embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                num_heads=hf["num_attention_heads"],
                num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                max_len=max_length or hf["max_position_embeddings"])
  for ours, theirs in (("tie_embeddings", "tie_word_embeddings"), ("rope_theta", "rope_theta"),
                       ("rms_norm_eps", "rms_norm_eps"),
                       ("query_pre_attn_scalar", "query_pre_attn_scalar"), ("sliding_window", "sliding_window"),
                       ("attn_logit_softcap", "attn_logit_softcapping"),
                       ("final_logit_softcap", "final_logit_softcapping")):
    if theirs in hf:
      fields[ours] = hf[theirs]
  if "rope_theta" in rope:
    fields["rope_theta"] = rope["rope_theta"]
  if activations[activation] is not None:
    fields["activation"] = activations[activation]
  kinds = {"sliding_attention": decoder.LOCAL, "full_attention": decoder.GLOBAL}
  if hf.get("layer_types"):
    fields["layer_types"] = tuple(kinds[kind] for kind in hf["layer_types"])
  return family.config(hf["vocab_size"], **fields)


def load_hf_decoder(directory: str, *, max_length: int | None = None, host: bool = False) -> decoder.Decoder:
  """The `Gemma2ForCausalLM` or `LlamaForCausalLM` that `save_pretrained` wrote to `directory`, as a float32
  `decoder.Decoder` (default max_length: the config's max_position_embeddings; `host`: parameters left in host
  memory, `models.with_params`). Raises CheckpointError naming a missing, unexpected or mis-shaped tensor."""
  directory = os.path.abspath(directory)
  where = f"Hugging Face checkpoint {directory}"
  try:
    config = config_from_hf(hf_config(directory), max_length=max_length)
  except (ValueError, KeyError) as e:
    raise CheckpointError(f"{where}: config.json is not a Gemma 2 or Llama config ({e!r})") from e
  files = safetensors_files(directory)

  def read(name: str) -> np.ndarray:
    with safe_open(files[name], framework="numpy") as f:
      return np.asarray(f.get_tensor(name), np.float32)
  return from_hf_tensors(config, set(files), read, where, host=host)


def load_gemma(path: str, preset: str, *, max_length: int | None = None, host: bool = False) -> decoder.Decoder:
  """A Gemma 2 checkpoint in the `gemma` library's Orbax layout (the released Flax checkpoints: a tree keyed
  'transformer/layer_i/attn/q_einsum' → {'w': …}, 'transformer/layer_i/mlp/gating_einsum' → {'w': …}, …,
  nested or flat), read without the `gemma` package and laid out input dimension first (`decoder.GEMMA_LIBRARY_AXES`).
  `preset` (`gemma2.PRESETS`: gemma2_2b, gemma2_9b, gemma2_27b) gives what the tensors do not (the query scaling,
  the window, the soft caps); the vocabulary is the embedding's rows; `host` as `load_hf_decoder`. Raises
  CheckpointError naming a missing, unexpected or mis-shaped tensor."""
  where = f"gemma checkpoint {path}"
  if preset not in gemma2.PRESETS:
    raise CheckpointError(f"{where}: unknown preset {preset!r}; one of {', '.join(gemma2.PRESETS)}")
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      stored = checkpointer.restore(os.path.abspath(path))
  except (OSError, ValueError, FileNotFoundError) as e:
    raise CheckpointError(f"{where}: not an Orbax checkpoint ({type(e).__name__}: {e})") from e
  flat = {}
  for keys, leaf in traverse_util.flatten_dict(stored).items():
    name = "/".join(keys).removeprefix("transformer/")
    # The gemma library stores the MLP's two weights as modules with one 'w' each.
    name = re.sub(r"/mlp/(gating_einsum|linear)/w$", r"/mlp/\1", name)
    try:
      flat[tuple(name.split("/"))] = decoder.from_gemma_library_layout(name, np.asarray(leaf, np.float32))
    except ValueError as e:   # a transpose of the wrong rank
      raise CheckpointError(f"{where}: tensor {name} of shape {np.shape(leaf)} is not in the gemma library's "
                            f"layout ({e})") from None
  embedding = flat.get(("embedder", "input_embedding"))
  if embedding is None:
    raise CheckpointError(f"{where}: tensor transformer/embedder/input_embedding is missing")
  config = gemma2.config(embedding.shape[0], **{**gemma2.PRESETS[preset], "max_len": max_length or 8192})
  return checked_model(f"{where} (preset {preset})", decoder.init, config, traverse_util.unflatten_dict(flat),
                       host=host)
