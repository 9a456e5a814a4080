"""A Gemma-3-4B-like shape for KV-memory arithmetic: 34 layers, 5 local (window 1024) : 1 global, 8 query heads
and 4 KV heads of dim 256, 128K context. For `causal-lm kv-bytes`; far too large to train on a CPU."""

from causal_lm.config import Config, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=262_144,
            d_model=2560,
            num_layers=34,
            num_heads=8,
            num_kv_heads=4,
            head_dim=256,
            mlp_dim=10_240,
            max_seq_len=131_072,
            sliding_window=1024,
            layer_pattern="local,local,local,local,local,global",
            dtype="bfloat16",
            param_dtype="bfloat16",
        )
    )
