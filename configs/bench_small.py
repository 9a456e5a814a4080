"""The benchmark shape (`causal-lm bench train|decode`): 6 layers, d_model 384, 6 heads (MHA), SwiGLU 1024, vocab 256,
sequence 256, batch 16, tied embeddings, float32 compute and parameters.

It is also a shape transformers' LlamaForCausalLM expresses exactly (RoPE on the whole head, no biases), so the
benchmark can run the same weights in the peer. max_seq_len covers the decode benchmark's longest context (2048)
plus its new tokens.
"""

from causal_lm.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=256,
            d_model=384,
            num_layers=6,
            num_heads=6,
            mlp_dim=1024,
            max_seq_len=4096,
            tie_embeddings=True,
            param_dtype="float32",
            dtype="float32",
        ),
        data=DataConfig(corpus="builtin", tokenizer="byte"),
        train=TrainConfig(batch_size=16, seq_len=256, compute_dtype="float32"),
    )
