"""`causal-lm info`: build a model from a config, print its size and KV-cache cost, run one forward pass."""

from __future__ import annotations

import time

from causal_lm.commands.common import add_config_args, config_from_args


def register(sub):
    p = sub.add_parser("info", help="build a model, print parameter count and KV bytes/token, run a forward pass")
    add_config_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def info(config, seed: int = 0) -> dict:
    import jax
    import numpy as np

    from causal_lm.model import build_model
    from causal_lm.model.functional import forward

    m = config.model
    model = build_model(m, seed=seed)
    tokens = np.random.default_rng(seed).integers(0, m.vocab_size, (1, min(64, m.max_seq_len)), dtype=np.int32)
    t0 = time.perf_counter()
    logits, _ = forward(model, tokens)
    jax.block_until_ready(logits)
    return {
        "params": model.num_params(),
        "kv_bytes_per_token": m.kv_bytes_per_token(),
        "logits_shape": tuple(logits.shape),
        "forward_s": time.perf_counter() - t0,
        "backend": jax.default_backend(),
        "finite": bool(np.isfinite(np.asarray(logits)).all()),
    }


def run(args) -> int:
    config = config_from_args(args)
    m = config.model
    attn = (
        f"{m.attention_label}, {m.num_heads} heads, KV latent {m.kv_lora_rank} + rope key {m.rope_dim}"
        if m.attention_type == "mla"
        else f"{m.attention_label}, {m.num_heads} heads / {m.num_kv_heads} kv heads, head dim {m.head_dim}"
    )
    print(
        f"model: {m.num_layers} layers, d_model {m.d_model}, {attn}, mlp {m.mlp_dim}, vocab {m.vocab_size}, "
        f"position {m.position}"
    )
    r = info(config, args.seed)
    print(f"parameters: {r['params']:,}")
    print(f"KV cache: {r['kv_bytes_per_token']:,} bytes per token ({m.dtype})")
    print(
        f"forward pass on {r['backend']}: logits {r['logits_shape']}, finite={r['finite']}, "
        f"{r['forward_s']:.2f}s including compile"
    )
    return 0
