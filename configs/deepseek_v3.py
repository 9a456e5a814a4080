"""Architecture shape (never built): DeepSeek-V3's multi-head latent attention (its published config.json).

Same MLA shapes as DeepSeek-V2 (512-dim latent + 64-dim rope key per layer) over 61 layers:
61 x 576 x 2 B = 70,272 B per token at bf16. MoE not modelled; only the attention shapes matter here.
"""

from causal_lm.config import Config, MLAConfig, ModelConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=129_280,
            d_model=7168,
            num_layers=61,
            num_heads=128,
            mlp_dim=18_432,
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
