"""The shape of SmolLM2-135M (a Llama): 30 layers, d_model 576, 9 query heads and 3 KV heads of dim 64, SwiGLU
1536, a 49,152-token vocabulary, tied embeddings, RoPE theta 100,000. Random weights, for timing
(`causal-lm bench train|decode --config llama_135m`); `./launch/real_model.sh` loads the real ones."""

from causal_lm.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=49_152,
            d_model=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            mlp_dim=1536,
            max_seq_len=2048,
            rope_theta=100_000.0,
            tie_embeddings=True,
            norm_eps=1e-5,
        ),
        data=DataConfig(corpus="builtin", tokenizer="byte"),
        train=TrainConfig(batch_size=8, seq_len=512, steps=100, learning_rate=1e-3, warmup_steps=10),
    )
