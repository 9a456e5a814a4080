"""Where the mask goes: added to the scores before the softmax, or used to zero the weights after it.

For one prompt (default: the seeds' sentence 小明把苹果给了小王) and one head of one layer of a trained causal
model, the four views: scores S, mask M, S + M, weights A, for both placements, with the real functions the
model runs (`grouped_scores`, `make_mask`, `masked_softmax`, `reference_attention`):

    before:  A = softmax(S + M),  M = 0 where key <= query, -inf (a large finite negative) elsewhere
    after:   A = softmax(S) * M,  M = 1 where key <= query, 0 elsewhere   (attention_mask="causal_after_softmax")

Then one future token is changed (default: the last character, 小王 -> 小李) and both placements are rerun
through the whole model: which rows of A, which head outputs and which logits move. Expected: before the softmax
every row sums to 1 and nothing before the changed token moves; after the softmax every row but the last sums to
less than 1, by an amount set by the future's scores, so the past rows change when the future does.

    run(config, out_dir) -> results dict; writes report.md, mask_placement.png, results.json and the model's
    training workdir out_dir/model (rerunning reuses it). run(..., workdir=DIR) uses an already trained model.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from causal_lm.config import Config, config_to_dict
from causal_lm.experiments.common import (
    base_config,
    pyplot,
    token_labels,
    train_variant,
    with_model,
    write_json,
    write_text,
)
from causal_lm.model import build_model
from causal_lm.model.kernels import default_scale, grouped_scores, masked_softmax, reference_attention
from causal_lm.model.mask import AttentionMask, make_mask
from causal_lm.model.rope import rope_tables
from causal_lm.train import load_for_inference

NAME = "mask-placement"
HELP = "scores / mask / S+M / weights of one head, mask before vs zeroing after softmax, and a changed future token"
PROMPT = "小明把苹果给了小王"
ALT_PROMPT = "小明把苹果给了小李"


def default_config() -> Config:
    """The mask-ablation experiment's causal model: tiny shape, 600 steps."""
    return base_config(["train.steps=600", "train.eval_every=200", "train.checkpoint_every=600"])


def layer_views(model, tokens, layer: int) -> dict:
    """Every head's views of `layer` for one row of tokens, both placements, from the same inputs.

    Returns numpy arrays: scores [N, T, T] (S, before any mask), causal [T, T] (bool, key <= query),
    weights_before / weights_after [N, T, T] and out_before / out_after [T, N, H] (the heads' outputs A V).
    The block's input is the model's own residual stream (its configured mask) at that layer.
    """
    c = model.config
    if c.attention_type != "mha":
        raise ValueError(f"layer_views covers MHA/GQA/MQA attention, not {c.attention_type!r}")
    if not 0 <= layer < c.num_layers:
        raise ValueError(f"layer {layer} out of range: the model has {c.num_layers} layers")
    tokens = np.asarray(tokens, np.int32).reshape(1, -1)
    T = tokens.shape[1]
    x = model.hidden_states(tokens)[layer]  # [1, T, D]: the input of block `layer`
    graphdef, state = nnx.split(model.blocks)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], state))
    x = block.attn_norm(x)
    pos = jnp.arange(T, dtype=jnp.int32)[None]  # [1, T]
    cos = sin = None
    if c.position == "rope":
        cos, sin = rope_tables(pos, c.rope_dim, c.rope_theta)
    q = block.attn.project_q(x, cos, sin)  # [1, T, N, H]
    k, v = block.attn.project_kv(x, cos, sin)  # [1, T, K, H]
    valid = jnp.ones((1, T), bool)
    window = c.layer_windows[layer] or None
    causal = make_mask(pos, pos, valid, causal=True, window=window)  # [1, T, T]
    everything = make_mask(pos, pos, valid, causal=False)
    sink = block.attn.sink[...] if c.attn_sink else None
    scale = default_scale(q.shape[-1])
    scores = grouped_scores(q, k, scale)  # [1, K, G, T, S]
    out_b, w_b = reference_attention(q, k, v, AttentionMask(causal), scale=scale, sink=sink)
    out_a, w_a = reference_attention(q, k, v, AttentionMask(everything, zero_after=causal), scale=scale, sink=sink)
    # the kernel's weights come from masked_softmax over the same scores; check the views are that computation
    assert np.allclose(np.asarray(masked_softmax(scores, causal, sink=sink)).reshape(w_b.shape), w_b, atol=1e-6)
    N = c.num_heads
    return {
        "scores": np.asarray(scores).reshape(N, T, T),
        "causal": np.asarray(causal[0]),
        "weights_before": np.asarray(w_b[0]),
        "weights_after": np.asarray(w_a[0]),
        "out_before": np.asarray(out_b[0], np.float32),
        "out_after": np.asarray(out_a[0], np.float32),
    }


