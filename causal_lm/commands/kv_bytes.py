"""`causal-lm kv-bytes`: what a KV cache costs, per token and at a context length, for any config or preset.

Pure shape arithmetic on the config (nothing is built or allocated, so 67B-scale presets answer instantly):

    MHA / GQA / MQA   per layer and token: 2 (K and V) x kv_heads x head_dim x bytes_per_element
    MLA               per layer and token: (kv_lora_rank + qk_rope_head_dim) x bytes_per_element
    sliding window    a local layer holds min(context, sliding_window) tokens, a global layer all of them

`bytes_per_token` is one token in every layer; `total_bytes` is one sequence of `context` tokens, counting local
layers at their window. `allocated_bytes` is what this codebase's `init_cache(config, 1, context)` allocates for
K/V (or latent + rope key): today it keeps local layers full length too, so for windowed models it is larger.
"""

from __future__ import annotations

import json

from causal_lm.config import ModelConfig


def register(sub):
    p = sub.add_parser(
        "kv-bytes",
        help="KV-cache bytes per token and at a context length, for a config or preset",
        description="Bytes of KV cache per token and in total at a context length, for MHA / GQA / "
        "MQA / MLA and sliding-window layers. Nothing is built: presets of any size "
        "answer instantly.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="architecture preset name (configs/NAME.py), e.g. deepseek_v2")
    src.add_argument("--config", help="config file with get_config()")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="shape overrides, e.g. num_layers=61")
    p.add_argument("--context", type=int, required=True, help="tokens in the sequence (one row)")
    p.add_argument("--bytes-per-element", type=int, default=2, help="cache element size; default 2 (bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def kv_bytes(model: ModelConfig, context: int, bytes_per_element: int = 2) -> dict:
    """The cache cost of one sequence of `context` tokens (see the module docstring for each field)."""
    if context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {context}")
    if bytes_per_element < 1:
        raise ValueError(f"--bytes-per-element must be positive, got {bytes_per_element}")
    per_token = model.kv_bytes_per_token(bytes_per_element)
    windows = model.layer_windows
    out = {
        "attention": model.attention_label,
        "num_layers": model.num_layers,
        "local_layers": sum(1 for w in windows if w),
        "sliding_window": model.sliding_window,
        "context": context,
        "bytes_per_element": bytes_per_element,
        "layer_bytes_per_token": model.kv_layer_bytes_per_token(bytes_per_element),
        "bytes_per_token": per_token,
        "total_bytes": model.kv_cache_bytes(context, bytes_per_element),
        "allocated_bytes": per_token * context,
        "exceeds_max_seq_len": context > model.max_seq_len,
    }
    if model.attention_type == "mla":
        out.update(kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.rope_dim)
    else:
        out.update(num_heads=model.num_heads, kv_heads=model.kv_heads, head_dim=model.head_size)
    return out


def human_bytes(n: float) -> str:
    """Binary units, up to two decimals: 393216 -> '384 KiB', 18119393280 -> '16.88 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.2f}".rstrip("0").rstrip(".") + f" {unit}"
        n /= 1024


def describe(model: ModelConfig) -> str:
    if model.attention_type == "mla":
        return (
            f"MLA, {model.num_layers} layers x (latent {model.kv_lora_rank} + rope key {model.rope_dim}) "
            f"elements per token"
        )
    return (
        f"{model.attention_label}, {model.num_layers} layers x 2 (K, V) x {model.kv_heads} KV heads "
        f"x {model.head_size} dims per token ({model.num_heads} query heads)"
    )


def run(args) -> int:
    from causal_lm.config import load_config

    config = load_config(args.preset or args.config, args.overrides)
    r = kv_bytes(config.model, args.context, args.bytes_per_element)
    r = {"config": args.preset or args.config, **r}
    if args.json:
        print(json.dumps(r))
        return 0
    m = config.model
    print(f"{r['config']}: {describe(m)}, {r['bytes_per_element']} bytes per element")
    print(f"  per token: {r['bytes_per_token']:,} B ({human_bytes(r['bytes_per_token'])})")
    print(f"  at {r['context']:,} tokens: {r['total_bytes']:,} B ({human_bytes(r['total_bytes'])}) per sequence")
    if r["local_layers"]:
        print(
            f"  {r['local_layers']} of {m.num_layers} layers are local (window {m.sliding_window:,} tokens) and "
            f"counted at min(context, window); init_cache here keeps them full length: "
            f"{r['allocated_bytes']:,} B ({human_bytes(r['allocated_bytes'])})"
        )
    if r["exceeds_max_seq_len"]:
        print(f"  note: {r['context']:,} tokens exceed this model's max_seq_len={m.max_seq_len:,}")
    return 0
