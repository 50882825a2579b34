"""Gemma 2 (Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024): the drafter/verifier
pairs of the speculative-cascades paper's §6 (2B → 9B, 2B → 27B), as switches of the shared decoder
(`models.decoder`).

The architecture as the report and the released checkpoints define it: token embeddings scaled by √d_model,
tied to the output projection; RMSNorm(x)·(1 + w) before and after attention and before and after the MLP;
grouped-query attention with RoPE (θ = 10,000), queries scaled by query_pre_attn_scalar^−½, attention logits
soft-capped (c = 50); local sliding-window layers alternating with global ones, the first layer local; a GeGLU
MLP (gelu_tanh); a final RMSNorm and final-logit soft-capping (c = 30).
"""

from __future__ import annotations

from typing import Any

from specdec.models.decoder import DecoderConfig

# What makes the shared decoder Gemma 2 (models/decoder.py's table), and the values its configs take unless given.
SWITCHES: dict[str, Any] = dict(norm_offset=1.0, post_norms=True, activation="gelu_tanh", scale_embeddings=True)
DEFAULTS: dict[str, Any] = dict(tie_embeddings=True, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                                sliding_window=4096, rope_theta=10_000.0, rms_norm_eps=1e-6)

# The report's sizes (Table 1; the released configs). The released vocabulary is 256,000 tokens (Hugging Face);
# the gemma library's checkpoints pad the embedding to 256,128 rows.
PRESETS: dict[str, dict[str, Any]] = {
    "gemma2_tiny": dict(embed_dim=32, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        query_pre_attn_scalar=8.0, sliding_window=8),
    "gemma2_2b": dict(embed_dim=2304, hidden_dim=9216, num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256,
                      query_pre_attn_scalar=256.0),
    "gemma2_9b": dict(embed_dim=3584, hidden_dim=14336, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256,
                      query_pre_attn_scalar=256.0),
    "gemma2_27b": dict(embed_dim=4608, hidden_dim=36864, num_layers=46, num_heads=32, num_kv_heads=16,
                       head_dim=128, query_pre_attn_scalar=144.0),
}


def config(vocab_size: int, **fields: Any) -> DecoderConfig:
  """A Gemma 2 config: the family's switches and defaults, then `fields` (a preset's sizes, max_len, dtype,
  overrides)."""
  return DecoderConfig(vocab_size=vocab_size, **{**SWITCHES, **DEFAULTS, **fields})

