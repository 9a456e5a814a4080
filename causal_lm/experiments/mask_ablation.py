"""Train once with the causal mask and once without: the seed's "mask on / mask off" experiment.

Two models from the same config, seed and data, differing only in `model.attention_mask` ("causal" vs "none").
Without the mask, position i sees token i+1, which is its own label: the model learns to copy it, and its
training and validation losses (both computed with the whole row visible) fall far below the causal model's.
At generation time the next token does not exist yet; evaluating the same weights with the causal mask put back
(what generation amounts to) shows what the model really learned, against ln(vocab_size), the loss of a uniform
guess.

    run(config, out_dir) -> results dict; writes report.md, mask_ablation.png, results.json and the two training
    workdirs (out_dir/causal, out_dir/no_mask; rerunning reuses them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from causal_lm.config import Config, config_to_dict
from causal_lm.decode import generate
from causal_lm.experiments.common import (
    base_config,
    held_out_batches,
    pyplot,
    train_variant,
    with_model,
    write_json,
    write_text,
)
from causal_lm.train import evaluate, load_for_inference, read_metrics

NAME = "mask-ablation"
HELP = "train with and without the causal mask; evaluate the no-mask weights with the mask put back"
VARIANTS = {"causal": "causal", "no_mask": "none"}
PROMPTS = ("The ", "def ", "Return the ")


def default_config() -> Config:
    """Tiny shape, 600 steps: under a minute per model on a laptop CPU, and the copy shortcut fully learned."""
    return base_config(["train.steps=600", "train.eval_every=100", "train.checkpoint_every=600"])


def run(
    config: Config | None = None,
    out_dir: str = "runs/mask_ablation",
    *,
    prompts: Sequence[str] = PROMPTS,
    sample_tokens: int = 48,
    eval_rows: int = 64,
) -> dict:
    """Train both variants in out_dir/<variant>, evaluate them on the same held-out rows, sample, write the report."""

    config = config or default_config()
    os.makedirs(out_dir, exist_ok=True)
    results: dict = {"experiment": NAME, "config": config_to_dict(config)}
    val = None
    for name, mask in VARIANTS.items():
        workdir = os.path.join(out_dir, name)
        _, model, tokenizer, trained = train_variant(with_model(config, attention_mask=mask), workdir)
        if val is None:  # the same held-out rows for both (same data config, same tokenizer)
            val = held_out_batches(trained, tokenizer, eval_rows)
            results["ln_vocab"] = math.log(trained.model.vocab_size)
            results["vocab_size"] = trained.model.vocab_size
        history = [r for r in read_metrics(workdir) if "loss" in r]
        r = {
            "final_train_loss": history[-1]["loss"],
            "val_loss": evaluate(model, val)["loss"],
            "train_curve": {"step": [h["step"] for h in history], "loss": [h["loss"] for h in history]},
            "val_curve": {
                "step": [h["step"] for h in history if "val_loss" in h],
                "loss": [h["val_loss"] for h in history if "val_loss" in h],
            },
        }
        # The same weights with the other mask: the no-mask model as it would run at generation time, and, for
        # contrast, the causal model allowed to see the future it never learned to use.
        other = "none" if mask == "causal" else "causal"
        swapped, _, _ = load_for_inference(workdir, overrides=[f"model.attention_mask={other}"])
        key = "val_loss_with_causal_mask" if other == "causal" else "val_loss_without_mask"
        r[key] = evaluate(swapped, val)["loss"]
        # Text from each model as trained: the no-mask model cannot use a KV cache (its old K/V would change).
        samples = []
        for i, p in enumerate(prompts):
            ids = tokenizer.encode(p) or [tokenizer.bos_id]
            out = generate(
                model,
                [ids],
                max_new_tokens=sample_tokens,
                use_cache=mask == "causal",
                temperature=trained.train.sample_temperature,
                seed=trained.train.seed + i,
                stop_tokens=[tokenizer.eos_id],
            )
            samples.append(p + tokenizer.decode(out.tokens[0]))
        r["samples"] = samples
        results[name] = r
    results["samples"] = {name: results[name].pop("samples") for name in VARIANTS}
    results["val_tokens"] = int(sum(float(b["weights"].sum()) for b in val))
    write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, os.path.join(out_dir, "mask_ablation.png"))
    write_text(os.path.join(out_dir, "report.md"), report(results))
    return results


def summary(results: dict) -> str:
    c, n = results["causal"], results["no_mask"]
    return (
        f"train loss: causal {c['final_train_loss']:.3f}, no mask {n['final_train_loss']:.3f}; "
        f"val loss: causal {c['val_loss']:.3f}, no mask {n['val_loss']:.3f}, no mask with the causal mask put "
        f"back {n['val_loss_with_causal_mask']:.3f} (ln vocab = {results['ln_vocab']:.3f})"
    )


def plot(results: dict, path: str) -> str:
    plt = pyplot()
    c, n, lnv = results["causal"], results["no_mask"], results["ln_vocab"]
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.6, 1]}, constrained_layout=True
    )
    for r, label, color in ((c, "causal mask", "C0"), (n, "no mask", "C3")):
        ax.plot(r["train_curve"]["step"], r["train_curve"]["loss"], color=color, label=f"{label}: train")
        ax.plot(r["val_curve"]["step"], r["val_curve"]["loss"], "o--", color=color, ms=4, label=f"{label}: val")
    ax.axhline(lnv, color="gray", ls=":", label=f"ln(vocab) = {lnv:.2f} (uniform guess)")
    ax.axhline(
        n["val_loss_with_causal_mask"],
        color="C3",
        ls="-.",
        lw=1.2,
        label=f"no-mask weights, causal mask put back: {n['val_loss_with_causal_mask']:.2f}",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("Training with and without the causal mask")
    ax.set_ylim(0, max(lnv, n["val_loss_with_causal_mask"]) * 1.12)
    ax.legend(fontsize=8, loc="center right")
    names = ["causal\n(as trained)", "no mask\n(as trained)", "no mask\n+ causal mask\n(= generation)"]
    vals = [c["val_loss"], n["val_loss"], n["val_loss_with_causal_mask"]]
    bars = bx.bar(names, vals, color=["C0", "C3", "C3"], alpha=0.85)
    bars[2].set_hatch("//")
    for b, v in zip(bars, vals, strict=True):
        bx.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom")
    bx.axhline(lnv, color="gray", ls=":")
    bx.text(-0.4, lnv, "ln(vocab)", ha="left", va="bottom", color="gray", fontsize=8)
    bx.set_ylabel("validation loss")
    bx.set_ylim(0, max(vals + [lnv]) * 1.15)
    bx.set_title("Same held-out rows")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def what_it_shows(results: dict) -> list[str]:
    """The report's findings, each sentence chosen from the numbers: a run too short to learn the copy shortcut
    (or any other outcome the lessons do not predict) is described as what it is, never with the expected words."""
    c, n, lnv, v = results["causal"], results["no_mask"], results["ln_vocab"], results["vocab_size"]
    steps = results["config"]["train"]["steps"]
    copies = n["final_train_loss"] < 0.5 * c["final_train_loss"] and n["val_loss"] < 0.5 * c["val_loss"]
    back = n["val_loss_with_causal_mask"]
    if copies:
        first = (
            f"- Without the mask, position i can read token i+1, which is its own label. The model learns to copy "
            f"it: its training loss ends at {n['final_train_loss']:.3f} against {c['final_train_loss']:.3f} with "
            f"the mask, and its validation loss looks as good ({n['val_loss']:.3f}) because validation also feeds "
            "whole rows without a mask."
        )
    else:
        first = (
            f"- Without the mask, position i can read token i+1, its own label, but after {steps} steps the model "
            f"has not yet learned to copy it: its training loss is {n['final_train_loss']:.3f} against "
            f"{c['final_train_loss']:.3f} with the mask (validation {n['val_loss']:.3f} against {c['val_loss']:.3f})."
            " Train longer (the default is 600 steps) to see the shortcut."
        )
    if back > lnv:
        how = f"worse than guessing uniformly over the vocabulary (ln {v} = {lnv:.3f})"
    elif back > 0.9 * lnv:
        how = f"about as bad as guessing uniformly over the vocabulary (ln {v} = {lnv:.3f})"
    else:
        how = f"better than guessing uniformly (ln {v} = {lnv:.3f})"
    if back > c["val_loss"]:
        how += f" and worse than the causal model's {c['val_loss']:.3f}"
    else:
        how += f" and no worse than the causal model's {c['val_loss']:.3f}"
    second = (
        f"- Put the causal mask back, which is the situation at generation time (the next token does not exist "
        f"yet), and the same weights score {back:.3f} nats/token: {how}."
    )
    if copies and back > c["val_loss"]:
        second += " What looked like learning was copying the answer."
    rev = c["val_loss_without_mask"]
    if rev > c["val_loss"]:
        third = (
            f"- The reverse swap is also wrong: the causal model with its mask removed scores {rev:.3f} against "
            f"{c['val_loss']:.3f}, because its layers now mix in tokens it never saw during training."
        )
    else:
        third = (
            f"- The causal model with its mask removed scores {rev:.3f} (against {c['val_loss']:.3f} with it): "
            "removing the mask did not make it worse on these rows."
        )
    return [first, second, third]


def report(results: dict) -> str:
    c, n, lnv = results["causal"], results["no_mask"], results["ln_vocab"]
    m, t = results["config"]["model"], results["config"]["train"]
    lines = [
        "# Training with and without the causal mask",
        "",
        f'Two models, identical except for `model.attention_mask` ("causal" vs "none"): {m["num_layers"]} layers, '
        f"d_model {m['d_model']}, vocabulary {results['vocab_size']}, {t['steps']} steps of {t['batch_size']}x"
        f"{t['seq_len']} tokens from `{results['config']['data']['corpus']}`, seed {t['seed']}. Validation losses "
        f"are on the same {results['val_tokens']:,} held-out target tokens.",
        "",
        "| model | final train loss | val loss (as trained) | val loss, other mask |",
        "|---|---|---|---|",
        f"| causal mask | {c['final_train_loss']:.4f} | {c['val_loss']:.4f} | {c['val_loss_without_mask']:.4f} "
        "(mask removed) |",
        f"| no mask | {n['final_train_loss']:.4f} | {n['val_loss']:.4f} | **{n['val_loss_with_causal_mask']:.4f}** "
        "(causal mask put back = generation) |",
        f"| uniform guess | | ln({results['vocab_size']}) = {lnv:.4f} | |",
        "",
        "![loss curves](mask_ablation.png)",
        "",
        "## What it shows",
        "",
        *what_it_shows(results),
        "",
        "## Samples (same prompts, each model as trained)",
        "",
        "The no-mask model generates without a KV cache (with no mask an old token's K/V change as tokens arrive, "
        "so a cache would be wrong; `generate(..., use_cache=False)`).",
        "",
    ]
    for name, title in (("causal", "causal mask"), ("no_mask", "no mask")):
        lines.append(f"**{title}**")
        lines.append("")
        lines += ["    " + repr(s) for s in results["samples"][name]]
        lines.append("")
    lines += [
        "Numbers: results.json; training workdirs: causal/ and no_mask/ beside this report "
        "(`causal-lm generate --workdir DIR/causal`, and `--no-cache` for DIR/no_mask).",
        "",
    ]
    return "\n".join(lines)
