"""Architecture shape (never built): DeepSeek-V2's multi-head latent attention (its published config.json).

60 layers, 128 heads; each layer caches a 512-dim KV latent plus one 64-dim RoPE key shared by all heads:
60 x (512 + 64) x 2 B = 69,120 B per token at bf16, 82.2% less than DeepSeek LLM 67B's 389,120 B. Queries go
through a 1536-dim latent; per head 128 no-position + 64 rope dims for q/k, 128 for v. The MoE feed-forward is
not modelled (mlp_dim is its dense layer's size); only the attention shapes matter for `causal-lm kv-bytes`.
"""

from causal_lm.config import Config, MLAConfig, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=102_400,
            d_model=5120,
            num_layers=60,
            num_heads=128,
            mlp_dim=12_288,
            max_seq_len=163_840,
            attention_type="mla",
            mla=MLAConfig(
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                absorb=True,
            ),
            param_dtype="bfloat16",
            dtype="bfloat16",
        )
    )
