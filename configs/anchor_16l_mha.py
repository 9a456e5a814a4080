"""Architecture shape (never built): the anchor's 16 full-attention layers had every query head its own K/V (MHA).

Same shape as anchor_16l_gqa4 with 24 K/V heads. At bf16: 16 layers x 2 x 24 x 256 x 2 B = 384 KiB per token,
96 GiB at 262,144 tokens, for one sequence, before any weights.
"""

from causal_lm.config import Config, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=151_936,
            d_model=5120,
            num_layers=16,
            num_heads=24,
            num_kv_heads=24,
            head_dim=256,
            mlp_dim=17_408,
            max_seq_len=262_144,
            rope_fraction=0.25,
            attn_output_gate=True,
            param_dtype="bfloat16",
            dtype="bfloat16",
        )
    )