def _placement_model(model, mask: str):
    """The same weights run with attention_mask=`mask` (a new module sharing no state with `model`)."""

    other = nnx.eval_shape(lambda: build_model(model.config.replace(attention_mask=mask)))
    graphdef, _ = nnx.split(other)
    _, state = nnx.split(model)
    return nnx.merge(graphdef, state)


def run(
    config: Config | None = None,
    out_dir: str = "runs/mask_placement",
    *,
    prompt: str = PROMPT,
    alt_prompt: str = ALT_PROMPT,
    layer: int = 0,
    head: int | None = None,
    workdir: str | None = None,
) -> dict:
    """Train `config` with the causal mask in out_dir/model (or use `workdir`'s model), draw the views of
    (layer, head) for `prompt`, then change the future: `alt_prompt` must tokenize to the same length.

    head=None picks the head of `layer` whose unmasked softmax gives the future about a third of each row on this
    prompt (averaged over rows): a head that already looks only backwards hides the difference, one that looks
    mostly forwards leaves almost nothing to draw after zeroing.
    """

    config = config or default_config()
    os.makedirs(out_dir, exist_ok=True)
    if workdir is None:
        workdir = os.path.join(out_dir, "model")
        train_variant(with_model(config, attention_mask="causal"), workdir)
    model, tokenizer, trained = load_for_inference(workdir, overrides=["model.attention_mask=causal"])
    c = model.config
    if head is not None and not 0 <= head < c.num_heads:
        raise ValueError(f"head {head} out of range: the model has {c.num_heads} heads")
    ids, alt = tokenizer.encode(prompt), tokenizer.encode(alt_prompt)
    if len(ids) < 2 or len(ids) != len(alt):
        raise ValueError(f"prompt and alt_prompt must tokenize to the same length >= 2, got {len(ids)} and {len(alt)}")
    changed = [i for i, (a, b) in enumerate(zip(ids, alt, strict=True)) if a != b]
    if not changed:
        raise ValueError(f"alt_prompt {alt_prompt!r} tokenizes the same as prompt {prompt!r}: nothing changes")
    first = changed[0]
    T = len(ids)

    views = layer_views(model, ids, layer)
    views_alt = layer_views(model, alt, layer)
    future_share = 1.0 - views["weights_after"].sum(-1).mean(-1)  # [N]: mean share the softmax gave the future
    if head is None:
        head = int(np.argmin(np.abs(future_share - 1.0 / 3.0)))
    wb, wa = views["weights_before"][head], views["weights_after"][head]
    past = np.arange(T) < first  # query rows that come before the changed token

    # Whole-model reruns with each placement: attention rows of (layer, head), and logits, per position.
    changes = {}
    for name, mask in (("before", "causal"), ("after", "causal_after_softmax")):
        m = _placement_model(model, mask)
        toks = np.asarray([ids, alt], np.int32)
        o = m.forward(toks, return_weights=True)
        logits, weights = o.logits, o.weights
        w = np.asarray(weights[layer, :, head], np.float64)  # [2, T, T]
        dw = np.abs(w[1] - w[0])  # [T, T]
        dl = np.abs(np.asarray(logits[1], np.float64) - np.asarray(logits[0], np.float64)).max(-1)  # [T]
        vo = views[f"out_{name}"][:, head]
        vo_alt = views_alt[f"out_{name}"][:, head]
        dout = np.abs(vo_alt.astype(np.float64) - vo).max(-1)  # [T]: this head's output A V per row
        changes[name] = {
            "weights_change_per_row": dw.max(-1).tolist(),
            "head_output_change_per_row": dout.tolist(),
            "logits_change_per_row": dl.tolist(),
            "max_weights_change_past": float(dw[past].max()),
            "max_head_output_change_past": float(dout[past].max()),
            "max_logits_change_past": float(dl[past].max()),
            "past_rows_changed": int((dw[past].max(-1) > 1e-7).sum()),  # beyond float32 rounding of a weight
            "row_sums": w[0].sum(-1).tolist(),
            "row_sums_changed_future": w[1].sum(-1).tolist(),
            "_dw": dw,
        }

    labels, legend = token_labels(tokenizer, ids)
    alt_labels, _ = token_labels(tokenizer, alt)
    results = {
        "experiment": NAME,
        "config": config_to_dict(trained),
        "workdir": workdir,
        "prompt": prompt,
        "alt_prompt": alt_prompt,
        "tokens": list(map(int, ids)),
        "alt_tokens": list(map(int, alt)),
        "labels": labels,
        "legend": legend,
        "alt_labels": alt_labels,
        "changed_positions": changed,
        "first_changed": first,
        "layer": layer,
        "head": head,
        "future_share_per_head": future_share.tolist(),
        "row_sums": {
            "before": wb.sum(-1).tolist(),
            "after": wa.sum(-1).tolist(),
            "after_changed_future": views_alt["weights_after"][head].sum(-1).tolist(),
        },
        "views": {
            "scores": views["scores"][head].tolist(),
            "weights_before": wb.tolist(),
            "weights_after": wa.tolist(),
        },
        "changes": {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in changes.items()},
    }
    write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, views, changes, os.path.join(out_dir, "mask_placement.png"))
    write_text(os.path.join(out_dir, "report.md"), report(results))
    return results


