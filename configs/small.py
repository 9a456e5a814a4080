"""The demo's model: trains on the built-in corpus on a laptop CPU in a few minutes (byte-level, GQA)."""

from causal_lm.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=259,
            d_model=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            mlp_dim=704,
            max_seq_len=512,
            rope_fraction=0.5,
        ),
        data=DataConfig(corpus="builtin", tokenizer="byte"),
        train=TrainConfig(
            steps=300,
            batch_size=16,
            seq_len=128,
            learning_rate=3e-3,
            warmup_steps=30,
            eval_every=100,
            log_every=10,
            checkpoint_every=100,
        ),
    )
