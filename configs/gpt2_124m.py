"""GPT-2 small's shape (124M parameters with GPT-2's vocabulary): 12 layers x d_model 768, 12 heads (MHA),
vocabulary 50257, sequence 1024, tied embeddings; bfloat16 compute over float32 parameters. The device
check (`./launch/device_check.sh`) benchmarks training and decoding at this shape.

Not GPT-2 itself: RoPE instead of learned positions, RMSNorm, no biases, and a SwiGLU MLP with hidden size 2048,
whose three 768 x 2048 matrices hold as many weights as GPT-2's two 768 x 3072 ones: 123.6M parameters, and
GPT-2 small's FLOPs per token. The built-in byte tokenizer has only 259 ids (training resizes the vocabulary to
the tokenizer's); text training at this shape wants a 50257-id tokenizer (data.tokenizer=PATH/tokenizer.json).
"""

from causal_lm.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            vocab_size=50257,
            d_model=768,
            num_layers=12,
            num_heads=12,
            mlp_dim=2048,
            max_seq_len=1024,
            tie_embeddings=True,
            param_dtype="float32",
            dtype="bfloat16",
        ),
        data=DataConfig(corpus="builtin", tokenizer="byte"),
        train=TrainConfig(
            steps=5000,
            batch_size=32,
            seq_len=1024,
            learning_rate=6e-4,
            warmup_steps=200,
            weight_decay=0.1,
            eval_every=500,
            checkpoint_every=1000,
            compute_dtype="bfloat16",
        ),
    )
