"""What a KV cache costs, measured: the levers of the KV-cache lesson (MHA -> GQA -> MQA -> MLA) and the two every
current small model adds (sliding windows, fewer bits), on one model size at a long context.

For each attention layout (MHA, GQA, MQA, MLA, all layers local with a window, 5 local : 1 global) a model is
trained from the same config on the same data, and for each cache storage type (float32, bfloat16, int8 with a
float32 scale per token and KV head):

    measured_bytes     the sum of the cache arrays' nbytes, as `init_cache` allocates them for one row at `context`
    calculated_bytes   what `causal-lm kv-bytes` computes from the shapes alone (they must be equal)
    decode_tokens_per_s  cached greedy decoding after a prompt that fills the context (batch 1; single-token
                       steps timed alone after a prefill of the context, best of `reps`)
    max_logit_diff, greedy_agreement  for bfloat16 and int8: a held-out text and the float32 cache's own greedy
                       continuation fed through both caches (teacher forcing), the largest |logit difference| and
                       the share of steps whose argmax agrees

    run(config, out_dir) -> results; writes report.md, kv_memory.png (bytes per token by layout, log scale) and
    results.json, with one training workdir per layout under out_dir/models (rerunning reuses them).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from causal_lm.config import Config, config_to_dict, load_config
from causal_lm.decode import generate
from causal_lm.experiments.common import pyplot, write_json, write_text
from causal_lm.model import init_cache
from causal_lm.model.functional import forward
from causal_lm.model.kv_cache import cache_bytes
from causal_lm.train import load_for_inference, train_and_evaluate

NAME = "kv-memory"
HELP = "cache bytes (measured and calculated), decode speed and quantization drift for MHA/GQA/MQA/MLA/windows"
DTYPES = ("float32", "bfloat16", "int8")


def layouts(window: int) -> dict:
    """Model overrides of each attention layout (the base config is GQA-2 over 4 query heads)."""
    local = dict(num_kv_heads=2, sliding_window=window)
    return {
        "MHA": dict(num_kv_heads=4),
        "GQA-2": dict(num_kv_heads=2),
        "MQA": dict(num_kv_heads=1),
        "MLA": dict(
            attention_type="mla", num_kv_heads=None, mla=dict(kv_lora_rank=16, qk_rope_head_dim=8, absorb=True)
        ),
        f"local-{window}": dict(local),
        "5:1 mixed": dict(local, layer_pattern="local,local,local,local,local,global"),
    }


def default_config() -> Config:
    """The tiny preset's width with 6 layers (room for a 5:1 pattern) on all of the built-in corpus, positions up
    to 2048: a few hundred steps per layout on a CPU."""
    return load_config(
        "tiny",
        [
            "model.num_layers=6",
            "model.max_seq_len=2048",
            "train.steps=300",
            "train.seq_len=128",
            "train.eval_every=300",
            "train.checkpoint_every=300",
            "data.max_documents=0",
            "train.progress=false",
            "train.sample_tokens=0",
        ],
    )


def _decode_tokens_per_s(model, context: int, new_tokens: int, reps: int, dtype: str) -> float:
    """Cached greedy decoding speed once a prompt has filled the context: the prompt is prefilled into a fresh
    cache of this storage type, then `new_tokens` single-token steps (the jitted forward pass with the cache, the
    next token chosen on the device) are timed on their own, best of `reps` after one untimed run that compiles.
    Timing the steps alone, rather than t(1 + n new) - t(1 new) through `generate`, keeps a loaded machine's noise
    in the long prefill out of the figure (that difference went negative here under load)."""
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, context - new_tokens))
    best = float("inf")
    for rep in range(reps + 1):
        cache = init_cache(model.config, 1, context, dtype)
        logits, cache = forward(model, jnp.asarray(prompt, jnp.int32), cache=cache)
        token = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        jax.block_until_ready(token)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            logits, cache = forward(model, token, cache=cache)
            token = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        jax.block_until_ready(token)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return new_tokens / best


def _teacher_forced(model, prompt, tokens, dtype):
    cache = init_cache(model.config, 1, len(prompt) + len(tokens), dtype)
    logits, cache = forward(model, np.asarray([prompt], np.int32), cache=cache)
    out = [np.asarray(logits)[0, -1]]
    for t in tokens[:-1]:
        logits, cache = forward(model, np.asarray([[t]], np.int32), cache=cache)
        out.append(np.asarray(logits)[0, -1])
    return np.stack(out)


def run(
    config: Config | None = None,
    out_dir: str = "runs/kv_memory",
    *,
    context: int = 2048,
    window: int = 128,
    new_tokens: int = 128,
    drift_tokens: int = 48,
    reps: int = 3,
    prompt: str = "The module provides functions to ",
    names: tuple | None = None,
    dtypes: tuple = DTYPES,
) -> dict:
    """Train every layout of `layouts(window)` (or those in `names`) in out_dir/models/NAME and measure each with
    every storage type in `dtypes` (float32 first: the others' drift is measured against it). reps=0 skips the
    decode timing."""
    if dtypes[0] != "float32" or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"dtypes must start with float32 and come from {DTYPES}, got {dtypes}")
    config = config or default_config()
    if context > config.model.max_seq_len:
        config = dataclasses.replace(config, model=config.model.replace(max_seq_len=context))
    os.makedirs(out_dir, exist_ok=True)
    results = {
        "experiment": NAME,
        "context": context,
        "window": window,
        "config": config_to_dict(config),
        "layouts": {},
    }
    chosen = layouts(window)
    unknown = [n for n in names or () if n not in chosen]
    if unknown:
        raise ValueError(f"unknown layouts {unknown}; choose from {list(chosen)}")
    for name, changes in chosen.items():
        if names is not None and name not in names:
            continue
        workdir = os.path.join(out_dir, "models", name.replace(" ", "_").replace(":", "-"))
        trained_config = dataclasses.replace(config, model=config.model.replace(**changes))
        record = train_and_evaluate(trained_config, workdir)
        model, tokenizer, _ = load_for_inference(workdir)
        ids = tokenizer.encode(prompt)
        greedy = generate(model, [ids], max_new_tokens=drift_tokens).tokens[0]
        reference = _teacher_forced(model, ids, greedy, "float32")
        rows = {}
        for dtype in dtypes:
            cache = init_cache(model.config, 1, context, dtype)
            measured = int(sum(x.nbytes for x in jax.tree.leaves(cache)))
            calc = cache_bytes(model.config, context, dtype=dtype)
            row = {
                "measured_bytes": measured,
                "calculated_bytes": calc["total_bytes"],
                "bytes_per_token": calc["bytes_per_token"],
                "bytes_per_token_at_context": measured / context,
                "decode_tokens_per_s": _decode_tokens_per_s(model, context, new_tokens, reps, dtype) if reps else None,
            }
            if dtype != "float32":
                low = _teacher_forced(model, ids, greedy, dtype)
                row["max_logit_diff"] = float(np.abs(low - reference).max())
                row["greedy_agreement"] = float(np.mean(low.argmax(-1) == reference.argmax(-1)))
            rows[dtype] = row
        results["layouts"][name] = {"val_loss": record.get("val_loss"), "overrides": changes, "caches": rows}
    write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, os.path.join(out_dir, "kv_memory.png"))
    write_text(os.path.join(out_dir, "report.md"), report(results))
    return results


def summary(results: dict) -> str:
    lay = results["layouts"]
    f32 = {n: v["caches"]["float32"]["bytes_per_token_at_context"] for n, v in lay.items()}
    i8 = max((c.get("max_logit_diff", 0.0) for v in lay.values() for c in v["caches"].values()), default=0.0)
    equal = all(c["measured_bytes"] == c["calculated_bytes"] for v in lay.values() for c in v["caches"].values())
    return (
        f"at {results['context']} tokens, float32 bytes per token: "
        + ", ".join(f"{n} {b:,.0f} B" for n, b in f32.items())
        + f"; quantized drift <= {i8:.2e}; measured == calculated: {equal}"
    )


def plot(results: dict, path: str) -> str:
    plt = pyplot()
    names = list(results["layouts"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8), constrained_layout=True)
    x = np.arange(len(names))
    dtypes = list(results["layouts"][names[0]]["caches"])
    for i, dtype in enumerate(dtypes):
        vals = [results["layouts"][n]["caches"][dtype]["bytes_per_token_at_context"] for n in names]
        ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=dtype)
        speeds = [results["layouts"][n]["caches"][dtype]["decode_tokens_per_s"] or 0.0 for n in names]
        bx.bar(x + (i - 1) * 0.27, speeds, 0.27, label=dtype)
    ax.set_yscale("log")
    ax.set_xticks(x, names)
    ax.set_ylabel("bytes per token (all layers, measured arrays / context)")
    ax.set_title(f"KV cache per token at a context of {results['context']:,} (window {results['window']})")
    ax.legend()
    bx.set_xticks(x, names)
    bx.set_ylabel("tokens / s")
    bx.set_title("Cached decoding after a full context, batch 1")
    bx.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict) -> str:
    ctx = results["context"]
    lines = [
        "# KV memory: layouts and storage types, measured",
        "",
        f"One model size (the config below), one model per layout trained on the same data; a cache for one row of "
        f"{ctx:,} tokens in each storage type. Measured bytes are the arrays' own nbytes (K/V or latent + rope key, "
        "scales, slot positions, the row's length); calculated bytes are `causal-lm kv-bytes` from the shapes.",
        "",
        "![bytes per token and decode speed](kv_memory.png)",
        "",
        "| layout | storage | measured bytes | calculated | bytes / token at context | decode tokens/s | "
        "max logit diff vs float32 | greedy agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in results["layouts"].items():
        for dtype, c in v["caches"].items():
            diff = f"{c['max_logit_diff']:.2e}" if "max_logit_diff" in c else "-"
            agree = f"{100 * c['greedy_agreement']:.0f}%" if "greedy_agreement" in c else "-"
            speed = "-" if c["decode_tokens_per_s"] is None else f"{c['decode_tokens_per_s']:,.1f}"
            lines.append(
                f"| {name} | {dtype} | {c['measured_bytes']:,} | {c['calculated_bytes']:,} | "
                f"{c['bytes_per_token_at_context']:,.1f} | {speed} | {diff} | {agree} |"
            )
    lay = results["layouts"]
    f32 = {n: v["caches"]["float32"]["bytes_per_token_at_context"] for n, v in lay.items()}
    mha = f32.get("MHA")
    lines += ["", "## What it shows", ""]
    if mha:
        lines.append(
            "Per token, relative to MHA in float32: "
            + ", ".join(f"{n} {b / mha:.2f}x" for n, b in f32.items() if n != "MHA")
            + ". Local layers keep a ring of `window` slots, so their share no longer grows with the context."
        )
    worst = max((c.get("max_logit_diff", 0.0) for v in lay.values() for c in v["caches"].values()), default=0.0)
    lines.append(
        f"Reduced storage (int8 with a float32 scale per token and KV head) changes the logits by at most "
        f"{worst:.2e} here; "
        "bfloat16 stores the same values rounded to 8 mantissa bits. On a CPU the storage type saves memory; the "
        "decode speeds above say whether it also saves time on this machine (dequantizing costs work)."
    )
    equal = all(c["measured_bytes"] == c["calculated_bytes"] for v in lay.values() for c in v["caches"].values())
    lines.append(f"Measured bytes equal the calculator's for every cell: {equal}.")
    return "\n".join(lines) + "\n"
