"""`causal-lm info`: build a model from a config, print its size and KV-cache cost, run one forward pass."""

from __future__ import annotations

import time

import jax
import numpy as np

from causal_lm.commands.common import add_config_args, config_from_args
from causal_lm.model import build_model
from causal_lm.model.functional import forward
from causal_lm.model.rope import yarn_attention_factor


def register(sub):
    p = sub.add_parser("info", help="build a model, print parameter count and KV bytes/token, run a forward pass")
    add_config_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def architecture_notes(m) -> list[str]:
    """One phrase per architecture setting away from the plain Llama-style default (RoPE scaling, per-layer RoPE,
    windows, QK-norm, Gemma's norms, softcaps, ...), for `info` to print."""
    notes = []
    r = m.rope_scaling
    if m.position == "rope" and r.type != "default":
        detail = f"factor {r.factor:g}"
        if r.type in ("llama3", "yarn"):
            detail += f", original context {r.original_max_len}"
        if r.type == "llama3":
            detail += f", low/high freq factors {r.low_freq_factor:g}/{r.high_freq_factor:g}"
        if r.type == "yarn":
            a = yarn_attention_factor(r.factor) if r.attention_factor is None else r.attention_factor
            detail += f", beta fast/slow {r.beta_fast:g}/{r.beta_slow:g}, attention factor {a:.4g}"
        where = " on the global layers" if m.rope_local_theta is not None else ""
        notes.append(f"RoPE scaling {r.type} ({detail}){where}")
    if m.rope_local_theta is not None:
        notes.append(f"local layers' RoPE theta {m.rope_local_theta:g} (global {m.rope_theta:g})")
    nope = [i for i, k in enumerate(m.layer_ropes) if k == "nope"]
    if nope:
        notes.append(f"NoPE layers {nope} ({len(nope)} of {m.num_layers}, RoPE on the others)")
    local = [i for i, w in enumerate(m.layer_windows) if w]
    if local:
        notes.append(f"sliding window {m.sliding_window} on {len(local)} of {m.num_layers} layers")
    if m.qk_norm:
        notes.append("QK-norm (RMSNorm over each head's q and k before RoPE)")
    if m.norm_scale_plus_one:
        notes.append("RMSNorm gains applied as (1 + w)")
    if m.post_norms:
        notes.append("post-norms on the attention and MLP outputs")
    if m.scale_embeddings:
        notes.append(f"embeddings x sqrt({m.d_model})")
    if m.mlp_activation == "gelu_tanh":
        notes.append("GeGLU MLP (tanh-approximate GELU)")
    if m.attn_scale is not None:
        notes.append(f"score scale {m.attn_scale:.6g} (= {m.attn_scale**-2:.6g} ** -0.5)")
    if m.attn_softcap:
        notes.append(f"attention scores softcapped at {m.attn_softcap:g}")
    if m.final_softcap:
        notes.append(f"final logits softcapped at {m.final_softcap:g}")
    return notes


def info(config, seed: int = 0) -> dict:

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
        f"{m.attention_label}, {m.num_heads} heads, KV latent {m.mla.kv_lora_rank} + rope key {m.rope_dim}"
        if m.attention_type == "mla"
        else f"{m.attention_label}, {m.num_heads} heads / {m.num_kv_heads} kv heads, head dim {m.head_dim}"
    )
    print(
        f"model: {m.num_layers} layers, d_model {m.d_model}, {attn}, mlp {m.mlp_dim}, vocab {m.vocab_size}, "
        f"position {m.position}"
    )
    notes = architecture_notes(m)
    if notes:
        print("architecture: " + "; ".join(notes))
    r = info(config, args.seed)
    print(f"parameters: {r['params']:,}")
    print(f"KV cache: {r['kv_bytes_per_token']:,} bytes per token ({m.dtype})")
    print(
        f"forward pass on {r['backend']}: logits {r['logits_shape']}, finite={r['finite']}, "
        f"{r['forward_s']:.2f}s including compile"
    )
    return 0
