"""Seconds-long CPU smoke test: a 2-layer, 90k-parameter byte-level model on short rows of the built-in corpus."""

from causal_lm.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=259, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128, max_seq_len=128
        ),
        data=DataConfig(corpus="builtin", tokenizer="byte", max_documents=200),
        train=TrainConfig(
            steps=20,
            batch_size=16,
            seq_len=64,
            learning_rate=1e-2,
            warmup_steps=5,
            eval_every=10,
            log_every=5,
            checkpoint_every=10,
            eval_batches=2,
            sample_tokens=16,
        ),
    )
