"""What a prefix costs: one masked forward over T tokens vs feeding every prefix, and generation with vs
without the KV cache.

1. Training-time view. Under the causal mask position i of one forward pass over T tokens computes exactly what a
   forward pass over the prefix 0..i computes at its last position. Feeding every prefix instead takes T passes
   over 1 + 2 + ... + T = T(T+1)/2 token positions (5 tokens -> 15 positions, against 5). The logits are checked
   equal and both ways are timed.
2. Generation-time view. Without a cache every step recomputes the K/V of the whole sequence so far; with one,
   each step computes them for the new token only: a 2-token prompt and 3 new tokens cost 2+3+4 = 9 K/V vectors
   (per layer and KV head) without a cache and 2+1+1 = 4 with one (`GenerateResult.kv_computed`). Both are timed
   per generated token across context lengths, with the tokens checked equal (greedy).

The model is the config's, freshly initialised (equality and cost do not depend on training); pass
workdir=DIR to use a trained one. Times exclude compilation: every shape is run once before it is timed.

    run(config, out_dir) -> results dict; writes report.md, prefix_cost.png and results.json.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence

import jax
import numpy as np

from causal_lm.config import Config, config_to_dict, load_config
from causal_lm.data.pipeline import build_data
from causal_lm.data.tokenizer import tokenizer_from_spec
from causal_lm.decode import generate
from causal_lm.experiments.common import pyplot, write_json, write_text
from causal_lm.model import build_model
from causal_lm.model.functional import forward
from causal_lm.train import load_for_inference
from causal_lm.train.loop import resolve_config

NAME = "prefix-cost"
HELP = "one forward vs every prefix (5 tokens -> 15 positions, logits equal), and generation with vs without cache"
PROMPT = "小明把苹果给了小王"
LENGTHS = (5, 10, 20, 40)  # forward over T tokens vs every prefix (each prefix length is one compile)
GEN_LENGTHS = (16, 32, 64, 128, 256)  # context lengths (prompt + new tokens) for the generation timing


def default_config() -> Config:
    """The demo's model (configs/small.py): 4 layers, d_model 256, GQA, byte-level."""
    return load_config("small")


def _tokenizer(config: Config):
    if config.data.tokenizer == "char":  # the vocabulary comes from the corpus
        return build_data(config).tokenizer
    return tokenizer_from_spec(config.data.tokenizer)


def _model(config: Config, workdir: str | None):
    if workdir is not None:
        model, tokenizer, config = load_for_inference(workdir, overrides=["model.attention_mask=causal"])
        return model, tokenizer, config
    tokenizer = _tokenizer(config)
    config = resolve_config(config, tokenizer)
    config = dataclasses.replace(config, model=config.model.replace(attention_mask="causal"))
    return build_model(config.model, config.train.seed), tokenizer, config


