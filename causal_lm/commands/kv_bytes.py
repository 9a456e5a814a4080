"""`causal-lm kv-bytes`: what a KV cache costs, per token and at a context length, for any config or preset.

Pure shape arithmetic on the config (nothing is built or allocated, so 67B-scale presets answer instantly), from
the same layout `init_cache` uses (`causal_lm.model.kv_cache.cache_bytes`):

    MHA / GQA / MQA   per layer and token: 2 (K and V) x kv_heads x head_dim x bytes_per_element
    MLA               per layer and token: (mla.kv_lora_rank + mla.qk_rope_head_dim) x bytes_per_element
    int8 / float8     plus a float32 scale per token and KV head (MLA: per token) for each stored array
    sliding window    a local layer keeps a ring of min(context, window + lookahead) slots, a global layer all

`bytes_per_token` is one token in every layer (the figure papers quote); `kv_bytes` is those arrays for one
sequence of `context` tokens; `total_bytes` adds the slots' positions and the row's length: exactly the bytes of
the arrays `init_cache(config, 1, context, dtype)` allocates (`cache.total_bytes`, tested equal), and
`allocated_bytes` is the same number.
"""

from __future__ import annotations

import json

from causal_lm.config import ModelConfig, load_config
from causal_lm.model.kv_cache import CACHE_DTYPES, cache_bytes


def register(sub):
    p = sub.add_parser(
        "kv-bytes",
        help="KV-cache bytes per token and at a context length, for a config or preset",
        description="Bytes of KV cache per token and in total at a context length, for MHA / GQA / "
        "MQA / MLA, sliding-window layers and quantized caches. Nothing is built: presets of any size "
        "answer instantly.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="architecture preset name (configs/NAME.py), e.g. deepseek_v2")
    src.add_argument("--config", help="config file with get_config()")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="shape overrides, e.g. num_layers=61")
    p.add_argument("--context", type=int, required=True, help="tokens in the sequence (one row)")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--bytes-per-element", type=int, default=None, help="raw cache element size, no scales; default 2 (bf16)"
    )
    size.add_argument(
        "--cache-dtype",
        choices=tuple(CACHE_DTYPES),
        default=None,
        help="the storage type init_cache / generate(cache_dtype=...) would use (int8 and float8 add scales)",
    )
    p.add_argument(
        "--lookahead", type=int, default=0, help="extra ring slots of local layers (speculative drafts); default 0"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def kv_bytes(
    model: ModelConfig,
    context: int,
    bytes_per_element: int | None = 2,
    *,
    cache_dtype: str | None = None,
    lookahead: int = 0,
) -> dict:
    """The cache cost of one sequence of `context` tokens (see the module docstring for each field)."""
    if context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {context}")
    if cache_dtype is None and (bytes_per_element is None or bytes_per_element < 1):
        raise ValueError(f"--bytes-per-element must be positive, got {bytes_per_element}")
    if lookahead < 0:
        raise ValueError(f"--lookahead must be >= 0, got {lookahead}")
    size = cache_bytes(
        model,
        context,
        dtype=cache_dtype,
        bytes_per_element=None if cache_dtype else bytes_per_element,
        lookahead=lookahead,
    )
    windows = model.layer_windows
    out = {
        "attention": model.attention_label,
        "num_layers": model.num_layers,
        "local_layers": sum(1 for w in windows if w),
        "sliding_window": model.sliding_window,
        "context": context,
        **size,
        "allocated_bytes": size["total_bytes"],
        "exceeds_max_seq_len": context > model.max_seq_len,
    }
    if model.attention_type == "mla":
        out.update(kv_lora_rank=model.mla.kv_lora_rank, qk_rope_head_dim=model.rope_dim)
    else:
        out.update(num_heads=model.num_heads, kv_heads=model.num_kv_heads, head_dim=model.head_dim)
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
            f"MLA, {model.num_layers} layers x (latent {model.mla.kv_lora_rank} + rope key {model.rope_dim}) "
            f"elements per token"
        )
    return (
        f"{model.attention_label}, {model.num_layers} layers x 2 (K, V) x {model.num_kv_heads} KV heads "
        f"x {model.head_dim} dims per token ({model.num_heads} query heads)"
    )


def run(args) -> int:
    config = load_config(args.preset or args.config, args.overrides)
    bpe = 2 if args.bytes_per_element is None and args.cache_dtype is None else args.bytes_per_element
    r = kv_bytes(config.model, args.context, bpe, cache_dtype=args.cache_dtype, lookahead=args.lookahead)
    r = {"config": args.preset or args.config, **r}
    if args.json:
        print(json.dumps(r))
        return 0
    m = config.model
    stored = r["cache_dtype"] or f"{r['bytes_per_element']} bytes per element"
    print(f"{r['config']}: {describe(m)}, {stored}")
    print(f"  per token: {r['bytes_per_token']:,} B ({human_bytes(r['bytes_per_token'])})")
    print(f"  at {r['context']:,} tokens: {r['total_bytes']:,} B ({human_bytes(r['total_bytes'])}) per sequence")
    if r["local_layers"]:
        ring = next(g["capacity"] for g in r["groups"] if g["window"])
        print(
            f"  {r['local_layers']} of {m.num_layers} layers are local (window {m.sliding_window:,} tokens): each "
            f"keeps a ring of {ring:,} slots, the global layers all {r['context']:,}"
        )
    print(f"  allocated by init_cache: {r['total_bytes']:,} B (K/V {r['kv_bytes']:,} B + slot positions and length)")
    if r["exceeds_max_seq_len"]:
        print(f"  note: {r['context']:,} tokens exceed this model's max_seq_len={m.max_seq_len:,}")
    return 0