def summary(results: dict) -> str:
    rb, ra = np.asarray(results["row_sums"]["before"]), np.asarray(results["row_sums"]["after"])
    cb, ca = results["changes"]["before"], results["changes"]["after"]
    return (
        f"row sums: before softmax {rb.min():.4f}..{rb.max():.4f}, after softmax {ra[:-1].min():.3f}.."
        f"{ra[:-1].max():.5f} (last row {ra[-1]:.3f}); changing a future token moves past attention rows by "
        f"{cb['max_weights_change_past']:.1e} (before) vs {ca['max_weights_change_past']:.1e} (after), past "
        f"logits by {cb['max_logits_change_past']:.1e} vs {ca['max_logits_change_past']:.1e}"
    )


def plot(results: dict, views: dict, changes: dict, path: str) -> str:
    plt = pyplot()
    import matplotlib.colors as mcolors

    h, labels, first = results["head"], results["labels"], results["first_changed"]
    T = len(labels)
    S = views["scores"][h]
    vis = views["causal"]
    wb, wa = views["weights_before"][h], views["weights_after"][h]
    soft_full = np.exp(S - S.max(-1, keepdims=True))
    soft_full /= soft_full.sum(-1, keepdims=True)
    fig, axes = plt.subplots(3, 4, figsize=(18, 14.5), constrained_layout=True)
    fs = 6 if T > 16 else 9

    def heat(ax, a, title, cmap="viridis", norm=None, bad=False, colorbar=True, bad_color="#c8c8c8"):
        cm = (plt.get_cmap(cmap) if isinstance(cmap, str) else cmap).with_extremes(bad=bad_color)
        im = ax.imshow(np.ma.masked_invalid(a) if bad else a, cmap=cm, norm=norm, interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(T))
        ax.set_yticks(range(T))
        ax.set_xticklabels(labels, fontsize=fs)
        ax.set_yticklabels(labels, fontsize=fs)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
        if colorbar:
            fig.colorbar(im, ax=ax, shrink=0.75)
        return im

    def mask_panel(ax, title, on, off):
        heat(
            ax,
            np.where(vis, 1.0, 0.0),
            title,
            mcolors.ListedColormap(["#3b3b3b", "#ffffff"]),
            mcolors.Normalize(0, 1),
            colorbar=False,
        )
        if T <= 12:
            for (i, j), v in np.ndenumerate(vis):
                ax.text(j, i, on if v else off, ha="center", va="center", fontsize=8, color="k" if v else "w")
        else:
            ax.text(T * 0.72, T * 0.25, off, ha="center", va="center", fontsize=16, color="w")
            ax.text(T * 0.28, T * 0.75, on, ha="center", va="center", fontsize=16, color="k")

    smax = float(np.abs(S).max()) or 1.0
    snorm = mcolors.TwoSlopeNorm(0.0, -smax, smax)
    heat(axes[0, 0], S, "① scores S = q·k/√d", "RdBu_r", snorm)
    mask_panel(axes[0, 1], "② mask M, added to the scores", "0", "−∞")
    heat(axes[0, 2], np.where(vis, S, -np.inf), "③ S + M (grey = −∞)", "RdBu_r", snorm, bad=True)
    heat(axes[0, 3], wb, "④ A = softmax(S + M): rows sum to 1", "magma", mcolors.Normalize(0, 1))
    heat(axes[1, 0], S, "① scores S (the same)", "RdBu_r", snorm)
    heat(axes[1, 1], soft_full, "softmax(S): future keys take a share", "magma", mcolors.Normalize(0, 1))
    mask_panel(axes[1, 2], "② mask M, multiplied after the softmax", "×1", "×0")
    heat(axes[1, 3], wa, "④ A = softmax(S) ⊙ M: rows sum to < 1", "magma", mcolors.Normalize(0, 1))
    axes[0, 0].annotate(
        "mask before softmax",
        (-0.45, 0.5),
        xycoords="axes fraction",
        rotation=90,
        va="center",
        fontsize=13,
        fontweight="bold",
    )
    axes[1, 0].annotate(
        "zero after softmax",
        (-0.45, 0.5),
        xycoords="axes fraction",
        rotation=90,
        va="center",
        fontsize=13,
        fontweight="bold",
    )

    ax = axes[2, 0]
    x = np.arange(T)
    ax.plot(x, results["row_sums"]["before"], "o-", color="C0", label="before softmax")
    ax.plot(x, results["row_sums"]["after"], "s-", color="C3", label="after softmax")
    ax.plot(x, results["row_sums"]["after_changed_future"], "x--", color="C1", label="after, future token changed")
    ax.axvline(first - 0.5, color="gray", ls=":")
    ax.set_xticks(range(T))
    ax.set_xticklabels(labels, fontsize=fs)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("query row")
    ax.set_title("row sums of A", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    dmax = max(float(changes["after"]["_dw"].max()), 1e-5)
    for ax, name in ((axes[2, 1], "before"), (axes[2, 2], "after")):
        dw = changes[name]["_dw"]
        heat(
            ax,
            np.where(dw > 0, dw, np.nan),
            f"|ΔA| with the future changed ({name})",
            "Reds",
            mcolors.LogNorm(1e-6, dmax, clip=True),
            bad=True,
            bad_color="white",
        )
        ax.axhline(first - 0.5, color="C0", lw=1)
        ax.text(T - 1, first - 1, "past rows ↑ (white = exactly 0)", ha="right", va="bottom", fontsize=7, color="C0")
    ax = axes[2, 3]
    floor = 1e-12
    for name, color, marker in (("before", "C0", "o"), ("after", "C3", "s")):
        d = np.maximum(np.asarray(changes[name]["logits_change_per_row"]), floor)
        ax.semilogy(x, d, marker + "-", color=color, label=f"mask {name} softmax")
    ax.axvline(first - 0.5, color="gray", ls=":")
    ax.axhline(floor, color="gray", lw=0.5)
    ax.text(0, floor * 2, "0 (no change)", fontsize=7, color="gray")
    ax.set_xticks(range(T))
    ax.set_xticklabels(labels, fontsize=fs)
    ax.set_title("max |Δ logits| per position, whole model", fontsize=10)
    ax.set_xlabel("position (left of the dotted line: before the change)")
    ax.legend(fontsize=8)
    fig.suptitle(
        f'Layer {results["layer"]}, head {h}: "{results["prompt"]}" (changed: "{results["alt_prompt"]}")'
        if all(c.isascii() for c in results["prompt"]) or not results["legend"]
        else f"Layer {results['layer']}, head {h}: the seeds' sentence, "
        f"{T} tokens; the changed token starts at position {first}",
        fontsize=13,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(results: dict) -> str:
    rs = results["row_sums"]
    cb, ca = results["changes"]["before"], results["changes"]["after"]
    labels, first, T = results["labels"], results["first_changed"], len(results["labels"])
    m = results["config"]["model"]
    lines = [
        "# Where the mask goes: before the softmax, or zeroing after it",
        "",
        f"Prompt `{results['prompt']}` ({T} tokens), layer {results['layer']}, head {results['head']} of a "
        f"{m['num_layers']}-layer causal model (`{results['workdir']}`). Changed prompt: `{results['alt_prompt']}` "
        f"(tokens at positions {results['changed_positions']} differ; rows 0..{first - 1} are its past).",
        "",
        "Share of each row's softmax that falls on future keys, averaged over rows, per head of this layer: "
        + ", ".join(f"head {i}: {v:.1%}" for i, v in enumerate(results["future_share_per_head"]))
        + f". Head {results['head']} is shown.",
        "",
        "![four views, row sums and what a future token changes](mask_placement.png)",
        "",
        "## What changes when a future token changes",
        "",
        "| placement | rows summing to 1 (within 1e-5) | max change of a past row of A | past rows that change "
        "| max change of this head's output (past) | max change of the logits (past) |",
        "|---|---|---|---|---|---|",
    ]
    for name, c, sums in (("mask before softmax", cb, rs["before"]), ("zero after softmax", ca, rs["after"])):
        ones = int(np.sum(np.abs(np.asarray(sums) - 1) < 1e-5))
        lines.append(
            f"| {name} | {ones} of {T} | {c['max_weights_change_past']:.2e} | {c['past_rows_changed']} of "
            f"{first} | {c['max_head_output_change_past']:.2e} | {c['max_logits_change_past']:.2e} |"
        )
    lines += [
        "",
        "- Before the softmax, −∞ (a large finite negative here) gives the future exactly zero weight and the "
        "softmax normalises over the visible keys only: every row sums to 1, and no row, head output or logit before "
        "the changed token moves at all. One forward pass over the sentence is the same as feeding each prefix.",
        "- After the softmax, the future's scores were already in the denominator: each row keeps only the share "
        "the past happened to get, so every row but the last (which has no future) sums to less than 1, by very "
        "little where the future keys happen to score far below the past ones; and that share moves when a future "
        "token changes. The future still leaks into the present; renormalising the rows would "
        "undo it, which is exactly what the pre-softmax mask does.",
        "",
        "## Row sums of A",
        "",
        "| position | token | before softmax | after softmax | after, future changed |",
        "|---|---|---|---|---|",
    ]
    for i in range(T):
        lines.append(
            f"| {i} | `{labels[i]}` | {rs['before'][i]:.4f} | {rs['after'][i]:.4f} | "
            f"{rs['after_changed_future'][i]:.4f} |"
        )
    if results["legend"]:
        lines += [
            "",
            "Token labels: a byte-level tokenizer splits each character into UTF-8 bytes; the first byte "
            "carries the label, continuation bytes show `·`. No CJK font was installed when the figure was "
            "drawn, so characters are numbered: " + "; ".join(results["legend"]) + ".",
        ]
    lines += ["", "Numbers: results.json (S and both A of the head, row sums, per-row changes).", ""]
    return "\n".join(lines)
