"""Architecture shape (never built): the 16 full-attention layers of the lessons' anchor model, GQA-4.

24 query heads of dim 256 share 4 K/V heads (6 per group); RoPE rotates 64 of each head's 256 dims and an output
gate sits on every head. The anchor's other 48 layers keep a fixed-size state instead of a KV cache, so only
these 16 count here. Only the attention shapes matter for `causal-lm kv-bytes`; d_model, mlp_dim and vocab_size
are placeholders. At bf16: 64 KiB per token, 16 GiB at 262,144 tokens.
"""

from causal_lm.config import Config, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=151_936,
            d_model=5120,
            num_layers=16,
            num_heads=24,
            num_kv_heads=4,
            head_dim=256,
            mlp_dim=17_408,
            max_seq_len=262_144,
            rope_fraction=0.25,
            attn_output_gate=True,
            param_dtype="bfloat16",
            dtype="bfloat16",
        )
    )
