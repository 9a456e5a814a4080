"""Architecture shape (never built): DeepSeek LLM 67B, GQA-8 (its published config.json).

95 layers, 64 query heads of dim 128 sharing 8 K/V heads. At bf16: 2 x 95 x 8 x 128 x 2 B = 389,120 B per token;
as MHA (`num_kv_heads=64`) it would be 3,112,960 B.
"""

from causal_lm.config import Config, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=102_400,
            d_model=8192,
            num_layers=95,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            mlp_dim=22_016,
            max_seq_len=4096,
            rope_theta=10_000.0,
            param_dtype="bfloat16",
            dtype="bfloat16",
        )
    )