def _ids(tokenizer, prompt: str, n: int) -> list[int]:
    """The first n tokens of `prompt`, repeated as often as needed."""
    base = tokenizer.encode(prompt) or [tokenizer.bos_id]
    return (base * (n // len(base) + 1))[:n]


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def forward_vs_prefixes(model, ids: Sequence[int], repeats: int = 3) -> dict:
    """Logits of one forward over ids vs the last position of a forward over each prefix, and both timed."""

    T = len(ids)
    tokens = np.asarray([ids], np.int32)
    full = np.asarray(forward(model, tokens)[0][0], np.float64)  # [T, V]
    last = np.stack([np.asarray(forward(model, tokens[:, :i])[0][0, -1], np.float64) for i in range(1, T + 1)])
    one = _best_time(lambda: forward(model, tokens)[0], repeats)
    every = _best_time(lambda: [forward(model, tokens[:, :i])[0] for i in range(1, T + 1)], repeats)
    return {
        "tokens": T,
        "positions_one_pass": T,
        "positions_every_prefix": T * (T + 1) // 2,
        "forwards_every_prefix": T,
        "max_abs_logit_diff": float(np.abs(full - last).max()),
        "logits_scale": float(np.abs(full).max()),
        "time_one_pass_s": one,
        "time_every_prefix_s": every,
    }


def generation_cost(model, ids: Sequence[int], new_tokens: int, repeats: int = 2) -> dict:
    """Greedy generation with and without the cache: K/V vectors computed, tokens, time per new token."""

    out = {"prompt_tokens": len(ids), "new_tokens": new_tokens, "context": len(ids) + new_tokens}
    tokens = {}
    for name, cache in (("cache", True), ("recompute", False)):
        run = functools.partial(generate, model, [list(ids)], max_new_tokens=new_tokens, use_cache=cache)
        res = run()  # compiles
        t = _best_time(lambda run=run: run().tokens, repeats)
        tokens[name] = res.tokens[0]
        out[name] = {
            "kv_computed": res.kv_computed,
            "steps": res.steps,
            "time_s": t,
            "time_per_token_s": t / max(len(res.tokens[0]), 1),
        }
    out["tokens_equal"] = tokens["cache"] == tokens["recompute"]
    return out


def run(
    config: Config | None = None,
    out_dir: str = "runs/prefix_cost",
    *,
    prompt: str = PROMPT,
    lengths: Sequence[int] = LENGTHS,
    gen_lengths: Sequence[int] = GEN_LENGTHS,
    gen_prompt_tokens: int = 2,
    workdir: str | None = None,
    repeats: int = 3,
) -> dict:
    config = config or default_config()
    os.makedirs(out_dir, exist_ok=True)
    model, tokenizer, config = _model(config, workdir)
    max_len = model.config.max_seq_len
    lengths = sorted({int(t) for t in lengths if 1 <= t <= max_len} | {5})
    results: dict = {
        "experiment": NAME,
        "config": config_to_dict(config),
        "prompt": prompt,
        "backend": jax.default_backend(),
        "workdir": workdir,
    }

    # 1. one pass vs every prefix (5 tokens of the prompt: the seed's 5 -> 15)
    results["forward"] = [forward_vs_prefixes(model, _ids(tokenizer, prompt, T), repeats) for T in lengths]
    results["five_tokens"] = next(r for r in results["forward"] if r["tokens"] == 5)

    # 2. generation: the seed's counting example (2-token prompt, 3 new), then time per token across lengths
    p = _ids(tokenizer, prompt, gen_prompt_tokens)
    results["generate_2_plus_3"] = generation_cost(model, p, 3, repeats=1)
    gens = [int(n) for n in gen_lengths if gen_prompt_tokens < n <= max_len]
    results["generate"] = [generation_cost(model, p, n - gen_prompt_tokens, repeats=min(repeats, 2)) for n in gens]

    write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, os.path.join(out_dir, "prefix_cost.png"))
    write_text(os.path.join(out_dir, "report.md"), report(results))
    return results


def summary(results: dict) -> str:
    f, g = results["five_tokens"], results["generate_2_plus_3"]
    s = (
        f"5 tokens: one pass {f['positions_one_pass']} positions vs every prefix {f['positions_every_prefix']} "
        f"(max logit diff {f['max_abs_logit_diff']:.1e}); prompt 2 + 3 new: K/V vectors {g['recompute']['kv_computed']}"
        f" without cache vs {g['cache']['kv_computed']} with"
    )
    if results["generate"]:
        last = results["generate"][-1]
        s += (
            f"; at context {last['context']}: {1e3 * last['recompute']['time_per_token_s']:.2f} vs "
            f"{1e3 * last['cache']['time_per_token_s']:.2f} ms/token"
        )
    return s


def plot(results: dict, path: str) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6), constrained_layout=True)
    fw = results["forward"]
    T = np.array([r["tokens"] for r in fw])
    f5 = results["five_tokens"]
    ax = axes[0]
    ax.plot(T, [r["positions_one_pass"] for r in fw], "o-", color="C0", label="one masked pass: T")
    ax.plot(T, [r["positions_every_prefix"] for r in fw], "s-", color="C3", label="every prefix: T(T+1)/2")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("token positions computed")
    ax.set_title(
        f"Positions per sequence ({f5['tokens']} tokens: {f5['positions_one_pass']} vs {f5['positions_every_prefix']})"
    )
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    ax.plot(T, [1e3 * r["time_one_pass_s"] for r in fw], "o-", color="C0", label="one masked pass")
    ax.plot(T, [1e3 * r["time_every_prefix_s"] for r in fw], "s-", color="C3", label="every prefix")
    ax.set_xlabel("tokens T")
    ax.set_ylabel("ms (best warm run)")
    ax.set_title(f"Same logits (max diff {max(r['max_abs_logit_diff'] for r in fw):.0e}), time")
    ax.legend(fontsize=8, loc="upper left")

    gen = results["generate"]
    ax = axes[2]
    if gen:
        ctx = [g["context"] for g in gen]
        ax.plot(
            ctx,
            [1e3 * g["recompute"]["time_per_token_s"] for g in gen],
            "s-",
            color="C3",
            label="no cache (recompute everything)",
        )
        ax.plot(ctx, [1e3 * g["cache"]["time_per_token_s"] for g in gen], "o-", color="C0", label="KV cache")
        ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (prompt + generated)")
    ax.set_ylabel("ms per generated token")
    ax.set_title(f"Generation time per token ({results['backend']})")
    ax.legend(fontsize=8)

    ax = axes[3]
    if gen:
        ax.plot(ctx, [g["recompute"]["kv_computed"] for g in gen], "s-", color="C3", label="no cache")
        ax.plot(ctx, [g["cache"]["kv_computed"] for g in gen], "o-", color="C0", label="KV cache")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    g = results["generate_2_plus_3"]
    ax.set_title(
        f"K/V vectors computed (prompt 2 + 3 new: {g['recompute']['kv_computed']} vs {g['cache']['kv_computed']})"
    )
    ax.set_xlabel("context length")
    ax.set_ylabel("K/V vectors per layer and KV head")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict) -> str:
    m = results["config"]["model"]
    f5, g = results["five_tokens"], results["generate_2_plus_3"]
    lines = [
        "# What a prefix costs",
        "",
        f"Model: {m['num_layers']} layers, d_model {m['d_model']}, {m['num_heads']} query / "
        f"{m['num_kv_heads'] or m['num_heads']} KV heads, "
        + (
            f"weights from `{results['workdir']}`"
            if results["workdir"]
            else "freshly initialised (equality and cost do not depend on training)"
        )
        + f"; backend {results['backend']}. Tokens: the prompt `{results['prompt']}`, repeated to length T. Times "
        "are the best of a few warm runs (compilation excluded).",
        "",
        "![positions, time per token and K/V vectors](prefix_cost.png)",
        "",
        "## One masked pass vs every prefix",
        "",
        "| T | positions, one pass | positions, every prefix | max abs logit difference | time one pass | "
        "time every prefix |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["forward"]:
        lines.append(
            f"| {r['tokens']} | {r['positions_one_pass']} | {r['positions_every_prefix']} | "
            f"{r['max_abs_logit_diff']:.1e} | {1e3 * r['time_one_pass_s']:.2f} ms | "
            f"{1e3 * r['time_every_prefix_s']:.2f} ms |"
        )
    lines += [
        "",
        f"With the causal mask, one forward pass over {f5['tokens']} tokens computes {f5['positions_one_pass']} "
        f"positions and gives, at every position, the logits of feeding that prefix alone (largest difference "
        f"{f5['max_abs_logit_diff']:.1e} on logits up to {f5['logits_scale']:.1f}): feeding the prefixes takes "
        f"{f5['forwards_every_prefix']} passes and {f5['positions_every_prefix']} positions. Training does all "
        "T next-token problems of a row in one pass for this reason.",
        "",
        "## Generation with and without the KV cache",
        "",
        f"Prompt of {g['prompt_tokens']} tokens, {g['new_tokens']} new (greedy): "
        f"**{g['recompute']['kv_computed']} K/V vectors without a cache, {g['cache']['kv_computed']} with one** "
        f"(per layer and KV head); same tokens: {g['tokens_equal']}.",
        "",
        "| context | new tokens | K/V no cache | K/V cache | ms/token no cache | ms/token cache | speed-up | "
        "same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["generate"]:
        a, b = r["recompute"], r["cache"]
        lines.append(
            f"| {r['context']} | {r['new_tokens']} | {a['kv_computed']:,} | {b['kv_computed']:,} | "
            f"{1e3 * a['time_per_token_s']:.2f} | {1e3 * b['time_per_token_s']:.2f} | "
            f"{a['time_per_token_s'] / b['time_per_token_s']:.1f}x | {r['tokens_equal']} |"
        )
    lines += [
        "",
        "Without a cache each new token reruns the model over the whole sequence so far, so its K/V count grows "
        "with the square of the length and its time per token with the context; with the cache each step computes "
        "one token's K/V and reads the rest, which the causal mask guarantees never change. (The recompute path "
        "runs every step over the whole fixed-size buffer, prompt bucket + new tokens, with the unwritten slots "
        "masked, so that one compiled loop serves every step: its time per token is that of a pass over the full "
        "context, while the K/V counts above count real tokens only.) A model trained "
        "without the causal mask cannot use a cache at all (its old K/V would change), so `generate` refuses it "
        "unless `use_cache=False`.",
        "",
        "Numbers: results.json.",
        "",
    ]
    return "\n".join(lines)
